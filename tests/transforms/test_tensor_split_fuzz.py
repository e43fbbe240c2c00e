"""Fuzz of tensor_split (issue 22): malformed plans, shapes, ids and per-rank inputs.

Hypothesis draws a plan (well formed or not: a list, a non-string key, an unknown
style, a style on a module it cannot split, sizes that do not divide), a rank 1
that differs from rank 0 (another valid plan, other inputs, another batch size, another
seed), and token ids (some outside the vocabulary). On a local world of 2 ranks,
in check mode, every rank must either give the unsplit model's output and
gradients, or raise a clear error: a ValueError / TypeError / IndexError raised
by shardfn's own code (or carrying its note), or the unsplit model's own error
for the same input. Never a hang past the check timeout, a crashed rank, an
error on one rank only, or a wrong number. (A rank that raises before a check its
peers make would cost them the check timeout: rank 1's other plan is drawn only when
rank 0's is valid, so the examples stay fast.)
"""

from __future__ import annotations

import traceback

import torch
import torch.nn.functional as F
from hypothesis import given, settings
from hypothesis import strategies as st
from torch import nn
from torch.testing import assert_close

import shardfn as sf
from shardfn.transforms.tensor_split import Colwise, Rowwise, tensor_split

CHECK_TIMEOUT_S = 20.0
GOOD_PLAN = {"emb": "vocab", "fc1": "colwise", "fc2": "rowwise"}
OTHER_PLANS = [{}, {"fc1": Colwise(gather_output=True)}, {"fc1": "colwise", "fc2": "rowwise"}]


class Net(nn.Module):
    def __init__(self, vocab: int, d: int, hidden: int):
        super().__init__()
        self.emb = nn.Embedding(vocab, d)
        self.ln = nn.LayerNorm(d)
        self.fc1 = nn.Linear(d, hidden)
        self.fc2 = nn.Linear(hidden, d)

    def forward(self, ids):
        h = self.emb(ids)
        return h + self.fc2(F.gelu(self.fc1(self.ln(h))))


KEYS = ["emb", "fc1", "fc2", "ln", "fc*", "nope", 3]
STYLES = ["colwise", "rowwise", "vocab", "replicate", "sideways", "sequence_parallel",
          "split_rng", Colwise(gather_output=True), Colwise(fused=2),
          Rowwise(sequence_parallel=True), 7]
plans = st.one_of(
    st.just(GOOD_PLAN),
    st.none(),
    st.dictionaries(st.sampled_from(KEYS), st.sampled_from(STYLES), max_size=3),
    st.lists(st.tuples(st.sampled_from(KEYS), st.sampled_from(STYLES)), max_size=2),
)


rarely = st.sampled_from([False, False, True])


def _ids(case: dict, rank: int) -> torch.Tensor:
    b = case["b"] + (rank if case["batch_per_rank"] else 0)
    g = torch.Generator().manual_seed(case["seed"] + (rank if case["ids_per_rank"] else 0))
    ids = torch.randint(0, case["vocab"], (b, 4), generator=g)
    if case["bad_id"] is not None:
        ids[0, 1] = case["bad_id"]
    return ids


def _error(error: BaseException) -> tuple:
    frames = traceback.extract_tb(error.__traceback__)
    raised_in_shardfn = bool(frames) and "/shardfn/" in frames[-1].filename.replace("\\", "/")
    noted = any("tensor_split" in note for note in getattr(error, "__notes__", []))
    return ("error", type(error).__name__, str(error)[:400], raised_in_shardfn or noted,
            isinstance(error, ValueError | TypeError | IndexError | RuntimeError))


def _on_rank(case: dict):
    rank = torch.distributed.get_rank()
    before = sf.check_consistency()
    sf.check_consistency(True, timeout=CHECK_TIMEOUT_S)
    try:
        plan = case["plan"]  # rank 1 builds another (valid) plan: both reach the same check
        if rank == 1 and case["rank1_plan"] is not None and plan == GOOD_PLAN \
                and case["vocab"] % 2 == 0:
            plan = case["rank1_plan"]
        fmodel = sf.functional(Net(case["vocab"], case["d"], case["hidden"]))
        tp = tensor_split(fmodel, sf.Mesh({"tp": 2}), "tp", plan)
        params = tp.init(case["seed"] + (rank if case["seed_per_rank"] else 0))
        ids = _ids(case, rank)
        grads, (_, out) = torch.func.grad_and_value(
            lambda p: (lambda y: (y.square().sum(), y))(tp.apply(p, ids)), has_aux=True)(params)
        return ("ok", out, sf.gather(grads, tp.specs, tp.mesh))
    except Exception as error:  # noqa: BLE001 - what it raised is the result
        return _error(error)
    finally:
        sf.check_consistency(before)


def _reference(case: dict):
    fmodel = sf.functional(Net(case["vocab"], case["d"], case["hidden"]))
    params = fmodel.init(case["seed"])
    try:
        return torch.func.grad_and_value(
            lambda p: (lambda y: (y.square().sum(), y))(fmodel.apply(p, _ids(case, 0))),
            has_aux=True)(params)
    except Exception as error:  # noqa: BLE001
        return error


def _valid(case: dict) -> bool:
    return (case["plan"] == GOOD_PLAN and case["vocab"] % 2 == 0
            and not any(case[k] for k in ("seed_per_rank", "ids_per_rank", "batch_per_rank"))
            and case["rank1_plan"] is None and case["bad_id"] is None)


@settings(max_examples=25, deadline=None)
@given(case=st.fixed_dictionaries({
    "plan": plans,
    "rank1_plan": st.one_of(st.none(), st.sampled_from(OTHER_PLANS)),
    "vocab": st.sampled_from([4, 5]), "d": st.sampled_from([4, 6]),
    "hidden": st.sampled_from([6, 8]), "b": st.integers(1, 2),
    "seed": st.integers(0, 2**16), "seed_per_rank": rarely,
    "ids_per_rank": rarely, "batch_per_rank": rarely,
    "bad_id": st.sampled_from([None, None, None, -1, 4, 5, 100]),
}))
def test_tensor_split_gives_the_right_result_or_a_clear_error_on_every_rank(worlds, case):
    reference = _reference(case)
    got = worlds(2).run(_on_rank, case)  # a crashed rank or a hang raises here
    kinds = {result[0] for result in got}
    assert len(kinds) == 1, f"some ranks failed, others did not: {got}"
    if kinds == {"ok"}:
        assert not isinstance(reference, Exception), f"the unsplit model raised {reference!r}"
        grads, (_, out) = reference
        for _, got_out, got_grads in got:
            assert_close(got_out, out)
            assert_close(got_grads, grads)
        return
    assert not _valid(case), f"a valid case raised: {got}"
    for _, name, message, from_shardfn, clear_type in got:
        assert message, f"{name} with no message"
        assert (from_shardfn and clear_type) or isinstance(reference, Exception), (
            f"{name} from outside shardfn on a case the unsplit model runs: {message}")
    if case["bad_id"] is not None and case["bad_id"] not in range(case["vocab"]):
        assert isinstance(reference, IndexError)
