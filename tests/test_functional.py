"""Tests for shardfn.functional: nn.Module -> pure (init, apply)."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from torch import nn
from torch.func import functional_call, grad, grad_and_value, vjp, vmap

from shardfn.functional import FunctionalModel, ShapeDtype, derive_seed, functional

FAST = settings(max_examples=10, deadline=None)


# ------------------------------------------------------------------ models


def mlp(widths: list[int], bias: bool = True) -> nn.Sequential:
    layers: list[nn.Module] = []
    for i, (n_in, n_out) in enumerate(zip(widths[:-1], widths[1:], strict=True)):
        layers.append(nn.Linear(n_in, n_out, bias=bias))
        if i < len(widths) - 2:
            layers.append(nn.Tanh())
    return nn.Sequential(*layers)


class TiedLM(nn.Module):
    """Embedding whose weight is also the output projection's weight."""

    def __init__(self, vocab: int = 11, dim: int = 6):
        super().__init__()
        self.emb = nn.Embedding(vocab, dim)
        self.norm = nn.LayerNorm(dim)
        self.head = nn.Linear(dim, vocab, bias=False)
        self.head.weight = self.emb.weight

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        return self.head(self.norm(self.emb(tokens)))


class Custom(nn.Module):
    """A parameter made with torch.randn in __init__ and a constant mask buffer."""

    def __init__(self, dim: int = 5):
        super().__init__()
        self.proj = nn.Linear(dim, dim)
        self.scale = nn.Parameter(torch.randn(dim))
        self.register_buffer("mask", (torch.arange(dim) % 2).float())

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.proj(x) * self.scale * self.mask


class ConvNet(nn.Module):
    def __init__(self):
        super().__init__()
        self.lin = nn.Linear(4, 6)
        self.bn = nn.BatchNorm1d(6)
        self.out = nn.Linear(6, 3)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.out(torch.relu(self.bn(self.lin(x))))


def load(module: nn.Module, params: dict[str, torch.Tensor], model: FunctionalModel) -> None:
    """Load ``params`` into ``module``; only tied aliases may be missing."""
    result = module.load_state_dict(params, strict=False)
    assert set(result.missing_keys) <= set(model.tied)
    assert not result.unexpected_keys


def assert_trees_equal(a: dict, b: dict) -> None:
    assert list(a) == list(b)
    for name in a:
        assert torch.equal(a[name], b[name]), name


# ------------------------------------------------------------------ init


def test_init_is_deterministic_and_seed_dependent():
    model = functional(mlp([3, 8, 8, 2]))
    first, second = model.init(0), model.init(0)
    assert_trees_equal(first, second)
    other = model.init(1)
    for name in ("0.weight", "2.weight", "4.weight"):
        assert not torch.equal(first[name], other[name])


def test_init_independent_of_global_rng_and_module_values():
    torch.manual_seed(1)
    model_a = functional(mlp([3, 8, 2]))
    torch.manual_seed(2)
    model_b = functional(mlp([3, 8, 2]))  # different current values
    torch.manual_seed(3)
    params_a = model_a.init(5)
    torch.manual_seed(4)
    params_b = model_b.init(5)
    assert_trees_equal(params_a, params_b)


def test_init_leaves_caller_rng_untouched():
    model = functional(mlp([3, 8, 2]))
    torch.manual_seed(123)
    state = torch.random.get_rng_state()
    model.init(0)
    model.init_subset(1, ["2"])
    assert torch.equal(torch.random.get_rng_state(), state)
    expected = torch.rand(3)
    torch.manual_seed(123)
    assert torch.equal(torch.rand(3), expected)


def test_init_calls_reset_parameters_with_the_derived_seed():
    # Reference: nn.Linear's constructor runs reset_parameters on the global RNG.
    model = functional(mlp([3, 4, 2]))
    params = model.init(7)
    for path, (n_in, n_out) in (("0", (3, 4)), ("2", (4, 2))):
        torch.manual_seed(derive_seed(7, path))
        reference = nn.Linear(n_in, n_out)
        assert torch.equal(params[f"{path}.weight"], reference.weight.detach())
        assert torch.equal(params[f"{path}.bias"], reference.bias.detach())


def test_init_identical_in_another_process():
    code = (
        "import torch, hashlib\n"
        "from shardfn.functional import functional\n"
        "m = torch.nn.Sequential(torch.nn.Linear(3, 5), torch.nn.LayerNorm(5))\n"
        "p = functional(m).init(11)\n"
        "h = hashlib.sha256()\n"
        "[h.update(k.encode() + p[k].numpy().tobytes()) for k in p]\n"
        "print(h.hexdigest())\n"
    )
    env = {**os.environ, "PYTHONHASHSEED": "12345", "PYTHONPATH": os.getcwd()}
    result = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, env=env, check=True
    )
    import hashlib

    params = functional(nn.Sequential(nn.Linear(3, 5), nn.LayerNorm(5))).init(11)
    digest = hashlib.sha256()
    for name in params:
        digest.update(name.encode() + params[name].numpy().tobytes())
    assert result.stdout.strip() == digest.hexdigest()


def test_derive_seed_is_stable():
    assert derive_seed(0, "a") == derive_seed(0, "a")
    assert len({derive_seed(0, "a"), derive_seed(1, "a"), derive_seed(0, "b")}) == 3
    assert 0 <= derive_seed(-5, "x") < 2**63


@FAST
@given(
    widths=st.lists(st.integers(1, 6), min_size=2, max_size=5),
    seed=st.integers(0, 2**40),
    data=st.data(),
)
def test_init_subset_equals_slice_of_init(widths, seed, data):
    model = functional(mlp(widths))
    full = model.init(seed)
    paths = data.draw(st.lists(st.sampled_from(model.module_paths), unique=True))
    subset = model.init_subset(seed, paths)
    expected = {n: v for n, v in full.items() if model.owners[n] in paths}
    assert_trees_equal(subset, expected)


def test_init_subset_recurse_and_bad_paths():
    net = nn.Sequential(nn.Sequential(nn.Linear(2, 3), nn.LayerNorm(3)), nn.Linear(3, 1))
    model = functional(net)
    full = model.init(0)
    assert model.init_subset(0, ["0"]) == {}  # owns nothing itself
    nested = model.init_subset(0, ["0"], recurse=True)
    assert_trees_equal(nested, {n: v for n, v in full.items() if n.startswith("0.")})
    assert_trees_equal(model.init_subset(0, [""], recurse=True), full)
    with pytest.raises(ValueError, match=r"no submodule at path '0\.2'.*did you mean"):
        model.init_subset(0, ["0.2"])
    with pytest.raises(TypeError, match="sequence of paths"):
        model.init_subset(0, "0.0")


def test_meta_module_init_equals_materialised_module_init():
    with torch.device("meta"):
        big = mlp([4, 7, 3])
    assert_trees_equal(functional(big).init(2), functional(mlp([4, 7, 3])).init(2))

    fns = {
        "scale": lambda shape, dtype, device, gen: torch.randn(shape, generator=gen),
        "mask": lambda shape, dtype, device, gen: torch.ones(shape),
    }
    with torch.device("meta"):
        meta_module = Custom()
    assert_trees_equal(
        functional(Custom(), init_fns=fns).init(3), functional(meta_module, init_fns=fns).init(3)
    )
    # without an init_fn, the meta module's mask cannot be initialised: clear error
    only_scale = functional(meta_module, init_fns={"scale": fns["scale"]})
    with pytest.raises(ValueError, match=r"cannot initialise leaf 'mask'.*init_fns"):
        only_scale.init(3)
    only_scale.init_subset(3, ["proj"])  # other submodules still initialise


def test_meta_module_mask_via_init_fns_and_pattern():
    with torch.device("meta"):
        module = nn.Sequential(Custom(), Custom())
    fns = {
        "*.scale": lambda shape, dtype, device, gen: torch.ones(shape, dtype=dtype),
        "*.mask": lambda shape, dtype, device, gen: torch.randn(shape, generator=gen),
        "1.mask": lambda shape, dtype, device, gen: torch.zeros(shape, dtype=dtype),
    }
    model = functional(module, init_fns=fns)
    params = model.init(0)
    assert torch.equal(params["0.scale"], torch.ones(5))
    assert torch.equal(params["1.mask"], torch.zeros(5))  # exact name beats pattern
    gen = torch.Generator().manual_seed(derive_seed(0, "leaf:0.mask"))
    assert torch.equal(params["0.mask"], torch.randn(5, generator=gen))
    assert_trees_equal(model.init_subset(0, ["0"]), {n: params[n] for n in ("0.scale", "0.mask")})


def test_uncovered_leaves_copied_from_module_not_aliased():
    module = Custom()
    model = functional(module)
    params = model.init(0)
    assert torch.equal(params["scale"], module.scale.detach())
    assert torch.equal(params["mask"], module.mask)
    params["mask"].add_(1)  # init returns copies
    assert torch.equal(module.mask, (torch.arange(5) % 2).float())


def test_multihead_attention_uses_private_reset():
    model = functional(nn.MultiheadAttention(8, 2))
    params = model.init(0)
    reference = nn.MultiheadAttention(8, 2)
    torch.manual_seed(derive_seed(0, ""))  # the root module's seed
    reference._reset_parameters()
    assert torch.equal(params["in_proj_weight"], reference.in_proj_weight.detach())
    assert torch.equal(params["in_proj_bias"], torch.zeros(24))


def test_init_dtype_and_meta_device():
    model = functional(mlp([3, 4]).double())
    assert model.init(0)["0.weight"].dtype == torch.float64
    abstract = model.init(0, device="meta")
    assert all(v.device.type == "meta" for v in abstract.values())


def test_param_shapes_and_abstract_match_init():
    model = functional(TiedLM())
    params = model.init(0)
    shapes = model.param_shapes()
    abstract = model.abstract()
    assert list(shapes) == list(params) == list(abstract)
    for name, value in params.items():
        assert shapes[name] == ShapeDtype(value.shape, value.dtype)
        assert abstract[name].device.type == "meta" and abstract[name].shape == value.shape


def test_user_module_is_never_touched():
    module = ConvNet()
    before = {k: v.clone() for k, v in module.state_dict().items()}
    model = functional(module)
    params = model.init(0)
    model.apply(params, torch.randn(5, 4))
    for name, value in module.state_dict().items():
        assert torch.equal(value, before[name]), name
    assert all(t.device.type == "meta" for t in model.module.state_dict().values())


# ------------------------------------------------------------------ apply


@FAST
@given(
    widths=st.lists(st.integers(1, 6), min_size=2, max_size=5),
    bias=st.booleans(),
    seed=st.integers(0, 1000),
    batch=st.integers(1, 4),
)
def test_apply_equals_module_forward(widths, bias, seed, batch):
    module = mlp(widths, bias)
    model = functional(module)
    params = model.init(seed)
    load(module, params, model)
    x = torch.randn(batch, widths[0])
    torch.testing.assert_close(model.apply(params, x), module(x))


def test_apply_does_not_keep_tensors_between_calls():
    model = functional(mlp([2, 3]))
    params = model.init(0)
    model.apply(params, torch.ones(2))
    assert all(p.device.type == "meta" for p in model.module.parameters())


def test_kwargs_are_forwarded():
    class Scaled(nn.Module):
        def __init__(self):
            super().__init__()
            self.lin = nn.Linear(2, 2)

        def forward(self, x, *, scale=1.0):
            return self.lin(x) * scale

    model = functional(Scaled())
    params = model.init(0)
    x = torch.randn(2)
    torch.testing.assert_close(model.apply(params, x, scale=3.0), 3 * model.apply(params, x))


# ------------------------------------------------------------------ tied weights


def test_tied_weights_are_one_leaf_and_stay_tied():
    module = TiedLM()
    model = functional(module)
    assert model.tied == {"head.weight": "emb.weight"}
    params = model.init(0)
    assert "head.weight" not in params and "emb.weight" in params
    # the owner (the embedding) initialises it; the head's reset_parameters does not overwrite it
    torch.manual_seed(derive_seed(0, "emb"))
    assert torch.equal(params["emb.weight"], nn.Embedding(11, 6).weight.detach())
    tokens = torch.tensor([1, 4, 7])
    # changing the one leaf changes both uses: compare with the real tied module
    params = {**params, "emb.weight": torch.randn(11, 6)}
    load(module, params, model)
    assert module.head.weight is module.emb.weight
    torch.testing.assert_close(model.apply(params, tokens), module(tokens))


def test_shared_submodule_is_one_set_of_leaves():
    linear = nn.Linear(3, 3)
    module = nn.Sequential(linear, nn.Tanh(), linear)
    model = functional(module)
    assert model.names == ("0.weight", "0.bias")
    assert model.tied == {"2.weight": "0.weight", "2.bias": "0.bias"}
    params = model.init(0)
    load(module, params, model)
    x = torch.randn(2, 3)
    torch.testing.assert_close(model.apply(params, x), module(x))
    grads = grad(lambda p: model.apply(p, x).sum())(params)
    module(x).sum().backward()
    torch.testing.assert_close(grads["0.weight"], linear.weight.grad)


def test_tied_weight_grad_matches_autograd():
    module = TiedLM()
    model = functional(module)
    params = model.init(0)
    load(module, params, model)
    tokens = torch.tensor([[1, 2, 3], [4, 5, 10]])
    target = torch.randn(2, 3, 11)

    def loss(p):
        return ((model.apply(p, tokens) - target) ** 2).mean()

    grads = grad(loss)(params)
    ((module(tokens) - target) ** 2).mean().backward()
    assert list(grads) == list(params)
    for name, param in module.named_parameters():
        torch.testing.assert_close(grads[name], param.grad)
    # both uses contribute: the head-only gradient is not the whole story
    head_only = torch.func.grad(
        lambda w: (
            (functional_call(module, {"head.weight": w}, (tokens,), tie_weights=False) - target)
            ** 2
        ).mean()
    )(params["emb.weight"])
    assert not torch.allclose(grads["emb.weight"], head_only)


# ------------------------------------------------------------------ buffers, frozen


def test_batchnorm_buffers_init_and_pure_apply():
    module = ConvNet()
    model = functional(module)
    params = model.init(0)
    assert model.buffer_names == ("bn.running_mean", "bn.running_var", "bn.num_batches_tracked")
    assert torch.equal(params["bn.running_mean"], torch.zeros(6))
    assert torch.equal(params["bn.running_var"], torch.ones(6))
    assert torch.equal(params["bn.num_batches_tracked"], torch.tensor(0))
    load(module, params, model)
    x = torch.randn(8, 4)
    snapshot = {n: params[n].clone() for n in model.buffer_names}
    out, buffers = model.apply_with_buffers(params, x)
    torch.testing.assert_close(out, module(x))  # module (train mode) updates its stats
    for name in model.buffer_names:
        assert torch.equal(params[name], snapshot[name]), "apply mutated the caller's buffer"
        torch.testing.assert_close(buffers[name], module.get_buffer(name))
    # eval mode uses the updated running stats
    eval_model = model.eval()
    assert model.module.training and not eval_model.module.training
    module.eval()
    torch.testing.assert_close(eval_model.apply({**params, **buffers}, x), module(x))


def test_constant_buffer_and_frozen_params_with_split_trainable():
    module = Custom()
    module.proj.bias.requires_grad_(False)
    model = functional(module)
    assert model.frozen_names == ("proj.bias",)
    assert model.buffer_names == ("mask",)
    params = model.init(0)
    load(module, params, model)
    trainable, rest = model.split_trainable(params)
    assert sorted(trainable) == ["proj.weight", "scale"]
    assert sorted(rest) == ["mask", "proj.bias"]
    assert_trees_equal(model.merge(trainable, rest), params)
    x, target = torch.randn(4, 5), torch.randn(4, 5)

    def loss(trainable, rest, x):
        return ((model.apply(model.merge(trainable, rest), x) - target) ** 2).sum()

    grads = grad(loss)(trainable, rest, x)
    ((module(x) - target) ** 2).sum().backward()
    assert sorted(grads) == sorted(trainable)
    for name in trainable:
        torch.testing.assert_close(grads[name], module.get_parameter(name).grad)
    with pytest.raises(ValueError, match=r"both trainable and rest: \['scale'\]"):
        model.merge(trainable, {**rest, "scale": trainable["scale"]})


# ------------------------------------------------------------------ torch.func


def test_grad_and_value_vjp_and_plain_autograd_agree():
    module = mlp([3, 5, 2])
    model = functional(module)
    params = model.init(0)
    load(module, params, model)
    x = torch.randn(4, 3)

    def loss(p):
        return model.apply(p, x).pow(2).sum()

    grads, value = grad_and_value(loss)(params)
    module(x).pow(2).sum().backward()
    torch.testing.assert_close(value, model.apply(params, x).pow(2).sum())
    out, pullback = vjp(lambda p: model.apply(p, x), params)
    (vjp_grads,) = pullback(2 * out)
    leaves = {n: v.clone().requires_grad_(True) for n, v in params.items()}
    model.apply(leaves, x).pow(2).sum().backward()
    for name, param in module.named_parameters():
        torch.testing.assert_close(grads[name], param.grad)
        torch.testing.assert_close(vjp_grads[name], param.grad)
        torch.testing.assert_close(leaves[name].grad, param.grad)


def test_vmap_over_batch_and_over_params():
    model = functional(mlp([3, 4, 2]))
    params = model.init(0)
    xs = torch.randn(6, 3)
    per_example = vmap(model.apply, in_dims=(None, 0))(params, xs)
    torch.testing.assert_close(per_example, model.apply(params, xs))
    # per-example gradients
    per_example_grads = vmap(grad(lambda p, x: model.apply(p, x).sum()), in_dims=(None, 0))(
        params, xs
    )
    for i in range(3):
        one = grad(lambda p, x: model.apply(p, x).sum())(params, xs[i])
        for name in params:
            torch.testing.assert_close(per_example_grads[name][i], one[name])
    # an ensemble: params stacked along a new leading dim
    members = [model.init(s) for s in range(3)]
    stacked = {n: torch.stack([m[n] for m in members]) for n in params}
    ensemble = vmap(model.apply, in_dims=(0, None))(stacked, xs)
    for i, member in enumerate(members):
        torch.testing.assert_close(ensemble[i], model.apply(member, xs))


# ------------------------------------------------------------------ errors


def test_errors_are_clear():
    with pytest.raises(TypeError, match="expects a torch.nn.Module, got list"):
        functional([nn.Linear(2, 2)])
    model = functional(TiedLM())
    params = model.init(0)
    missing = {k: v for k, v in params.items() if k != "norm.bias"}
    with pytest.raises(ValueError, match=r"missing \['norm.bias'\]"):
        model.apply(missing, torch.tensor([1]))
    with pytest.raises(ValueError, match=r"'head.weight' \(tied to 'emb.weight'"):
        model.apply({**params, "head.weight": params["emb.weight"]}, torch.tensor([1]))
    with pytest.raises(ValueError, match=r"unexpected \['extra'\]"):
        model.apply({**params, "extra": torch.zeros(1)}, torch.tensor([1]))
    with pytest.raises(
        ValueError, match=r"params\['norm.weight'\] has shape \(5,\), expected \(6,\)"
    ):
        model.apply({**params, "norm.weight": torch.zeros(5)}, torch.tensor([1]))
    with pytest.raises(TypeError, match=r"params\['norm.bias'\] must be a Tensor, got list"):
        model.apply({**params, "norm.bias": [0.0] * 6}, torch.tensor([1]))
    with pytest.raises(TypeError, match="params must be a mapping"):
        model.apply(list(params.values()), torch.tensor([1]))
    with pytest.raises(TypeError, match="seed must be an int"):
        model.init(0.5)
    with pytest.raises(
        ValueError, match=r"init_fns keys match no leaf: 'norm.wieght'.*norm.weight"
    ):
        functional(TiedLM(), init_fns={"norm.wieght": lambda *a: torch.zeros(6)})
    with pytest.raises(ValueError, match=r"'head.weight' \(tied to 'emb.weight'; use that name\)"):
        functional(TiedLM(), init_fns={"head.weight": lambda *a: torch.zeros(11, 6)})
    bad_shape = functional(TiedLM(), init_fns={"norm.bias": lambda *a: torch.zeros(3)})
    with pytest.raises(ValueError, match=r"'norm.bias' gave shape \(3,\), expected \(6,\)"):
        bad_shape.init(0)
    with pytest.raises(ValueError, match="lazy"):
        functional(nn.LazyLinear(3))


def test_model_is_immutable_and_repr_is_short():
    model = functional(TiedLM())
    with pytest.raises(AttributeError):
        model.names = ()
    assert repr(model).startswith("FunctionalModel(TiedLM, 3 params")


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_cuda_init_deterministic_and_rng_untouched():
    model = functional(mlp([16, 32, 8]))
    cpu_state = torch.random.get_rng_state()
    cuda_state = torch.cuda.get_rng_state()
    first = model.init(0, device="cuda")
    assert all(v.device.type == "cuda" for v in first.values())
    assert_trees_equal(first, model.init(0, device="cuda"))
    assert_trees_equal(
        model.init_subset(0, ["2"], device="cuda"), {n: first[n] for n in ("2.weight", "2.bias")}
    )
    assert torch.equal(torch.random.get_rng_state(), cpu_state)
    assert torch.equal(torch.cuda.get_rng_state(), cuda_state)
    x = torch.randn(4, 16, device="cuda")
    grads = grad(lambda p: model.apply(p, x).sum())(first)
    assert grads["0.weight"].device.type == "cuda"


def test_model_pickles_for_the_local_world():
    import cloudpickle

    model = functional(Custom())
    clone = cloudpickle.loads(cloudpickle.dumps(model))
    assert_trees_equal(clone.init(4), model.init(4))


def test_failing_reset_parameters_names_the_submodule():
    class Broken(nn.Linear):
        armed = False

        def reset_parameters(self):
            if self.armed:
                raise RuntimeError("boom")
            super().reset_parameters()

    module = nn.Sequential(nn.Linear(2, 2), Broken(2, 2))
    Broken.armed = True
    model = functional(module)  # the meta dry run fails too: values are kept from the module
    with pytest.raises(RuntimeError, match=r"reset_parameters\(\) of Broken at '1' failed.*boom"):
        model.init(0)


# ------------------------------------------------------------------ buffers: apply(mutable=True)


def bn_model_and_module():
    module = ConvNet()
    model = functional(module)
    params = model.init(0)
    load(module, params, model)
    return model, module, params


def test_apply_mutable_returns_every_buffer_after_the_forward():
    model, module, params = bn_model_and_module()
    x = torch.randn(8, 4)
    out, new = model.apply(params, x, mutable=True)
    torch.testing.assert_close(out, module(x))
    assert list(new) == list(model.buffer_names)
    for name in model.buffer_names:
        torch.testing.assert_close(new[name], module.get_buffer(name))
    assert new["bn.num_batches_tracked"].item() == 1 and params["bn.num_batches_tracked"] == 0
    # two steps: {**params, **new} is the next tree
    _, newer = model.apply({**params, **new}, x, mutable=True)
    module(x)
    assert newer["bn.num_batches_tracked"].item() == 2
    torch.testing.assert_close(newer["bn.running_var"], module.get_buffer("bn.running_var"))
    # the alias and the default
    alias_out, alias_new = model.apply_with_buffers(params, x)
    torch.testing.assert_close((alias_out, alias_new), (out, new))
    torch.testing.assert_close(model.apply(params, x), out)
    with pytest.raises(TypeError, match="mutable must be True or False"):
        model.apply(params, x, mutable="yes")


def test_apply_mutable_under_grad_has_aux_and_autograd():
    model, module, params = bn_model_and_module()
    x = torch.randn(8, 4)
    trainable, rest = model.split_trainable(params)

    def loss(trainable, rest, x):
        out, new = model.apply(model.merge(trainable, rest), x, mutable=True)
        return out.pow(2).sum(), new

    grads, new = grad(loss, has_aux=True)(trainable, rest, x)
    module(x).pow(2).sum().backward()
    for name in trainable:
        torch.testing.assert_close(grads[name], module.get_parameter(name).grad)
    for name in model.buffer_names:
        torch.testing.assert_close(new[name], module.get_buffer(name))
    leaves = {k: v.clone().requires_grad_() for k, v in trainable.items()}
    value, new_autograd = loss(leaves, rest, x)
    value.backward()
    for name in trainable:
        torch.testing.assert_close(leaves[name].grad, grads[name])
    torch.testing.assert_close(new_autograd, new)


def test_apply_mutable_under_vmap():
    model, module, params = bn_model_and_module()
    xs = torch.randn(3, 8, 4)
    # batched buffers (an ensemble of 3): each member updates its own statistics
    stacked = {k: torch.stack([v] * 3) for k, v in params.items()}
    outs, new = vmap(lambda p, x: model.apply(p, x, mutable=True))(stacked, xs)
    for i in range(3):
        out_i, new_i = model.apply(params, xs[i], mutable=True)
        torch.testing.assert_close(outs[i], out_i)
        torch.testing.assert_close({k: v[i] for k, v in new.items()}, new_i)
    # unbatched buffers cannot be updated in place under vmap: torch refuses, and we say what to do
    with pytest.raises(RuntimeError, match=r"under torch.func.vmap.*Batch the buffers too"):
        vmap(lambda x: model.apply(params, x, mutable=True))(xs)
    # eval mode reads the statistics only: fine
    vmap(lambda x: model.eval().apply(params, x, mutable=True))(xs)


def test_integer_leaves_are_never_trainable():
    class Counting(nn.Module):
        def __init__(self):
            super().__init__()
            self.lin = nn.Linear(3, 3)
            self.bn = nn.BatchNorm1d(3)
            self.steps = nn.Parameter(torch.tensor([0]), requires_grad=False)  # integer param

        def forward(self, x):
            return self.bn(self.lin(x)) + self.steps

    model = functional(Counting())
    trainable, rest = model.split_trainable(model.init(0))
    assert all(v.is_floating_point() for v in trainable.values())
    assert "bn.num_batches_tracked" in rest and "steps" in rest
    assert set(model.trainable_names) == set(trainable)
    assert "steps" in model.frozen_names


def test_merge_rejects_unknown_names():
    model = functional(mlp([3, 4, 2]))
    trainable, rest = model.split_trainable(model.init(0))
    with pytest.raises(ValueError, match=r"not leaves of Sequential: '0.wieght'"):
        model.merge({**trainable, "0.wieght": torch.zeros(1)}, rest)
    subset = model.merge({"0.weight": trainable["0.weight"]}, {})  # a stage's leaves: allowed
    assert list(subset) == ["0.weight"]


def _split_and_merge_shards():
    import shardfn as sf

    model = functional(ConvNet())
    mesh = sf.Mesh({"dp": 2})
    full = model.init(0)
    specs = {n: sf.P("dp") if n in ("lin.weight", "out.weight", "bn.running_mean") else None
             for n in model.names}
    shards = sf.shard(full, specs, mesh)
    assert shards["lin.weight"].shape != full["lin.weight"].shape
    trainable, rest = model.split_trainable(shards)
    merged = model.merge(trainable, rest)
    errors = {}
    for what, bad in {"missing": {k: v for k, v in shards.items() if k != "bn.running_var"},
                      "unexpected": {**shards, "lin.wieght": shards["lin.weight"]}}.items():
        try:
            model.split_trainable(bad)
        except ValueError as error:
            errors[what] = str(error)
    return (sorted(trainable), sorted(rest), list(merged) == list(model.names),
            all(merged[n] is shards[n] for n in model.names), errors)


def test_split_and_merge_work_on_shard_trees(worlds):
    for trainable, rest, ordered, same, errors in worlds(2).run(_split_and_merge_shards):
        assert trainable == ["bn.bias", "bn.weight", "lin.bias", "lin.weight", "out.bias",
                             "out.weight"]
        assert rest == ["bn.num_batches_tracked", "bn.running_mean", "bn.running_var"]
        assert ordered and same
        assert "missing ['bn.running_var']" in errors["missing"]
        assert "unexpected ['lin.wieght']" in errors["unexpected"]


def test_remat_over_functional_batchnorm_with_mutable():
    from shardfn.transforms.remat import checkpoint_policies, remat

    model, _, params = bn_model_and_module()
    x = torch.randn(8, 4)
    trainable, rest = model.split_trainable(params)

    def step(trainable, rest, x):
        out, new = model.apply(model.merge(trainable, rest), x, mutable=True)
        return out, new

    def loss(fn):
        def value(trainable, rest, x):
            out, new = fn(trainable, rest, x)
            return out.pow(2).sum(), new
        return value

    for policy in (checkpoint_policies.nothing_saveable, checkpoint_policies.dots_saveable):
        fast = remat(step, policy)
        ref_grads, ref_new = grad(loss(step), has_aux=True)(trainable, rest, x)
        grads, new = grad(loss(fast), has_aux=True)(trainable, rest, x)
        torch.testing.assert_close(grads, ref_grads)
        torch.testing.assert_close(new, ref_new)
        assert new["bn.num_batches_tracked"].item() == 1
        leaves = {k: v.clone().requires_grad_() for k, v in trainable.items()}
        value, new_autograd = loss(fast)(leaves, rest, x)
        value.backward()
        torch.testing.assert_close({k: v.grad for k, v in leaves.items()}, ref_grads)
        torch.testing.assert_close(new_autograd, ref_new)


# ------------------------------------------------------------- apply's swap (no functional_call)


class _Reassigns(nn.Module):
    """A forward that reassigns its buffer (``self.count = ...``) and uses a tied head."""

    def __init__(self):
        super().__init__()
        self.emb = nn.Linear(3, 3, bias=False)
        self.head = nn.Linear(3, 3, bias=False)
        self.head.weight = self.emb.weight
        self.register_buffer("count", torch.zeros(()))

    def forward(self, x, fail=False):
        self.count = self.count + 1
        if fail:
            raise ValueError("forward failed on purpose")
        return self.head(self.emb(x))


def _skeleton_tensors(model):
    return [(n, t.device.type) for n, t in [*model.module.named_parameters(remove_duplicate=False),
                                            *model.module.named_buffers()]]


def test_apply_swap_equals_functional_call_and_restores_the_skeleton():
    model = functional(_Reassigns())
    params = model.init(0)
    before = _skeleton_tensors(model)
    x = torch.randn(2, 3)
    out, new = model.apply(params, x, mutable=True)
    call = {**params, "count": params["count"].clone()}
    expected = torch.func.functional_call(model.module, call, (x,), tie_weights=True, strict=True)
    torch.testing.assert_close(out, expected)
    assert new["count"].item() == 1 == call["count"].item() and params["count"].item() == 0
    assert _skeleton_tensors(model) == before  # meta tensors back in every slot
    assert model.module.head.weight is model.module.emb.weight
    with pytest.raises(ValueError, match="on purpose"):
        model.apply(params, x, fail=True)
    assert _skeleton_tensors(model) == before  # also after the forward raised
    # the tied leaf gets both uses' gradients, as under functional_call
    trainable, rest = model.split_trainable(params)
    grads = torch.func.grad(lambda t: model.apply(model.merge(t, rest), x).sum())(trainable)
    ref = torch.func.grad(lambda t: torch.func.functional_call(
        model.module, {**t, "count": rest["count"].clone()}, (x,), tie_weights=True).sum())(
        trainable)
    torch.testing.assert_close(grads, ref)


def test_apply_falls_back_to_functional_call_for_a_parametrized_module():
    module = nn.Linear(3, 3)
    nn.utils.parametrize.register_parametrization(module, "weight", _Symmetric())
    model = functional(module)
    assert model._slots is None
    params = model.init(0)
    x = torch.randn(2, 3)
    torch.testing.assert_close(model.apply(params, x), torch.func.functional_call(
        model.module, params, (x,), tie_weights=True, strict=True))


class _Symmetric(nn.Module):
    def forward(self, w):
        return w.triu() + w.triu(1).transpose(0, 1)


def test_apply_after_a_pickle_round_trip_swaps_into_the_copy():
    import cloudpickle

    model = functional(_Reassigns())
    params = model.init(0)
    x = torch.randn(2, 3)
    out = model.apply(params, x)  # _slots worked out before the pickle
    clone = cloudpickle.loads(cloudpickle.dumps(model))
    torch.testing.assert_close(clone.apply(params, x), out)
    assert all(slot.table is not orig.table for slot, orig in zip(clone._slots, model._slots,
                                                                  strict=True))
    assert clone._slots[0].table is clone.module.emb._parameters
    assert _skeleton_tensors(clone) == _skeleton_tensors(model)


# ------------------------------------- call_module: the swap for shard_params and tensor_split


def _plain_reassigns() -> nn.Module:
    module = _Reassigns()
    with torch.no_grad():
        module.emb.weight.copy_(torch.arange(9.0).reshape(3, 3) / 9)
    return module


@pytest.mark.parametrize("names", [("emb.weight", "count"), ("head.weight", "count"),
                                   ("emb.weight", "head.weight", "count")])
def test_call_module_equals_functional_call_with_tied_names(names):
    """The call's names are the module's own; a tied alias left out takes its owner's
    value (``tie_weights=True``); a reassigned buffer comes back in the dict."""
    from shardfn._functional_swap import call_module, module_slots

    module = _plain_reassigns()
    weight = torch.randn(3, 3)
    x = torch.randn(2, 3)

    def call_params():
        return {n: (weight if n.endswith("weight") else torch.zeros(())) for n in names}

    got_params, ref_params = call_params(), call_params()
    out = call_module(module, got_params, (x,), {})
    expected = functional_call(module, ref_params, (x,), tie_weights=True, strict=True)
    torch.testing.assert_close(out, expected)
    torch.testing.assert_close(out, x @ weight.T @ weight.T)
    assert got_params["count"].item() == 1 == ref_params["count"].item()
    assert module.head.weight is module.emb.weight and module.count.item() == 0  # restored
    with pytest.raises(ValueError, match="on purpose"):
        call_module(module, call_params(), (x,), {"fail": True})
    assert module.head.weight is module.emb.weight and module.count.item() == 0

    def with_weight(w):
        return {**call_params(), **{n: w for n in names if n.endswith("weight")}}

    grads = grad(lambda w: call_module(module, with_weight(w), (x,), {}).sum())(weight)
    ref = grad(lambda w: functional_call(module, with_weight(w), (x,), tie_weights=True,
                                         strict=True).sum())(weight)
    torch.testing.assert_close(grads, ref)
    # both names of the tied weight: functional_call does the call (it checks one value)
    assert (module_slots(module, names) is None) == (len(names) == 3)
    if len(names) == 3:
        with pytest.raises(ValueError, match="tied"):
            call_module(module, {**call_params(), "head.weight": weight.clone()}, (x,), {})


def test_call_module_names_that_do_not_match_raise_as_functional_call_does():
    from shardfn._functional_swap import call_module, module_slots

    module = nn.Linear(2, 2)
    x = torch.randn(1, 2)
    assert module_slots(module, ("weight",)) is None  # bias missing
    assert module_slots(module, ("weight", "bias", "extra")) is None
    for params in ({"weight": torch.eye(2)}, {"weight": torch.eye(2), "bias": torch.zeros(2),
                                              "extra": torch.zeros(1)}):
        with pytest.raises(RuntimeError) as ours:
            call_module(module, params, (x,), {})
        with pytest.raises(RuntimeError) as theirs:
            functional_call(module, params, (x,), tie_weights=True, strict=True)
        assert str(ours.value) == str(theirs.value)


def test_call_module_gives_a_copied_module_its_own_slots():
    import copy

    from shardfn._functional_swap import _CALL_SLOTS, call_module

    module = nn.Linear(2, 2)
    params = {"weight": torch.eye(2), "bias": torch.ones(2)}
    x = torch.randn(1, 2)
    call_module(module, params, (x,), {})
    twin = copy.deepcopy(module)
    torch.testing.assert_close(call_module(twin, params, (x,), {}), x + 1)
    (slots,) = _CALL_SLOTS[twin].values()
    assert all(slot.table is twin._parameters for slot in slots)
    assert twin.weight is not params["weight"] and module.weight is not params["weight"]
