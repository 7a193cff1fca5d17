"""Hugging Face model directories on disk: weight import block by block, export, tokenizer.

The import reads only the keys of one block at a time from the (possibly sharded) safetensors files; the
export streams the store's weights, block by block, into safetensors shards of bounded size with
``model.safetensors.index.json``, next to config.json, generation_config.json and the tokenizer files.
The model's structure (which parameter belongs to which block) is `lohan.models.hf.HFBlocks`'s.
"""

from __future__ import annotations

import itertools
import json
import os
import re
import shutil
import struct
from collections.abc import Callable, Iterator
from typing import TYPE_CHECKING, Any

import torch
from safetensors import SafetensorError, safe_open
from torch import Tensor

from lohan.plan.records import TORCH_NAMES

if TYPE_CHECKING:
    from lohan.models.hf import HFBlocks

__all__ = ["EXPORT_DTYPES", "MAX_SHARD_BYTES", "WEIGHTS_INDEX", "WEIGHTS_NAME", "check_weights", "config_dtype",
           "export_hf", "has_tokenizer", "has_weights", "load_tokenizer", "make_init_block",
           "read_config"]

TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json", "vocab.json",
                   "merges.txt", "tokenizer.model", "added_tokens.json", "chat_template.jinja",
                   "chat_template.json")
"""Files copied verbatim from the source directory on export (whichever exist)."""

WEIGHTS_NAME = "model.safetensors"
WEIGHTS_INDEX = "model.safetensors.index.json"
MAX_SHARD_BYTES = 5 * 10**9
"""The export's shard size bound (transformers' own default for save_pretrained is 5 GB too)."""

EXPORT_DTYPES = {name: getattr(torch, t) for short, t in TORCH_NAMES.items() for name in (short, t)}
"""The export dtypes by their lohan names and torch's (``bf16`` and ``bfloat16``)."""
_ST_DTYPE = {torch.float32: "F32", torch.bfloat16: "BF16", torch.float16: "F16"}


# ------------------------------------------------------------------------------------------ directory
def read_config(path: str | os.PathLike) -> dict:
    """config.json of a model directory, as a dict (ValueError naming the file when it is not JSON)."""
    with open(os.path.join(path, "config.json")) as f:
        try:
            data = json.load(f)
        except json.JSONDecodeError as e:  # its own message names neither the file nor a fix
            raise ValueError(f"{path}/config.json is not valid JSON ({e}); save the model again or repair "
                             "the file") from None
    if not isinstance(data, dict):
        raise ValueError(f"{path}/config.json is not a JSON object")
    return data


def config_dtype(config: dict) -> str:
    """The dtype a model was saved in (config.json's ``dtype`` / ``torch_dtype``), as an export dtype name;
    float32 when it names none (or one lohan does not export)."""
    for key in ("dtype", "torch_dtype"):
        value = config.get(key)
        if isinstance(value, str) and value.removeprefix("torch.") in EXPORT_DTYPES:
            return value.removeprefix("torch.")
    return "float32"


def has_weights(path: str | os.PathLike) -> bool:
    """Whether a model directory holds safetensors weights (a config-only directory can still be planned)."""
    return os.path.isdir(path) and any(n.endswith(".safetensors") or n == WEIGHTS_INDEX for n in os.listdir(path))


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

    def resolve(self, name: str, prefix: str, renames: list[tuple[str, str]] = ()) -> str:
        """The checkpoint key of HF parameter `name`, with or without the base-model prefix, or under the name a
        checkpoint of the family's gives it (`renames`: (model's name prefix, checkpoint's), e.g. GPT-NeoX's
        ``lm_head.`` saved as ``embed_out.``)."""
        candidates = [name]
        if prefix and name.startswith(prefix + "."):
            candidates.append(name[len(prefix) + 1:])
        elif prefix:
            candidates.append(f"{prefix}.{name}")
        candidates += [old + c[len(new):] for c in list(candidates) for new, old in renames if c.startswith(new)]
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


def checkpoint_renames(model: Any) -> list[tuple[str, str]]:
    """(model's name prefix, checkpoint's) pairs of the renamings transformers applies when it loads a checkpoint
    of `model`'s family (its weight-conversion mapping), for the plain prefix renamings among them (``^old\\.``
    to ``new.``): lohan reads checkpoints itself, one block at a time, so it looks their keys up the same way."""
    try:
        from transformers.conversion_mapping import WeightRenaming, get_model_conversion_mapping
    except ImportError:  # transformers before 5 renamed nothing at load time
        return []
    out = []
    for rule in get_model_conversion_mapping(model) or []:
        if not isinstance(rule, WeightRenaming):
            continue
        for src, dst in zip(rule.source_patterns, rule.target_patterns):
            old = src[1:].replace("\\.", ".") if src.startswith("^") else None
            if old and re.fullmatch(r"[\w.]+", old) and re.fullmatch(r"[\w.]+", dst):
                out.append((dst, old))
    return out


def make_init_block(program: HFBlocks, path: str | os.PathLike) -> Callable[[int], list[Tensor]]:
    """init_block(i) -> block i's fp32 weights from the checkpoint in `path` (the engine's import hook)."""
    ckpt: list[_Checkpoint] = []
    prefix = program.model.base_model_prefix
    renames = checkpoint_renames(program.model)

    def init_block(i: int) -> list[Tensor]:
        if not ckpt:
            ckpt.append(_Checkpoint(path))
        src = ckpt[0]
        keys = [src.resolve(n, prefix, renames) for n in program.param_names(i)]
        tensors = src.read(keys)
        out = []
        for key, (pname, p) in zip(keys, program.modules[i].named_parameters()):
            t = tensors.pop(key)
            if tuple(t.shape) != tuple(p.shape):
                raise ValueError(f"{path}: tensor {key!r} has shape {tuple(t.shape)}, the config gives "
                                 f"{tuple(p.shape)} for {program.names[i]}.{pname}")
            t = t.to(torch.float32)
            _check_finite(t, key, os.path.join(str(path), src.key_file[key]))
            out.append(t)
        return out

    return init_block


def _check_finite(t: Tensor, key: str, file: str) -> None:
    """Refuse an imported tensor holding NaN or infinite values. Every step would then be skipped as not finite
    (`engine.max_bad_steps` of them, with advice about the learning rate), where the weights are what is wrong.

    Every tensor passes here once, on its way into the store: its fp32 sum is one cheap pass with no temporary
    (NaN and inf propagate into it); only a sum that is not finite is looked at element by element, since
    finite values of a legitimate checkpoint may also overflow it.
    """
    if torch.isfinite(t.sum()):
        return
    nan, inf = int(torch.isnan(t).sum()), int(torch.isinf(t).sum())
    if nan or inf:
        raise ValueError(f"tensor {key!r} in {file} holds {nan:,} NaN and {inf:,} infinite values (of {t.numel():,}): "
                         "the checkpoint is damaged, training from it would only skip steps. Save the model again "
                         "(save_pretrained) or re-download it, then continue with --resume (the blocks imported "
                         "before it are kept) or start over with --overwrite")


def check_weights(program: HFBlocks, path: str | os.PathLike) -> None:
    """Refuse a checkpoint that cannot give every parameter of `program` its tensor, from the safetensors
    headers alone (no tensor is read).

    The import itself runs block by block while the store is being written on the SSDs, so a missing,
    truncated or mismatched checkpoint found there would leave a half-built store behind; checked first,
    it is refused with nothing written. Raises ValueError naming the directory, the problem and the fix.
    """
    if not has_weights(path):
        other = sorted(n for n in os.listdir(path) if n.endswith((".bin", ".pt", ".pth", ".ckpt")))
        if other:
            raise ValueError(f"{path} has no *.safetensors weights (found {', '.join(other[:3])}): convert them to "
                             "safetensors first (load with from_pretrained, save with save_pretrained)")
        raise ValueError(f"{path} holds no weights, only the model's config: --dry-run plans it, but training "
                         "needs its *.safetensors files; download or copy them into the directory")
    try:
        ckpt = _Checkpoint(path)
        prefix = program.model.base_model_prefix
        renames = checkpoint_renames(program.model)
        by_file: dict[str, list[tuple[str, tuple[int, ...], str]]] = {}
        for i, block in enumerate(program.modules):
            for name, (pname, p) in zip(program.param_names(i), block.named_parameters()):
                key = ckpt.resolve(name, prefix, renames)
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




# ------------------------------------------------------------------------------------------ export
def _check_out_dir(src_dir: str, out_dir: str) -> None:
    from lohan.models.gpt_export import check_export_dir

    if os.path.isdir(out_dir) and os.path.samefile(src_dir, out_dir):
        raise ValueError(f"export target {out_dir} is the source directory; export to a new directory")
    check_export_dir(out_dir)


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
              dtype: str | None = None, *, max_shard_bytes: int = MAX_SHARD_BYTES) -> str:
    """Write the engine's current weights as a HF model directory that `from_pretrained` loads; returns the
    dtype written.

    `engine` is anything with the model's ``layout`` and ``read_params(i)`` (`Engine.whole`). `dtype` (fp32, bf16, fp16 or
    their torch names) defaults to the dtype the source was saved in (config.json), fp32 if it names none.
    The weights are read one block at a time and streamed into safetensors shards of at most
    `max_shard_bytes` (a single larger tensor gets a shard of its own): ``model.safetensors`` when one shard
    holds them all, else ``model-0000k-of-0000n.safetensors`` with ``model.safetensors.index.json``. A tied
    lm_head is written once, as the embedding (transformers ties it on load). config.json is the model's
    (with its dtype set to the export dtype, and the layer count of a ``--layers`` slice);
    generation_config.json and the tokenizer files (chat template included) are copied from `src_dir`,
    generation_config.json derived from the config when the source has none.
    """
    src_dir, out_dir = str(src_dir), str(out_dir)
    name = config_dtype(program.config_dict) if dtype is None else dtype
    if name not in EXPORT_DTYPES:
        raise ValueError(f"export dtype {name!r}: choose fp32, bf16 or fp16")
    tdtype = EXPORT_DTYPES[name]
    _check_out_dir(src_dir, out_dir)
    os.makedirs(out_dir, exist_ok=True)

    layout = engine.layout
    if [b.name for b in layout.blocks] != program.names:
        raise ValueError("export_hf: the engine's store was not laid out for this program")
    itemsize = torch.empty(0, dtype=tdtype).element_size()
    entries = [(pname, tuple(spec.shape)) for b in layout.blocks
               for pname, spec in zip(program.param_names(b.index), b.params, strict=True)]
    shards: list[list[tuple[str, tuple[int, ...]]]] = []
    size = 0
    for entry in entries:
        nbytes = itemsize * int(torch.Size(entry[1]).numel())
        if not shards or (size + nbytes > max_shard_bytes and size > 0):
            shards.append([])
            size = 0
        shards[-1].append(entry)
        size += nbytes

    def all_tensors() -> Iterator[Tensor]:
        for b in layout.blocks:  # one block in memory at a time; shards may start and end inside a block
            yield from engine.read_params(b.index)

    stream = all_tensors()
    weight_map: dict[str, str] = {}
    total = 0
    for k, shard in enumerate(shards):
        fname = WEIGHTS_NAME if len(shards) == 1 else f"model-{k + 1:05d}-of-{len(shards):05d}.safetensors"
        total += _write_shard(os.path.join(out_dir, fname), shard, tdtype, itertools.islice(stream, len(shard)))
        weight_map.update((pname, fname) for pname, _ in shard)
    if next(stream, None) is not None:
        raise RuntimeError("export: the store holds more tensors than the program names")
    if len(shards) > 1:
        with open(os.path.join(out_dir, WEIGHTS_INDEX), "w") as f:
            json.dump({"metadata": {"total_size": total}, "weight_map": weight_map}, f, indent=2, sort_keys=True)

    config = dict(program.config_dict)
    dtype_name = str(tdtype).removeprefix("torch.")
    for key in [k for k in ("dtype", "torch_dtype") if k in config] or ["dtype"]:
        config[key] = dtype_name
    with open(os.path.join(out_dir, "config.json"), "w") as f:
        json.dump(config, f, indent=2, sort_keys=True)
    for fname in ("generation_config.json", *TOKENIZER_FILES):
        src = os.path.join(src_dir, fname)
        if os.path.isfile(src):
            shutil.copyfile(src, os.path.join(out_dir, fname))
    if not os.path.isfile(os.path.join(src_dir, "generation_config.json")):
        from transformers import GenerationConfig

        GenerationConfig.from_model_config(program.config).save_pretrained(out_dir)
    return dtype_name


# ------------------------------------------------------------------------------------------ tokenizer
def load_tokenizer(path: str | os.PathLike):
    """The tokenizer saved in a HF directory (local files only)."""
    if not has_tokenizer(path):
        raise ValueError(f"{path} has no tokenizer (none of tokenizer.json, tokenizer_config.json, "
                         "tokenizer.model, vocab.json); pass a directory that has one")
    from transformers import AutoTokenizer

    try:
        return AutoTokenizer.from_pretrained(path, local_files_only=True)
    except (OSError, ValueError, KeyError) as e:
        raise ValueError(f"could not load the tokenizer in {path}: {e}") from e


def has_tokenizer(path: str | os.PathLike) -> bool:
    return os.path.isdir(path) and any(os.path.exists(os.path.join(path, n)) for n in
                                       ("tokenizer.json", "tokenizer_config.json", "tokenizer.model", "vocab.json"))
