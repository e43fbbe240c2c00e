"""Fuzz ``pipeline_stages`` on 2 ranks: malformed balances, shapes and per-rank batches.

Every drawn case ends in one of two ways on every rank: the unsplit model's loss and
gradients, or an error that shardfn raises on purpose (``ValueError``, ``TypeError``,
``NotImplementedError``, a peer's ``PeerFailed``; or the unsplit model's own error when
the unsplit model fails on that batch too). Never a hang (the world's timeout), a dead
rank, a stray ``KeyError``/``IndexError``/``AttributeError``, or a wrong number. Ranks
given different batches must all raise (check mode, on in the local world, also compares
the values).
"""

from __future__ import annotations

import os

import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from torch.testing import assert_close

import shardfn as sf
from shardfn.transforms.pipeline import pipeline_stages
from tests.transforms.pipeline._pipeline_models import mlp_units, mse, reference

#: what a rank may raise on purpose (PeerFailed: a peer's error; ConsistencyError is a
#: ValueError)
_ON_PURPOSE = ("ValueError", "TypeError", "NotImplementedError", "PeerFailed",
               "ConsistencyError")


@st.composite
def cases(draw):
    n_units = draw(st.integers(2, 5))
    virtual = draw(st.sampled_from([1, 1, 2]))
    n_stages = 2 * virtual
    valid = None
    if n_units >= n_stages:
        cuts = sorted(draw(st.lists(st.integers(1, n_units - 1), min_size=n_stages - 1,
                                    max_size=n_stages - 1, unique=True)))
        valid = [b - a for a, b in zip([0, *cuts], [*cuts, n_units], strict=True)]
    balance = draw(st.one_of(
        st.just(valid), st.just(valid), st.just("params"), st.just("time"),
        st.lists(st.integers(-1, 4), max_size=5), st.just([1.0] * n_stages),
        st.just("fastest")))
    rows = draw(st.integers(1, 6))
    same = draw(st.booleans()) or draw(st.booleans())
    per_rank = [{"rows": rows, "d_in": 4, "d_out": 3, "seed": 7, "t_rows": rows}
                for _ in range(2)]
    if not same:  # one rank's batch differs in one way
        field = draw(st.sampled_from(["rows", "d_in", "d_out", "seed", "t_rows"]))
        per_rank[1][field] = {"rows": rows + 1, "d_in": 5, "d_out": 2, "seed": 8,
                              "t_rows": rows + 1}[field]
    elif draw(st.integers(0, 4)) == 0:  # both ranks, the same bad batch
        field = draw(st.sampled_from(["d_in", "d_out", "t_rows"]))
        for r in per_rank:
            r[field] = {"d_in": 5, "d_out": 2, "t_rows": rows + 1}[field]
    m = draw(st.integers(0, 4))
    shapes = draw(st.sampled_from([None, None, "dynamic", "declared", "wrong"]))
    schedule = "interleaved" if virtual == 2 else draw(st.sampled_from(["gpipe", "1f1b"]))
    return {"n_units": n_units, "virtual": virtual, "balance": balance, "m": m,
            "per_rank": per_rank, "shapes": shapes, "schedule": schedule}


def _batch(spec):
    gen = torch.Generator().manual_seed(spec["seed"])
    return (torch.randn(spec["rows"], spec["d_in"], generator=gen),
            torch.randn(spec["t_rows"], spec["d_out"], generator=gen))


def _shapes(case, rows):
    m = max(case["m"], 1)
    return {"declared": (max(rows // m, 1), 8), "wrong": (max(rows // m, 1), 7)}.get(
        case["shapes"], case["shapes"])


def _raised(where, error):
    """What a rank reports: where, the error's type, its text, its innermost frame's file."""
    import traceback

    frames = traceback.extract_tb(error.__traceback__)
    return where, type(error).__name__, str(error)[:400], frames[-1].filename if frames else ""


def _on_rank(case):
    import torch.distributed as dist

    spec = case["per_rank"][dist.get_rank()]
    x, y = _batch(spec)
    try:
        pp = pipeline_stages(mlp_units(case["n_units"]), sf.Mesh({"pp": 2}), "pp",
                             balance=case["balance"], schedule=case["schedule"],
                             microbatches=case["m"], loss_fn=mse, virtual=case["virtual"],
                             shapes=_shapes(case, spec["rows"]), sample=x[:1])
    except Exception as error:  # noqa: BLE001 - the test classifies every rank's error
        return _raised("build", error)
    try:
        loss, grads = pp.value_and_grad(pp.init(0), x, y)
    except Exception as error:  # noqa: BLE001
        return _raised("step", error)
    return "ok", loss, grads, ""


def _reference_error(case):
    spec = case["per_rank"][0]
    try:
        reference(mlp_units(case["n_units"]), 0, *_batch(spec))
    except Exception as error:  # noqa: BLE001
        return type(error).__name__
    return None


@settings(max_examples=10, deadline=None, suppress_health_check=list(HealthCheck))
@given(case=cases())
def test_pipeline_fuzz_right_result_or_a_clear_error_on_every_rank(worlds, case):
    found = worlds(2).run(_on_rank, case)
    outcomes = {f[0] for f in found}
    agreed = case["per_rank"][0] == case["per_rank"][1]
    if outcomes == {"ok"}:
        assert agreed, f"ranks given different batches returned a loss: {case}"
        _, loss, grads, _ = reference(mlp_units(case["n_units"]), 0,
                                      *_batch(case["per_rank"][0]))
        merged = {**found[0][2], **found[1][2]}
        assert_close(found[0][1], loss)
        assert_close(found[1][1], loss)
        assert_close(merged, grads)
        return
    assert "ok" not in outcomes, f"one rank returned, another raised: {found} for {case}"
    model_error = _reference_error(case) if agreed else None  # the unsplit model's own
    for rank, (where, name, text, innermost) in enumerate(found):
        if name == model_error:
            continue
        assert name in _ON_PURPOSE, f"rank {rank} raised {name} at {where}: {text} ({case})"
        assert f"{os.sep}shardfn{os.sep}" in innermost, (
            f"rank {rank}: {name} from {innermost}, not shardfn's own check: {text} ({case})")
