"""Checkpoints, below training: the store (DeepSpeed state + dstrain's JSON state, COMPLETE/latest, discovery,
pruning; store.py), the layout-free fp32 weights every checkpoint holds (weights.py), LoRA settings and PEFT
adapter folders (lora.py), and `dstrain export` (export.py). Nothing here imports dstrain.training."""
