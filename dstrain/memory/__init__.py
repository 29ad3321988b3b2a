"""Will it fit: the predicted peak memory per rank of a resolved run (estimate.py), `dstrain plan` with its
layout search (planner.py), and the CPU measurement the predictions are tested against (measure.py).
DeepSeek-V4's layers are v4.py's, Kimi Linear's kimi_linear.py's, GLM-5.3-Flash's glm5_next.py's, registered in
estimate.SHAPES on import."""

from . import glm5_next, kimi_linear, v4  # noqa: F401 - register each family's sizes with the estimate
