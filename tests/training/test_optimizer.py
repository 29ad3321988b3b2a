"""dstrain/training/optimizer.py: DeepSpeed's Muon module imported without Inductor, its functions compiled on
their first call."""

from __future__ import annotations

from tests.helpers.ranks import run_python

CHECK = """
import sys
import torch
from dstrain.training.optimizer import DEEPSPEED_MUON, import_deepspeed_muon

import_deepspeed_muon()
assert DEEPSPEED_MUON in sys.modules
assert "torch._inductor.compile_fx" not in sys.modules, "Inductor imported with DeepSpeed's Muon"
from deepspeed.runtime.zero.muon.muon_optimizer import MuonWithAuxAdam  # as ZeRO's optimizers import it
from deepspeed.runtime.zero.muon import original_muon

assert "torch._inductor.compile_fx" not in sys.modules
ns = original_muon.zeropower_via_newtonschulz5
g = torch.randn(8, 4)
with torch._dynamo.config.patch(disable=True):  # torch.compile's wrapper, run eagerly: no C++ build here
    got = ns(g, 3)
assert "torch._inductor.compile_fx" in sys.modules, "the first call did not go through torch.compile"
assert torch.equal(got, ns.__wrapped__(g, 3))
print("ok")
"""


def test_deepspeed_s_muon_imports_without_inductor_and_compiles_at_its_first_call():
    out = run_python(CHECK)
    assert out.returncode == 0 and out.stdout.strip().endswith("ok"), out.stdout + out.stderr
