"""Will it fit: the predicted peak memory per rank of a resolved run (estimate.py), its layers' sizes (shapes.py
for the DeepSeek-V3 family; v4.py, kimi_linear.py, glm5_next.py), `dstrain plan` with its layout search
(planner.py), and the CPU measurement the predictions are tested against (measure.py)."""
