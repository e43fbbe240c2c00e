"""Weights from and to Hugging Face ``save_pretrained`` directories (issue #24, item 6).

A tiny tied Llama (random init, no download) saved by HF's own ``save_pretrained``
in 20 KB shards (an index and several files) loads with
``sf.checkpoint.load_pretrained`` into ZeRO-3 on 2 ranks, ``tensor_split`` over 2
ranks (a hand plan: q/k/v/gate/up colwise, o/down rowwise) and FSDP x TP, each rank
reading only its rows, equal to ``model.shard`` of the HF weights; a bfloat16 file
loads into float32 leaves. The ZeRO-3 leaves are written back with
``save_pretrained``; ``from_pretrained`` loads them with no missing or unexpected key,
bit for bit, and ``generate()`` gives the original model's tokens. The window
arithmetic of a split of a split (uneven, padded) is checked against
``FsdpTpLayout.shard_leaf``; missing, unexpected and mis-shaped keys are refused by
name; ``strict=False`` and the base model prefix load what both have.
"""

from __future__ import annotations

import json
import warnings

import pytest
import torch
from safetensors.torch import load_file

import shardfn as sf
import shardfn.checkpoint as ck
from shardfn.checkpoint import _hf_files
from shardfn.checkpoint.hf import _windows

transformers = pytest.importorskip("transformers")

COLWISE = ("self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj", "mlp.gate_proj",
           "mlp.up_proj")
PLAN = {**{f"model.layers.*.{m}": "colwise" for m in COLWISE},
        "model.layers.*.self_attn.o_proj": "rowwise", "model.layers.*.mlp.down_proj": "rowwise"}


def llama(dtype: torch.dtype = torch.float32) -> torch.nn.Module:
    """A tiny tied Llama, the same in every process."""
    config = transformers.LlamaConfig(vocab_size=64, hidden_size=32, intermediate_size=64,
                                      num_hidden_layers=2, num_attention_heads=4,
                                      num_key_value_heads=2, max_position_embeddings=64,
                                      tie_word_embeddings=True)
    torch.manual_seed(0)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        module = transformers.AutoModelForCausalLM.from_config(config,
                                                               attn_implementation="eager")
    return module.to(dtype).eval()


@pytest.fixture(scope="module")
def saved(tmp_path_factory):
    """HF's own save of the model: in 20 KB shards (fp32) and as one bf16 file."""
    root = tmp_path_factory.mktemp("hf")
    module = llama()
    module.save_pretrained(root / "sharded", max_shard_size="20KB")
    llama(torch.bfloat16).save_pretrained(root / "bf16")
    return module, root


def _equal(got: dict, want: dict) -> list[str]:
    """The names whose tensors differ (in value, dtype or presence)."""
    return [n for n in sorted(set(got) | set(want))
            if n not in got or n not in want or got[n].dtype != want[n].dtype
            or not torch.equal(got[n], want[n])]


def _on_ranks(root, module) -> dict:
    fmodel = sf.functional(module)
    hf = fmodel.params_from(module)                            # the HF weights, full
    out = {}
    zero3 = sf.shard_params(fmodel, sf.Mesh({"dp": 2}), "dp")
    params = ck.load_pretrained(root / "sharded", zero3)
    out["zero3"] = _equal(params, zero3.shard(hf))
    out["zero3 gather"] = _equal(sf.gather(params, zero3.specs, zero3.mesh), hf)
    tp = sf.tensor_split(fmodel, sf.Mesh({"tp": 2}), "tp", PLAN)
    tp_params = ck.load_pretrained(root / "sharded", tp)
    out["tp"] = _equal(tp_params, tp.shard(hf))
    ck.save_pretrained(root / "tp", tp, tp_params, max_shard_size=10**9)
    mesh = sf.Mesh({"dp": 1, "tp": 2})
    fsdp_tp = sf.shard_params(sf.tensor_split(fmodel, mesh, "tp", PLAN), mesh, "dp")
    out["fsdp x tp"] = _equal(ck.load_pretrained(root / "sharded", fsdp_tp), fsdp_tp.shard(hf))
    bf16 = ck.load_pretrained(root / "bf16", zero3)            # bf16 file, fp32 leaves
    rounded = {n: v.to(torch.bfloat16).float() if v.is_floating_point() and
               "inv_freq" not in n else v for n, v in hf.items()}
    out["bf16"] = _equal(bf16, zero3.shard(rounded))
    ck.save_pretrained(root / "out", zero3, params, max_shard_size="20KB")
    small = _write(root / f"small{zero3.mesh.rank}", _small().state_dict())
    fused = sf.tensor_split(sf.functional(_small()), sf.Mesh({"tp": 2}), "tp",
                            {"0": sf.Colwise(fused=3)})            # read whole, cut by shard
    out["fused"] = _equal(ck.load_pretrained(small, fused), fused.shard(_small().state_dict()))
    pp = sf.pipeline_stages(_small(), sf.Mesh({"pp": 2}), "pp", balance=[2, 1],
                            microbatches=2, loss_fn=torch.nn.functional.mse_loss)
    stages = ck.load_pretrained(small, pp)                     # this rank's stage only
    out["pp"] = _equal(stages, pp.shard(_small().state_dict()))
    ck.save_pretrained(root / "pp", pp, stages)
    return out


def _small() -> torch.nn.Module:
    torch.manual_seed(1)
    return torch.nn.Sequential(torch.nn.Linear(4, 12), torch.nn.Tanh(), torch.nn.Linear(12, 3))


def test_load_into_every_layout_and_save_back(saved, worlds):
    module, root = saved
    assert len(json.loads((root / "sharded" / _hf_files.INDEX).read_text())["weight_map"]) > 1
    results = worlds(2).run(_on_ranks, root, module)
    for rank, checks in enumerate(results):
        assert checks == dict.fromkeys(checks, []), (rank, checks)
    written = load_file(root / "pp" / _hf_files.SINGLE)        # a pipeline's export
    assert _equal(written, _small().state_dict()) == []
    written = load_file(root / "tp" / _hf_files.SINGLE)        # tensor_split's: one file
    persistent = {k: v for k, v in module.state_dict().items() if k != "lm_head.weight"}
    assert _equal(written, persistent) == []
    out = root / "out"
    files = sorted(p.name for p in out.iterdir())
    assert _hf_files.INDEX in files and "config.json" in files and len(files) > 4, files
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        back, info = transformers.AutoModelForCausalLM.from_pretrained(
            out, output_loading_info=True, attn_implementation="eager")
    assert {k: v for k, v in info.items() if v} == {}, info  # no missing/unexpected keys
    assert back.lm_head.weight.data_ptr() == back.model.embed_tokens.weight.data_ptr()
    assert _equal(back.state_dict(), module.state_dict()) == []
    prompt = torch.tensor([[1, 5, 9, 3]])
    generate = dict(max_new_tokens=3, min_new_tokens=3, do_sample=False, pad_token_id=0)
    assert torch.equal(back.eval().generate(prompt, **generate),
                       module.generate(prompt, **generate))


class _Mesh:
    """Just what ``_windows`` and ``sf.shard`` read of a mesh: one rank's coordinates."""

    def __init__(self, **coords: tuple[int, int]):
        self.axis_names, self._coords = tuple(coords), coords

    def size(self, axis):
        return self._coords[axis][1]

    def index(self, axis):
        return self._coords[axis][0]


@pytest.mark.parametrize(("tp_spec", "shape", "tp_shape"), [
    (sf.P("tp"), (12, 5), (6, 5)),                             # colwise: dp splits 6 rows
    (sf.P(None, "tp"), (13, 12), (13, 6))])                    # rowwise: dp splits 13 rows
def test_windows_of_a_split_of_a_split(tp_spec, shape, tp_shape, tmp_path):
    full = torch.arange(float(shape[0] * shape[1])).reshape(shape)
    _hf_files.write_file(tmp_path / _hf_files.SINGLE, {"w": full})
    layout = sf.FsdpTpLayout(sf.Layout(tp_spec, shape), sf.Layout(sf.P("dp"), tp_shape))
    with _hf_files.WeightFiles(tmp_path) as files:
        for tp in range(2):
            for dp in range(4):                                  # uneven: padded
                mesh = _Mesh(dp=(dp, 4), tp=(tp, 2))
                windows = _windows(layout, tuple(full.shape), mesh)
                assert torch.equal(files.read("w", windows), layout.shard_leaf(full, mesh))


def _write(path, tensors):
    path.mkdir(exist_ok=True)
    _hf_files.write_file(path / _hf_files.SINGLE, tensors)
    return path


def test_refusals_name_the_key(saved, tmp_path):
    module, root = saved
    fmodel = sf.functional(module)
    state = {k: v.clone() for k, v in module.state_dict().items() if k != "lm_head.weight"}
    key = "model.layers.1.mlp.down_proj.weight"
    lacking = _write(tmp_path / "lacking", {k: v for k, v in state.items() if k != key})
    with pytest.raises(ck.CheckpointMismatchError, match=rf"missing keys \[{key!r}\]"):
        ck.load_pretrained(lacking, fmodel)
    partial = ck.load_pretrained(lacking, fmodel, strict=False)  # weights it has, no more
    assert key not in partial and len(partial) == len(fmodel.names) - 1
    wrong = _write(tmp_path / "wrong", {**state, key: torch.zeros(3, 4)})
    with pytest.raises(ck.CheckpointMismatchError, match=rf"{key!r}: stored \(3, 4\), the "
                       r"model's \(32, 64\)"):
        ck.load_pretrained(wrong, fmodel, strict=False)
    extra = _write(tmp_path / "extra", {**state, "model.extra.weight": torch.zeros(2)})
    with pytest.raises(ck.CheckpointMismatchError, match=r"unexpected keys \['model.extra"):
        ck.load_pretrained(extra, fmodel)
    with pytest.raises(FileNotFoundError, match="model.safetensors"):
        ck.load_pretrained(tmp_path, fmodel)
    base = sf.functional(module.model)                         # the base model: no prefix
    loaded = ck.load_pretrained(root / "sharded", base)
    assert _equal(loaded, base.params_from(module.model)) == []
