"""``plain_tensor`` reads exactly what ``torch.load`` reads, or declines (None).

Every standard dtype, 0-d, empty and large shapes, with and without torch.save's
record CRCs: the same values, dtype and shape as ``torch.load``. A transposed
(non-contiguous) tensor, a view at a storage offset, a non-tensor, a pickle
naming another global, and bytes that are no zip are declined, so the caller
falls back to ``torch.load``.
"""

from __future__ import annotations

import io

import pytest
import torch

from shardfn.checkpoint._zipread import plain_tensor


def _saved(x, crc: bool = True) -> bytearray:
    before = torch.serialization.get_crc32_options()
    torch.serialization.set_crc32_options(crc)
    try:
        buf = io.BytesIO()
        torch.save(x, buf)
    finally:
        torch.serialization.set_crc32_options(before)
    return bytearray(buf.getvalue())


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64, torch.float16, torch.bfloat16,
                                   torch.int64, torch.int32, torch.int16, torch.int8,
                                   torch.uint8, torch.bool, torch.complex64])
@pytest.mark.parametrize("shape", [(), (0,), (7,), (3, 5), (2, 0, 4), (257, 33)])
def test_same_as_torch_load(dtype, shape):
    torch.manual_seed(0)
    x = (torch.randn(shape) * 50).to(dtype)
    for crc in (True, False):
        buf = _saved(x, crc)
        got = plain_tensor(buf)
        want = torch.load(io.BytesIO(bytes(buf)), weights_only=True)
        assert got is not None
        assert got.dtype == want.dtype and got.shape == want.shape
        assert torch.equal(got, want)


def test_declines_what_is_not_the_plain_case():
    base = torch.arange(12.0).reshape(3, 4)
    assert plain_tensor(_saved(base.t())) is None  # strides (1, 4)
    assert plain_tensor(_saved(base[1:])) is None  # a view at storage offset 4
    assert plain_tensor(_saved({"a": 1})) is None
    assert plain_tensor(_saved([base])) is None  # a list holding a tensor
    assert plain_tensor(bytearray(b"not a zip at all")) is None
    buf = _saved(base)
    buf[buf.find(b"_rebuild_tensor_v2")] ^= 0x01  # another global: refused, not called
    assert plain_tensor(buf) is None
    assert torch.equal(plain_tensor(_saved(base)), base)


def test_checksum_is_zlibs_crc32():
    """The checkpoint CRC-32 (zlib-ng's where installed) gives zlib's values, so either
    verifies the other's checkpoints; on bytes, bytearrays and memoryviews, chained."""
    import zlib

    from shardfn.checkpoint._commit import crc32

    data = bytes(range(256)) * 1000
    for buf in (data, bytearray(data), memoryview(data).cast("B")):
        assert crc32(buf) == zlib.crc32(data)
        assert crc32(buf[100:], crc32(buf[:100])) == zlib.crc32(data)


def test_a_checkpoint_load_reads_its_tensors_without_torch_load(tmp_path, monkeypatch):
    """What DCP writes for shardfn is the plain case: ``torch.load`` only for objects."""
    import shardfn.checkpoint as ck

    state = {"w": torch.randn(6, 5), "b": torch.arange(4), "h": torch.ones(3).half(),
             "step": 7}
    path = ck.save(str(tmp_path / "c"), state)
    calls = []
    real = torch.load
    monkeypatch.setattr(torch, "load", lambda *a, **k: calls.append(1) or real(*a, **k))
    like = {"w": torch.zeros(6, 5), "b": torch.zeros(4, dtype=torch.int64),
            "h": torch.zeros(3).half(), "step": 0}
    torch.testing.assert_close(ck.load(path, like), state)
    assert len(calls) == 1  # the step
