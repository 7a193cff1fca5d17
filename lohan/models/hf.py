"""Hugging Face causal LMs (Llama, GPT-2, OPT, Qwen2) as engine block programs.

A local model directory (``config.json`` + ``*.safetensors``, possibly sharded with
``model.safetensors.index.json``) becomes ``[embed, decoder layer 0..L-1, head]``:

- The HF model is built from its config with every *parameter* on the meta device and every
  *buffer* real (rotary ``inv_freq`` is computed on the CPU as usual), in fp32, with SDPA attention
  and in eval mode (dropout off: the engine's recomputation must reproduce the forward exactly).
- Decoder layers are the HF layer modules themselves, so their direct children (``self_attn``,
  ``mlp``, the norms, ...) are the ops the activation runtime profiles, swaps and replays. Each is
  called the way the HF model calls it for an unpadded causal batch: ``attention_mask=None`` (SDPA's
  ``is_causal``) and, for rotary families, the model's own ``rotary_emb`` output for positions
  ``0..T-1`` (cached per sequence length, dtype and device).
- The embed block holds the token embedding, learned positions (GPT-2 ``wpe``; OPT
  ``embed_positions``, offset 2) and OPT's ``project_in``; the head block holds the final norm, OPT's
  ``project_out`` and, when untied, ``lm_head``. A tied ``lm_head`` is owned by the embed block only:
  the head borrows it (``external_params``) and reads the embedding's *current* parameter at call time.

Weights are imported block by block (``init_block(i)`` opens the safetensors files and reads only
block i's keys) and exported block by block from the store into streamed safetensors shards, so
neither direction ever holds more than one block. Exported directories load with
``AutoModelForCausalLM.from_pretrained`` and give exactly the engine's logits.
"""

from __future__ import annotations

import contextlib
import json
import os
import re
import shutil
import struct
from collections.abc import Callable, Iterator
from typing import Any

import torch
import torch.nn.functional as F
from safetensors import SafetensorError, safe_open
from torch import Tensor, nn

from .gpt import lm_loss

__all__ = ["SUPPORTED", "HFBlocks", "check_weights", "export_hf", "init_from_hf", "is_hf_dir", "load_hf_skeleton",
           "load_tokenizer", "model_meta"]

SUPPORTED = ("llama", "gpt2", "opt", "qwen2")

TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json", "vocab.json",
                   "merges.txt", "tokenizer.model", "added_tokens.json", "chat_template.jinja",
                   "chat_template.json")
"""Files copied verbatim from the source directory on export (whichever exist)."""

WEIGHTS_NAME = "model.safetensors"
WEIGHTS_INDEX = "model.safetensors.index.json"
_SHARD_RE = re.compile(r"^model-\d{5}-of-\d{5}\.safetensors$")
_EXPORT_FILES = frozenset(("config.json", "generation_config.json", WEIGHTS_NAME, WEIGHTS_INDEX, *TOKENIZER_FILES))

_META_DROP = ("_name_or_path", "transformers_version", "torch_dtype", "dtype")
"""config.json keys left out of the store's model description: they do not change the model (a
re-export in another dtype or by another transformers version resumes the same store)."""

# Where each family keeps its pieces, as attribute paths of the *ForCausalLM model.
_ARCH: dict[str, dict[str, str | None]] = {
    "llama": dict(tokens="model.embed_tokens", positions=None, project_in=None, layers="model.layers",
                  norm="model.norm", project_out=None, rope="model.rotary_emb"),
    "qwen2": dict(tokens="model.embed_tokens", positions=None, project_in=None, layers="model.layers",
                  norm="model.norm", project_out=None, rope="model.rotary_emb"),
    "gpt2": dict(tokens="transformer.wte", positions="transformer.wpe", project_in=None, layers="transformer.h",
                 norm="transformer.ln_f", project_out=None, rope=None),
    "opt": dict(tokens="model.decoder.embed_tokens", positions="model.decoder.embed_positions",
                project_in="model.decoder.project_in", layers="model.decoder.layers",
                norm="model.decoder.final_layer_norm", project_out="model.decoder.project_out", rope=None),
}

_DTYPES = {"float32": torch.float32, "fp32": torch.float32, "bfloat16": torch.bfloat16, "bf16": torch.bfloat16,
           "float16": torch.float16, "fp16": torch.float16}
_ST_DTYPE = {torch.float32: "F32", torch.bfloat16: "BF16", torch.float16: "F16"}


# ------------------------------------------------------------------------------------------ directory
def _read_config(path: str | os.PathLike) -> dict:
    with open(os.path.join(path, "config.json")) as f:
        try:
            data = json.load(f)
        except json.JSONDecodeError as e:  # its own message names neither the file nor a fix
            raise ValueError(f"{path}/config.json is not valid JSON ({e}); save the model again or repair "
                             "the file") from None
    if not isinstance(data, dict):
        raise ValueError(f"{path}/config.json is not a JSON object")
    return data


def is_hf_dir(path: str | os.PathLike) -> bool:
    """True for a directory with a config.json whose model_type is one of SUPPORTED."""
    try:
        return os.path.isdir(path) and _read_config(path).get("model_type") in SUPPORTED
    except (OSError, ValueError):
        return False


def _family(path: str | os.PathLike) -> tuple[str, dict]:
    if not os.path.isdir(path):
        raise FileNotFoundError(f"{path} is not a directory (expected a Hugging Face model directory)")
    if not os.path.exists(os.path.join(path, "config.json")):
        raise FileNotFoundError(f"{path} has no config.json; it is not a Hugging Face model directory")
    data = _read_config(path)
    family = data.get("model_type")
    if family not in SUPPORTED:
        raise ValueError(f"{path}: model_type {family!r} is not supported; lohan fine-tunes causal LMs of the "
                         f"families {', '.join(SUPPORTED)}")
    return family, data


@contextlib.contextmanager
def _meta_parameters() -> Iterator[None]:
    """Parameters registered inside go to the meta device; buffers stay where they are created (CPU)."""
    register = nn.Module.register_parameter

    def on_meta(module: nn.Module, name: str, param: nn.Parameter | None) -> None:
        if param is not None and param.device.type != "meta":  # an already-meta one (a tie) is kept as is
            param = nn.Parameter(param.to("meta"), requires_grad=param.requires_grad)
        register(module, name, param)

    nn.Module.register_parameter = on_meta
    try:
        yield
    finally:
        nn.Module.register_parameter = register


def _attr(root: nn.Module, path: str | None) -> nn.Module | None:
    if path is None:
        return None
    obj: Any = root
    for part in path.split("."):
        obj = getattr(obj, part, None)
        if obj is None:
            return None
    return obj


def _leaf(path: str | None) -> str:
    return path.rpartition(".")[2] if path else ""


class _Part(nn.Module):
    """HF sub-modules grouped into one engine block (embed or head), registered under their HF names.

    It computes nothing itself: `HFBlocks.run` calls the sub-modules the way the HF model does.
    """

    def __init__(self, parts: list[tuple[str, nn.Module | None]]) -> None:
        super().__init__()
        for name, module in parts:
            if module is not None:
                self.add_module(name, module)


class HFBlocks:
    """A Hugging Face causal LM as [embed, decoder layer 0..L-1, head] (implements BlockProgram).

    Block 0 maps token ids [B, T] to hidden states; the last block returns the mean fp32
    cross-entropy over targets [B, T] (already shifted; -100 ignored), like `lohan.models.gpt.lm_loss`.
    """

    def __init__(self, model: nn.Module, family: str, config_dict: dict) -> None:
        if family not in _ARCH:
            raise ValueError(f"model_type {family!r} is not supported ({', '.join(SUPPORTED)})")
        model.eval()  # dropout off (and OPT's layerdrop): recomputation must reproduce the forward
        self.model = model
        self.family = family
        self.config = model.config
        self.config_dict = config_dict
        arch = _ARCH[family]
        cfg = self.config
        self.n_layer = int(cfg.num_hidden_layers)
        self.vocab_size = int(cfg.vocab_size)
        self.hidden_size = int(cfg.hidden_size)
        self.max_seq_len = int(cfg.max_position_embeddings)
        self._check_supported()

        tokens = _attr(model, arch["tokens"])
        positions = _attr(model, arch["positions"])
        project_in = _attr(model, arch["project_in"])
        layers = list(_attr(model, arch["layers"]))
        norm = _attr(model, arch["norm"])
        project_out = _attr(model, arch["project_out"])
        self._rotary = _attr(model, arch["rope"])
        lm_head = model.get_output_embeddings()
        self.tied = lm_head.weight is tokens.weight
        if getattr(lm_head, "bias", None) is not None:
            raise NotImplementedError(f"{family}: an lm_head with a bias is not supported")
        self.embed = _Part([(_leaf(arch["tokens"]), tokens), (_leaf(arch["positions"]), positions),
                            (_leaf(arch["project_in"]), project_in)])
        self.head = _Part([(_leaf(arch["norm"]), norm), (_leaf(arch["project_out"]), project_out),
                           ("lm_head", None if self.tied else lm_head)])
        if not any(True for _ in self.head.parameters()):
            raise NotImplementedError(
                f"{family}: this configuration has no final norm and a tied lm_head, so the head block would own "
                "no parameters (e.g. OPT with do_layer_norm_before=false and no project_out); not supported")
        self._tokens_name = _leaf(arch["tokens"])
        self._norm_name = _leaf(arch["norm"])
        self._has_positions = positions is not None
        self._has_project_in = project_in is not None
        self._has_norm = norm is not None
        self._has_project_out = project_out is not None

        self.modules: list[nn.Module] = [self.embed, *layers, self.head]
        self.names = ["embed", *(f"layer{i}" for i in range(len(layers))), "head"]
        tok_index = [n for n, _ in self.embed.named_parameters()].index(f"{self._tokens_name}.weight")
        self._tied_ref = (0, tok_index)

        # HF state-dict names of every block's parameters (module identity is stable; the streamer
        # only swaps the entries of `module._parameters`)
        module_names: dict[int, str] = {}
        for name, module in model.named_modules():
            module_names.setdefault(id(module), name)
        self._param_names: list[list[str]] = []
        covered: set[int] = set()
        for block in self.modules:
            names = []
            for pname, p in block.named_parameters():
                owner, _, leaf_name = pname.rpartition(".")
                names.append(f"{module_names[id(block.get_submodule(owner))]}.{leaf_name}")
                covered.add(id(p))
            self._param_names.append(names)
        missing = [n for n, p in model.named_parameters() if id(p) not in covered]
        if missing:
            raise NotImplementedError(f"{family}: parameters outside the embed/layers/head blocks: {missing[:5]}")
        self._cache: dict[tuple, Any] = {}

    def _check_supported(self) -> None:
        cfg = self.config
        if self.family == "gpt2" and getattr(cfg, "add_cross_attention", False):
            raise NotImplementedError("gpt2 with add_cross_attention is not supported")
        if self.family == "qwen2" and "sliding_attention" in (getattr(cfg, "layer_types", None) or ()):
            raise NotImplementedError("qwen2 with sliding-window attention layers (use_sliding_window=true) is "
                                      "not supported")
        if getattr(cfg, "_attn_implementation", "sdpa") != "sdpa":
            raise NotImplementedError(f"attention implementation {cfg._attn_implementation!r}: build with sdpa")

    # ------------------------------------------------------------------ BlockProgram
    def param_names(self, i: int) -> list[str]:
        """HF state-dict names of block i's parameters, in `modules[i].parameters()` order."""
        return list(self._param_names[i])

    def param_order(self) -> list[tuple[int, int]]:
        """(block, index in the block) of every parameter in the model's own `parameters()` order, which
        is not always block order (OPT registers its final norm before the layers). Gradient clipping
        takes the global norm in this order, as `clip_grad_norm_(model.parameters())` does."""
        where = {name: (i, k) for i, names in enumerate(self._param_names) for k, name in enumerate(names)}
        return [where[name] for name, _ in self.model.named_parameters() if name in where]

    def external_params(self, i: int) -> list[tuple[int, int]]:
        return [self._tied_ref] if self.tied and i == len(self.modules) - 1 else []

    def run(self, i: int, x: Tensor, targets: Tensor | None) -> Tensor:
        last = len(self.modules) - 1
        if i == 0:
            return self._embed(x)
        if i < last:
            if self._rotary is not None:
                out = self.modules[i](x, attention_mask=None, position_embeddings=self._rope(x))
            else:
                out = self.modules[i](x, attention_mask=None)
            return out[0] if isinstance(out, tuple) else out
        return lm_loss(self.logits(x), targets)

    def logits(self, x: Tensor) -> Tensor:
        """The head block without the loss: final hidden states -> logits (as HF's lm_head gives them)."""
        h = x
        if self._has_norm:
            h = getattr(self.head, self._norm_name)(h)
        if self._has_project_out:
            h = self.head.project_out(h)
        if self.tied:  # the embedding's current parameter (the streamer swaps it in and out)
            return F.linear(h, getattr(self.embed, self._tokens_name).weight)
        return self.head.lm_head(h)

    def forward(self, ids: Tensor) -> Tensor:
        """All blocks in a row (materialized weights): logits for token ids [B, T]."""
        x = self.run(0, ids, None)
        for i in range(1, len(self.modules) - 1):
            x = self.run(i, x, None)
        return self.logits(x)

    # ------------------------------------------------------------------ pieces
    def _embed(self, ids: Tensor) -> Tensor:
        tokens = getattr(self.embed, self._tokens_name)
        h = tokens(ids)
        if self._has_project_in:
            h = self.embed.project_in(h)
        if self._has_positions:
            b, t = ids.shape
            if t > self.max_seq_len:
                raise ValueError(f"sequence length {t} exceeds the model's {self.max_seq_len} position embeddings; "
                                 "use a shorter seq_len")
            if self.family == "opt":  # HF: positions from a [B, T] all-ones mask (cumsum - 1), offset 2
                pos = self._positions(b, t, ids.device)
                h = h + self.embed.embed_positions(None, 0, position_ids=pos)
            else:
                h = h + self.embed.wpe(self._positions(1, t, ids.device))
        return h

    def _positions(self, b: int, t: int, device: torch.device) -> Tensor:
        key = ("pos", b, t, device)
        pos = self._cache.get(key)
        if pos is None:
            pos = self._cache[key] = torch.arange(t, device=device).unsqueeze(0).expand(b, t).contiguous()
        return pos

    def _rope(self, x: Tensor) -> tuple[Tensor, Tensor]:
        """(cos, sin) of positions 0..T-1 from the model's rotary module, as the HF model computes them."""
        t = x.shape[1]
        key = ("rope", t, x.dtype, x.device)
        hit = self._cache.get(key)
        if hit is None:
            if len(self._cache) > 16:
                self._cache.clear()
            with torch.no_grad():
                hit = self._cache[key] = self._rotary(x, self._positions(1, t, x.device))
        return hit

    def flops_per_token(self, seq: int) -> float:
        """Forward FLOPs per token: 2 x matmul weights (lm_head included) + attention's 4 x L x T x width."""
        if not hasattr(self, "_matmul_params"):
            from transformers.pytorch_utils import Conv1D

            heads = int(self.config.num_attention_heads)
            self._attn_width = heads * int(getattr(self.config, "head_dim", None) or self.hidden_size // heads)
            self._matmul_params = sum(m.weight.numel() for m in self.model.modules()
                                      if isinstance(m, nn.Linear | Conv1D))
        return 2.0 * self._matmul_params + 4.0 * self.n_layer * seq * self._attn_width


def load_hf_skeleton(path: str | os.PathLike) -> HFBlocks:
    """The model of a local HF directory with parameters on the meta device (buffers real, fp32, SDPA)."""
    family, data = _family(path)
    from transformers import AutoConfig, AutoModelForCausalLM

    config = AutoConfig.from_pretrained(path, local_files_only=True)
    with _meta_parameters():
        model = AutoModelForCausalLM.from_config(config, dtype=torch.float32, attn_implementation="sdpa")
    return HFBlocks(model, family, data)


# ------------------------------------------------------------------------------------------ import
class _Checkpoint:
    """Which safetensors file of a directory holds each key (headers only; no tensor is read)."""

    def __init__(self, path: str | os.PathLike) -> None:
        self.path = str(path)
        index = os.path.join(self.path, WEIGHTS_INDEX)
        single = os.path.join(self.path, WEIGHTS_NAME)
        if os.path.exists(index):
            with open(index) as f:
                self.key_file = dict(json.load(f)["weight_map"])
        else:
            files = [single] if os.path.exists(single) else sorted(
                os.path.join(self.path, n) for n in os.listdir(self.path) if n.endswith(".safetensors"))
            if not files:
                other = [n for n in os.listdir(self.path) if n.endswith((".bin", ".pt", ".pth", ".ckpt"))]
                raise FileNotFoundError(
                    f"{self.path} has no *.safetensors weights" + (f" (found {', '.join(other)}: convert them "
                                                                     "to safetensors first)" if other else ""))
            self.key_file = {}
            for file in files:
                with safe_open(file, framework="pt") as f:
                    for k in f.keys():
                        self.key_file[k] = os.path.basename(file)

    def resolve(self, name: str, prefix: str) -> str:
        """The checkpoint key of HF parameter `name`, with or without the base-model prefix."""
        candidates = [name]
        if prefix and name.startswith(prefix + "."):
            candidates.append(name[len(prefix) + 1:])
        elif prefix:
            candidates.append(f"{prefix}.{name}")
        for key in candidates:
            if key in self.key_file:
                return key
        sample = ", ".join(sorted(self.key_file)[:5])
        raise KeyError(f"{self.path}: no tensor for parameter {name!r} (tried {candidates}; the checkpoint has "
                       f"e.g. {sample})")

    def read(self, keys: list[str]) -> dict[str, Tensor]:
        """Exactly these tensors, each file opened once."""
        by_file: dict[str, list[str]] = {}
        for k in keys:
            by_file.setdefault(self.key_file[k], []).append(k)
        out = {}
        for file, ks in by_file.items():
            with safe_open(os.path.join(self.path, file), framework="pt", device="cpu") as f:
                for k in ks:
                    out[k] = f.get_tensor(k)
        return out


def _make_init_block(program: HFBlocks, path: str | os.PathLike) -> Callable[[int], list[Tensor]]:
    ckpt: list[_Checkpoint] = []
    prefix = program.model.base_model_prefix

    def init_block(i: int) -> list[Tensor]:
        if not ckpt:
            ckpt.append(_Checkpoint(path))
        src = ckpt[0]
        keys = [src.resolve(n, prefix) for n in program.param_names(i)]
        tensors = src.read(keys)
        out = []
        for key, (pname, p) in zip(keys, program.modules[i].named_parameters()):
            t = tensors.pop(key)
            if tuple(t.shape) != tuple(p.shape):
                raise ValueError(f"{path}: tensor {key!r} has shape {tuple(t.shape)}, the config gives "
                                 f"{tuple(p.shape)} for {program.names[i]}.{pname}")
            out.append(t.to(torch.float32))
        return out

    return init_block


def check_weights(program: HFBlocks, path: str | os.PathLike) -> None:
    """Refuse a checkpoint that cannot give every parameter of `program` its tensor, from the safetensors
    headers alone (no tensor is read).

    The import itself runs block by block while the store is being written on the SSDs, so a missing,
    truncated or mismatched checkpoint found there would leave a half-built store behind; checked first,
    it is refused with nothing written. Raises ValueError naming the directory, the problem and the fix.
    """
    try:
        ckpt = _Checkpoint(path)
        prefix = program.model.base_model_prefix
        by_file: dict[str, list[tuple[str, tuple[int, ...], str]]] = {}
        for i, block in enumerate(program.modules):
            for name, (pname, p) in zip(program.param_names(i), block.named_parameters()):
                key = ckpt.resolve(name, prefix)
                by_file.setdefault(ckpt.key_file[key], []).append((key, tuple(p.shape), f"{program.names[i]}.{pname}"))
        for file, entries in by_file.items():
            with safe_open(os.path.join(ckpt.path, file), framework="pt") as f:
                for key, shape, where in entries:
                    have = tuple(f.get_slice(key).get_shape())
                    if have != shape:
                        raise ValueError(f"tensor {key!r} in {file} has shape {have}, but config.json gives {shape} "
                                         f"for {where}: the weights and config.json are from different models")
    except (OSError, KeyError, ValueError, SafetensorError) as e:
        # KeyError's str() quotes its message; the safetensors errors name only the failing field
        detail = e.args[0] if isinstance(e, KeyError) and e.args else str(e)
        raise ValueError(f"the weights in {path} cannot be read: {detail}. Save the model again (save_pretrained) "
                         "or re-download it") from None


def model_meta(program: HFBlocks) -> dict:
    """The store's description of the model: stable across runs, no paths."""
    config = {k: v for k, v in program.config_dict.items() if k not in _META_DROP}
    return {"kind": "hf", "family": program.family, "config": config}


def init_from_hf(path: str | os.PathLike, config: Any, *, resume: bool = False, overwrite: bool = False,
                 progress: Callable[[int, int], None] | None = None):
    """An Engine that fine-tunes the HF model in directory `path` (weights imported block by block).

    `config` is an EngineConfig or a dict of its fields. With `resume=True` an existing store of the
    same model continues where it stopped (the weights in `path` are not read then).
    """
    from ..config import EngineConfig
    from ..engine import Engine

    cfg = config if isinstance(config, EngineConfig) else EngineConfig(**(config or {}))
    program = load_hf_skeleton(path)
    return Engine(program, cfg, model_meta(program), _make_init_block(program, path),
                  flops_per_token=program.flops_per_token, resume=resume, overwrite=overwrite, progress=progress)


# ------------------------------------------------------------------------------------------ export
def _check_out_dir(src_dir: str, out_dir: str) -> None:
    if os.path.exists(out_dir) and not os.path.isdir(out_dir):
        raise ValueError(f"export target {out_dir} exists and is not a directory")
    if os.path.isdir(out_dir) and os.path.samefile(src_dir, out_dir):
        raise ValueError(f"export target {out_dir} is the source directory; export to a new directory")
    if os.path.isdir(out_dir):
        foreign = [n for n in os.listdir(out_dir) if n not in _EXPORT_FILES and not _SHARD_RE.match(n)]
        if foreign:
            raise ValueError(f"refusing to export into {out_dir}: it is not empty and holds files an export does "
                             f"not write ({', '.join(sorted(foreign)[:5])}); choose a new or empty directory")


def _write_shard(path: str, entries: list[tuple[str, tuple[int, ...]]], dtype: torch.dtype,
                 tensors: Iterator[Tensor]) -> int:
    """Stream one safetensors file: the header from shapes, then each tensor's bytes as it comes."""
    itemsize = torch.empty(0, dtype=dtype).element_size()
    header: dict[str, Any] = {"__metadata__": {"format": "pt"}}
    offset = 0
    for name, shape in entries:
        n = itemsize * int(torch.Size(shape).numel())
        header[name] = {"dtype": _ST_DTYPE[dtype], "shape": list(shape), "data_offsets": [offset, offset + n]}
        offset += n
    raw = json.dumps(header, separators=(",", ":")).encode()
    raw += b" " * (-len(raw) % 8)
    written = 0
    with open(path, "wb") as f:
        f.write(struct.pack("<Q", len(raw)))
        f.write(raw)
        for (name, shape), t in zip(entries, tensors, strict=True):
            if tuple(t.shape) != tuple(shape):
                raise RuntimeError(f"export: {name} has shape {tuple(t.shape)}, expected {shape}")
            data = t.to(dtype).contiguous().reshape(-1).view(torch.uint8)
            f.write(memoryview(data.numpy()))
            written += data.numel()
        f.flush()
        os.fsync(f.fileno())
    if written != offset:
        raise RuntimeError(f"export: wrote {written} bytes of tensors into {path}, the header announced {offset}")
    return offset


def export_hf(engine: Any, program: HFBlocks, src_dir: str | os.PathLike, out_dir: str | os.PathLike,
              dtype: str = "float32", *, max_shard_bytes: int = 5 * 10**9) -> None:
    """Write the engine's current weights as a HF model directory that `from_pretrained` loads.

    config.json (the source's, dtype updated), generation_config.json and the tokenizer files are
    copied from `src_dir`; the weights are read from the store one block at a time and streamed into
    safetensors shards of at most `max_shard_bytes` (a block larger than that gets a shard of its
    own), with model.safetensors.index.json when there is more than one. A tied lm_head is written
    once, as the embedding (transformers ties it on load).
    """
    if dtype not in _DTYPES:
        raise ValueError(f"export dtype {dtype!r}: choose float32, bfloat16 or float16")
    tdtype = _DTYPES[dtype]
    src_dir, out_dir = str(src_dir), str(out_dir)
    _check_out_dir(src_dir, out_dir)
    os.makedirs(out_dir, exist_ok=True)
    for n in os.listdir(out_dir):  # a previous export's weights: the shard count may change
        if n in (WEIGHTS_NAME, WEIGHTS_INDEX) or _SHARD_RE.match(n):
            os.unlink(os.path.join(out_dir, n))

    layout = engine.store.layout
    if [b.name for b in layout.blocks] != program.names:
        raise ValueError("export_hf: the engine's store was not laid out for this program")
    itemsize = torch.empty(0, dtype=tdtype).element_size()
    shards: list[list[int]] = []
    size = 0
    for b in layout.blocks:
        nbytes = itemsize * b.numel
        if not shards or size + nbytes > max_shard_bytes:
            shards.append([])
            size = 0
        shards[-1].append(b.index)
        size += nbytes

    def block_tensors(blocks: list[int]) -> Iterator[Tensor]:
        for i in blocks:  # one block in memory at a time
            yield from engine.store.read_params(i)

    weight_map: dict[str, str] = {}
    total = 0
    for k, blocks in enumerate(shards):
        fname = WEIGHTS_NAME if len(shards) == 1 else f"model-{k + 1:05d}-of-{len(shards):05d}.safetensors"
        entries = [(name, spec.shape) for i in blocks
                   for name, spec in zip(program.param_names(i), layout.blocks[i].params, strict=True)]
        total += _write_shard(os.path.join(out_dir, fname), entries, tdtype, block_tensors(blocks))
        weight_map.update((name, fname) for name, _ in entries)
    if len(shards) > 1:
        with open(os.path.join(out_dir, WEIGHTS_INDEX), "w") as f:
            json.dump({"metadata": {"total_size": total}, "weight_map": weight_map}, f, indent=2, sort_keys=True)

    config = _read_config(src_dir)
    dtype_name = str(tdtype).removeprefix("torch.")
    present = [k for k in ("dtype", "torch_dtype") if k in config]
    for k in present or ["dtype"]:
        config[k] = dtype_name
    with open(os.path.join(out_dir, "config.json"), "w") as f:
        json.dump(config, f, indent=2, sort_keys=True)
    for name in ("generation_config.json", *TOKENIZER_FILES):
        src = os.path.join(src_dir, name)
        if os.path.isfile(src):
            shutil.copyfile(src, os.path.join(out_dir, name))


# ------------------------------------------------------------------------------------------ tokenizer
def load_tokenizer(path: str | os.PathLike):
    """The tokenizer saved in a HF directory (local files only)."""
    if not os.path.isdir(path) or not any(os.path.exists(os.path.join(path, n)) for n in
                                          ("tokenizer.json", "tokenizer_config.json", "tokenizer.model",
                                           "vocab.json")):
        raise ValueError(f"{path} has no tokenizer (none of tokenizer.json, tokenizer_config.json, "
                         "tokenizer.model, vocab.json); pass a directory that has one")
    from transformers import AutoTokenizer

    try:
        return AutoTokenizer.from_pretrained(path, local_files_only=True)
    except (OSError, ValueError, KeyError) as e:
        raise ValueError(f"could not load the tokenizer in {path}: {e}") from e
