"""`python -m dstrain COMMAND ...`: the same as the `dstrain` console script."""

import sys

from dstrain.cli import main

sys.exit(main())
