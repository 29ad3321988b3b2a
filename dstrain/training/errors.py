"""User-facing errors: `dstrain train` prints their message as one line and exits non-zero (no traceback)."""

from __future__ import annotations


class UserError(ValueError):
    """Something the user can fix (a flag, a config, a checkpoint path); `exit_code` is what main returns."""

    exit_code = 2


class ConfigError(UserError):
    """An invalid or conflicting option, recipe entry or DeepSpeed config setting."""


class CheckpointError(UserError):
    """A checkpoint that is missing, incomplete, corrupt or does not fit this run."""


class NonFiniteLossError(UserError):
    """A NaN/Inf loss under `--nan_policy stop`; raised on every rank before the update is applied."""

    exit_code = 3
    all_ranks = True
