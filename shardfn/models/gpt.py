"""A small GPT (pre-LN decoder) written so that tensor parallelism needs no patching.

``GPT(GPTConfig(...))`` is a plain ``nn.Module``: token embedding ``tok`` and
position embedding ``pos``, ``blocks`` (an ``nn.ModuleList`` of :class:`Block`),
a final LayerNorm ``ln_f`` and an LM head ``head`` whose weight *is*
``tok.weight`` when ``tied_embeddings`` (one leaf under ``sf.functional``:
``tok.weight``, with ``head.weight`` as its alias).

Written for tensor parallelism (see :func:`gpt_tp_plan`): no module stores a
head count or a width that a split would make wrong. :class:`Attention` reads
its number of *local* heads from the shape of its ``qkv`` weight (``rows //
(3 * head_dim)``, with ``head_dim = d_model // n_heads`` fixed by the config),
and every reshape uses ``-1`` or the local shape, so a block whose Linear
weights are split by rows or columns runs as it is.

Example:
    >>> import torch, shardfn as sf
    >>> config = GPTConfig(vocab_size=32, d_model=16, n_layers=2, n_heads=4, seq_len=8)
    >>> model = sf.functional(GPT(config))
    >>> params = model.init(0)
    >>> model.apply(params, torch.zeros(2, 8, dtype=torch.long)).shape
    torch.Size([2, 8, 32])
"""

from __future__ import annotations

import dataclasses

import torch
import torch.nn.functional as F
from torch import nn

__all__ = ["GPT", "MLP", "Attention", "AttentionCore", "Block", "Embed", "GPTConfig", "LMHead",
           "gpt_tp_plan", "gpt_units"]


@dataclasses.dataclass(frozen=True)
class GPTConfig:
    """The shape of a :class:`GPT`; validated on construction.

    Attributes:
        vocab_size: number of tokens (> 0).
        d_model: width of the residual stream, divisible by ``n_heads``.
        n_layers: number of blocks (> 0).
        n_heads: attention heads per block (> 0).
        seq_len: the longest sequence (number of positions).
        dropout: dropout probability in [0, 1), applied in training mode only
            (attention weights, after each projection back to the residual, and
            after the embeddings).
        tied_embeddings: the LM head reuses the token embedding's weight.
        bias: the Linear layers (qkv, proj, fc1, fc2) have biases, as in GPT-2; False
            drops them (as LLaMA does). Without them no parameter has a zero gradient in
            exact arithmetic: the key bias's is (softmax is invariant to a shift along
            the keys), so Adam turns its round-off into steps of about the learning rate,
            and two runs that sum in different orders drift apart there.

    Raises:
        TypeError / ValueError: naming the field and what would be valid.
    """

    vocab_size: int
    d_model: int
    n_layers: int
    n_heads: int
    seq_len: int
    dropout: float = 0.0
    tied_embeddings: bool = True
    bias: bool = True

    def __post_init__(self) -> None:
        for name in ("vocab_size", "d_model", "n_layers", "n_heads", "seq_len"):
            value = getattr(self, name)
            if not isinstance(value, int) or isinstance(value, bool):
                raise TypeError(f"GPTConfig.{name} must be an int, got {value!r}")
            if value <= 0:
                raise ValueError(f"GPTConfig.{name} must be > 0, got {value}")
        if self.d_model % self.n_heads:
            raise ValueError(f"GPTConfig: d_model={self.d_model} is not divisible by "
                             f"n_heads={self.n_heads}; choose d_model = n_heads * head_dim")
        if isinstance(self.dropout, bool) or not isinstance(self.dropout, (int, float)):
            raise TypeError(f"GPTConfig.dropout must be a float, got {self.dropout!r}")
        if not 0.0 <= self.dropout < 1.0:
            raise ValueError(f"GPTConfig.dropout must be in [0, 1), got {self.dropout}")
        for name in ("tied_embeddings", "bias"):
            if not isinstance(getattr(self, name), bool):
                raise TypeError(f"GPTConfig.{name} must be a bool, got {getattr(self, name)!r}")

    @property
    def head_dim(self) -> int:
        """Width of one attention head: ``d_model // n_heads``."""
        return self.d_model // self.n_heads


class AttentionCore(nn.Module):
    """Causal scaled-dot-product attention of ``q, k, v`` ``[..., heads, T, head_dim]``, with
    dropout on the attention probabilities in training mode. No parameters: a module of its
    own so that a tensor-parallel plan can give it the per-rank RNG stream
    (``"split_rng"``: the heads are split, so their dropout masks must differ per rank)."""

    def __init__(self, dropout: float) -> None:
        super().__init__()
        self.dropout = dropout

    def forward(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        return F.scaled_dot_product_attention(q, k, v, is_causal=True,
                                              dropout_p=self.dropout if self.training else 0.0)


class Attention(nn.Module):
    """Causal self-attention with a fused ``qkv`` Linear(d, 3d) and an output ``proj`` Linear(d, d).

    Layout of the ``qkv`` output (and of the rows of ``qkv.weight`` / ``qkv.bias``):
    ``[q | k | v]``, each of ``n_heads * head_dim`` features made of whole heads in
    order, head ``h`` at ``[h * head_dim, (h + 1) * head_dim)`` inside its part. A
    column split for tensor parallelism must give each rank the rows of the same
    whole heads of q, k and v, again as ``[q_local | k_local | v_local]``; then
    ``proj`` is split on its input features (the same heads) and its output summed.

    The number of heads used is the *local* one, read from the weight:
    ``qkv.weight.shape[0] // (3 * head_dim)``.
    """

    def __init__(self, config: GPTConfig) -> None:
        super().__init__()
        self.head_dim = config.head_dim
        self.qkv = nn.Linear(config.d_model, 3 * config.d_model, bias=config.bias)
        self.core = AttentionCore(config.dropout)
        self.proj = nn.Linear(config.d_model, config.d_model, bias=config.bias)
        self.resid_dropout = nn.Dropout(config.dropout)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        rows = self.qkv.weight.shape[0]
        if rows % (3 * self.head_dim):
            raise ValueError(f"Attention: qkv.weight has {rows} rows, not a multiple of "
                             f"3 * head_dim = {3 * self.head_dim} (whole heads of q, k, v)")
        local_heads = rows // (3 * self.head_dim)
        qkv = self.qkv(x)  # sequence parallel: the gathered sequence, [..., T, 3 d_local]
        batch = qkv.shape[:-1]  # [..., T]
        q, k, v = (t.unflatten(-1, (local_heads, self.head_dim)).transpose(-3, -2)
                   for t in qkv.chunk(3, dim=-1))
        y = self.core(q, k, v)
        y = y.transpose(-3, -2).reshape(*batch, local_heads * self.head_dim)
        return self.resid_dropout(self.proj(y))


class MLP(nn.Module):
    """``fc1`` Linear(d, 4d), GELU, ``fc2`` Linear(4d, d), dropout."""

    def __init__(self, config: GPTConfig) -> None:
        super().__init__()
        self.fc1 = nn.Linear(config.d_model, 4 * config.d_model, bias=config.bias)
        self.act = nn.GELU()
        self.fc2 = nn.Linear(4 * config.d_model, config.d_model, bias=config.bias)
        self.dropout = nn.Dropout(config.dropout)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.dropout(self.fc2(self.act(self.fc1(x))))


class Block(nn.Module):
    """Pre-LN transformer block: ``x + attn(ln1(x))``, then ``x + mlp(ln2(x))``."""

    def __init__(self, config: GPTConfig) -> None:
        super().__init__()
        self.ln1 = nn.LayerNorm(config.d_model)
        self.attn = Attention(config)
        self.ln2 = nn.LayerNorm(config.d_model)
        self.mlp = MLP(config)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x + self.attn(self.ln1(x))
        return x + self.mlp(self.ln2(x))


class GPT(nn.Module):
    """Decoder-only transformer: ``tokens [..., T] (int64) -> logits [..., T, vocab_size]``.

    Args:
        config: a :class:`GPTConfig`.

    The LM head is ``head`` (Linear(d, vocab_size) without bias); with
    ``tied_embeddings`` its weight is the token embedding's (one parameter).

    Example:
        >>> model = GPT(GPTConfig(vocab_size=32, d_model=16, n_layers=1, n_heads=2, seq_len=8))
        >>> model(torch.zeros(1, 5, dtype=torch.long)).shape
        torch.Size([1, 5, 32])
    """

    def __init__(self, config: GPTConfig) -> None:
        super().__init__()
        if not isinstance(config, GPTConfig):
            raise TypeError(f"GPT expects a GPTConfig, got {type(config).__name__}")
        self.config = config
        self.tok = nn.Embedding(config.vocab_size, config.d_model)
        self.pos = nn.Embedding(config.seq_len, config.d_model)
        self.drop = nn.Dropout(config.dropout)
        self.blocks = nn.ModuleList(Block(config) for _ in range(config.n_layers))
        self.ln_f = nn.LayerNorm(config.d_model)
        self.head = nn.Linear(config.d_model, config.vocab_size, bias=False)
        if config.tied_embeddings:
            self.head.weight = self.tok.weight

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        if tokens.dtype not in (torch.int64, torch.int32):
            raise TypeError(f"GPT: tokens must be int64 or int32 token ids, got {tokens.dtype}")
        if tokens.dim() < 1:
            raise ValueError("GPT: tokens must have a sequence dimension [..., T]")
        seq = tokens.shape[-1]
        if seq > self.config.seq_len:
            raise ValueError(f"GPT: sequence length {seq} exceeds config.seq_len="
                             f"{self.config.seq_len}")
        positions = torch.arange(seq, device=tokens.device)
        x = self.drop(self.tok(tokens) + self.pos(positions))
        for block in self.blocks:
            x = block(x)
        x = self.ln_f(x)
        if self.config.tied_embeddings:
            # the tied head reads N(0, 1) embedding rows: scale its input by d ** -0.5 (as
            # T5 / PaLM do) so the first logits are O(1) and the first loss ~ log(vocab)
            x = x * self.config.d_model ** -0.5
        return self.head(x)


class Embed(nn.Module):
    """The first pipeline unit of a GPT: token + position embedding, dropout."""

    def __init__(self, config: GPTConfig) -> None:
        super().__init__()
        self.seq_len = config.seq_len
        self.tok = nn.Embedding(config.vocab_size, config.d_model)
        self.pos = nn.Embedding(config.seq_len, config.d_model)
        self.drop = nn.Dropout(config.dropout)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        if tokens.shape[-1] > self.seq_len:
            raise ValueError(f"Embed: sequence length {tokens.shape[-1]} exceeds seq_len="
                             f"{self.seq_len}")
        positions = torch.arange(tokens.shape[-1], device=tokens.device)
        return self.drop(self.tok(tokens) + self.pos(positions))


class LMHead(nn.Module):
    """The last pipeline unit of a GPT: final LayerNorm and the (untied) LM head."""

    def __init__(self, config: GPTConfig) -> None:
        super().__init__()
        self.ln_f = nn.LayerNorm(config.d_model)
        self.head = nn.Linear(config.d_model, config.vocab_size, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(self.ln_f(x))


def gpt_units(config: GPTConfig) -> list[nn.Module]:
    """The GPT as a list of pipeline units: ``[Embed, Block x n_layers, LMHead]``.

    ``nn.Sequential(*gpt_units(config))`` computes what ``GPT(config)`` does for an
    untied model (``tied_embeddings=False``): a pipeline puts the embedding and the
    head on different stages, so their weights cannot be one tensor.

    Args:
        config: a :class:`GPTConfig` with ``tied_embeddings=False``.

    Returns:
        ``n_layers + 2`` modules, for ``sf.pipeline_stages``.

    Raises:
        ValueError: for tied embeddings.

    Example:
        >>> cfg = GPTConfig(32, 16, 2, 2, 8, tied_embeddings=False)
        >>> [type(u).__name__ for u in gpt_units(cfg)]
        ['Embed', 'Block', 'Block', 'LMHead']
    """
    if not isinstance(config, GPTConfig):
        raise TypeError(f"gpt_units expects a GPTConfig, got {type(config).__name__}")
    if config.tied_embeddings:
        raise ValueError("gpt_units: tied_embeddings=True ties the head to the embedding, "
                         "but pipeline stages cannot share a weight; use "
                         "GPTConfig(..., tied_embeddings=False)")
    return [Embed(config), *(Block(config) for _ in range(config.n_layers)), LMHead(config)]


def gpt_tp_plan(sequence_parallel: bool = False) -> dict[str, str]:
    """The Megatron tensor-parallel plan for :class:`GPT`: glob over module paths -> style.

    * ``tok``: ``"vocab"`` (embedding split on the vocabulary: each rank looks up its
      rows, the partial embeddings are summed);
    * ``blocks.*.attn.qkv`` / ``blocks.*.mlp.fc1``: ``"colwise"`` (output features
      split; for qkv whole heads of q, k and v per rank, see :class:`Attention`);
    * ``blocks.*.attn.core``: ``"split_rng"`` (the attention-probability dropout of
      the local heads draws from this rank's stream);
    * ``blocks.*.attn.proj`` / ``blocks.*.mlp.fc2``: ``"rowwise"`` (input features
      split, output summed over the axis);
    * ``head``: ``"colwise"`` with the output left split: the logits stay
      vocab-parallel, to be fed to ``sf.vocab_parallel_cross_entropy`` (gather them
      only to print them). With ``tied_embeddings`` the head's weight is ``tok.weight``
      and its split is the vocab split of ``tok`` (the same rows); the entry still
      tells the transform to enter the head as a column-parallel region.

    LayerNorms, ``pos`` and biases of rowwise layers stay replicated.

    Args:
        sequence_parallel: Megatron-SP. Between the split regions the activations
            (embedding sum, dropout, LayerNorms, residual) are this rank's chunk of
            the sequence: ``tok`` reduce-scatters its lookups along the sequence,
            ``pos`` looks up only this rank's positions, ``qkv``/``fc1``/``head``
            all-gather their input along the sequence, ``proj``/``fc2``
            reduce-scatter their output; the LayerNorms, ``pos`` and the rowwise
            biases are ``SequenceParallel`` (their gradients summed over the axis)
            and the dropouts (``drop``, ``resid_dropout``, ``mlp.dropout``) draw from
            the per-rank stream. The sequence length must divide by the axis size.
            The styles are named: ``"colwise_sp"`` is ``Colwise(sequence_parallel=True)``,
            likewise ``"rowwise_sp"``, ``"vocab_sp"``; ``"sequence_parallel"`` is
            ``SequenceParallel()``.

    Returns:
        A new dict ``{pattern: style}``.

    Example:
        >>> gpt_tp_plan()["blocks.*.attn.qkv"]
        'colwise'
    """
    if not isinstance(sequence_parallel, bool):
        raise TypeError(f"gpt_tp_plan: sequence_parallel must be a bool, "
                        f"got {sequence_parallel!r}")
    if not sequence_parallel:
        return {
            "tok": "vocab",
            "blocks.*.attn.qkv": "colwise",
            "blocks.*.attn.core": "split_rng",
            "blocks.*.attn.proj": "rowwise",
            "blocks.*.mlp.fc1": "colwise",
            "blocks.*.mlp.fc2": "rowwise",
            "head": "colwise",
        }
    chunks = "sequence_parallel"  # names, not style objects: models sit below transforms
    return {
        "tok": "vocab_sp",
        "pos": chunks,
        "drop": chunks,
        "blocks.*.ln1": chunks,
        "blocks.*.attn.qkv": "colwise_sp",
        "blocks.*.attn.core": "split_rng",
        "blocks.*.attn.proj": "rowwise_sp",
        "blocks.*.attn.resid_dropout": chunks,
        "blocks.*.ln2": chunks,
        "blocks.*.mlp.fc1": "colwise_sp",
        "blocks.*.mlp.fc2": "rowwise_sp",
        "blocks.*.mlp.dropout": chunks,
        "ln_f": chunks,
        "head": "colwise_sp",
    }
