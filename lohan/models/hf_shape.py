"""A Hugging Face config's shape, checked from its arithmetic before transformers builds the skeleton.

`lohan.models.hf.load_hf_skeleton` builds the model with every parameter on the meta device, but each parameter is
first made as a real tensor (``nn.Linear`` calls ``torch.empty(out, in)``) and only then moved there, and the
buffers (rotary ``inv_freq``, masks) stay real. A config.json with ``hidden_size`` 1,048,576 therefore allocated
hundreds of GiB inside ``from_config``, also for ``--dry-run``; a negative dimension ended in a raw RuntimeError;
100,000 layers took minutes and GBs of Python objects. :func:`check_dimensions` and :func:`check_shape` refuse all
of these first: every dimension a positive integer (as written, and as the family derives them), at most
`MAX_LAYERS` layers, then a build of the whole model on the meta device (nothing allocated, whatever the sizes) to
count the parameters against `MAX_PARAMS` and the bytes the real build allocates against this machine's memory.
"""

from __future__ import annotations

import copy
import logging
import math
import os
from typing import Any

import psutil
import torch

from lohan.config import MAX_LAYERS, MAX_PARAMS

log = logging.getLogger(__name__)

DIMENSIONS = ("vocab_size", "hidden_size", "num_hidden_layers", "num_attention_heads", "num_key_value_heads",
              "intermediate_size", "head_dim", "max_position_embeddings", "ffn_dim", "n_inner",
              "word_embed_proj_dim")
"""Config attributes that size tensors. Each one a family has (not None) must be a positive integer. They are read
through the config object, so a family's own name (GPT-2's ``n_embd``) is checked as the standard one and reported
under its config.json name."""

WRITTEN_NAMES = (*DIMENSIONS, "n_embd", "n_head", "n_layer", "n_positions", "n_ctx", "num_layers", "num_heads")
"""The same dimensions as config.json files write them (families' own names included), checked before transformers
reads the file: its config classes divide by some (a head width is hidden_size // num_attention_heads)."""

GiB = 2**30


def _json_name(config: Any, attr: str) -> str:
    return getattr(config, "attribute_map", {}).get(attr, attr)


def _positive_int(value: object) -> bool:
    return isinstance(value, int) and not isinstance(value, bool) and value >= 1


def dimension_problems(written: dict, config: Any = None) -> list[str]:
    """`name=value must be a positive integer` for each dimension that is set but is not one: those config.json
    writes (`written`), else those the family's `config` derives from them (a head width from the hidden size)."""
    given = [f"{k}={v!r} must be a positive integer" for k, v in written.items()
             if k in WRITTEN_NAMES and v is not None and not _positive_int(v)]
    if given or config is None:
        return given
    derived = [(_json_name(config, attr), getattr(config, attr, None)) for attr in DIMENSIONS]
    return [f"{name}={value!r} (derived from the others) must be a positive integer" for name, value in derived
            if value is not None and not _positive_int(value)]


def check_dimensions(path: str | os.PathLike, written: dict, config: Any = None) -> None:
    """Refuse a config whose dimensions are not all positive integers (`dimension_problems`): the file as written
    (before transformers reads it), and with `config` what its family derives."""
    problems = dimension_problems(written, config)
    if problems:
        raise ValueError(f"{path}/config.json: {'; '.join(problems)}; fix the file (every dimension of a model is a "
                         "positive integer)")


def _check_layers(path: str | os.PathLike, config: Any) -> None:
    """Refuse a config with more decoder layers than lohan builds (before anything per layer is made)."""
    layers = int(config.num_hidden_layers)
    if layers > MAX_LAYERS:
        raise ValueError(f"{path}/config.json: {_json_name(config, 'num_hidden_layers')}={layers:,} decoder layers are "
                         f"more than lohan builds (at most {MAX_LAYERS:,}); train a slice of its first layers with "
                         f"--layers N (N <= {MAX_LAYERS:,}), or fix the file")


def _meta_sizes(config: Any, attn: str) -> tuple[int, str, tuple[int, ...], int] | None:
    """(parameters, the largest one's name and shape, buffer bytes) of the model built on the meta device; None
    when the family's constructor needs real values (a ``.item()``): the real build then goes ahead unmeasured."""
    from transformers import AutoModelForCausalLM

    try:
        with torch.device("meta"):
            model = AutoModelForCausalLM.from_config(copy.deepcopy(config), dtype=torch.float32,
                                                     attn_implementation=attn)
    except Exception as e:  # noqa: BLE001 - any failure only means the sizes are unknown, as before this check
        log.debug("the meta-device build of %s failed (%s); its sizes are not checked", type(config).__name__, e)
        return None
    params = dict(model.named_parameters())  # a tied weight once
    name, largest = max(params.items(), key=lambda kv: kv[1].numel())
    buffers = sum(b.numel() * b.element_size() for b in model.buffers())
    return sum(p.numel() for p in params.values()), name, tuple(largest.shape), buffers


def check_shape(path: str | os.PathLike, config: Any, attn: str) -> None:
    """Refuse, before the skeleton is built, a shape (its dimensions checked already: `check_dimensions`) that lohan
    cannot plan or whose build this machine would not survive: more layers than `MAX_LAYERS` (`config` as built: cut
    by --layers already), more parameters than `MAX_PARAMS`, or real allocations (the largest parameter, made in fp32
    before it moves to the meta device, and every buffer) beyond this machine's memory. `attn`: the attention
    implementation the real build uses.

    Raises:
        ValueError: The problem, with the config.json it is in and what to do.
    """
    _check_layers(path, config)
    sizes = _meta_sizes(config, attn)
    if sizes is None:
        return
    count, name, shape, buffers = sizes
    if count > MAX_PARAMS:
        raise ValueError(f"{path}/config.json describes {count:,} parameters ({count / 1e12:,.4g}T), more than lohan "
                         f"plans for (at most {MAX_PARAMS:,}, {MAX_PARAMS / 1e12:g}T); the largest tensor is {name} "
                         f"{list(shape)}: check its dimensions (hidden_size, intermediate_size, vocab_size), or train "
                         "a slice with --layers N")
    largest = 4 * math.prod(shape)
    ram = psutil.virtual_memory().total
    if largest + buffers > ram:
        raise ValueError(f"{path}/config.json: building its skeleton allocates {(largest + buffers) / GiB:,.1f} GiB at "
                         f"once ({name} {list(shape)} in fp32, made real before it moves to the meta device, and "
                         f"{buffers / GiB:,.2f} GiB of buffers), more than this machine's {ram / GiB:,.1f} GiB of "
                         "RAM: check its dimensions (hidden_size, intermediate_size, vocab_size)")

