"""scripts/make_tiny_hf.py --streamed: a model written tensor by tensor into shards loads as the in-memory build does."""

from __future__ import annotations

import importlib.util
import json
from pathlib import Path

import torch

SCRIPT = Path(__file__).resolve().parents[3] / "scripts" / "make_tiny_hf.py"


def _script():
    spec = importlib.util.spec_from_file_location("make_tiny_hf", SCRIPT)
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def test_a_streamed_model_is_sharded_and_loads_with_every_weight(tmp_path, monkeypatch):
    from transformers import AutoModelForCausalLM

    mod = _script()
    monkeypatch.setattr(mod, "SHARD_BYTES", 64 << 10)  # (a few shards from a tiny model)
    args = ["--layers", "2", "--hidden", "64", "--heads", "4", "--kv-heads", "2", "--vocab", "256"]
    assert mod.main([str(tmp_path / "streamed"), "--streamed", "--dtype", "bf16", *args]) == 0
    assert mod.main([str(tmp_path / "built"), *args]) == 0
    index = json.loads((tmp_path / "streamed" / "model.safetensors.index.json").read_text())
    assert len(set(index["weight_map"].values())) > 1
    streamed, info = AutoModelForCausalLM.from_pretrained(tmp_path / "streamed", output_loading_info=True)
    built = AutoModelForCausalLM.from_pretrained(tmp_path / "built")
    assert not info["missing_keys"] and not info["unexpected_keys"], info
    shapes = {n: p.shape for n, p in built.named_parameters()}
    assert {n: p.shape for n, p in streamed.named_parameters()} == shapes
    from safetensors import safe_open

    first = next(iter(index["weight_map"].items()))
    with safe_open(str(tmp_path / "streamed" / first[1]), "pt") as f:
        assert f.get_tensor(first[0]).dtype == torch.bfloat16
    w = streamed.model.layers[0].self_attn.q_proj.weight.float()
    assert 0.01 < w.std() < 0.03 and torch.equal(streamed.model.norm.weight.float(), torch.ones(64))
