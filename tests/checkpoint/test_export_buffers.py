"""Export and import follow ``module.state_dict()``: persistent entries only (issue #22).

Tiny Hugging Face models from configs (random init, no download): Llama's rotary
``inv_freq`` and BERT's ``position_ids`` / ``token_type_ids`` are non-persistent
buffers. Their params exported (``module=`` or ``model=``) load into the module with
``load_state_dict(strict=True)``; ``import_state_dict(module.state_dict(), model)``
builds the non-persistent buffers as ``init`` does and round-trips exactly, for a
functional model, and for ZeRO-3 on 2 ranks (a small module with a non-persistent
``inv_freq``); a missing persistent entry is still refused by name.
"""

from __future__ import annotations

import pytest
import torch
from safetensors.torch import load_file

import shardfn as sf
import shardfn.checkpoint as ck

transformers = pytest.importorskip("transformers")


def _llama():
    torch.manual_seed(0)
    config = transformers.LlamaConfig(hidden_size=32, intermediate_size=64,
                                      num_hidden_layers=2, num_attention_heads=4,
                                      num_key_value_heads=2, vocab_size=64,
                                      max_position_embeddings=64)
    return transformers.LlamaForCausalLM(config)


def _bert():
    torch.manual_seed(0)
    config = transformers.BertConfig(hidden_size=32, intermediate_size=64,
                                     num_hidden_layers=2, num_attention_heads=4, vocab_size=64,
                                     max_position_embeddings=64)
    return transformers.BertForMaskedLM(config)


BUFFERS = {"llama": (_llama, {"model.rotary_emb.inv_freq"}),
           "bert": (_bert, {"bert.embeddings.position_ids"})}


@pytest.mark.parametrize("kind", sorted(BUFFERS))
def test_export_is_strict_loadable_and_import_round_trips(kind, tmp_path):
    make, expected = BUFFERS[kind]
    module = make()
    fmodel = sf.functional(module)
    assert expected <= ck.non_persistent_buffers(fmodel) == ck.non_persistent_buffers(module)
    params = {k: v + 0.5 if v.is_floating_point() and k not in expected else v
              for k, v in fmodel.init(3).items()}  # not the module's values
    assert expected <= set(params)
    for how in ({"module": module}, {"model": fmodel}):
        file = ck.export_state_dict(tmp_path / "m.safetensors", params, **how)
        written = load_file(file)
        assert not expected & set(written)
        fresh = make()
        fresh.load_state_dict(written if "module" in how else {**written, **_tied(fresh,
                                                                                  written)},
                              strict=True)
        for name, value in fresh.state_dict().items():
            torch.testing.assert_close(value, params[fmodel.tied.get(name, name)],
                                       rtol=0, atol=0)
    back = ck.import_state_dict(module.state_dict(), fmodel)
    own = _values(module)
    assert sorted(back) == sorted(fmodel.names)
    for name, value in back.items():
        torch.testing.assert_close(value, own[name], rtol=0, atol=0)
    again = ck.import_state_dict(ck.export_state_dict(tmp_path / "n.pt", back, "torch",
                                                      module=module), fmodel)
    assert all(torch.equal(again[k], back[k]) for k in back)
    persistent = sorted(set(module.state_dict()) & set(fmodel.names))[0]
    with pytest.raises(ValueError, match=rf"lacks \[{persistent!r}\]"):
        ck.import_state_dict({k: v for k, v in module.state_dict().items()
                              if k != persistent}, fmodel)


def _values(module) -> dict[str, torch.Tensor]:
    """The module's own value of every leaf, buffers of any kind included."""
    return {**dict(module.named_buffers()), **module.state_dict()}


def _tied(module, written):
    """The tied names ``model=`` cannot add (no module given): from the fresh module."""
    sd = module.state_dict(keep_vars=True)
    first = {}
    for name, value in sd.items():
        first.setdefault(id(value), name)
    return {n: written[first[id(v)]] for n, v in sd.items()
            if n not in written and first[id(v)] in written}


class _Rotary(torch.nn.Module):
    """A Llama-like module: a linear layer and a non-persistent ``inv_freq`` buffer."""

    def __init__(self):
        super().__init__()
        self.fc = torch.nn.Linear(4, 6)
        self.register_buffer("inv_freq", 1.0 / 1e4 ** (torch.arange(0, 6, 2) / 6),
                             persistent=False)
        self.register_buffer("scale", torch.full((6,), 2.0))  # persistent

    def forward(self, x):
        return self.fc(x) * self.scale + self.inv_freq.repeat(2)


def _zero3_import(state_dict):
    mesh = sf.Mesh({"dp": 2})
    torch.manual_seed(1)  # other weights than the state_dict's
    model = sf.shard_params(sf.functional(_Rotary()), mesh, "dp")
    shards = ck.import_state_dict(state_dict, model)
    full = sf.gather(shards, model.specs, mesh)
    return {k: v.clone() for k, v in full.items()}, model.apply(shards, torch.ones(3, 4))


def test_import_into_zero3_builds_the_non_persistent_buffers(worlds):
    torch.manual_seed(0)
    module = _Rotary()
    assert ck.non_persistent_buffers(module) == {"inv_freq"}
    own = _values(module)
    for full, out in worlds(2).run(_zero3_import, module.state_dict()):
        assert sorted(full) == ["fc.bias", "fc.weight", "inv_freq", "scale"]
        for name, value in full.items():
            torch.testing.assert_close(value, own[name], rtol=0, atol=0)
        torch.testing.assert_close(out, module(torch.ones(3, 4)))
