"""The one command-line policy: one line `dstrain: error: ...`, the error's exit code, a traceback only with --debug."""

from __future__ import annotations

import pytest

from tests.helpers.ranks import run_python


@pytest.mark.parametrize(
    ("argv", "message"),
    [
        (["--config", "zero1", "--clip_grad", "-1"], "--clip_grad -1.0: must be >= 0"),
        (["--config", "no_such_config"], "--config no_such_config: no such file"),
        (["--model", "gigantic"], "--model gigantic"),
        (["--max_stepz", "3"], "unrecognized arguments: --max_stepz 3"),
        (["--data_format", "weird"], "--data_format: invalid choice: 'weird'"),
    ],
)
def test_main_reports_one_line_and_exit_code(argv, message, capsys):
    from dstrain.train import main

    code = main(argv)
    err = capsys.readouterr().err
    assert code == 2
    assert message in err, err
    assert "Traceback" not in err and len(err.strip().splitlines()) == 1


def test_debug_shows_the_traceback(capsys):
    from dstrain.train import main

    assert main(["--config", "no_such_config", "--debug"]) == 2
    assert "Traceback" in capsys.readouterr().err


SUBCOMMAND_MISTAKES = {
    "train": (["train", "--config", "no_such_config"], "--config no_such_config: no such file"),
    "data": (["data", "audit", "--data", "/no/such/data.jsonl"], "/no/such/data.jsonl"),
    "plan": (["plan", "--num_gpus", "0", "--gpu_memory_gb", "80"], "--num_gpus 0"),
    "smoke": (["smoke", "--model", "gigantic"], "--model: invalid choice: 'gigantic'"),
    "export": (["export", "/no/such/run", "--out", "/tmp/never"], "/no/such/run: no such file or folder"),
    "plot": (["plot", "/no/such/run"], "/no/such/run"),
    "unknown flag": (["plot", "/no/such/run", "--colour"], "unrecognized arguments: --colour"),
    "unknown command": (["trian"], "unknown command 'trian'"),
}


@pytest.mark.parametrize("case", SUBCOMMAND_MISTAKES, ids=str)
def test_every_subcommand_reports_one_line_and_the_errors_exit_code(case, capsys):
    from dstrain.cli import main

    argv, message = SUBCOMMAND_MISTAKES[case]
    assert main(argv) == 2
    err = capsys.readouterr().err
    assert err.startswith("dstrain: error: ") and message in err and err.count("\n") == 1, err
    if case != "unknown command":
        assert main([*argv, "--debug"]) == 2
        assert "Traceback" in capsys.readouterr().err


def test_debug_from_a_recipe_is_read_from_the_parsed_options(tmp_path, capsys):
    from dstrain.cli import main

    recipe = tmp_path / "debug.toml"
    recipe.write_text('config = "no_such_config"\n[logging]\ndebug = true\n')
    assert main(["train", "--recipe", str(recipe)]) == 2
    assert "Traceback" in capsys.readouterr().err


def test_the_other_ranks_leave_an_error_all_raise_to_rank_0(monkeypatch, capsys):
    """Under a launcher, a rank other than 0 that raised the error every rank raises prints nothing at once: it
    waits (the launcher ends it once rank 0 has printed and exited; exiting first, it could take rank 0 down
    unprinted), then, still running, prints the line itself with its rank."""
    import dstrain.cli as cli
    from dstrain.errors import ConfigError

    def fail(args):  # noqa: ANN001, ANN202
        exc = ConfigError("train_batch_size=4 is not a multiple of 8")
        exc.all_ranks = True  # as `dstrain train` marks every error of its plan
        raise exc

    waited = []
    monkeypatch.setattr(cli.time, "sleep", waited.append)
    monkeypatch.setenv("WORLD_SIZE", "2")
    monkeypatch.setenv("RANK", "1")
    assert cli.invoke(lambda argv: argv, fail, []) == ConfigError.exit_code
    assert waited == [cli.REPORT_GRACE_S]
    assert capsys.readouterr().err == "dstrain: error (rank 1): train_batch_size=4 is not a multiple of 8\n"
    monkeypatch.setenv("RANK", "0")
    assert cli.invoke(lambda argv: argv, fail, []) == ConfigError.exit_code
    assert waited == [cli.REPORT_GRACE_S]  # rank 0 prints at once
    assert capsys.readouterr().err == "dstrain: error: train_batch_size=4 is not a multiple of 8\n"


def test_a_command_line_imports_without_the_collector_and_freezes_what_it_imported():
    """A process's own command line (dstrain/collector.py): its imports with the collector paused and frozen
    after, the run's later imports (PRELOAD) with them, except for --help; in-process calls (start=False, as
    the tests and the Python API make them) never freeze."""
    code = (
        "import gc, sys\n"
        "from dstrain import cli, collector\n"
        "assert cli.run_command('plan', ['--help']) == 0 and gc.get_freeze_count() == 0\n"
        "assert cli.run_command('train', ['--help'], start=True) == 0\n"
        "assert gc.isenabled() and gc.get_freeze_count() > 0 and 'deepspeed' not in sys.modules\n"
        "gc.unfreeze()\n"
        "with collector.paused():\n"
        "    with collector.paused(freeze=True):\n"  # nested: the outer block owns the collector
        "        assert not gc.isenabled()\n"
        "    assert not gc.isenabled()\n"
        "assert gc.isenabled() and gc.get_freeze_count() == 0\n"
    )
    run = run_python(code)
    assert run.returncode == 0, run.stderr[-3000:]


def test_a_program_ends_like_python_s_exit_without_the_teardown():
    """cli.exit_process, the end of `dstrain` and `dstrain/train.py`: the exit code, non-daemon threads joined,
    atexit handlers run, unflushed output written — and no teardown (an object's __del__ at exit never runs)."""
    code = (
        "import atexit, sys, threading, time\n"
        "from dstrain import cli\n"
        "class Kept:\n"
        "    def __del__(self):\n"
        "        print('teardown ran', flush=True)\n"
        "kept = [Kept()]\n"
        "kept.append(kept)\n"  # a cycle: only the teardown's collection would reach it
        "atexit.register(lambda: print('atexit ran'))\n"
        "threading.Thread(target=lambda: (time.sleep(0.3), print('thread finished'))).start()\n"
        "sys.stdout.write('unflushed ')\n"
        "cli.exit_process(3)\n"
        "print('after exit')\n"
    )
    run = run_python(code)
    assert run.returncode == 3, run.stderr[-3000:]
    assert run.stdout.split() == ["unflushed", "thread", "finished", "atexit", "ran"], run.stdout
    assert not run.stderr, run.stderr


def test_a_command_line_on_a_machine_without_a_gpu_leaves_out_deepspeeds_cpu_warning(tmp_path):
    """DeepSpeed's accelerator probe warns "Setting accelerator to CPU" wherever it finds no GPU: a command
    line (here `dstrain train`, which imports deepspeed once parsed, then stops on a data mistake) sets
    DS_ACCELERATOR=cpu first where the machine has none, and its one error line stays; a call from Python
    leaves the environment alone. Where a GPU is visible there is no warning to leave out either way."""
    import os

    env = {k: v for k, v in os.environ.items() if k != "DS_ACCELERATOR"}
    code = (
        "import os, sys\n"
        "from dstrain import cli\n"
        "assert cli.run_command('train', ['--help']) == 0 and 'DS_ACCELERATOR' not in os.environ\n"
        f"code = cli.run_command('train', ['--data', {str(tmp_path / 'none.jsonl')!r}], start=True)\n"
        "assert 'deepspeed' in sys.modules and code == 2, code\n"
    )
    run = run_python(code, env=env)
    assert run.returncode == 0, run.stderr[-3000:]
    assert "Setting accelerator to CPU" not in run.stdout + run.stderr
    assert run.stderr.strip() == f"dstrain: error: data: no such file or folder: {tmp_path / 'none.jsonl'}"


def test_ctrl_c_outside_the_training_steps_is_one_line_and_exit_130(capsys):
    """Where the trainer does not take Ctrl-C (a command's start, `dstrain data`, an export): one line, the
    shell's 130, no traceback."""
    from dstrain.cli import INTERRUPTED_EXIT_CODE, invoke

    def interrupted(args: object) -> int:
        raise KeyboardInterrupt

    assert invoke(lambda argv: argv, interrupted, []) == INTERRUPTED_EXIT_CODE == 130
    err = capsys.readouterr().err
    assert err == "dstrain: interrupted (Ctrl-C)\n"
