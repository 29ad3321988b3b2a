"""The one command-line policy: one line `dstrain: error: ...`, the error's exit code, a traceback only with --debug."""

from __future__ import annotations

import pytest


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
