"""Will it fit: the predicted peak memory per rank of a resolved run (estimate.py), `dstrain plan` with its
layout search (planner.py), and the CPU measurement the predictions are tested against (measure.py)."""
