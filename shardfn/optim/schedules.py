"""Learning-rate schedules: functions ``schedule(step) -> float`` (optax's conventions).

``step`` is the number of updates already done (an int or an int64 scalar
tensor, as optimizers pass their ``count``), so the first update uses
``schedule(0)`` — the same as ``torch.optim.lr_scheduler``, whose lr for the
first ``optimizer.step()`` is the one at epoch 0. Values are computed in Python
double precision.

Example:
    >>> lr = warmup_cosine_decay(1e-3, warmup_steps=100, decay_steps=1000)
    >>> opt = adamw(lr, weight_decay=0.1)
    >>> lr(0), lr(100), lr(1000)
    (0.0, 0.001, 0.0)
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence

import torch

from shardfn.primitives._compiled import tracing

__all__ = [
    "constant",
    "cosine_decay",
    "join",
    "linear_schedule",
    "linear_warmup",
    "warmup_cosine_decay",
]

Schedule = Callable[["int | torch.Tensor"], float]


def _count(step: int | torch.Tensor) -> int:
    """The step as a Python int (a clear error in code that ``torch.compile`` traces)."""
    if isinstance(step, torch.Tensor) and tracing():
        raise TypeError("sf.optim.schedules read the step count as a Python int, which a "
                        "torch.compile'd step cannot do without a recompile per step: compile "
                        "with a constant learning rate, or give a schedule written with tensor "
                        "ops (e.g. lambda count: 1e-3 * 0.99 ** count)")
    return int(step)


def _check_steps(value: int, name: str, low: int) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or value < low:
        raise ValueError(f"{name} must be an int >= {low}, got {value!r}")
    return value


def _finite(value: float, name: str) -> float:
    """``value`` as a float; a NaN or infinite schedule parameter is refused, naming it."""
    if isinstance(value, bool) or not isinstance(value, (int, float, torch.Tensor)):
        raise TypeError(f"{name} must be a number, got {value!r}")
    value = float(value)
    if not math.isfinite(value):
        raise ValueError(f"{name} must be a finite number, got {value}")
    return value


def constant(value: float) -> Schedule:
    """The same value at every step.

    Example:
        >>> constant(0.1)(7)
        0.1
    """
    value = _finite(value, "value")
    return lambda step: value


def linear_schedule(init_value: float, end_value: float, transition_steps: int,
                    transition_begin: int = 0) -> Schedule:
    """``init_value`` until ``transition_begin``, then linear to ``end_value`` over
    ``transition_steps`` steps, then ``end_value``.

    Example:
        >>> linear_schedule(1.0, 0.0, 10)(5)
        0.5
    """
    _check_steps(transition_steps, "transition_steps", 0)
    _check_steps(transition_begin, "transition_begin", 0)
    init_value, end_value = _finite(init_value, "init_value"), _finite(end_value, "end_value")

    def schedule(step):
        if transition_steps == 0:
            return init_value if _count(step) < transition_begin else end_value
        done = min(max(_count(step) - transition_begin, 0), transition_steps)
        return init_value + (end_value - init_value) * done / transition_steps

    return schedule


def linear_warmup(peak: float, warmup_steps: int, init_value: float = 0.0) -> Schedule:
    """Linear from ``init_value`` at step 0 to ``peak`` at ``warmup_steps``, then ``peak``.

    Example:
        >>> linear_warmup(1.0, 4)(1)
        0.25
    """
    return linear_schedule(init_value, peak, warmup_steps)


def cosine_decay(peak: float, decay_steps: int, alpha: float = 0.0) -> Schedule:
    """Cosine from ``peak`` at step 0 to ``alpha * peak`` at ``decay_steps``, then flat.

    ``peak * (alpha + (1 - alpha) * (1 + cos(pi * min(step, decay_steps) / decay_steps)) / 2)``
    — torch's ``CosineAnnealingLR(T_max=decay_steps, eta_min=alpha * peak)`` closed form.

    Example:
        >>> cosine_decay(1.0, 10)(5)
        0.5
    """
    _check_steps(decay_steps, "decay_steps", 1)
    peak, alpha = _finite(peak, "peak"), _finite(alpha, "alpha")

    def schedule(step):
        done = min(max(_count(step), 0), decay_steps)
        cosine = 0.5 * (1.0 + math.cos(math.pi * done / decay_steps))
        return peak * ((1.0 - alpha) * cosine + alpha)

    return schedule


def warmup_cosine_decay(peak: float, warmup_steps: int, decay_steps: int,
                        end_value: float = 0.0, init_value: float = 0.0) -> Schedule:
    """Linear warmup to ``peak`` over ``warmup_steps``, then cosine to ``end_value``.

    ``decay_steps`` counts from step 0 and includes the warmup (optax's
    convention): the cosine runs from ``warmup_steps`` to ``decay_steps`` and the
    value stays at ``end_value`` after that.

    Example:
        >>> lr = warmup_cosine_decay(1.0, warmup_steps=10, decay_steps=110)
        >>> lr(5), lr(10), lr(60), lr(200)
        (0.5, 1.0, 0.5, 0.0)
    """
    _check_steps(warmup_steps, "warmup_steps", 0)
    _check_steps(decay_steps, "decay_steps", warmup_steps + 1)
    peak, end_value = _finite(peak, "peak"), _finite(end_value, "end_value")
    _finite(init_value, "init_value")
    cosine_steps = decay_steps - warmup_steps

    def cosine(step):
        done = min(max(_count(step), 0), cosine_steps)
        cosine_factor = 0.5 * (1.0 + math.cos(math.pi * done / cosine_steps))
        return end_value + (peak - end_value) * cosine_factor

    return join([linear_warmup(peak, warmup_steps, init_value), cosine], [warmup_steps])


def join(schedules: Sequence[Schedule], boundaries: Sequence[int]) -> Schedule:
    """Switch between schedules at ``boundaries``; each restarts its count at its boundary.

    ``schedules[i]`` runs from ``boundaries[i - 1]`` (0 for the first) and gets
    ``step - boundaries[i - 1]``.

    Args:
        schedules: ``len(boundaries) + 1`` schedules.
        boundaries: increasing step numbers.

    Example:
        >>> lr = join([constant(1.0), cosine_decay(1.0, 10)], [5])
        >>> lr(4), lr(5), lr(10)
        (1.0, 1.0, 0.5)
    """
    schedules, boundaries = list(schedules), [int(b) for b in boundaries]
    if len(schedules) != len(boundaries) + 1:
        raise ValueError(f"join needs one more schedule than boundaries, got {len(schedules)} "
                         f"schedules and {len(boundaries)} boundaries")
    if boundaries != sorted(boundaries) or any(b < 0 for b in boundaries):
        raise ValueError(f"join: boundaries must be non-negative and increasing, got {boundaries}")

    def schedule(step):
        count = _count(step)
        start, index = 0, 0
        for i, b in enumerate(boundaries):
            if count >= b:
                start, index = b, i + 1
        return schedules[index](count - start)

    return schedule
