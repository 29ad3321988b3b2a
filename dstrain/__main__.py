"""`python -m dstrain COMMAND ...`: the same as the `dstrain` console script."""

from dstrain.cli import console

console()
