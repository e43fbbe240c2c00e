"""Small models and references shared by the pipeline tests."""

from __future__ import annotations

import torch
from torch import nn

from shardfn.functional import functional
from shardfn.transforms.pipeline import make_schedule

#: every schedule the pipeline knows; those make_schedule does not have yet are skipped
ALL_SCHEDULES = ("gpipe", "1f1b", "interleaved", "zb-h1")


def schedule_status(name: str, p: int, m: int, v: int) -> str | None:
    """None when ``make_schedule(name, p, m, v)`` works; else why not ("missing" / the error)."""
    try:
        make_schedule(name, p, m, v)
    except NotImplementedError:
        return "missing"
    except ValueError as error:
        return str(error)
    return None


def virtual_for(name: str) -> int:
    return 2 if name == "interleaved" else 1


def mlp_units(n_units: int, d: int = 8, d_in: int = 4, d_out: int = 3) -> list[nn.Module]:
    """Linear/Tanh units (d_in -> d ... -> d_out): every even unit a Linear."""
    units: list[nn.Module] = []
    width = d_in
    for k in range(n_units):
        if k == n_units - 1:
            units.append(nn.Linear(width, d_out))
        elif k % 2 == 0:
            units.append(nn.Linear(width, d))
            width = d
        else:
            units.append(nn.Tanh())
    return units


def mse(out: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
    return ((out - target) ** 2).mean()


def reference(units: list[nn.Module], seed: int, x: torch.Tensor, y: torch.Tensor, loss_fn=mse):
    """(params, loss, grads, out) of the unsplit nn.Sequential on the whole batch."""
    model = functional(nn.Sequential(*units))
    params = model.init(seed)
    trainable, rest = model.split_trainable(params)
    grads, loss = torch.func.grad_and_value(
        lambda t: loss_fn(model.apply({**rest, **t}, x), y))(trainable)
    return params, loss, grads, model.apply(params, x)


def batch(n: int, d_in: int = 4, d_out: int = 3, seed: int = 7):
    gen = torch.Generator().manual_seed(seed)
    return torch.randn(n, d_in, generator=gen), torch.randn(n, d_out, generator=gen)
