"""TokenFile and write_tokens: nanoGPT's raw token files read as (inputs, targets) windows."""

from __future__ import annotations

import pickle

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

import shardfn.data as sfd


@settings(max_examples=30, deadline=None)
@given(num_tokens=st.integers(2, 60), seq_len=st.integers(1, 8), stride=st.integers(1, 9),
       dtype=st.sampled_from(["uint16", "uint32"]), seed=st.integers(0, 99))
def test_windows_are_the_files_tokens_shifted_by_one(tmp_path_factory, num_tokens, seq_len,
                                                     stride, dtype, seed):
    path = tmp_path_factory.mktemp("tokens") / "train.bin"
    high = 65536 if dtype == "uint16" else 2**32
    tokens = torch.randint(0, high, (num_tokens,), generator=torch.Generator().manual_seed(seed))
    assert sfd.write_tokens(path, tokens, dtype) == num_tokens
    assert path.stat().st_size == num_tokens * (2 if dtype == "uint16" else 4)
    if num_tokens < seq_len + 1:
        with pytest.raises(ValueError, match=f"fewer than one window of seq_len \\+ 1 = "
                                             f"{seq_len + 1}"):
            sfd.TokenFile(path, seq_len, dtype, stride=stride)
        return
    data = sfd.TokenFile(path, seq_len, dtype, stride=stride)
    starts = range(0, num_tokens - seq_len, stride)  # every window that fits, no more
    assert len(data) == len(starts)
    for i, start in enumerate(starts):
        inputs, targets = data[i]
        assert inputs.dtype == targets.dtype == torch.int64
        assert torch.equal(inputs, tokens[start:start + seq_len])
        assert torch.equal(targets, tokens[start + 1:start + seq_len + 1])
    with pytest.raises(IndexError, match=f"has {len(data)} windows"):
        data[len(data)]
    # the nanoGPT reader sees the same ids
    assert np.array_equal(np.fromfile(path, dtype=dtype).astype(np.int64), tokens.numpy())


def test_bad_files_and_ids_are_refused(tmp_path):
    path = tmp_path / "t.bin"
    with pytest.raises(ValueError, match="id 65536 does not fit uint16.*use dtype='uint32'"):
        sfd.write_tokens(path, [1, 65536])
    with pytest.raises(ValueError, match="id -1 does not fit uint32"):
        sfd.write_tokens(path, np.array([-1, 2]), "uint32")
    with pytest.raises(ValueError, match="1-D"):
        sfd.write_tokens(path, torch.zeros(2, 2, dtype=torch.int64))
    with pytest.raises(ValueError, match="integer ids"):
        sfd.write_tokens(path, [1.5])
    with pytest.raises(ValueError, match="'uint16' or 'uint32'"):
        sfd.write_tokens(path, [1], "int32")
    assert not path.exists() and list(tmp_path.iterdir()) == []  # nothing half-written
    sfd.write_tokens(path, torch.arange(7))                      # 14 bytes
    with pytest.raises(ValueError, match="14 bytes is not a whole number of uint32 tokens"):
        sfd.TokenFile(path, 2, "uint32")
    assert len(sfd.TokenFile(path, 2, torch.uint16)) == 3
    with pytest.raises(ValueError, match="seq_len must be an int >= 1"):
        sfd.TokenFile(path, 0)


def test_token_file_pickles_without_its_mapping_and_loads_in_workers(tmp_path):
    path = tmp_path / "t.bin"
    sfd.write_tokens(path, torch.arange(41) * 3)
    data = sfd.TokenFile(path, seq_len=4)
    first = data[0]
    copy = pickle.loads(pickle.dumps(data))
    assert copy._tokens is None and torch.equal(copy[0][0], first[0])
    kwargs = dict(global_batch=4, seed=2)
    plain = [(x.clone(), y.clone()) for x, y in sfd.loader(data, **kwargs)]
    workers = list(sfd.loader(data, **kwargs, num_workers=2))  # forked: a mapping each
    assert len(plain) == len(workers) == 2
    for (x, y), (x2, y2) in zip(plain, workers, strict=True):
        assert x.shape == (4, 4) and torch.equal(x, x2) and torch.equal(y, y2)
        assert torch.equal(y[:, :-1], x[:, 1:])
