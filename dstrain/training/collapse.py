"""A warning when routing collapses: a layer whose busiest expert's load stays near the most it can be (E / k
times the mean: every token on the same k experts) for several steps. Seen in a fine-tune at the demo's lr 3e-3:
a 2.96B V2-Lite-shaped model routed every token to the same 6 of 64 experts by step 3, and stayed there."""

from __future__ import annotations

NEAR = 0.97
"""A layer is collapsed while its imbalance is at least this share of E / k (the tiny demo, 8 experts top-2 on
512 tokens a step, touches 0.99 for single steps but never stays above 0.97 for two)."""
STEPS = 5
"""... for this many steps in a row."""


class CollapseWatch:
    """Fed each step's `moe_imbalance` ({"layer_i": busiest / mean}); `update` returns the warning once, the
    step the first layers have been collapsed for STEPS steps in a row (later ones join the same line if they
    collapse by then), None otherwise."""

    def __init__(self, experts: int, top_k: int) -> None:
        self.most = experts / top_k
        self.run: dict[str, int] = {}
        self.warned = False

    def update(self, imbalance: dict[str, float], lr: float) -> str | None:
        for layer, ratio in imbalance.items():
            self.run[layer] = self.run.get(layer, 0) + 1 if ratio >= NEAR * self.most else 0
        collapsed = [layer for layer, n in self.run.items() if n >= STEPS]
        if self.warned or not collapsed:
            return None
        self.warned = True
        names = ", ".join(layer.removeprefix("layer_") for layer in collapsed)
        worst = max(imbalance[layer] for layer in collapsed)
        return (
            f"dstrain: warning: routing collapsed in layer(s) {names}: the busiest expert has {worst:.2f} x the "
            f"mean load (at most {self.most:.2f} = experts / top-k: every token on the same experts) for "
            f"{STEPS} steps; lower --lr (now {lr:g}) or raise --moe_bias_update_speed / --moe_aux_loss_alpha"
        )
