"""The optimizer-state roles are memoized: repeated saves and loads probe ``init`` once.

One process: two saves and a load with the same AdamW probe its ``init`` once; a
different optimizer (SGD with momentum) over the same parameters, and the same
one over parameters of another dtype, are probed anew; every round trip gives
back the state saved, and a state of the wrong structure is still refused.
"""

from __future__ import annotations

import pytest
import torch

import shardfn as sf
import shardfn.checkpoint as ck
from shardfn.checkpoint import _layout


def _params(dtype=torch.float32):
    return {"w": torch.arange(6.0, dtype=dtype).reshape(3, 2), "b": torch.ones(2, dtype=dtype)}


def test_roles_are_probed_once_per_optimizer_and_dtypes(tmp_path, monkeypatch):
    probes = []
    real = _layout.state_roles
    monkeypatch.setattr(_layout, "state_roles", lambda *a: probes.append(a[0]) or real(*a))
    _layout._ROLES.clear()
    mesh = sf.Mesh({"dp": 1})
    adam, sgd = sf.optim.adamw(1e-2), sf.optim.sgd(0.1, momentum=0.9)
    for i, (opt, dtype) in enumerate([(adam, torch.float32), (adam, torch.float32),
                                      (sgd, torch.float32), (adam, torch.float64)]):
        params = _params(dtype)
        state = {"params": params, "opt": opt.init(params)}
        state["opt"] = sf.pytree.tree_map(lambda x: x + 3 if isinstance(x, torch.Tensor)
                                          and x.is_floating_point() else x, state["opt"])
        layouts = {"params": {"w": None, "b": None}, "opt": opt}
        path = ck.save(str(tmp_path / f"c{i}"), state, mesh, layouts)
        like = {"params": _params(dtype), "opt": opt.init(_params(dtype))}
        torch.testing.assert_close(ck.load(path, like, mesh, layouts), state)
    assert probes == [adam, sgd, adam]  # the second AdamW save and every load: memoized
    wrong = {"params": _params(), "opt": sgd.init(_params())}
    with pytest.raises(ValueError, match="is not its optimizer's init of these params"):
        ck.save(str(tmp_path / "bad"), wrong, mesh, {"params": {"w": None, "b": None},
                                                      "opt": adam})
