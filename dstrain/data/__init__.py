"""dstrain's data pipeline: sources -> formats -> tokenizer -> packing -> resumable per-rank loader.

Public API (the trainer's contract, see docs/interfaces.md):

    from dstrain.data import DataOptions, load_tokenizer, build_loader
    tok = load_tokenizer(opts.tokenizer, model_path)
    loader = build_loader(opts, tok, micro_batch_size, dp_rank=r, dp_world=n, seed=s, objective="sft")
    batch = next(loader)  # input_ids / labels / position_ids, LongTensor (micro_batch_size, seq_len)
    state = loader.state_dict(); loader.load_state_dict(state)
    rows = build_eval_rows(opts, tok, "sft")  # the whole eval set, the same on every rank, or None
    # objective: the run's --objective: "dpo" refuses data that is not preference pairs, "sft" reads a pair's
    # prompt and chosen completion; None (the data tools) reads the data as it is
"""

from dstrain.errors import DataError

from .evalset import build_eval_rows
from .loader import Loader, build_loader, epoch_rows, merge_states
from .options import DataOptions, field_help
from .tokenizer import load_tokenizer

__all__ = [
    "DataError",
    "DataOptions",
    "Loader",
    "build_eval_rows",
    "build_loader",
    "epoch_rows",
    "merge_states",
    "field_help",
    "load_tokenizer",
]
