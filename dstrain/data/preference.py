"""Preference pairs (DPO): records -> (prompt, chosen, rejected) chats (`formats.normalize_pair`) -> one packed
sample of two documents (here).

The layouts read, detected by `chosen` and `rejected` columns or a chat with `rejected_response`:
- TRL's explicit prompt: `prompt` + `chosen` + `rejected`, each a text or a message list, mixed freely (a text
  prompt is one user turn, a text completion one assistant turn);
- TRL's implicit prompt: `chosen` and `rejected` whole conversations, that is starting with a user or system
  turn (UltraFeedback, HH-RLHF as chats): the messages they share from the start are the prompt (TRL's
  `extract_prompt`); a text `prompt` or a `messages` column beside them (UltraFeedback's) is ignored, as TRL's
  `maybe_extract_prompt` does;
- LLaMA-Factory's: the prompt in `conversations` / `messages` (or Alpaca's `instruction` + `input`), `chosen`
  and `rejected` single messages (or texts);
- ms-swift's: `messages` ending with the chosen reply, `rejected_response` the rejected reply's text.
An optional `system` column is the system prompt unless the prompt has its own. An empty completion is a
skip (`skipped_empty`), as is a layout recognised without its prompt. An SFT run reads pairs as their prompt
and chosen completion (`formats.Normalizer`, format `chosen`).

Both completions are rendered after the prompt with the chat template; only the completion's assistant replies
(with their end-of-turn token) are targets, so a sequence's log-probability is the completion's. A pair is one
sample for packing, its two documents adjacent in one row, chosen first: in a batch, the k-th document holding
targets is pair k // 2's chosen (k even) or rejected (k odd) completion (`dstrain.batch.document_index`).
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from .chat import ChatEncoder, Encoded
from .formats import Skip


@dataclass
class PairEncoded:
    """A pair as one sample: `ids` both documents' tokens (their lengths make the sample's length for
    packing), `pieces()` the two documents, chosen first."""

    chosen: Encoded
    rejected: Encoded

    @property
    def ids(self) -> np.ndarray:
        return np.concatenate([self.chosen.ids, self.rejected.ids])

    @property
    def targets(self) -> list[tuple[int, int]]:
        """Both documents' target ranges in `ids`; none unless both completions have targets."""
        if not (self.chosen.targets and self.rejected.targets):
            return []
        k = len(self.chosen.ids)
        return self.chosen.targets + [(a + k, b + k) for a, b in self.rejected.targets]

    def n_targets(self) -> int:
        return self.chosen.n_targets() + self.rejected.n_targets()

    def pieces(self) -> list[tuple[np.ndarray, list[tuple[int, int]]]]:
        return [(self.chosen.ids, self.chosen.targets), (self.rejected.ids, self.rejected.targets)]

    def truncated(self, n: int) -> PairEncoded:
        """Both within `n` tokens together: the longer side is cut first, neither below n // 2 unless the other
        is shorter (TRL's keep_start truncation of each sequence, sized so that the pair shares one row)."""
        lc, lr = len(self.chosen.ids), len(self.rejected.ids)
        keep_c = min(lc, max(n // 2, n - lr))
        return PairEncoded(self.chosen.truncated(keep_c), self.rejected.truncated(min(lr, n - keep_c)))


class PreferenceEncoder:
    """Pair documents (`normalize_pair`'s) -> `PairEncoded` samples, or `Skip`s; each side through the SFT
    chat encoder, every completion reply a target."""

    def __init__(self, tok, think: str = "last"):
        self.chat = ChatEncoder(tok, "all", think)

    @staticmethod
    def sides(doc: dict) -> tuple[list[dict], list[dict]]:
        return doc["prompt"] + doc["chosen"], doc["prompt"] + doc["rejected"]

    def render(self, doc: dict) -> str:
        return "".join(self.chat.render(side) for side in self.sides(doc))

    def encode(self, docs: list[dict], keep_text: bool = False) -> list[PairEncoded | Skip]:
        flat = self.chat.encode([side for doc in docs for side in self.sides(doc)], keep_text)
        out: list[PairEncoded | Skip] = []
        for c, r in zip(flat[0::2], flat[1::2]):
            out.append(c if isinstance(c, Skip) else r if isinstance(r, Skip) else PairEncoded(c, r))
        return out
