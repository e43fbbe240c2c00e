"""Reference models used by tests, benchmarks, docs and the demo.

Example:
    >>> from shardfn import models
    >>> config = models.GPTConfig(vocab_size=32, d_model=16, n_layers=2, n_heads=4, seq_len=8)
    >>> model = models.GPT(config)
"""

from shardfn.models.gpt import (
    GPT,
    MLP,
    Attention,
    AttentionCore,
    Block,
    Embed,
    GPTConfig,
    LMHead,
    gpt_tp_plan,
    gpt_units,
)
from shardfn.models.moe import Experts, MoE, MoEAux

__all__ = ["GPT", "MLP", "Attention", "AttentionCore", "Block", "Embed", "GPTConfig", "LMHead",
           "gpt_tp_plan", "gpt_units", "Experts", "MoE", "MoEAux"]
