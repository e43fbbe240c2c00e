"""Dropout RNG for tensor parallelism: one shared stream, one stream per rank (Megatron's tracker).

The rule, for every ``TensorSplitModel.apply`` call:

* **Replicated regions** (outside every split, and any module not marked below)
  draw from the global torch generator, exactly as the unsplit model does. Every
  tp rank must enter ``apply`` with the same global RNG state (seed them alike,
  as you do for the inputs); their masks are then equal, and equal to the
  unsplit model's as long as the unsplit model draws nothing where the split
  one uses the per-rank stream.
* **Split regions** (modules styled ``SplitRNG()`` or ``SequenceParallel()``:
  the attention probabilities of the local heads, dropout on a local sequence
  chunk) draw from this rank's stream. It is a ``torch.Generator`` seeded with
  ``rank_seed(base, rank)``, where ``base`` is a 64-bit hash (blake2b) of the
  global CPU generator's state when the first split-region module of the call
  runs (read, not drawn from: no random op, so it also runs under
  ``torch.func.vmap``'s default ``randomness="error"``), and ``rank`` is this
  rank's index on the tp axis. Split-region modules consume that one stream in
  call order; they never consume the global generator. So masks differ between
  ranks, and the same global state before ``apply`` gives the same masks.
* If a split-region module drew random numbers in a call, the global CPU
  generator is advanced by one draw when ``apply`` returns, so the next call gets
  a fresh per-rank stream. A call in which none drew consumes the global
  generator exactly as the unsplit model.

Like Megatron's ``model-parallel-rng`` tracker (``get_cuda_rng_tracker().fork()``),
the per-rank stream is swapped into the device's default generator around the
module, so ``F.dropout`` and ``F.scaled_dot_product_attention(dropout_p=...)``
use it unchanged.

Example:
    >>> with call_streams(rank=1):
    ...     with rank_stream(torch.device("cpu")):
    ...         mask = torch.rand(3) > 0.5      # this rank's stream
"""

from __future__ import annotations

import contextlib
import contextvars
import dataclasses
import hashlib
from collections.abc import Iterator
from typing import NamedTuple

import torch

__all__ = ["StreamsState", "call_streams", "rank_seed", "rank_stream", "refuse_compiled_draws",
           "replay_streams", "set_streams", "streams_state"]

_MASK = (1 << 63) - 1
_GOLDEN = 0x9E3779B97F4A7C15


def rank_seed(base: int, rank: int) -> int:
    """The seed of rank ``rank``'s stream for a call whose peeked base draw is ``base``.

    A splitmix64 finaliser of ``base + (rank + 1) * golden``: distinct ranks get
    unrelated seeds.

    Example:
        >>> rank_seed(7, 0) != rank_seed(7, 1)
        True
    """
    z = (base + (rank + 1) * _GOLDEN) & 0xFFFFFFFFFFFFFFFF
    z = ((z ^ (z >> 30)) * 0xBF58476D1CE4E5B9) & 0xFFFFFFFFFFFFFFFF
    z = ((z ^ (z >> 27)) * 0x94D049BB133111EB) & 0xFFFFFFFFFFFFFFFF
    return (z ^ (z >> 31)) & _MASK


@dataclasses.dataclass
class _CallStreams:
    """The per-rank streams of one ``apply`` call (one generator per device, made on first use)."""

    rank: int
    base: int | None = None
    drew: bool = False
    generators: dict[torch.device, torch.Generator] = dataclasses.field(default_factory=dict)

    def generator(self, device: torch.device) -> torch.Generator:
        if self.base is None:
            state = bytes(torch.default_generator.get_state().tolist())
            self.base = int.from_bytes(hashlib.blake2b(state, digest_size=8).digest(), "little")
        if device not in self.generators:
            generator = torch.Generator(device)
            generator.manual_seed(rank_seed(self.base, self.rank))
            self.generators[device] = generator
        return self.generators[device]


_CURRENT: contextvars.ContextVar[_CallStreams | None] = contextvars.ContextVar(
    "shardfn_tp_rng", default=None)


@contextlib.contextmanager
def call_streams(rank: int) -> Iterator[None]:
    """Scope of one ``apply`` call: split-region modules inside it use rank ``rank``'s stream.

    On leaving, advances the global CPU generator by one draw if a stream was drawn from.

    Args:
        rank: this rank's index on the tensor-parallel axis.
    """
    if torch.compiler.is_compiling():  # no streams in a compiled step: refuse_compiled_draws
        yield
        return
    streams = _CallStreams(rank)
    token = _CURRENT.set(streams)
    try:
        yield
    finally:
        _CURRENT.reset(token)
        if streams.drew:
            torch.randint(0, 1 << 62, (), dtype=torch.int64)


#: attributes that hold a dropout probability in torch's modules and the common model code
_DROPOUT_ATTRS = ("p", "dropout", "dropout_p", "attention_dropout", "attn_dropout")


def refuse_compiled_draws(module: torch.nn.Module, path: str) -> None:
    """Under ``torch.compile``: raise if a split-region module in training mode may draw.

    The per-rank streams swap generator states around the module, which a compiled
    graph cannot do; drawing from the global generator instead would give every rank
    the same masks (not the unsplit model's distribution). A module whose dropout
    probabilities (``p``, ``dropout``, ``dropout_p``, ... of it and its submodules) are
    all 0 draws nothing and runs as it is.

    Raises:
        NotImplementedError: naming the module and the probability found.

    Example:
        >>> refuse_compiled_draws(nn.Dropout(0.0), "blocks.0.attn.core")   # fine
    """
    for sub_path, sub in module.named_modules():
        for attr in _DROPOUT_ATTRS:
            value = getattr(sub, attr, 0.0)
            if isinstance(value, float) and value > 0.0:
                where = f"{path}.{sub_path}" if sub_path else path
                raise NotImplementedError(
                    f"tensor_split under torch.compile: the split-region module {where!r} "
                    f"has {attr}={value} in training mode; per-rank dropout streams "
                    "(SplitRNG / SequenceParallel) run in eager steps only. Compile with "
                    "dropout 0 in split regions, call .eval(), or run the step eagerly")


def _default_generator(device: torch.device) -> torch.Generator:
    if device.type == "cpu":
        return torch.default_generator
    if device.type == "cuda":
        index = device.index if device.index is not None else torch.cuda.current_device()
        return torch.cuda.default_generators[index]
    raise ValueError(f"tensor_split: per-rank dropout streams support cpu and cuda tensors, "
                     f"got a tensor on {device}")


@contextlib.contextmanager
def rank_stream(device: torch.device) -> Iterator[None]:
    """Run the block with this rank's stream as ``device``'s default generator.

    Raises:
        RuntimeError: outside :func:`call_streams` (a split-region module called
            outside ``TensorSplitModel.apply``).
    """
    streams = _CURRENT.get()
    if streams is None:
        raise RuntimeError("tensor_split: a split-region module (SplitRNG / SequenceParallel) "
                           "ran outside TensorSplitModel.apply, which sets its RNG stream")
    mine = streams.generator(device)
    default = _default_generator(device)
    saved, start = default.get_state(), mine.get_state()
    default.set_state(start)
    try:
        yield
    finally:
        now = default.get_state()
        streams.drew = streams.drew or not torch.equal(now, start)
        mine.set_state(now)
        default.set_state(saved)


# --------------------------------------------------------------- recomputation (remat, ZeRO-3)
class StreamsState(NamedTuple):
    """A snapshot of the current call's per-rank streams, for a recomputation to start from.

    Attributes:
        rank: the tp rank of the call.
        base: the call's base seed, or None if no split-region module has run yet
            (a recomputation then derives it from the replayed global state, as the
            forward did).
        generators: ``(device, generator state)`` of each stream made so far.
        drew: whether a split-region module of the call drew random numbers.
    """

    rank: int
    base: int | None
    generators: tuple[tuple[torch.device, torch.Tensor], ...]
    drew: bool


def streams_state() -> StreamsState | None:
    """The current call's streams (None outside ``TensorSplitModel.apply``).

    Taken with the global RNG state by ``recording.rng_state``, so a recomputation in
    backward (``sf.remat``, ``shard_params(remat=...)``), which runs outside ``apply``,
    draws the same split-region masks as the forward.
    """
    streams = _CURRENT.get()
    if streams is None:
        return None
    return StreamsState(streams.rank, streams.base,
                        tuple((d, g.get_state()) for d, g in streams.generators.items()),
                        streams.drew)


def _restore(streams: _CallStreams, state: StreamsState) -> None:
    streams.base = state.base
    streams.generators = {}
    for device, generator_state in state.generators:
        generator = torch.Generator(device)
        generator.set_state(generator_state)
        streams.generators[device] = generator


@contextlib.contextmanager
def replay_streams(state: StreamsState | None) -> Iterator[None]:
    """Run the block with the streams as ``state`` had them (no streams if None).

    The call's own streams, if any, are untouched, and leaving advances nothing:
    a recomputation consumes no randomness of the live call.
    """
    streams = None
    if state is not None:
        streams = _CallStreams(state.rank)
        _restore(streams, state)
    token = _CURRENT.set(streams)
    try:
        yield
    finally:
        _CURRENT.reset(token)


def set_streams(state: StreamsState | None) -> None:
    """Move the current call's streams to ``state`` for good (a unit call whose replay
    is skipped leaves them where the forward's call of it left them)."""
    streams = _CURRENT.get()
    if streams is None or state is None or state.rank != streams.rank:
        return
    _restore(streams, state)
    streams.drew = streams.drew or state.drew
