"""The strategies draw what they promise: meshes that fit, specs valid for their shape
(shard then gather is the identity on the local world, uneven dims included), pytrees, and
tiny models whose options are really there."""

from __future__ import annotations

import math
import re
from pathlib import Path

import torch
from hypothesis import given, settings
from hypothesis import strategies as st

import shardfn as sf
from shardfn.testing import strategies

DOC = Path(__file__).resolve().parents[2] / "docs" / "testing.md"


@settings(max_examples=30, deadline=None)
@given(mesh=strategies.meshes(max_ranks=4, min_ranks=2), data=st.data())
def test_meshes_shapes_and_specs_are_valid(mesh, data):
    assert 2 <= math.prod(mesh.values()) <= 4 and 1 <= len(mesh) <= 2
    shape, spec = data.draw(strategies.sharded_arrays(mesh))
    assert len(spec) == len(shape)
    used = [a for part in spec if part for a in ((part,) if isinstance(part, str) else part)]
    assert len(used) == len(set(used)) and set(used) <= set(mesh)
    even_shape = data.draw(strategies.shapes(min_dims=1))
    even = data.draw(strategies.partition_specs(even_shape, mesh, even=True))
    for side, part in zip(even_shape, even, strict=True):
        names = () if part is None else (part,) if isinstance(part, str) else part
        assert side % math.prod(mesh[a] for a in names) == 0


def _round_trip(mesh, cases):
    import shardfn as sf

    out = []
    with sf.Mesh(mesh) as m:
        for full, spec in cases:
            local = sf.shard(full, spec, m)
            out.append(torch.equal(sf.gather(local, sf.layout_of(full, spec), m), full))
    return out


@settings(max_examples=4, deadline=None)
@given(mesh=strategies.meshes(max_ranks=4, min_ranks=2),
       data=st.data())
def test_drawn_specs_shard_and_gather_back_on_the_world(worlds, mesh, data):
    cases = [(torch.randn(shape), spec) for shape, spec in
             (data.draw(strategies.sharded_arrays(mesh)) for _ in range(3))]
    for ok in worlds(math.prod(mesh.values())).run(_round_trip, mesh, cases):
        assert ok == [True, True, True]


@settings(max_examples=10, deadline=None)
@given(tree=strategies.pytrees(dtypes=(torch.float32, torch.int64)))
def test_pytrees_are_small_dicts_of_tensors(tree):
    leaves = sf.pytree.tree_leaves(tree)
    assert 1 <= len(leaves) <= 4 and all(isinstance(t, torch.Tensor) for t in leaves)


@settings(max_examples=6, deadline=None)
@given(spec=strategies.models())
def test_models_have_their_tied_weights_buffers_and_frozen_layers(spec):
    module = spec()
    fmodel = sf.functional(module)
    params = fmodel.init(0)
    assert bool(fmodel.tied) == spec.tied
    assert bool(fmodel.buffer_names) == spec.buffer
    assert any(not p.requires_grad for p in module.parameters()) == spec.frozen
    loss = spec.loss(fmodel.apply, params, spec.batch(2, 0))
    assert loss.dim() == 0 and torch.isfinite(loss)


def test_the_documented_megatron_example_runs_and_is_short():
    """docs/testing.md's example, executed: under 20 lines of code (blank lines aside), green."""
    block = re.search(r"<!-- example: megatron -->\n```python\n(.*?)```", DOC.read_text(),
                      re.S).group(1)
    assert len([line for line in block.splitlines() if line.strip()]) < 20
    namespace = {"__name__": "docs_testing_example"}
    exec(compile(block, str(DOC), "exec"), namespace)  # noqa: S102
    namespace["test_megatron_mlp"]()
