"""dstrain: train DeepSeek-style MoE language models with DeepSpeed."""

__version__ = "0.1.0"
