"""User-facing errors, one root for every floor: `dstrain train`, `dstrain export` and `dstrain data` print
their message as one line and exit non-zero (no traceback)."""

from __future__ import annotations


class UserError(ValueError):
    """Something the user can fix (a flag, a config, a checkpoint path, a data file); `exit_code` is what
    main returns."""

    exit_code = 2
    all_ranks = False
    """Raised alike by every rank of a job (an agreed decision, the NaN check): printed once."""
    names_rank = True
    """A rank other than 0 that prints it says which rank it is."""


class ConfigError(UserError):
    """An invalid or conflicting option, recipe entry or DeepSpeed config setting."""


class CheckpointError(UserError):
    """A checkpoint that is missing, incomplete, corrupt or does not fit this run."""


class DataError(UserError):
    """Bad data, a bad data option or an unusable tokenizer."""


class NonFiniteLossError(UserError):
    """A NaN/Inf loss under `--nan_policy stop`; raised on every rank before the update is applied."""

    exit_code = 3
    all_ranks = True


class PeerLostError(UserError):
    """Another rank of the job died or stopped responding (training/watchdog.py); the message, which names the
    lost rank, is empty on the ranks that leave the report to another survivor."""

    exit_code = 76  # distinct from 75 (preempted): the run is not resumable as is, a rank is gone
    names_rank = False
