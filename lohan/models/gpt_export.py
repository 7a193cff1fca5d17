"""Export the in-house GPT (presets) as a Hugging Face GPT-2 checkpoint.

The preset architecture is GPT-2's (pre-LayerNorm blocks, learned positions, biases, tied head) with
exact GELU, so `transformers` loads it as `GPT2LMHeadModel` with ``activation_function="gelu"``. GPT-2
stores its projections as `Conv1D` ([in, out]), the transpose of our `nn.Linear` weights. Weights are
read from the store one block at a time and written one safetensors shard per block, so the export
never holds more than one block in memory.
"""

from __future__ import annotations

import json
import os
from pathlib import Path

import torch
from safetensors.torch import save_file

from lohan.config import ModelConfig
from lohan.models import EXPORT_MARKER

_BLOCK_NAMES = {  # ours -> GPT-2's, and whether the weight is transposed (Conv1D)
    "ln1.weight": ("ln_1.weight", False), "ln1.bias": ("ln_1.bias", False),
    "qkv.weight": ("attn.c_attn.weight", True), "qkv.bias": ("attn.c_attn.bias", False),
    "proj.weight": ("attn.c_proj.weight", True), "proj.bias": ("attn.c_proj.bias", False),
    "ln2.weight": ("ln_2.weight", False), "ln2.bias": ("ln_2.bias", False),
    "fc.weight": ("mlp.c_fc.weight", True), "fc.bias": ("mlp.c_fc.bias", False),
    "fc_proj.weight": ("mlp.c_proj.weight", True), "fc_proj.bias": ("mlp.c_proj.bias", False),
}
_OTHER_NAMES = {"wte.weight": "transformer.wte.weight", "wpe.weight": "transformer.wpe.weight",
                "ln_f.weight": "transformer.ln_f.weight", "ln_f.bias": "transformer.ln_f.bias",
                "lm_head.weight": "lm_head.weight"}


def gpt2_config(cfg: ModelConfig) -> dict:
    return {
        "architectures": ["GPT2LMHeadModel"], "model_type": "gpt2", "vocab_size": cfg.vocab_size,
        "n_positions": cfg.seq_len, "n_embd": cfg.d_model, "n_layer": cfg.n_layer, "n_head": cfg.n_head,
        "n_inner": cfg.mlp_ratio * cfg.d_model, "activation_function": "gelu",
        "layer_norm_epsilon": cfg.layer_norm_eps, "tie_word_embeddings": cfg.tie_embeddings,
        "resid_pdrop": 0.0, "embd_pdrop": 0.0, "attn_pdrop": 0.0, "torch_dtype": "float32",
    }


def check_export_dir(out: str | os.PathLike) -> None:
    """Refuse a directory that holds anything (an export is written into a new or empty folder, or one that holds
    only the manifest its caller began it with, `lohan.app.ownership.begin_folder`): nothing is ever written over.
    Replacing a previous export is the run's job (`lohan.app.export`), which proves what it removes."""
    out = Path(out)
    if out.is_symlink():
        raise ValueError(f"export path {out} is a symbolic link; give the directory it points to, or a new one")
    if out.exists() and not out.is_dir():
        raise ValueError(f"export path {out} is a file; give a directory")
    held = sorted(e.name for e in out.iterdir() if e.name != EXPORT_MARKER) if out.exists() else []
    if held:
        raise ValueError(f"refusing to export into {out}: it is not empty (it holds {', '.join(held[:5])}"
                         f"{' ...' if len(held) > 5 else ''}); export into a new or empty directory")


def export_gpt2(engine, cfg: ModelConfig, out_dir: str | os.PathLike) -> None:
    """Write `engine`'s current fp32 weights to `out_dir` as a GPT-2 checkpoint (`from_pretrained` loads it)."""
    out = Path(out_dir)
    check_export_dir(out)
    out.mkdir(parents=True, exist_ok=True)
    layout = engine.layout
    weight_map: dict[str, str] = {}
    total = 0
    n = len(layout.blocks)
    for b in layout.blocks:
        tensors: dict[str, torch.Tensor] = {}
        for spec, t in zip(b.params, engine.read_params(b.index)):
            if b.index in (0, n - 1):
                name = _OTHER_NAMES[spec.name]
            else:
                hf, transpose = _BLOCK_NAMES[spec.name]
                name = f"transformer.h.{b.index - 1}.{hf}"
                t = t.t() if transpose else t
            tensors[name] = t.contiguous()
        shard = f"model-{b.index + 1:05d}-of-{n:05d}.safetensors"
        save_file(tensors, str(out / shard), metadata={"format": "pt"})
        for name, t in tensors.items():
            weight_map[name] = shard
            total += t.numel() * t.element_size()
    index = {"metadata": {"total_size": total}, "weight_map": weight_map}
    (out / "model.safetensors.index.json").write_text(json.dumps(index, indent=2))
    (out / "config.json").write_text(json.dumps(gpt2_config(cfg), indent=2))
