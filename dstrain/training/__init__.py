"""The run itself: `dstrain train` (cli.py), the model in its training layout (build.py, finetune.py), the loop
(trainer.py, objective.py, evaluate.py, schedule.py), what it records (metrics.py, plots.py) and how it stops
(preempt.py, watchdog.py)."""
