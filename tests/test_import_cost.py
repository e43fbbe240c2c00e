"""``import shardfn`` stays cheap: every rank of every local world, docs page and launched
script pays it. Heavy torch subsystems are imported where they are used."""

from __future__ import annotations

import subprocess
import sys

HEAVY = ("torch._dynamo", "torch._inductor", "torch.distributed.checkpoint",
         "torch.distributed.tensor", "transformers", "hypothesis", "cloudpickle")


def test_import_shardfn_leaves_heavy_subsystems_unimported():
    code = ("import sys, shardfn as sf\n"
            f"print([m for m in {HEAVY!r} if m in sys.modules])\n"
            "sf.checkpoint.save\n"  # the lazy attribute still works
            "print('torch.distributed.checkpoint' in sys.modules)\n")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                         check=True, timeout=120).stdout.split("\n")
    assert out[0] == "[]", f"import shardfn imported {out[0]}"
    assert out[1] == "True"
