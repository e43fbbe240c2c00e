"""Export to plain PyTorch and back, and torch.optim state interop.

A GPT with a tied head, sharded with ZeRO-3 on 2 ranks: its gathered
parameters exported (safetensors and torch.save) load into a fresh
``nn.Module`` with ``load_state_dict(strict=True)`` and give the sharded
model's outputs. A plain ``state_dict`` imports into a sharded run with the
same outputs. Adam, AdamW and SGD: K steps in shardfn then K in torch.optim
(and the other way round) end where 2K steps in either end.
"""

from __future__ import annotations

import pytest
import torch
from safetensors.torch import load_file

import shardfn as sf
import shardfn.checkpoint as ck
from shardfn.models import GPT, GPTConfig

CONFIG = dict(vocab_size=11, d_model=8, n_layers=1, n_heads=2, seq_len=8, dropout=0.0)


def _tokens():
    return torch.randint(0, 11, (2, 8), generator=torch.Generator().manual_seed(5))


def _export_on_ranks(directory: str):
    import torch.distributed as dist

    mesh = sf.Mesh({"dp": 2})
    torch.manual_seed(3)
    module = GPT(GPTConfig(**CONFIG))
    model = sf.shard_params(sf.functional(module), mesh, "dp")
    params = model.init(7)
    out = model.apply(params, _tokens())
    full = sf.gather(params, model.specs, mesh)
    if dist.get_rank() == 0:
        ck.export_state_dict(f"{directory}/m.safetensors", full, module=module)
        ck.export_state_dict(f"{directory}/m.pt", full, "torch", module=module)
    return out


def _import_on_ranks(state_dict):
    mesh = sf.Mesh({"dp": 2})
    torch.manual_seed(0)
    model = sf.shard_params(sf.functional(GPT(GPTConfig(**CONFIG))), mesh, "dp")
    return model.apply(ck.import_state_dict(state_dict, model), _tokens())


def test_export_loads_into_the_module_and_import_shards_it(worlds, tmp_path):
    out = worlds(2).run(_export_on_ranks, str(tmp_path))[0]
    for loaded in (load_file(tmp_path / "m.safetensors"),
                   torch.load(tmp_path / "m.pt", weights_only=True)):
        torch.manual_seed(99)
        module = GPT(GPTConfig(**CONFIG))  # other weights until loaded
        assert not torch.allclose(module(_tokens()), out)
        module.load_state_dict(loaded, strict=True)
        assert module.head.weight is module.tok.weight  # still tied
        torch.testing.assert_close(module(_tokens()), out)
    torch.manual_seed(42)
    module = GPT(GPTConfig(**CONFIG))
    for got in worlds(2).run(_import_on_ranks, module.state_dict()):
        torch.testing.assert_close(got, module(_tokens()))


def _pair(name):
    if name == "adam":
        return sf.optim.adam(1e-2, weight_decay=0.01), \
            lambda p: torch.optim.Adam(p, lr=1e-2, weight_decay=0.01)
    if name == "adamw":
        return sf.optim.adamw(1e-2, weight_decay=0.1), \
            lambda p: torch.optim.AdamW(p, lr=1e-2, weight_decay=0.1)
    return sf.optim.sgd(0.05, momentum=0.9, weight_decay=0.01), \
        lambda p: torch.optim.SGD(p, lr=0.05, momentum=0.9, weight_decay=0.01)


def _module():
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(4, 6), torch.nn.Tanh(), torch.nn.Linear(6, 2))


def _batch(i):
    g = torch.Generator().manual_seed(i)
    return torch.randn(8, 4, generator=g), torch.randn(8, 2, generator=g)


def _torch_steps(module, torch_opt, steps, start):
    for i in range(start, start + steps):
        x, y = _batch(i)
        torch_opt.zero_grad()
        ((module(x) - y) ** 2).mean().backward()
        torch_opt.step()


def _sf_steps(fmodel, opt, params, state, steps, start):
    loss = lambda p, x, y: ((fmodel.apply(p, x) - y) ** 2).mean()  # noqa: E731
    for i in range(start, start + steps):
        grads = torch.func.grad(loss)(params, *_batch(i))
        updates, state = opt.update(grads, state, params)
        params = sf.optim.apply_updates(params, updates)
    return params, state


@pytest.mark.parametrize("name", ["adam", "adamw", "sgd"])
def test_torch_optimizer_interop(name):
    opt, make_torch = _pair(name)
    k = 3
    module = _module()
    fmodel = sf.functional(module)
    names = [n for n, _ in module.named_parameters()]
    params = {n: p.detach().clone() for n, p in module.named_parameters()}
    # reference: 2K shardfn steps
    ref, _ = _sf_steps(fmodel, opt, params, opt.init(params), 2 * k, 0)
    # K in shardfn, then K in torch.optim
    half, state = _sf_steps(fmodel, opt, params, opt.init(params), k, 0)
    module.load_state_dict(half)
    torch_opt = make_torch(module.parameters())
    ck.optimizer_to_torch(state, torch_opt, names)
    _torch_steps(module, torch_opt, k, k)
    got = {n: p.detach() for n, p in module.named_parameters()}
    torch.testing.assert_close(got, ref)
    assert not torch.allclose(got["0.weight"], half["0.weight"])
    # K in torch.optim, then K in shardfn
    module = _module()
    torch_opt = make_torch(module.parameters())
    _torch_steps(module, torch_opt, k, 0)
    now = {n: p.detach().clone() for n, p in module.named_parameters()}
    state = ck.optimizer_from_torch(torch_opt, names, opt.init(now), step=k)
    assert int(state.count) == k
    back, _ = _sf_steps(fmodel, opt, now, state, k, k)
    torch.testing.assert_close(back, ref)
