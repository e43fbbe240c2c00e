"""Issue 26 item 8: a leaf whose exact gradient is zero drifts under Adam, and the kit says so.

The case is real: one attention layer with a key bias, data parallel over 2 ranks
against the one-process reference, Adam, four steps. Softmax is invariant to the key
bias, so its gradient is round-off; Adam normalises that round-off into lr-sized steps
of random sign, and the two runs part ways on that leaf alone. The kit names the leaf,
says why, and suggests SGD / masking / comparing gradients; SGD and a gradients-only
comparison indeed pass. A genuine bug (the sharded step's learning rate doubled) is
reported on a leaf with a real gradient, without that hint, even though the key bias
comes first in the tree and drifts too.
"""

from __future__ import annotations

import pytest
import torch

import shardfn as sf
from shardfn.testing import assert_sharded_matches, loss_trainer
from shardfn.testing._compare import Tolerance, compare_runs

D, SEQ, ROWS, STEPS = 8, 6, 4, 4
ZERO_GRAD_HINT = "has an exact gradient of zero"


def attention_params(seed: int = 0) -> dict[str, torch.Tensor]:
    """One attention head with a key bias (first in the tree, so it is compared first)."""
    gen = torch.Generator().manual_seed(seed)
    return {"bk": torch.randn(D, generator=gen) / D**0.5,
            **{name: torch.randn(D, D, generator=gen) / D**0.5
               for name in ("wq", "wk", "wv", "wo")}}


def attention_loss(params, batch):
    x, y = batch
    q, v = x @ params["wq"].T, x @ params["wv"].T
    k = x @ params["wk"].T + params["bk"]  # adds q . bk to every score of a row: no effect
    weights = torch.softmax(q @ k.transpose(-1, -2) / D**0.5, dim=-1)
    return ((weights @ v) @ params["wo"].T - y).square().mean()


def batches() -> list:
    gen = torch.Generator().manual_seed(1)
    return [(torch.randn(ROWS, SEQ, D, generator=gen), torch.randn(ROWS, SEQ, D, generator=gen))
            for _ in range(STEPS)]


def optimizer(kind: str, lr: float):
    return sf.optim.adam(lr) if kind == "adam" else sf.optim.sgd(lr)


def data_parallel(kind: str, lr: float = 1e-2):
    def sharded(mesh):
        return loss_trainer(attention_params(), attention_loss, opt=optimizer(kind, lr),
                            reduce_grads=lambda g: sf.pmean(g, "dp"),
                            reduce_loss=lambda loss: sf.pmean(loss, "dp"))
    return sharded


def reference(kind: str):
    return lambda: loss_trainer(attention_params(), attention_loss, opt=optimizer(kind, 1e-2))


def test_the_key_bias_gradient_is_round_off():
    grads = torch.func.grad(attention_loss)(attention_params(), batches()[0])
    largest = max(float(g.abs().max()) for g in grads.values())
    assert float(grads["bk"].abs().max()) < 1e-5 * largest  # zero but for round-off


def test_adam_drift_of_a_key_bias_is_explained_and_the_suggestions_pass(worlds):
    with pytest.raises(AssertionError) as caught:
        assert_sharded_matches(data_parallel("adam"), reference("adam"), n_ranks=2,
                               inputs=batches(), world=worlds)
    message = str(caught.value)
    assert "assert_sharded_matches: params['bk'] differs" in message, message
    assert ZERO_GRAD_HINT in message and "Adam" in message and "round-off" in message
    assert "sf.optim.sgd" in message and "sf.optim.masked" in message
    assert 'compare=("loss", "grads")' in message
    # the suggestions work: SGD, or the gradients before the update
    assert_sharded_matches(data_parallel("sgd"), reference("sgd"), n_ranks=2, inputs=batches(),
                           world=worlds)
    assert_sharded_matches(data_parallel("adam"), reference("adam"), n_ranks=2,
                           inputs=batches(), world=worlds, compare=("loss", "grads"))


def test_a_genuine_difference_gets_no_zero_gradient_hint(worlds):
    with pytest.raises(AssertionError) as caught:
        assert_sharded_matches(data_parallel("adam", lr=2e-2), reference("adam"), n_ranks=2,
                               inputs=batches(), world=worlds)
    message = str(caught.value)
    headline = message.splitlines()[0]
    assert "params['bk']" not in headline and "params['w" in headline, message
    assert ZERO_GRAD_HINT not in message
    assert "note: params['bk'] differs too" in message  # the drift is still mentioned


def _records(grad: torch.Tensor, before: torch.Tensor, after: torch.Tensor) -> list[dict]:
    other = torch.ones(3)
    return [{"params": {"b": before, "w": other}},
            {"params": {"b": after, "w": other}, "grads": {"b": grad, "w": other}}]


def _message(reference: list[dict], sharded_b: torch.Tensor) -> str:
    runs = [[reference[0], {**reference[1], "params": {**reference[1]["params"],
                                                       "b": sharded_b}}]]
    with pytest.raises(AssertionError) as caught:
        compare_runs(reference, runs, keys=("params",), tolerance=Tolerance(),
                     mesh_shape={"dp": 1})
    return str(caught.value)


def test_the_hint_needs_a_round_off_gradient_and_an_amplified_update():
    before = torch.zeros(3)
    adam_step = torch.tensor([1e-2, -1e-2, 1e-2])
    drift = _message(_records(torch.full((3,), 1e-9), before, adam_step), -adam_step)
    assert ZERO_GRAD_HINT in drift and "params['b']" in drift
    # a real (small) gradient, amplified the same: a genuine difference
    real = _message(_records(torch.full((3,), 1e-3), before, adam_step), -adam_step)
    assert ZERO_GRAD_HINT not in real
    # a round-off gradient moved by SGD (update = lr * grad): not amplified, no hint
    sgd = _message(_records(torch.full((3,), 1e-9), before, torch.full((3,), -1e-10)),
                   torch.ones(3))
    assert ZERO_GRAD_HINT not in sgd
