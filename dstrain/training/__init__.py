"""dstrain's training engine: options, DeepSpeed config resolution, the loop, checkpoints, metrics."""
