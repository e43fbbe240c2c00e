"""Mesh under a launcher: refuse WORLD_SIZE > 1 with no process group; size-mismatch messages."""

from __future__ import annotations

import re

import pytest

import shardfn as sf

NOT_INITIALISED = re.escape(
    "WORLD_SIZE=2 in the environment (torchrun?) but torch.distributed is not initialised: "
    "call sf.distributed.initialize() first"
)


def test_launched_without_group_raises(monkeypatch):
    monkeypatch.setenv("WORLD_SIZE", "2")
    with pytest.raises(RuntimeError, match=NOT_INITIALISED):
        sf.Mesh({"dp": 1})
    with pytest.raises(RuntimeError, match=NOT_INITIALISED):
        sf.Mesh({"dp": 2})
    # explicit ranks would otherwise let every process believe it is rank 0 of its own mesh
    with pytest.raises(RuntimeError, match=NOT_INITIALISED):
        sf.Mesh({"dp": 1}, ranks=[0])


def test_world_of_one_needs_no_group(monkeypatch):
    monkeypatch.delenv("WORLD_SIZE", raising=False)
    assert sf.Mesh({"dp": 1}).size("dp") == 1
    monkeypatch.setenv("WORLD_SIZE", "1")  # torchrun --nproc-per-node 1 without initialize()
    assert sf.Mesh({"dp": 1, "tp": 1}).shape == (1, 1)
    monkeypatch.setenv("WORLD_SIZE", "")
    assert sf.Mesh({"dp": 1}).rank == 0


def test_malformed_world_size(monkeypatch):
    monkeypatch.setenv("WORLD_SIZE", "two")
    with pytest.raises(ValueError, match="WORLD_SIZE='two' in the environment is not an integer"):
        sf.Mesh({"dp": 1})


def test_size_mismatch_without_group_says_how_to_launch(monkeypatch):
    monkeypatch.delenv("WORLD_SIZE", raising=False)
    with pytest.raises(ValueError) as error:
        sf.Mesh({"dp": 2})
    message = str(error.value)
    assert "mesh {'dp': 2} has 2 positions" in message
    assert "a world of one process (torch.distributed is not initialised)" in message
    assert "multiply to the world size (1)" in message
    assert "Mesh({'dp': 1})" in message
    assert "torchrun --nproc-per-node 2" in message
    assert "sf.distributed.initialize()" in message
    assert "sf.testing.local_world(2)" in message


def test_size_mismatch_with_explicit_ranks(monkeypatch):
    monkeypatch.delenv("WORLD_SIZE", raising=False)
    with pytest.raises(ValueError, match=re.escape(
            "mesh {'dp': 2, 'tp': 2} has 4 positions but spans the 1 ranks given in ranks=; "
            "axis sizes must multiply to len(ranks) (1)")):
        sf.Mesh({"dp": 2, "tp": 2}, ranks=[0])


def _mismatch_in_world():
    import shardfn as sf

    try:
        sf.Mesh({"dp": 4})
    except ValueError as error:
        return str(error)
    return None


def test_size_mismatch_in_a_world(worlds):
    messages = worlds(2).run(_mismatch_in_world)
    for message in messages:
        assert message is not None
        assert "spans the torch.distributed world of 2 ranks" in message
        assert "multiply to the world size (2)" in message
        assert "Mesh({'dp': 2})" in message
        assert "torchrun" not in message  # the group exists: launching is not the problem


@pytest.mark.parametrize("size", [True, False, 2.0, "2"])
def test_axis_sizes_must_be_ints_not_bools(size):
    with pytest.raises(ValueError, match="sizes are ints >= 1"):
        sf.Mesh({"dp": size})


def test_copies_of_a_mesh_are_the_mesh(worlds):
    """Process groups cannot be copied: a deep copy of a module holding a mesh shares it."""
    import copy

    def copies():
        import torch

        from shardfn.mesh import Mesh

        mesh = Mesh({"dp": 2})
        holder = {"mesh": mesh, "w": torch.zeros(1)}
        clone = copy.deepcopy(holder)
        return clone["mesh"] is mesh and copy.copy(mesh) is mesh and clone["w"] is not holder["w"]

    assert worlds(2).run(copies) == [True, True]
