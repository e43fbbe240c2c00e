"""Fuzz ``sf.checkpoint.load`` with malformed files, on 1 and 2 ranks (issue #22).

A checkpoint of a sharded tensor, a replicated one, a bf16 one and Python objects is
saved once per world size; each example copies it, damages one file (truncate, flip
bytes, delete, replace with random bytes or with a pickle that would run code,
append, garble the JSON of the commit marker) and loads it with ``verify=True`` or
``False``. Every rank must give the same outcome: the saved values exactly, or a
``CheckpointError`` (the project's error, not a raw traceback from inside torch or
pickle). Never a hang (the run's timeout), a dead rank, executed code (a marker
file), or a wrong number: with ``verify=True`` always, with ``verify=False`` unless
the damage is in a data file's bytes (nothing is checked then, as documented).
"""

from __future__ import annotations

import json
import os
import shutil
import uuid

import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import shardfn as sf
import shardfn.checkpoint as ck

SHAPE = (8, 6)
EXAMPLES = int(os.environ.get("SHARDFN_FUZZ_EXAMPLES", "40"))  # more: a longer local hunt
QUIET = [HealthCheck.too_slow, HealthCheck.function_scoped_fixture]
_SAVED: dict[int, str] = {}


def _full():
    g = torch.Generator().manual_seed(11)
    return {"w": torch.randn(SHAPE, generator=g), "b": torch.randn(5, generator=g),
            "h": torch.randn(3, 4, generator=g).to(torch.bfloat16), "step": 12,
            "data": {"epoch": 2, "name": "run"}}


def _layouts():
    return {"w": sf.Layout(sf.P("dp", None), SHAPE)}


def _local(world: int, rank: int):
    full = _full()
    return {**full, "w": full["w"].tensor_split(world)[rank]}


def _save(path: str) -> str:
    import torch.distributed as dist

    world, rank = (dist.get_world_size(), dist.get_rank()) if dist.is_initialized() else (1, 0)
    with sf.Mesh({"dp": world}):
        return ck.save(path, _local(world, rank), layouts=_layouts(), thread_count=2)


def _load(path: str, verify: bool):
    import torch.distributed as dist

    world, rank = (dist.get_world_size(), dist.get_rank()) if dist.is_initialized() else (1, 0)
    like = {"w": torch.zeros(_local(world, rank)["w"].shape), "b": torch.zeros(5),
            "h": torch.zeros(3, 4, dtype=torch.bfloat16), "step": 0,
            "data": {"epoch": 0, "name": ""}}
    try:
        with sf.Mesh({"dp": world}):
            out = ck.load(path, like, layouts=_layouts(), verify=verify)
    except ck.CheckpointError as err:
        return "error", str(err)
    except Exception as err:  # noqa: BLE001 - a raw error is what the test looks for
        return "raw", f"{type(err).__name__}: {err}"
    return "ok", _same(out, _local(world, rank))


def _same(a, b) -> bool:
    if isinstance(a, torch.Tensor):
        return isinstance(b, torch.Tensor) and a.dtype == b.dtype and a.shape == b.shape \
            and bool(torch.equal(a, b))
    if isinstance(a, dict):
        return isinstance(b, dict) and a.keys() == b.keys() and all(_same(a[k], b[k])
                                                                    for k in a)
    return type(a) is type(b) and a == b


class _Payload:
    def __init__(self, flag: str):
        self.flag = flag

    def __reduce__(self):
        return os.system, (f"touch {self.flag}",)


def _damage(path: str, name: str, how: tuple, flag: str) -> None:
    file = os.path.join(path, name)
    raw = bytearray(open(file, "rb").read())
    kind, a, b = how
    if kind == "delete":
        os.remove(file)
        return
    if kind == "truncate":
        raw = raw[:a % (len(raw) + 1)]
    elif kind == "flip":
        raw[a % len(raw)] ^= b or 1
    elif kind == "append":
        raw += bytes([b]) * (a % 64 + 1)
    elif kind == "random":
        raw = bytearray(uuid.UUID(int=a * 7919 + b).bytes * (a % 8 + 1))
    elif kind == "payload":
        import pickle

        raw = bytearray(pickle.dumps(_Payload(flag)))
    elif kind == "json":  # still JSON, a value changed, removed or of another type
        manifest = json.loads(bytes(raw))
        key = sorted(manifest)[a % len(manifest)]
        if b % 3 == 0:
            del manifest[key]
        else:
            manifest[key] = [None, "x", -1, {"a": 1}, [1, 2, 3], 2 ** 40][b % 6]
        raw = bytearray(json.dumps(manifest).encode())
    open(file, "wb").write(bytes(raw))


DAMAGE = st.tuples(st.sampled_from(["delete", "truncate", "flip", "append", "random",
                                    "payload", "json"]),
                   st.integers(0, 1 << 20), st.integers(0, 255))


def _check(world, path: str, name: str, how: tuple, verify: bool, tmp: str) -> None:
    copy = os.path.join(tmp, uuid.uuid4().hex)
    shutil.copytree(path, copy)
    flag = os.path.join(tmp, "ran-" + uuid.uuid4().hex)
    try:
        if how[0] == "json" and name != ck._commit.MARKER:
            how = ("flip", *how[1:])
        _damage(copy, name, how, flag)
        outcomes = (world.run(_load, copy, verify, timeout=60) if world is not None
                    else [_load(copy, verify)])
    finally:
        shutil.rmtree(copy, ignore_errors=True)
    assert not os.path.exists(flag), f"{name} {how}: the payload ran"
    kinds = {o[0] for o in outcomes}
    assert "raw" not in kinds, f"{name} {how} verify={verify}: {outcomes}"
    assert len(kinds) == 1, f"{name} {how}: ranks disagree: {outcomes}"
    data_bytes = name.endswith(".distcp") and how[0] in ("flip", "append", "truncate",
                                                         "random")
    if kinds == {"ok"} and (verify or not data_bytes):
        assert all(o[1] for o in outcomes), f"{name} {how} verify={verify}: wrong values"
    if kinds == {"error"} and how[0] in ("delete", "truncate", "payload", "random"):
        for _, message in outcomes:  # the damaged file is named
            assert name in message or (name == ck._commit.MARKER and
                                       "commit marker" in message), (name, how, message)


def _saved(world_size: int, world, tmp_dir) -> str:
    if world_size not in _SAVED or not os.path.exists(_SAVED[world_size]):
        path = str(tmp_dir / f"saved-{world_size}-{uuid.uuid4().hex}")
        _SAVED[world_size] = world.run(_save, path)[0] if world is not None else _save(path)
    return _SAVED[world_size]


def _names(path: str) -> list[str]:
    return sorted(os.listdir(path))


@settings(max_examples=EXAMPLES, deadline=None, suppress_health_check=QUIET)
@given(pick=st.integers(0, 10), how=DAMAGE, verify=st.booleans())
def test_fuzz_load_one_process(tmp_path_factory, pick, how, verify):
    tmp = tmp_path_factory.getbasetemp()
    path = _saved(1, None, tmp)
    names = _names(path)
    _check(None, path, names[pick % len(names)], how, verify, str(tmp))


@settings(max_examples=max(EXAMPLES // 3, 1), deadline=None, suppress_health_check=QUIET)
@given(pick=st.integers(0, 10), how=DAMAGE, verify=st.booleans())
def test_fuzz_load_two_ranks(worlds, tmp_path_factory, pick, how, verify):
    tmp = tmp_path_factory.getbasetemp()
    path = _saved(2, worlds(2), tmp)
    names = _names(path)
    _check(worlds(2), path, names[pick % len(names)], how, verify, str(tmp))


def test_every_file_kind_is_fuzzed(worlds, tmp_path):
    """The files the fuzz picks from: both ranks' data files, the metadata, the marker."""
    path = worlds(2).run(_save, str(tmp_path / "c"))[0]
    names = _names(path)
    assert {".metadata", ck._commit.MARKER, "__0_0.distcp", "__1_0.distcp"} <= set(names)
    for name in names:
        for how in [("delete", 0, 0), ("truncate", 7, 0), ("payload", 0, 0),
                    ("json", 3, 1), ("flip", 100, 8)]:
            for verify in (True, False):
                _check(worlds(2), path, name, how, verify, str(tmp_path))
