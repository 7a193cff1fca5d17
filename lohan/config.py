"""Typed configuration dataclasses and the named model presets.

This module deliberately does not import torch: configs are parsed, validated, printed and planned
(``--dry-run``, the capacity planner) on machines where importing torch is slow or pointless.

The presets are one table ``name -> dims`` (:data:`PRESETS`). Paper sizes come from the LoHan paper,
Table IV (seq 1024, vocab 50257); the small ones are for CPU boxes and tests. Tests shrink a real
architecture instead of inventing one: ``get_model_config("13b", n_layer=2, d_model=64, n_head=4)``.

`EngineConfig` is made of typed sections (`ENGINE_SECTIONS`: store, memory, execution, schedule, stability, lora,
activations); a choice is a ``Literal`` type, written once, whose values the tuples below (`MODES`...) are. A
field declared with `setting` also has a command-line flag, which `lohan.app.cli` builds from the field.
"""

from __future__ import annotations

import dataclasses
import math
import os
import re
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any, Literal, get_args

__all__ = ["MAX_LAYERS", "MAX_PARAMS", "ModelConfig", "PRESETS", "get_model_config"]

def _is_int(value: object) -> bool:
    # bool is a subclass of int; `n_layer=True` is a bug, not a 1-layer model.
    return isinstance(value, int) and not isinstance(value, bool)


def _is_finite(value: object) -> bool:
    """A real number that is neither NaN nor infinite (bool excluded, as in `_is_int`)."""
    return isinstance(value, int | float) and not isinstance(value, bool) and math.isfinite(value)


MAX_LAYERS = 1024
"""The most transformer blocks a model may have: 8 times the deepest preset (412b: 128) and beyond any published
LLM. The planner, the store and the engine build one record per block, so a typo such as ``--layers 1000000000``
must be refused from the count, before the first per-block object is made (it once grew to 23 GB)."""

MAX_PARAMS = 2 * 10**12
"""The most parameters a model may have (2T: 5 times the largest preset, 412b; its exact optimizer states alone
would fill 56 TB of SSDs in two slots). The planners' work grows with the bytes of each block's record, so a shape
past this (``d_model`` or ``vocab_size`` a million times too big) is refused from its arithmetic at once."""


@dataclass(frozen=True)
class ModelConfig:
    """Dimensions of a GPT-style decoder (pre-LayerNorm, learned positions, GELU MLP).

    The architecture is the one built by :class:`lohan.models.gpt.GPT`; :meth:`param_count` is exact
    for it. Instances are immutable; use :meth:`with_overrides` to derive a modified copy.
    """

    name: str
    """Human-readable name, usually the preset key (e.g. ``"175b"``). Not interpreted."""

    n_layer: int
    """Number of transformer blocks."""

    n_head: int
    """Number of attention heads per block; must divide ``d_model``."""

    d_model: int
    """Hidden size (width of the residual stream)."""

    vocab_size: int = 50257
    """Number of token ids; 50257 is the GPT-2 BPE vocabulary used by the paper."""

    seq_len: int = 1024
    """Maximum sequence length, i.e. the number of learned position embeddings."""

    mlp_ratio: int = 4
    """MLP hidden size as a multiple of ``d_model`` (``fc`` maps d -> mlp_ratio * d)."""

    layer_norm_eps: float = 1e-5
    """Epsilon of every LayerNorm (the PyTorch and GPT-2 default)."""

    tie_embeddings: bool = True
    """Reuse the token embedding ``wte`` as the LM head weight (GPT-2 style, counted once).
    If False the head owns a separate ``vocab_size x d_model`` weight."""

    def __post_init__(self) -> None:
        # Collect every problem and raise once, so a bad YAML is fixed in one round trip.
        problems: list[str] = []
        if not isinstance(self.name, str) or not self.name:
            problems.append(f"name={self.name!r} must be a non-empty string")
        for field in ("n_layer", "n_head", "d_model", "vocab_size", "seq_len", "mlp_ratio"):
            value = getattr(self, field)
            if not _is_int(value) or value <= 0:
                problems.append(f"{field}={value!r} must be a positive integer")
        if (
            _is_int(self.d_model)
            and _is_int(self.n_head)
            and self.n_head > 0
            and self.d_model > 0
            and self.d_model % self.n_head != 0
        ):
            lower = (self.d_model // self.n_head) * self.n_head
            upper = lower + self.n_head
            hint = f"e.g. d_model={upper}" if lower == 0 else f"e.g. d_model={lower} or {upper}"
            problems.append(
                f"d_model={self.d_model} is not divisible by n_head={self.n_head}; every head needs the "
                f"same width: pick d_model as a multiple of n_head ({hint}) or pick an n_head that divides it"
            )
        eps = self.layer_norm_eps
        if isinstance(eps, bool) or not isinstance(eps, (int, float)) or not eps > 0:
            # PyYAML reads `1e-5` (no dot) as a string; say so, it is the usual cause.
            problems.append(
                f"layer_norm_eps={eps!r} must be a positive number (in YAML write 1.0e-5, not 1e-5)"
            )
        if not isinstance(self.tie_embeddings, bool):
            problems.append(f"tie_embeddings={self.tie_embeddings!r} must be True or False")
        if not problems:  # the dimensions are valid integers: now their arithmetic
            problems += self._size_problems()
        if problems:
            raise ValueError(f"invalid ModelConfig {self.name!r}:\n  - " + "\n  - ".join(problems))

    def _size_problems(self) -> list[str]:
        """A shape past `MAX_LAYERS` or `MAX_PARAMS`, from the counts alone (nothing per block is built)."""
        if self.n_layer > MAX_LAYERS:
            return [f"n_layer={self.n_layer:,} transformer blocks are more than lohan builds (at most "
                    f"{MAX_LAYERS:,}; the deepest preset, 412b, has 128): use --layers N with N <= {MAX_LAYERS:,} "
                    "(a slice of the same width), or another preset"]
        count = self.param_count()
        if count <= MAX_PARAMS:
            return []
        block, embed = self.n_layer * self.block_param_count(), self.embed_param_count()
        if block >= embed:
            fits = MAX_PARAMS // self.block_param_count()
            shrink = f"a smaller d_model ({self.d_model:,}) or mlp_ratio ({self.mlp_ratio:,})"
            most = (f"the {self.n_layer:,} blocks of {self.block_param_count():,} ({block:,}): "
                    + (f"use --layers N with N <= {fits:,}, or {shrink}" if fits else
                       f"not even one block of this width fits; give it {shrink}"))
        else:
            most = (f"the embeddings, (vocab_size {self.vocab_size:,} + seq_len {self.seq_len:,}) x d_model "
                    f"{self.d_model:,} ({embed:,}): make them smaller")
        return [f"{count:,} parameters ({count / 1e12:,.4g}T) are more than lohan plans for (at most {MAX_PARAMS:,}, "
                f"{MAX_PARAMS / 1e12:g}T: 5 times the largest preset, 412b); most are in {most}, or pick another "
                "preset"]

    # ----------------------------------------------------------------------------------- sizes

    @property
    def head_dim(self) -> int:
        """Width of one attention head, ``d_model // n_head``."""
        return self.d_model // self.n_head

    @property
    def mlp_hidden(self) -> int:
        """Hidden width of the MLP, ``mlp_ratio * d_model``."""
        return self.mlp_ratio * self.d_model

    def block_param_count(self) -> int:
        """Parameters of one transformer block (weights and biases).

        Returns:
            ``ln1 + qkv + proj + ln2 + fc + fc_proj``, i.e. ``(4 + 2r)·d² + (9 + r)·d`` for MLP ratio ``r``
            (``12·d² + 13·d`` for r = 4).
        """
        d, h = self.d_model, self.mlp_hidden
        layer_norms = 2 * (2 * d)  # ln1, ln2: weight + bias each
        attention = (d * 3 * d + 3 * d) + (d * d + d)  # qkv, proj
        mlp = (d * h + h) + (h * d + d)  # fc, fc_proj
        return layer_norms + attention + mlp

    def embed_param_count(self) -> int:
        """Parameters of the embedding block: token (``wte``) and position (``wpe``) tables."""
        return self.vocab_size * self.d_model + self.seq_len * self.d_model

    def head_param_count(self) -> int:
        """Parameters owned by the head block: ``ln_f``, plus the LM head weight only if untied."""
        own_lm_head = 0 if self.tie_embeddings else self.vocab_size * self.d_model
        return 2 * self.d_model + own_lm_head

    def param_count(self) -> int:
        """Exact number of parameters of the model (a tied embedding is counted once).

        Equals ``sum(p.numel() for p in GPT(cfg).parameters())``.
        """
        return self.embed_param_count() + self.n_layer * self.block_param_count() + self.head_param_count()

    def flops_per_token(self, seq_len: int | None = None) -> int:
        """Forward FLOPs per token (multiply-add = 2 FLOPs), the ``FLOP_f`` of the cost model per token.

        Args:
            seq_len: Sequence length the model is run at (attention cost grows with it).
                Defaults to :attr:`seq_len`.

        Returns:
            ``2·(matmul params) + n_layer·4·seq_len·d_model``. Backward is twice this (paper §III).
        """
        s = self.seq_len if seq_len is None else seq_len
        if not _is_int(s) or s <= 0:
            raise ValueError(f"seq_len={s!r} must be a positive integer")
        d = self.d_model
        # Every weight matrix that multiplies the activations costs 2 FLOPs per element per token.
        # Counted: qkv, proj, fc, fc_proj per block and the LM head (vocab x d, tied or not).
        # Not counted: embedding lookups (gathers), biases, LayerNorm, GELU, softmax: O(d) per token.
        matmul_params = self.n_layer * (4 + 2 * self.mlp_ratio) * d * d + self.vocab_size * d
        # Attention scores Q·Kᵀ and the weighted sum A·V each cost 2·seq_len·d per token per layer
        # (PaLM appendix B / Chinchilla convention; the causal mask's halving is not credited, as in
        # the usual MFU accounting).
        attention = self.n_layer * 2 * 2 * s * d
        return 2 * matmul_params + attention

    def with_overrides(self, **overrides: Any) -> ModelConfig:
        """Return a copy with some fields replaced, validated again.

        Args:
            **overrides: Field names and their new values, e.g. ``n_layer=2, d_model=64``.

        Raises:
            TypeError: If a name is not a field of ``ModelConfig``.
            ValueError: If the resulting config is invalid.
        """
        valid = {f.name for f in dataclasses.fields(self)}
        unknown = sorted(set(overrides) - valid)
        if unknown:
            raise TypeError(f"unknown ModelConfig field(s) {unknown}; valid fields are {sorted(valid)}")
        return dataclasses.replace(self, **overrides)


# name -> dims. Fields not given take the ModelConfig defaults (vocab 50257, seq_len 1024, mlp_ratio 4).
# The comments are the exact param_count() rounded; tests/test_config.py checks each is within 10% of
# the size in its name.
PRESETS: dict[str, dict[str, Any]] = {
    # Small sizes for CPU boxes and tests. `tiny` keeps the real GPT-2 vocabulary (so the init loss is
    # ln(50257) and the GPT-2 tokenizer works); its embeddings are ~80% of its parameters.
    "tiny": dict(n_layer=6, n_head=4, d_model=160, seq_len=256),  # ~9.9M params
    "125m": dict(n_layer=12, n_head=12, d_model=768),  # ~124M params (GPT-2 small)
    "350m": dict(n_layer=24, n_head=16, d_model=1024),  # ~355M params (GPT-2 medium)
    # GPT-3 XL's 24/16/2048 would be ~1.3B; 18 layers at the same width gives an honest "1b".
    "1b": dict(n_layer=18, n_head=16, d_model=2048),  # ~1.01B params
    # LoHan paper, Table IV.
    "6b": dict(n_layer=28, n_head=32, d_model=4096),  # ~5.85B params
    "13b": dict(n_layer=40, n_head=40, d_model=5120),  # ~12.85B params
    "30b": dict(n_layer=48, n_head=56, d_model=7168),  # ~29.97B params
    "70b": dict(n_layer=80, n_head=64, d_model=8192),  # ~64.85B params
    "135b": dict(n_layer=88, n_head=88, d_model=11264),  # ~134.57B params
    "175b": dict(n_layer=96, n_head=96, d_model=12288),  # ~174.59B params
    "276b": dict(n_layer=112, n_head=112, d_model=14336),  # ~276.98B params
    "412b": dict(n_layer=128, n_head=128, d_model=16384),  # ~413.18B params
}


def get_model_config(name: str, **overrides: Any) -> ModelConfig:
    """Build the :class:`ModelConfig` of a named preset, optionally with some fields replaced.

    Args:
        name: A key of :data:`PRESETS` (e.g. ``"tiny"``, ``"13b"``, ``"175b"``).
        **overrides: Fields to replace, e.g. ``n_layer=2, d_model=64, n_head=4`` to shrink a real
            architecture for a test. The ``name`` stays the preset's unless overridden too.

    Raises:
        ValueError: If ``name`` is not a preset (the message lists the valid names) or the result is invalid.
        TypeError: If an override is not a ``ModelConfig`` field.
    """
    if name not in PRESETS:
        raise ValueError(f"unknown model preset {name!r}; valid presets are: {', '.join(PRESETS)}")
    return ModelConfig(name=name, **PRESETS[name]).with_overrides(**overrides)


_STORE_NAME = re.compile(r"[A-Za-z0-9][A-Za-z0-9_-]{0,63}")
_VOLUME_TAILS = ("-act", "-grad", "-probe")
"""The run's scratch volumes are ``<name>-act`` and so on (lohan.store.files.VOLUMES): a store named like one of them
would share its files with another store's scratch volume in the same directory."""


def store_name_problem(name: object) -> str | None:
    """Why `name` cannot name a store (None if it can). The store's files are ``<nvme>/<name><suffix>``, so the name
    must be a plain file name: a ``/``, ``..`` or an empty name would put them outside the directories the run
    checks and locks (or name them ``None.slab``)."""
    fix = "a store name is a file name: letters, digits, '_' and '-', 1 to 64 characters, e.g. lohan or run-2"
    if not isinstance(name, str) or not _STORE_NAME.fullmatch(name):
        return f"name={name!r}: {fix}"
    if name.endswith(_VOLUME_TAILS):
        return (f"name={name!r}: names ending in {', '.join(_VOLUME_TAILS)} are the scratch volumes of other stores "
                "in the same directory; choose another")
    return None


_BYTE_UNITS = {"": 1, "b": 1, "kb": 10**3, "mb": 10**6, "gb": 10**9, "tb": 10**12,
               "kib": 2**10, "mib": 2**20, "gib": 2**30, "tib": 2**40}


def parse_bytes(value: int | str) -> int:
    """Parse a size such as ``8GiB``, ``512 MiB``, ``2e9`` or ``1073741824`` into bytes.

    GiB/MiB are powers of two, GB/MB powers of ten (STYLE: GiB != GB).

    Raises:
        ValueError: Not a size, not finite (``1e400GiB``), or below zero (``-5GiB`` was once taken as a budget).
    """
    size = None
    if _is_int(value):
        size = int(value)
    elif isinstance(value, float) and value.is_integer():
        size = int(value)
    elif isinstance(value, str):
        text = value.strip().lower().replace(" ", "")
        num = text.rstrip("abcdefghijklmnopqrstuvwxyz")
        unit = text[len(num):]
        if unit in _BYTE_UNITS and num:
            try:
                scaled = float(num) * _BYTE_UNITS[unit]
            except ValueError:
                scaled = math.nan
            size = int(scaled) if math.isfinite(scaled) else None
    if size is None:
        raise ValueError(f"cannot read {value!r} as a size; write e.g. 8GiB, 512MiB or a number of bytes")
    if size < 0:
        raise ValueError(f"{value!r} is below zero: a size is 0 or more; write e.g. 8GiB, 512MiB or a number of bytes")
    return size


SIZE_FIELDS = ("cpu_mem", "act_mem", "gpu_mem", "stripe_bytes", "opt_chunk_bytes", "resident_mem",
               "readahead_mem")
"""EngineConfig fields that hold byte sizes (a user writes them with a unit: `8GiB`)."""


def unitless_size_problems(engine: dict) -> list[str]:
    """Sizes a user gave as bare numbers (flags, YAML, --set): `--cpu-mem 4` would mean 4 bytes, which nobody
    means. 0 needs no unit. The Python API takes ints as bytes; this is for what a person typed."""
    problems = []
    for name in SIZE_FIELDS:
        value = engine.get(name)
        bare = (isinstance(value, int | float) and not isinstance(value, bool)) or (
            isinstance(value, str) and value.strip().replace(".", "", 1).isdigit())
        if bare and float(value) > 0:  # (a negative size is refused as one by parse_bytes)
            problems.append(f"{name}={value!r}: a size needs a unit; write e.g. {value}GiB, {value}MiB or {value}B "
                            "(bytes)")
    return problems


def steps_share(ratio: float, steps: int) -> int:
    """`ratio` of `steps`, rounded up: 0.07 of 100 is 7 (float arithmetic makes the product 7.000000000000001,
    which a plain ceil would make 8)."""
    return math.ceil(ratio * steps - 1e-9)


Mode = Literal["serial", "naive", "optimized"]
"""Gradient offloading modes (`ExecutionConfig.mode`)."""
ComputeDtype = Literal["auto", "bf16", "fp16", "fp32"]
"""`ExecutionConfig.compute_dtype`'s values; past `lohan.plan.compute_dtype.choose` every layer sees one of the
last three."""
StateFormat = Literal["exact", "bf16-moments", "8bit-moments", "bf16-master"]
"""The optimizer-state formats (`StoreConfig.state_format`; their bytes in `lohan.plan.formats`)."""
Scheduler = Literal["cosine", "linear", "constant", "wsd"]
"""The learning-rate schedules (`ScheduleConfig.lr_scheduler`)."""
ClipMode = Literal["auto", "speculate", "defer"]
Backend = Literal["auto", "aio", "threads"]
Device = Literal["auto", "cpu", "cuda", "sim"]
ActCompress = Literal["none", "int8"]
Slots = Literal[1, 2]
NoDecayKind = Literal["bias", "norm", "embedding"]

# Each choice list is written once, as the type above; these are its values.
MODES: tuple[str, ...] = get_args(Mode)
COMPUTE_DTYPES: tuple[str, ...] = get_args(ComputeDtype)
STATE_FORMATS: tuple[str, ...] = get_args(StateFormat)
SCHEDULERS: tuple[str, ...] = get_args(Scheduler)
CLIP_MODES: tuple[str, ...] = get_args(ClipMode)
BACKENDS: tuple[str, ...] = get_args(Backend)
DEVICES: tuple[str, ...] = get_args(Device)
ACT_COMPRESSIONS: tuple[str, ...] = get_args(ActCompress)
SLOTS: tuple[int, ...] = get_args(Slots)
NO_DECAY_KINDS: tuple[str, ...] = get_args(NoDecayKind)
ACT_POLICIES = ("plan", "interblock", "swap-all", "recompute-all")
"""`ActivationConfig.act_policy`'s named policies; ``ops:NAME,...`` names the ops to swap instead."""


@dataclass(frozen=True)
class Flag:
    """The command-line flag of a config field (`setting`): `lohan.app.cli` builds it from the field's name, type
    (choices from a ``Literal``), default and this, so a flag is declared once, at its field."""

    help: str
    """One line for ``--help`` (the field's docstring is the long form, for ``--help-config``)."""
    group: str
    """The ``--help`` section it is listed in."""
    flag: str | None = None
    """The flag's name without ``--`` when it is not the field's (``lora`` for ``lora_r``)."""
    metavar: str | tuple[str, ...] | None = None
    parse: str | None = None
    """A parser of `lohan.app.cli` for a value the type does not say how to read (``names``: comma-separated;
    ``count-or-auto``: an integer >= 1 or auto)."""


def setting(default: Any, *, help: str, group: str, flag: str | None = None,
            metavar: str | tuple[str, ...] | None = None, parse: str | None = None) -> Any:
    """A config field with a command-line flag (see `Flag`)."""
    return dataclasses.field(default=default, metadata={"flag": Flag(help, group, flag, metavar, parse)})


FINETUNE_LR = 2e-5
"""Peak learning rate of a local Hugging Face model run without --config (full fine-tuning of a pretrained model:
the range 1e-5..5e-5 that fine-tuning recipes use; the presets' 3e-4 would wreck pretrained weights)."""
LORA_LR = 2e-4
"""Peak learning rate of a LoRA run of a local Hugging Face model without --config: adapters start at zero and
take the 1e-4..3e-4 that LoRA recipes (PEFT's examples, axolotl, torchtune) use."""
FINETUNE_WARMUP = 0.03
"""Its warm-up, as a fraction of the run's steps (at least one step)."""


@dataclass(frozen=True)
class StoreConfig:
    """Where and how the model states are stored: the SSD directories, the store's name and layout
    (fixed when the store is created: ``slots``, ``checksums``, ``state_format``) and the I/O settings.

    Part of :class:`EngineConfig` (``engine.store``), which validates it.
    """

    nvme: tuple[str, ...] = setting(
        ("./runs/nvme",), group="memory and storage", metavar="DIR",
        help="one directory per SSD (striped)")
    """One directory per SSD; the store is striped over all of them."""

    name: str = "lohan"
    """Store name: file stem of the slab files and records in the NVMe directories (``<nvme>/<name>.slab``, ...).
    A file name, not a path: letters, digits, ``_`` and ``-`` (`store_name_problem`)."""

    slots: Slots = setting(
        2, group="memory and storage",
        help="2: crash-consistent alternate slots; 1: in place")
    """2: a step's states go to the alternate slot and become current with an atomic commit record
    (crash-consistent, 2x SSD space). 1: in place (needs periodic checkpoints to survive a crash)."""

    checksums: bool = True
    """Hash every record section the store writes (XXH3-64, committed with the step) and verify every read,
    so bytes damaged on the SSDs stop the run instead of training on. Fixed when the store is created."""

    state_format: StateFormat = setting(
        "exact", group="memory and storage",
        help="optimizer states on the SSDs: exact (fp32, 14 B/param), bf16-moments (10), 8bit-moments "
             "(8), bf16-master (4; stochastic rounding, needs --compute-dtype bf16); fixed at creation")
    """How the optimizer states are stored (README "Smaller states"; fixed when the store is created):
    ``exact`` (fp32 master, m, v and the P16 copy: bit-exact with PyTorch's AdamW, 14 bytes per parameter),
    ``bf16-moments`` (m and v in bf16: 10), ``8bit-moments`` (m and v 8-bit block-wise, as bitsandbytes' and
    torchao's 8-bit Adam: 8.03) or ``bf16-master`` (bf16 weights updated with stochastic rounding, seeded by
    ``seed``, no separate P16, 8-bit moments: 4.03; needs compute_dtype bf16, which ``auto`` picks for it)."""

    backend: Backend = setting("auto", group="memory and storage", help="NVMe I/O backend")
    """io_engine backend: ``auto``, ``aio`` or ``threads``."""

    stripe_bytes: int | str = "1MiB"
    """Stripe unit over the SSD directories (each volume's striping; the optimizer's unit is `opt_chunk_bytes`)."""

    emulate_ssd_gbps: float | None = None
    """Pace every NVMe directory to this many GB/s (reads and writes share it), to emulate slower
    or fewer SSDs on a fast disk in benchmarks and ablations. Results measured so are emulated."""


@dataclass(frozen=True)
class MemoryConfig:
    """Main and device memory: the budgets and how the engine's host pools use them.

    Part of :class:`EngineConfig` (``engine.memory``), which validates it.
    """

    cpu_mem: int | str = setting(
        "8GiB", group="memory and storage",
        help="main-memory budget of the engine, e.g. 8GiB")
    """Main-memory budget for every buffer the engine owns (parameter prefetch, optimizer working
    set, gradients). Must hold at least three times the largest block's optimizer record."""

    gpu_mem: int | str | None = setting(
        None, group="memory and storage",
        help="device memory the plan must fit in, e.g. 24GiB (default: the device's)")
    """Device memory the run must fit in (the planner checks it before anything is written);
    None: the device's own (main memory when the device is the CPU)."""

    prefetch_depth: int = setting(2, group="memory and storage", help="blocks of parameters read ahead")
    """Blocks whose parameters are read ahead of the one computing (forward and backward)."""

    max_inflight_blocks: int = 3
    """Blocks the optimizer pipeline holds at once (each needs its P32, m, v, P16 record in memory)."""

    opt_chunk_bytes: int | str = "512MiB"
    """Largest piece of a block's optimizer record (P32, m, v, P16) the CPU optimizer works on at once.
    Blocks with bigger records (a 175B layer's is 25 GB) are updated in chunks, so the optimizer's
    memory is ``max_inflight_blocks`` chunks, not whole records."""

    resident_records: bool = True
    """Keep the optimizer records (P32, m, v, P16) of some blocks in the record pool from one step to the next,
    so that only the others are read from the SSDs each step (every record is still written: the commit
    needs it there). The pool streams the other records through `max_inflight_blocks` buffers beside the
    records bigger than those (a tied embedding's: one buffer for it instead of `max_inflight_blocks`,
    `plan.pools.record_pool_bytes`), and `resident_mem` gives it room for more. With `resident_mem: 0` the 110M
    Llama reads 1.0 instead of 1.3 GB per step; with the default every record stays and nothing is read.
    False: every record is read every step, through `max_inflight_blocks` buffers of the largest."""

    resident_mem: int | str = "auto"
    """Main memory beyond the record pool for more resident records (part of ``cpu_mem``; never more than
    all of them take). ``auto``: half of what ``cpu_mem`` and the machine's available memory leave after the
    engine's other pools and the gradient stash (the other half stays for swapped activations); ``all``: as
    much as keeps every record resident (the optimizer states then live in RAM, as with ZeRO-Offload, and are
    still written every step); ``0``: none, the leanest setting. Fewer bytes are read, and the update after a
    deferred gate waits for fewer READs: the 110M Llama, whose records are 1.53 GB, keeps them all with
    ``auto`` (within an 8 GiB ``cpu_mem``) and steps in 1.14 instead of 1.58 s with ``0``, at 2.93 instead of
    2.09 GiB peak RSS. A value other than ``auto`` and ``0`` needs ``resident_records``."""

    readahead_mem: int | str = "auto"
    """Main memory (part of ``cpu_mem``) for optimizer records READ ahead of their update, in ``optimized`` mode:
    during backward, ahead of an update that waits for the global gradient norm (a clipped step's deferred
    update, every update with ``slots=1``), so those READs run under backward instead of after it; and ahead of
    the gradients when the update runs during backward (the SSDs' pace evens out). ``auto``: what ``resident_mem:
    auto`` leaves of its half of the memory ``cpu_mem`` and the machine's available memory leave after the other
    pools and the gradient stash (so with ``resident_mem: 0`` that whole half), never more than reading every
    record ahead takes; ``0``: only the record pool's ``max_inflight_blocks`` buffers read ahead. Resident records
    serve the same purpose and more (their READs are never made), so ``auto`` gives them the memory first."""

    heap_reuse: bool = True
    """Have glibc's malloc serve every allocation from its heap and keep what is freed there for reuse
    (`runtime/heap.py`, `reuse_heap`), instead of mapping each tensor over 32 MiB afresh and unmapping it when it is
    freed. A step's biggest temporaries (the logits, the embedding's gradient) are then not page-faulted in
    again every step: the 110M Llama's step spent ~0.3 s of its two cores' time in the kernel doing that.
    Process-wide, and set when the engine is built; False leaves the allocator as it is. No effect where
    the C library is not glibc."""


@dataclass(frozen=True)
class ExecutionConfig:
    """How a step runs: the offloading mode, the precision, the device, gradient accumulation,
    the seed and when steps become durable.

    Part of :class:`EngineConfig` (``engine.execution``), which validates it.
    """

    mode: Mode = setting("optimized", group="memory and storage", help="gradient offloading mode")
    """Active gradient offloading mode: ``serial`` (optimizer after backward, ZeRO-Infinity style),
    ``naive`` (per block READ -> ADAM -> WRITE during backward) or ``optimized`` (READ of block i-1
    issued before WRITE of block i, paper Fig. 3b)."""

    compute_dtype: ComputeDtype = setting(
        "auto", group="model",
        help="device compute precision. auto: bf16 on a GPU and on a CPU with native bf16 (AMX or "
             "AVX-512 bf16), fp32 on other CPUs, where bf16 runs ~10x slower (the header says which and "
             "why); fp16 uses dynamic loss scaling")
    """``bf16``: bf16 parameters on the device under autocast, fp32 master weights and Adam states.
    ``fp32``: everything fp32 (bit-exact with a plain PyTorch fp32 loop). ``fp16``: with dynamic loss scaling.
    ``auto``: bf16 on a GPU and on a CPU with native bf16 (AMX or AVX-512 bf16), fp32 on other CPUs, where bf16
    runs ~10x slower; bf16 for ``state_format`` bf16-master; a resume keeps the store's. The engine and the run
    resolve it once (`lohan.plan.compute_dtype.choose`) and the header says which and why."""

    micro_batches: int = setting(1, group="data", help="gradient accumulation: micro-batches per step")
    """Gradient accumulation: each batch is split into this many micro-batches."""

    device: Device = setting(
        "auto", group="model",
        help="compute device (sim: the CPU simulating a separate GPU, to test lohan's device code)")
    """``auto`` (CUDA when available), ``cpu``, ``cuda``, or ``sim``: the CPU simulating a separate device, whose
    tensors do not mix with host buffers and whose copies complete late (lohan/runtime/simdevice.py; for tests)."""

    sim_gpu: str | None = setting(
        None, group="model", metavar="SPEC",
        help="with --device sim: run at a modeled GPU's pace, e.g. rtx4090, h100 or "
             "tflops=150,h2d=25GB/s,d2h=25GB/s,hbm=1000GB/s (default: LOHAN_SIM_GPU, else order only)")
    """A GPU the simulated device models the timing of; only with device ``sim`` (README "The simulated device"):
    a name of the planner's GPU presets (``rtx4090``, ``h100``, ...) and/or ``key=value`` rates over it
    (``tflops=150,h2d=25GB/s,d2h=25GB/s,hbm=1000GB/s``; lohan/runtime/simgpu.py). None: ``LOHAN_SIM_GPU`` when
    set, else the simulated device checks order only, not time."""

    seed: int = setting(0, group="optimization", help="initialization and data-order seed")
    """Seed of the model's initialization."""

    write_behind: bool = True
    """When a step's optimizer pass runs after backward with the next step's forward beside it (a deferred
    update, two slots, one process), hold each updated record's WRITE back until the READs that forward
    waits for are done, and let the writes still held at the end, and the step's commit, complete during
    the next step's backward (where the SSDs are otherwise idle once its read-ahead is done). A step is then
    durable once the next step's backward has begun, or at `flush()` / `close()`; a crash in between
    resumes from the step before. False: every step is committed before `step` returns."""

    persist_every: int | str = setting(
        "auto", group="memory and storage", metavar="N|auto", parse="count-or-auto",
        help="durability interval: write and commit the records every N steps (between, a step commits "
             "nothing to the SSDs and a kill replays it); only with every record resident; auto (default): "
             "the least N that keeps the writes under ~10%% of the run's time")
    """The durability interval: every this many steps the optimizer records are written to the SSDs and committed;
    the steps between commit nothing there and keep their states in RAM. Only where every record stays resident
    (``resident_records``, enough memory), two slots and one process: records streamed from the SSDs are written
    every step anyway (a slot must hold one step's records, all of them). A kill resumes from the last durable step
    and replays the steps after it (bit-identical); Ctrl-C, SIGTERM, ``close``, evaluations, exports and
    checkpoints persist first. A step that is not durable defers its update until the gradient norm is known (its
    states have no copy on the SSDs to redo or skip from). ``auto``: 1 while any record streams; with every record
    resident, the least interval that keeps the persist writes under ~10% of the run's time
    (`lohan.plan.planner.persist_interval`, from the first step's profile). An integer N > 1 where records stream
    is lowered to 1 (said in the header: the same config runs on machines with less memory)."""


@dataclass(frozen=True)
class ScheduleConfig:
    """AdamW's hyper-parameters and the learning-rate schedule: the settings a resume may change (the
    run state saves them and the header says what changed) and that a preset other than the default config's
    does not take from that config.

    Part of :class:`EngineConfig` (``engine.schedule``), which validates it.
    """

    lr: float = setting(
        3e-4, group="optimization",
        help="peak learning rate (a local Hugging Face model without --config: "
             f"{FINETUNE_LR:g}; a preset other than the config's: 3e-4)")
    """Peak learning rate."""

    lr_scheduler: Scheduler = setting(
        "cosine", group="optimization",
        help="after the warm-up: cosine or linear decay, constant, or wsd (stable, then a 1-sqrt decay over "
             "the last --decay-ratio of the steps)")
    """The lr after the warm-up (`lohan.runtime.optim.lr_factor`), down to the floor (``min_lr`` or ``lr *
    min_lr_ratio``) at ``total_steps``: ``cosine`` (half a cosine), ``linear`` (a straight line; with
    ``min_lr_ratio: 0`` it is the Hugging Face Trainer's ``linear``), ``constant`` (the peak lr throughout, no
    floor), or ``wsd`` (warm-up, stable, decay: the peak lr until the last ``decay_ratio`` of ``total_steps``,
    then a 1-sqrt decay to the floor, the cooldown Hägele et al. 2024, "Scaling Laws and Compute-Optimal
    Training Beyond Fixed Training Durations", found best)."""

    warmup_steps: int = setting(
        0, group="optimization",
        help="linear warmup steps (a local Hugging Face model without "
             f"--config: {FINETUNE_WARMUP * 100:.0f}%% of --steps)")
    """Linear warmup from lr/warmup_steps to lr over this many steps."""

    warmup_ratio: float | None = setting(
        None, group="optimization", metavar="R",
        help="warm-up: a share of the steps (or --warmup-steps)")
    """The warm-up as a share of ``total_steps``, in [0, 1]: ``ceil(warmup_ratio * total_steps)`` steps (as the
    Hugging Face Trainer counts it). Exclusive with a nonzero ``warmup_steps``; None: ``warmup_steps`` decides."""

    total_steps: int | None = setting(
        None, group="optimization",
        help="length of the schedule (default: the run's steps)")
    """Length of the schedule (including warmup); None keeps the lr constant after warmup (the command line
    sets it to the run's steps)."""

    min_lr_ratio: float | None = setting(None, group="optimization", help="the decay ends at lr x this")
    """The decay ends at lr * min_lr_ratio at total_steps. None: 0.1, unless ``min_lr`` gives the floor
    (the two are exclusive; after validation it is None only when ``min_lr`` is set)."""

    min_lr: float | None = setting(
        None, group="optimization",
        help="the decay ends at this lr (instead of --min-lr-ratio)")
    """The decay's floor as a learning rate (the Hugging Face name), in [0, lr]; exclusive with
    ``min_lr_ratio``."""

    decay_ratio: float = setting(
        0.1, group="optimization", metavar="R",
        help="wsd: the final decay's share of the steps")
    """``wsd`` only: the share of ``total_steps``, in (0, 1], that the final decay takes
    (``ceil(decay_ratio * total_steps)`` steps, at most those after the warm-up); 0.1 as in MiniCPM's WSD."""

    weight_decay: float = setting(0.01, group="optimization", help="AdamW decoupled weight decay")
    """Decoupled (AdamW) weight decay, applied to every parameter except those `no_decay` names."""

    betas: tuple[float, float] = setting(
        (0.9, 0.999), group="optimization", metavar=("B1", "B2"),
        help="Adam betas")
    """Adam betas."""

    eps: float = setting(1e-8, group="optimization", help="Adam epsilon")
    """Adam epsilon."""

    no_decay: tuple[NoDecayKind, ...] = ("bias", "norm")
    """Parameters AdamW does not decay, by kind: ``bias`` (every bias), ``norm`` (weights of LayerNorm /
    RMSNorm modules), ``embedding`` (token and position embeddings, and a head tied to them). The
    Hugging Face Trainer's default is ``bias`` and ``norm``; ``[]`` decays everything."""

    @property
    def warmup(self) -> int:
        """Warm-up steps: ``warmup_steps``, or ``warmup_ratio`` of ``total_steps`` (none while that is None)."""
        if self.warmup_ratio is None:
            return self.warmup_steps
        return steps_share(self.warmup_ratio, self.total_steps) if self.total_steps else 0

    @property
    def floor_ratio(self) -> float:
        """Where the decay ends, as a share of ``lr`` (from ``min_lr`` or ``min_lr_ratio``)."""
        return self.min_lr / self.lr if self.min_lr is not None else self.min_lr_ratio


@dataclass(frozen=True)
class StabilityConfig:
    """Gradient clipping, the fp16 loss scale and the limit on non-finite steps in a row.

    Part of :class:`EngineConfig` (``engine.stability``), which validates it.
    """

    max_grad_norm: float = setting(
        1.0, group="optimization", metavar="NORM",
        help="clip gradients to this global L2 norm (0 turns clipping off)")
    """Clip the gradients to this global L2 norm before the update, exactly as
    `torch.nn.utils.clip_grad_norm_` (0 turns clipping off). Under active gradient offloading the norm is
    only known at the end of backward: see `clip_mode`."""

    clip_mode: ClipMode = setting(
        "auto", group="optimization",
        help="clipping under overlapped updates: speculate and redo, or defer updates")
    """How updates overlap backward when clipping (every choice gives the same bits). ``speculate``: update each
    block with coefficient 1 as its gradients arrive and redo the step's optimizer pass from the previous slot
    (kept gradients, exact coefficient) when the step's norm says clipping applies: best when steps rarely clip,
    a clipped step costs a second pass. ``defer``: read ahead during backward (up to ``readahead_mem``) and update
    once the norm is known, in forward order with the next step's forward beside it: best when most steps clip
    (early fine-tuning). ``auto``: choose per step (`runtime/clip_schedule.py`): speculate when the chance that
    the step clips, estimated from the recent norms, times a redo's cost is below what deferring costs, both
    measured as the run goes (the cost model's figures until then); data parallel ranks speculate after an
    unclipped step and defer after a clipped one. With ``slots=1`` only ``defer`` is possible.

    With clipping off (``max_grad_norm`` 0) nothing is redone, and the choice is where the update runs: under
    backward (``speculate``), or after it beside the next step's forward (``defer``; one process, two slots, not
    serial mode; the step's gradients are kept meanwhile). ``auto`` plans room for them only where they all fit
    in what cpu_mem leaves, and then defers where that measures faster (a CPU device whose cores the optimizer
    shares: the update fills the forward's idle time); elsewhere it updates under backward."""

    loss_scale: float = 65536.0
    """fp16 only: the initial dynamic loss scale (`torch.amp.GradScaler`'s ``init_scale``). The loss is
    multiplied by it before backward and the gradients divided by it after; a step whose gradients overflow
    is skipped (the previous slot stands) and the scale halved; after ``loss_scale_growth_interval`` steps
    without overflow it doubles."""

    loss_scale_growth_interval: int = 2000
    """fp16 only: steps without overflow before the loss scale doubles (GradScaler's ``growth_interval``)."""

    max_bad_steps: int = 8
    """A step whose loss or gradients are not finite is never committed (the previous states stand, its
    batch is skipped); after this many such steps in a row the run stops."""


@dataclass(frozen=True)
class LoraConfig:
    """LoRA: the adapters' rank, scaling, dropout and targets (rank 0: full fine-tuning).

    Part of :class:`EngineConfig` (``engine.lora``), which validates it.
    """

    lora_r: int = setting(
        0, group="optimization", flag="lora", metavar="R",
        help="LoRA of rank R: the weights stay frozen (stored once as read-only P16 and streamed), only "
             "adapters of the decoder layers' projections train, as PEFT's; fixed when the store is created")
    """LoRA rank (``--lora R``; 0: full fine-tuning). With R > 0 the model's weights are a frozen base, stored once
    as read-only P16 and streamed, and only rank-R adapters (A, B) of the targeted projections are trained, as PEFT's
    LoRA (`lohan.runtime.lora_engine`). Fixed when the store is created: a resume with other LoRA settings is
    refused."""

    lora_alpha: float = setting(
        8.0, group="optimization", metavar="A",
        help="LoRA scaling alpha / R (default 8, PEFT's)")
    """LoRA scaling numerator: the adapters' update is scaled by ``lora_alpha / lora_r`` (PEFT's ``lora_alpha``,
    whose default is 8 whatever the rank)."""

    lora_dropout: float = setting(
        0.0, group="optimization", metavar="P",
        help="dropout on the adapters' input (only 0 so far)")
    """Dropout on the adapters' input (PEFT's ``lora_dropout``), in [0, 1); its masks are drawn per (seed, step,
    micro-batch, block, target), so a recomputed block draws its forward's again (`lohan.models.lora.mask_seed`)."""

    lora_targets: tuple[str, ...] = setting(
        (), group="optimization", metavar="NAMES", parse="names",
        help="comma-separated module names to adapt, e.g. q_proj,v_proj (default: every linear projection "
             "of the decoder layers, attention and MLP)")
    """Names of the modules that get adapters, matched against each module's name inside a decoder layer as PEFT's
    ``target_modules`` (the last part, or a dotted suffix: ``q_proj``, ``self_attn.o_proj``); empty: every linear
    projection of the decoder layers, attention and MLP (PEFT's ``all-linear``), never the embedding or the head."""


@dataclass(frozen=True)
class ActivationConfig:
    """Which activations leave the device between forward and backward, where they wait, and how.

    Part of :class:`EngineConfig` (``engine.activations``), which validates it.
    """

    act_policy: str = setting(
        "plan", group="memory and storage",
        help=f"activations: {' | '.join(ACT_POLICIES)} | ops:NAME,...")
    """Which activations leave the device between forward and backward (DESIGN.md §4.4):
    ``plan`` (the traffic-aware planner, Algorithm 1, on a profile measured at the first step),
    ``interblock`` (block inputs only, the rest recomputed; ZeRO-Infinity style), ``swap-all``
    (every op's outputs; G10 style) or ``recompute-all`` (block inputs stay on the device)."""

    act_mem: int | str | None = setting(
        None, group="memory and storage",
        help="main memory for swapped activations (the rest goes to the SSDs)")
    """Main memory for swapped activations; what does not fit goes on to the SSDs. None: what
    ``cpu_mem`` and the machine's free memory leave after the engine's own pools."""

    act_compress: ActCompress = setting(
        "none", group="memory and storage",
        help="int8: swapped activations travel and wait as int8 codes with a scale per row (lossy)")
    """``int8``: activation records leaving the device for main memory or the SSDs carry their floating tensors as
    int8 codes with an fp32 scale per row (symmetric, PyAO's scheme; quantized on the device before the copy,
    dequantized there just before use): ~1/4 of the bytes of fp32, ~1/2 of bf16, lossy. ``none``: as they are."""

    profile_from: str | None = None
    """A saved profile (JSON) to plan from instead of measuring one at the first step."""


ENGINE_SECTIONS: dict[str, type] = {
    "store": StoreConfig, "memory": MemoryConfig, "execution": ExecutionConfig, "schedule": ScheduleConfig,
    "stability": StabilityConfig, "lora": LoraConfig, "activations": ActivationConfig}
"""`EngineConfig`'s sections: name -> class (``engine.<name>.<field>`` in a YAML or ``--set``)."""

FLAT_KEYS: dict[str, str] = {f.name: section for section, cls in ENGINE_SECTIONS.items()
                             for f in dataclasses.fields(cls)}
"""Each engine setting's name -> its section. Setting names are unique across the sections, so a YAML, ``--set``
and ``EngineConfig(...)`` may give them without the section (``engine.cpu_mem`` for ``engine.memory.cpu_mem``,
as every config written before the sections does), and `EngineConfig` has a read-only alias of each."""

SCHEDULE_FIELDS: tuple[str, ...] = tuple(f.name for f in dataclasses.fields(ScheduleConfig))
"""The schedule section's settings (see `ScheduleConfig`)."""


def flat_engine_settings(engine: Any, where: str = "engine") -> dict[str, Any]:
    """A YAML's ``engine:`` mapping with its sections opened: ``{memory: {cpu_mem: 2GiB}, lr: 1.0e-3}`` ->
    ``{cpu_mem: 2GiB, lr: 1.0e-3}``. Unknown names are kept for the caller to report; a setting given both in its
    section and by its flat name is refused (which one would win is not obvious)."""
    if engine is None:
        return {}
    if not isinstance(engine, Mapping):
        raise ValueError(f"{where}: give a mapping of engine settings (key: value lines), not {engine!r}")
    flat = {k: v for k, v in engine.items() if k not in ENGINE_SECTIONS}
    for section in (s for s in ENGINE_SECTIONS if s in engine):
        given = engine[section]
        if isinstance(given, ENGINE_SECTIONS[section]):
            given = {f.name: getattr(given, f.name) for f in dataclasses.fields(given)}
        if not isinstance(given, Mapping):
            raise ValueError(f"{where}.{section}: give a mapping of its settings ({', '.join(_names(section))}), "
                             f"not {given!r}")
        for key, value in given.items():
            if FLAT_KEYS.get(key) != section:
                raise ValueError(f"{where}.{section}.{key}: unknown setting of engine.{section} (valid: "
                                 f"{', '.join(_names(section))})")
            if key in flat:
                raise ValueError(f"{where}: {key} is given twice, as {where}.{key} and {where}.{section}.{key}; "
                                 "keep one")
            flat[key] = value
    return flat


def _names(section: str) -> list[str]:
    return [f.name for f in dataclasses.fields(ENGINE_SECTIONS[section])]


@dataclass(frozen=True, init=False)
class EngineConfig:
    """How the engine runs, in sections: where states live (`store`), memory budgets (`memory`), how a step runs
    (`execution`), the optimizer's schedule (`schedule`), clipping and loss scaling (`stability`), LoRA (`lora`),
    activations (`activations`).

    Built from sections (``EngineConfig(memory=MemoryConfig(cpu_mem="8GiB"))``, or mappings of them) and/or flat
    settings (``EngineConfig(cpu_mem="8GiB", mode="serial")``; a flat setting overrides its section's value, so
    ``dataclasses.replace(cfg, mode="serial")`` and `with_overrides` work). Validated as a whole (some checks
    span sections) with every problem reported at once; sizes accept strings such as ``"8GiB"`` and are stored as
    bytes. Read settings through their section (``cfg.memory.cpu_mem``); the flat names (``cfg.cpu_mem``) are
    read-only aliases kept for code written before the sections.
    """

    store: StoreConfig
    """The SSD directories, the store's name and layout, the I/O backend."""
    memory: MemoryConfig
    """Main and device memory budgets, the host pools' sizes."""
    execution: ExecutionConfig
    """Offloading mode, precision, device, accumulation, seed, durability."""
    schedule: ScheduleConfig
    """AdamW and the learning-rate schedule."""
    stability: StabilityConfig
    """Clipping, the fp16 loss scale, non-finite steps."""
    lora: LoraConfig
    """LoRA adapters (rank 0: full fine-tuning)."""
    activations: ActivationConfig
    """Activation offloading."""

    def __init__(self, **settings: Any) -> None:
        unknown = [k for k in settings if k not in ENGINE_SECTIONS and k not in FLAT_KEYS]
        if unknown:
            raise TypeError(f"EngineConfig got unknown setting(s) {', '.join(map(repr, unknown))}; the settings "
                            f"are the sections ({', '.join(ENGINE_SECTIONS)}) and their fields (lohan --help-config)")
        for section, cls in ENGINE_SECTIONS.items():
            flat = {k: v for k, v in settings.items() if FLAT_KEYS.get(k) == section}
            given = settings.get(section)
            if isinstance(given, cls):  # (a copy: validation normalizes this config's sections in place)
                part = dataclasses.replace(given, **flat)
            else:  # a mapping of the section's settings (checked there), or none
                part = cls(**flat_engine_settings({section: {} if given is None else given, **flat}))
            object.__setattr__(self, section, part)
        self.__post_init__()

    def _normalize(self, name: str, value: Any) -> None:
        """Store a setting's validated form (bytes for a size, a tuple for a list) in its section."""
        object.__setattr__(getattr(self, FLAT_KEYS[name]), name, value)

    def get(self, name: str) -> Any:
        """A setting by its flat name (``"cpu_mem"``), from its section."""
        return getattr(getattr(self, FLAT_KEYS[name]), name)

    def settings(self) -> dict[str, Any]:
        """Every setting by its flat name (what a YAML's ``engine:`` may hold; trackers log these keys)."""
        return {name: getattr(getattr(self, section), name) for name, section in FLAT_KEYS.items()}


    def __post_init__(self) -> None:
        # every problem is reported at once, in field order within each group
        problems = (self._placement_problems() + self._execution_problems() + self._optimizer_problems()
                    + self._stability_problems())
        if problems:
            raise ValueError("invalid engine config:\n  - " + "\n  - ".join(problems))

    def _placement_problems(self) -> list[str]:
        """Where states and activations go: the SSD directories, memory budgets and sizes (normalized to
        bytes), the activation policy, the SSD emulation."""
        store, mem, act = self.store, self.memory, self.activations
        problems: list[str] = []
        # `--set engine.nvme=5` or a YAML mapping must be a message, not a TypeError from tuple()
        nvme = (store.nvme,) if isinstance(store.nvme, str | os.PathLike) else tuple(store.nvme) if isinstance(
            store.nvme, list | tuple) else None
        if nvme is None or not all(isinstance(d, str | os.PathLike) and os.fspath(d) for d in nvme):
            problems.append(f"nvme={store.nvme!r}: give one directory path or a list of them, e.g. [/mnt/nvme0/lohan]")
            nvme = ()
        elif not nvme:
            problems.append("nvme: give at least one directory")
        nvme = tuple(os.fspath(d) for d in nvme)
        self._normalize("nvme", nvme)
        problem = store_name_problem(store.name)
        if problem:
            problems.append(problem)
        for name in ("act_mem", "gpu_mem"):
            if self.get(name) is not None:
                try:
                    self._normalize(name, parse_bytes(self.get(name)))
                except ValueError as e:
                    problems.append(f"{name}: {e}")
        if not isinstance(act.act_policy, str) or (act.act_policy not in ACT_POLICIES
                                                     and not act.act_policy.startswith("ops:")):
            problems.append(f"act_policy={act.act_policy!r}: choose one of {', '.join(ACT_POLICIES)}, or "
                            "'ops:NAME,NAME' to swap exactly those ops of every block")
        if act.act_compress not in ACT_COMPRESSIONS:
            problems.append(f"act_compress={act.act_compress!r}: choose none (records as they are) or int8 "
                            "(int8 codes and a scale per row on the CPU and SSD tiers)")
        if store.emulate_ssd_gbps is not None and not (isinstance(store.emulate_ssd_gbps, int | float)
                                                      and store.emulate_ssd_gbps > 0):
            problems.append(f"emulate_ssd_gbps={store.emulate_ssd_gbps!r} must be a positive number or None")
        for name in ("cpu_mem", "stripe_bytes", "opt_chunk_bytes") + (() if mem.resident_mem in ("all", "auto")
                                                                    else ("resident_mem",)) + (
                () if mem.readahead_mem == "auto" else ("readahead_mem",)):
            try:
                self._normalize(name, parse_bytes(self.get(name)))
            except ValueError as e:
                problems.append(f"{name}: {e}" + (", 'auto' or 'all'" if name == "resident_mem" else
                                                  ", or 'auto'" if name == "readahead_mem" else ""))
        return problems + self._size_range_problems()

    def _lora_problems(self) -> list[str]:
        """LoRA's rank, scaling, dropout and targets (`lora_r`...)."""
        lora = self.lora
        problems: list[str] = []
        if not _is_int(lora.lora_r) or lora.lora_r < 0:
            problems.append(f"lora_r={lora.lora_r!r} must be an integer >= 0 (the adapters' rank; 0: full fine-tuning)")
        if not (_is_finite(lora.lora_alpha) and lora.lora_alpha > 0):
            problems.append(f"lora_alpha={lora.lora_alpha!r} must be a finite positive number (PEFT's default: 8)")
        if not (_is_finite(lora.lora_dropout) and 0 <= lora.lora_dropout < 1):
            problems.append(f"lora_dropout={lora.lora_dropout!r} must be a number in [0, 1)")
        targets = (lora.lora_targets,) if isinstance(lora.lora_targets, str) else lora.lora_targets
        if not isinstance(targets, list | tuple) or not all(isinstance(t, str) and t.strip() for t in targets):
            problems.append(f"lora_targets={lora.lora_targets!r}: give module names such as q_proj,v_proj (or none: "
                            "every linear projection of the decoder layers)")
        else:
            self._normalize("lora_targets", tuple(t.strip() for t in targets))
        return problems

    def _size_range_problems(self) -> list[str]:
        """Sizes that parse but cannot be (parse_bytes refuses negative ones): zero where it means nothing, a stripe
        the SSD volumes cannot cut."""
        store, mem = self.store, self.memory
        problems = []
        if _is_int(mem.gpu_mem) and mem.gpu_mem == 0:
            problems.append("gpu_mem=0: give the device memory the run must fit in, e.g. 24GiB, or leave it unset "
                            "(the device's own)")
        if _is_int(mem.opt_chunk_bytes) and mem.opt_chunk_bytes == 0:
            problems.append("opt_chunk_bytes=0: give the largest piece of a record the optimizer updates at once, "
                            "e.g. 512MiB")
        # io_engine.align.ALIGN (this layer imports nothing): every transfer is O_DIRECT, in 4 KiB units
        if _is_int(store.stripe_bytes) and (store.stripe_bytes == 0 or store.stripe_bytes % 4096):
            problems.append(f"stripe_bytes={store.stripe_bytes}: the stripe unit over the SSD directories must be a "
                            "positive multiple of 4 KiB (4096 bytes, the unit of direct I/O), e.g. 1MiB")
        return problems

    def _execution_problems(self) -> list[str]:
        """How a step runs: the named choices, the counts, the switches, resident records, the slots."""
        store, mem, ex = self.store, self.memory, self.execution
        problems: list[str] = []
        choices = {"mode": MODES, "compute_dtype": COMPUTE_DTYPES, "backend": BACKENDS, "device": DEVICES}
        for name, allowed in choices.items():
            if self.get(name) not in allowed:
                problems.append(f"{name}={self.get(name)!r}: choose one of {', '.join(allowed)}")
        for name in ("micro_batches", "prefetch_depth", "max_inflight_blocks"):
            value = self.get(name)
            if not _is_int(value) or value < 1:
                problems.append(f"{name}={value!r} must be an integer >= 1")
        for name in (f.name for cls in ENGINE_SECTIONS.values() for f in dataclasses.fields(cls)
                     if f.type in ("bool", bool)):
            if not isinstance(self.get(name), bool):
                problems.append(f"{name}={self.get(name)!r} must be true or false")
        if mem.resident_mem not in (0, "auto") and not mem.resident_records:
            problems.append(f"resident_mem={mem.resident_mem} needs resident_records=true")
        if not (ex.persist_every == "auto" or (_is_int(ex.persist_every) and ex.persist_every >= 1)):
            problems.append(f"persist_every={ex.persist_every!r} must be an integer >= 1 (steps between durable "
                            "commits) or 'auto'")
        if store.slots not in SLOTS:
            problems.append(f"slots={store.slots!r} must be 1 (in place) or 2 (alternate slots)")
        # the spec's names and rates are read against the planner's GPU presets, a layer above this one:
        # `lohan.runtime.simgpu.parse_sim_gpu` checks them when the device is made (and the CLI before the run)
        if ex.sim_gpu is not None and not (isinstance(ex.sim_gpu, str) and ex.sim_gpu.strip()):
            problems.append(f"sim_gpu={ex.sim_gpu!r}: name a GPU (e.g. rtx4090) or give rates "
                            "(e.g. tflops=150,h2d=25GB/s), or leave it unset")
        elif ex.sim_gpu is not None and ex.device in ("cpu", "cuda"):
            problems.append(f"sim_gpu={ex.sim_gpu!r} models a GPU's timing on the simulated device: it needs "
                            f"device sim, not {ex.device} (--device sim)")
        return problems

    def _optimizer_problems(self) -> list[str]:
        """AdamW and its schedule: warm-up, total steps, lr, betas, eps, weight decay and its exclusions."""
        store, ex, sch = self.store, self.execution, self.schedule
        problems: list[str] = []
        if not _is_int(sch.warmup_steps) or sch.warmup_steps < 0:
            problems.append(f"warmup_steps={sch.warmup_steps!r} must be an integer >= 0")
        if sch.total_steps is not None and (not _is_int(sch.total_steps) or sch.total_steps < 1):
            problems.append(f"total_steps={sch.total_steps!r} must be a positive integer or None")
        # NaN fails every comparison and inf passes `> 0`: both would train on garbage, so ask for finite numbers
        if not (_is_finite(sch.lr) and sch.lr > 0):
            problems.append(f"lr={sch.lr!r} must be a finite positive number, e.g. 3.0e-4")
        b = tuple(sch.betas) if isinstance(sch.betas, list | tuple) else (sch.betas,)
        self._normalize("betas", b)
        if len(b) != 2 or not all(isinstance(x, int | float) and 0 <= x < 1 for x in b):
            problems.append(f"betas={sch.betas!r} must be two numbers in [0, 1)")
        if not (_is_finite(sch.eps) and sch.eps > 0):
            problems.append(f"eps={sch.eps!r} must be positive (YAML reads 1e-8 as a string; write 1.0e-8)")
        if not (_is_finite(sch.weight_decay) and sch.weight_decay >= 0):
            problems.append(f"weight_decay={sch.weight_decay!r} must be a finite number >= 0")
        problems += self._schedule_problems() + self._lora_problems()
        if store.state_format not in STATE_FORMATS:
            problems.append(f"state_format={store.state_format!r}: choose one of {', '.join(STATE_FORMATS)}")
        elif store.state_format == "bf16-master" and ex.compute_dtype not in ("bf16", "auto"):
            problems.append(f"state_format=bf16-master keeps bf16 weights only, which the compute reads as they are: "
                            f"it needs compute_dtype bf16, not {ex.compute_dtype} (--compute-dtype bf16)")
        if isinstance(sch.no_decay, str | list):
            self._normalize("no_decay", (sch.no_decay,) if isinstance(sch.no_decay, str)
                               else tuple(sch.no_decay))
        bad = [k for k in sch.no_decay if k not in NO_DECAY_KINDS] if isinstance(sch.no_decay, tuple) else [0]
        if bad:
            problems.append(f"no_decay={sch.no_decay!r}: list kinds among {', '.join(NO_DECAY_KINDS)}, e.g. "
                            "[bias, norm]")
        return problems

    def _schedule_problems(self) -> list[str]:
        """The lr schedule's shape: the scheduler, the warm-up as a share, the floor, the WSD decay share."""
        sch = self.schedule
        problems: list[str] = []
        if sch.lr_scheduler not in SCHEDULERS:
            problems.append(f"lr_scheduler={sch.lr_scheduler!r}: choose one of {', '.join(SCHEDULERS)}")
        if sch.warmup_ratio is not None:
            if not (_is_finite(sch.warmup_ratio) and 0 <= sch.warmup_ratio <= 1):
                problems.append(f"warmup_ratio={sch.warmup_ratio!r} must be a number in [0, 1], e.g. 0.03")
            elif sch.warmup_steps:
                problems.append(f"warmup_steps={sch.warmup_steps!r} and warmup_ratio={sch.warmup_ratio!r} both set the "
                                "warm-up: give one (--warmup-steps N, or --warmup-ratio R for a share of the steps)")
        if sch.min_lr is not None and sch.min_lr_ratio is not None:
            problems.append(f"min_lr={sch.min_lr!r} and min_lr_ratio={sch.min_lr_ratio!r} both set where the decay "
                            "ends: give one (--min-lr as a learning rate, or --min-lr-ratio as a share of --lr)")
        elif sch.min_lr is not None:
            if not (_is_finite(sch.min_lr) and sch.min_lr >= 0):
                problems.append(f"min_lr={sch.min_lr!r} must be a finite number >= 0 (in YAML write 1.0e-5)")
            elif _is_finite(sch.lr) and sch.min_lr > sch.lr:
                problems.append(f"min_lr={sch.min_lr:g} is above the peak lr={sch.lr:g}: the decay ends below "
                                "where it starts; lower --min-lr or raise --lr")
        elif sch.min_lr_ratio is None:
            self._normalize("min_lr_ratio", 0.1)
        elif not (_is_finite(sch.min_lr_ratio) and 0 <= sch.min_lr_ratio <= 1):
            problems.append(f"min_lr_ratio={sch.min_lr_ratio!r} must be in [0, 1]")
        if not (_is_finite(sch.decay_ratio) and 0 < sch.decay_ratio <= 1):
            problems.append(f"decay_ratio={sch.decay_ratio!r} must be a number in (0, 1], e.g. 0.1 (the last 10% of "
                            "the steps decay)")
        return problems

    def _stability_problems(self) -> list[str]:
        """Clipping, the fp16 loss scale and the limit on non-finite steps in a row."""
        store, stab = self.store, self.stability
        problems: list[str] = []
        if not (_is_finite(stab.max_grad_norm) and stab.max_grad_norm >= 0):
            problems.append(f"max_grad_norm={stab.max_grad_norm!r} must be a finite number >= 0 (0: no clipping)")
        if stab.clip_mode not in CLIP_MODES:
            problems.append(f"clip_mode={stab.clip_mode!r}: choose one of auto, speculate, defer")
        elif stab.clip_mode == "speculate" and store.slots == 1 and stab.max_grad_norm:
            problems.append("clip_mode=speculate needs slots=2 (a wrong guess is undone from the previous slot, "
                            "which slots=1 overwrites); use clip_mode=defer or auto")
        if not (_is_finite(stab.loss_scale) and stab.loss_scale > 0):
            problems.append(f"loss_scale={stab.loss_scale!r} must be a positive number, e.g. 65536")
        if not (isinstance(stab.loss_scale_growth_interval, int) and stab.loss_scale_growth_interval >= 1):
            problems.append(f"loss_scale_growth_interval={stab.loss_scale_growth_interval!r} must be an integer >= 1")
        if not (isinstance(stab.max_bad_steps, int) and stab.max_bad_steps >= 1):
            problems.append(f"max_bad_steps={stab.max_bad_steps!r} must be an integer >= 1")
        return problems

    def with_overrides(self, **overrides: Any) -> EngineConfig:
        """A copy with some settings replaced (by flat name, ``mode="serial"``, or whole sections), re-validated."""
        return dataclasses.replace(self, **overrides)


_DERIVED = {"warmup": "schedule", "floor_ratio": "schedule"}
"""`ScheduleConfig`'s derived values, aliased on `EngineConfig` like the settings."""


class _Alias:
    """A read-only alias on `EngineConfig` of a section's setting (code in lohan/ reads the section). On the class
    it is the setting's default, as a plain dataclass field's class attribute is (``EngineConfig.lr``)."""

    def __init__(self, section: str, name: str) -> None:
        self.section, self.name = section, name
        self.__doc__ = f"Read-only alias of ``{section}.{name}``."

    def __get__(self, obj: Any, owner: type | None = None) -> Any:
        if obj is None:
            return getattr(ENGINE_SECTIONS[self.section], self.name)
        return getattr(getattr(obj, self.section), self.name)

    def __set__(self, obj: Any, value: Any) -> None:
        raise dataclasses.FrozenInstanceError(f"cannot assign to field {self.name!r}")


for _name, _section in {**FLAT_KEYS, **_DERIVED}.items():
    setattr(EngineConfig, _name, _Alias(_section, _name))


DataFormat = Literal["auto", "text", "prompt-response", "messages", "alpaca", "sharegpt"]
DATA_FORMATS: tuple[str, ...] = get_args(DataFormat)
"""How the records of ``data`` are read (``RunConfig.data_format``; lohan.data.formats maps each onto the examples
lohan trains)."""

MAX_STEPS = 2**24
"""The most optimizer steps a run may ask for: AdamW's step counter is a float32 tensor (exact to 2**24)."""


TRACKERS = ("tensorboard", "wandb", "mlflow")
"""What ``report_to`` takes (the names HF Trainer uses), besides ``none`` and ``all``."""


def parse_report_to(value: str | Sequence[str] | None) -> tuple[str, ...]:
    """``"tensorboard,wandb"`` / ``["mlflow"]`` / ``"all"`` / ``"none"`` -> the trackers, in the given order.

    Raises:
        ValueError: An unknown name (the message lists the known ones).
    """
    if value is None:
        return ()
    items = value.split(",") if isinstance(value, str) else [s for v in value for s in str(v).split(",")]
    names = [s.strip().lower() for s in items if s.strip()]
    if names in (["none"], []):
        return ()
    if names == ["all"]:
        return TRACKERS
    unknown = [n for n in names if n not in TRACKERS]
    if unknown:
        raise ValueError(f"report_to: unknown tracker(s) {', '.join(unknown)}: choose from {', '.join(TRACKERS)} "
                         "(comma-separated), 'all' or 'none'")
    return tuple(dict.fromkeys(names))


@dataclass(frozen=True)
class RunConfig:
    """A fine-tuning run: which model, which data, how long, and the engine settings.

    Loaded from YAML (``configs/*.yaml``) and command-line overrides by :mod:`lohan.app.cli`.
    """

    model: str = setting(
        "tiny", group="model",
        help=f"preset ({', '.join(PRESETS)}) or a local Hugging Face model directory")
    """A preset name (see :data:`PRESETS`), or a local Hugging Face model directory (config.json +
    safetensors; any decoder-only ``*ForCausalLM`` of the standard layout, see :mod:`lohan.models.hf`)."""

    model_overrides: dict = dataclasses.field(default_factory=dict)
    """Fields of the preset to replace, e.g. ``{vocab_size: 256, seq_len: 256}``."""

    data: str = setting(
        "data/corpus.txt", group="data", metavar="PATH",
        help="training data: a .txt file (plain text), a file of records (.jsonl, .json, .parquet, .arrow, "
             ".csv: text, prompt/response, chat messages, Alpaca or ShareGPT records), a folder written by "
             "datasets' save_to_disk, or 'synthetic'; records are tokenized once into the token cache "
             "($LOHAN_DATA_CACHE, default: the datasets cache)")
    """A local ``.txt`` file (plain text), a file of records (``.jsonl``, ``.json``, ``.parquet``, ``.arrow``,
    ``.csv``: text, prompt/response with the loss on the response, chat ``messages`` rendered with the model's chat
    template with the loss on the assistant turns, Alpaca or ShareGPT records; see ``data_format``), a folder
    written by ``datasets``' ``save_to_disk``, or ``synthetic`` for random tokens. Presets use byte-level tokens; a
    Hugging Face model uses its own tokenizer. Records are tokenized once into the token cache
    (``$LOHAN_DATA_CACHE``; lohan/data/token_cache.py)."""

    data_format: DataFormat = setting(
        "auto", group="data",
        help="how records are read (auto: by their columns: messages, conversations -> sharegpt, "
             "instruction+output -> alpaca, prompt+response, text); also for --eval-data")
    """How records are read: ``auto`` (by each record's keys), ``text``, ``prompt-response``, ``messages``,
    ``alpaca`` (instruction + input as the prompt, in Stanford Alpaca's template; output as the response) or
    ``sharegpt`` (``conversations`` of human/gpt/system turns, read as chat messages). Also for ``eval_data``."""

    text_field: str | None = setting(
        None, group="data", metavar="NAME",
        help="the column holding the text of text records, if not 'text'")
    """The column (key) holding the text of ``text`` records, when it is not ``text``. Also for ``eval_data``."""

    split: str | None = setting(
        None, group="data", metavar="NAME",
        help="the split of a saved DatasetDict folder given as --data (default train)")
    """The split of ``data`` when it is a ``DatasetDict.save_to_disk`` folder (default ``train``)."""

    steps: int = setting(
        200, group="optimization",
        help="optimizer steps to run (in total, when resuming)")
    """Optimizer steps to run (the total, counting steps of the run being resumed)."""

    epochs: int | None = setting(
        None, group="optimization",
        help="passes over the data (instead of --steps)")
    """If set, run this many passes over the data instead of ``steps``."""

    batch_size: int = setting(
        8, group="data",
        help="sequences per optimizer step")
    """Sequences per optimizer step (split into ``engine.micro_batches``)."""

    seq_len: int | None = setting(
        None, group="model",
        help="tokens per sequence (default: the model's)")
    """Tokens per sequence; defaults to the model's ``seq_len``."""

    metrics: str | None = setting(
        None, group="output",
        help="JSONL metrics file, one record per step (default: <nvme>/<name>.metrics.jsonl)")
    """JSONL file receiving one record per step (default: ``<first nvme dir>/<engine.name>.metrics.jsonl``)."""

    log_every: int | None = setting(
        None, group="output", metavar="N",
        help="a log line every N steps (and the first, the last and evaluating ones); default: every step "
             "on a terminal, about 200 lines over the run in a log file")
    """Steps between log lines (the first, the last and evaluating steps always get one); None: every step on a
    terminal, about 200 lines over the run in a log file."""

    report_to: tuple[str, ...] | str = setting(
        (), group="output", metavar="TRACKERS",
        help="also send each step's metrics and the run's settings to tensorboard, wandb and/or mlflow "
             "(comma-separated; 'all'; default none). wandb runs offline unless WANDB_MODE says otherwise; "
             "mlflow writes a local store unless MLFLOW_TRACKING_URI is set")
    """Experiment trackers that receive each step's record and the run's settings: ``tensorboard``, ``wandb``,
    ``mlflow`` (comma-separated in a string), ``all`` or ``none`` (the default). See :mod:`lohan.app.tracking`."""

    logging_dir: str | None = setting(
        None, group="output", metavar="DIR",
        help="where the trackers write (default: <metrics dir>/<run name>.logs)")
    """Where the trackers write (``tensorboard/``, ``wandb/``, ``mlflow/`` inside it); default
    ``<the metrics file's directory>/<engine.name>.logs``."""

    eval_data: str | None = setting(
        None, group="data", metavar="PATH",
        help="evaluate on this data (forward only): anything --data takes")
    """A file or saved dataset to evaluate on (anything ``data`` takes, read the same way, with the model's
    tokenizer)."""

    eval_split: str | None = setting(
        None, group="data", metavar="NAME",
        help="the split of a saved DatasetDict folder given as --eval-data (default train)")
    """The split of ``eval_data`` when it is a ``DatasetDict.save_to_disk`` folder (default ``train``)."""

    eval_fraction: float | None = setting(
        None, group="data", metavar="F",
        help="hold out this share of the data's sequences, in (0, 0.5], for evaluation (seeded)")
    """Hold out this share of the data's packed sequences, in (0, 0.5], for evaluation (seeded by
    ``engine.seed``; the held-out sequences are not trained on). Exclusive with ``eval_data``."""

    eval_every: int | None = setting(
        None, group="data", metavar="N",
        help="evaluate every N steps and at the end (default: only at the end)")
    """Evaluate every this many steps, and at the end; None: only at the end (with an eval set)."""

    save_every: int | None = setting(
        None, group="output", metavar="N",
        help="every N steps, also write a Hugging Face checkpoint to DIR/step-N (needs --export DIR)")
    """Every this many optimizer steps, write the weights as a Hugging Face checkpoint into ``<export>/step-N``
    (the same files as the export at the end, `lohan.app.export`); needs an export directory (``--export``)."""

    save_total_limit: int | None = setting(
        None, group="output", metavar="K",
        help="keep only the last K DIR/step-N checkpoints (default: all)")
    """Keep only the last this many ``step-N`` checkpoints (lohan's own; older ones are deleted after each save);
    None keeps them all. Needs ``save_every``."""

    engine: EngineConfig = dataclasses.field(default_factory=EngineConfig)
    """Engine settings (NVMe directories, memory budget, offloading mode, optimizer)."""

    def __post_init__(self) -> None:
        problems: list[str] = []
        if not isinstance(self.model, str) or (self.model not in PRESETS and not is_model_dir(self.model)):
            # say which of the two readings failed: a directory without config.json is the usual mistake
            found = (f" ({self.model} is a directory without config.json: point at the folder that "
                     "save_pretrained wrote)" if isinstance(self.model, str) and os.path.isdir(self.model) else "")
            problems.append(f"model={self.model!r}: choose a preset ({', '.join(PRESETS)}) or a local Hugging Face "
                            f"model directory (with config.json){found}")
        if not isinstance(self.model_overrides, dict):
            problems.append("model_overrides must be a mapping of ModelConfig fields")
        if not isinstance(self.data, str) or not self.data:
            problems.append(f"data={self.data!r}: give a file (.txt, .jsonl, .json, .parquet, .arrow, .csv), a folder "
                            "written by datasets' save_to_disk, or 'synthetic'")
        problems += self._format_problems()
        if self.log_every is not None and (not _is_int(self.log_every) or self.log_every < 1):
            problems.append(f"log_every={self.log_every!r}: give a number of steps >= 1, or leave it unset")
        try:
            object.__setattr__(self, "report_to", parse_report_to(self.report_to))
        except ValueError as err:
            problems.append(str(err))
        if self.logging_dir is not None and (not isinstance(self.logging_dir, str) or not self.logging_dir):
            problems.append(f"logging_dir={self.logging_dir!r}: give a directory path or leave it unset")
        if self.metrics is not None and not isinstance(self.metrics, str):
            problems.append(f"metrics={self.metrics!r}: give a file path (JSONL) or leave it unset")
        for name in ("steps", "batch_size"):
            value = getattr(self, name)
            if not _is_int(value) or value < 1:
                problems.append(f"{name}={value!r} must be an integer >= 1")
        if _is_int(self.steps) and self.steps > MAX_STEPS:
            problems.append(f"steps={self.steps:,} is more than lohan counts ({MAX_STEPS:,}: the optimizer's step "
                            "counter is float32, exact up to 2**24); a typo? Ask for fewer steps")
        if self.epochs is not None and (not _is_int(self.epochs) or self.epochs < 1):
            problems.append(f"epochs={self.epochs!r} must be an integer >= 1")
        if self.epochs is not None and self.data == "synthetic":
            problems.append("epochs needs a dataset; synthetic data has no epochs (use steps)")
        if self.seq_len is not None and (not _is_int(self.seq_len) or self.seq_len < 1):
            problems.append(f"seq_len={self.seq_len!r} must be a positive integer")
        problems += self._eval_problems() + self._save_problems()
        if isinstance(self.engine, dict):
            try:
                object.__setattr__(self, "engine", EngineConfig(**self.engine))
            except (TypeError, ValueError) as e:
                problems.append(f"engine: {e}")
        m = self.engine.execution.micro_batches if isinstance(self.engine, EngineConfig) else None
        if _is_int(self.batch_size) and self.batch_size >= 1 and _is_int(m) and m >= 1 and self.batch_size % m:
            # every micro-batch has the same shape; refusing here beats a failure at the first step
            fits = [d for d in range(1, self.batch_size + 1) if self.batch_size % d == 0]
            problems.append(f"batch_size={self.batch_size} is not divisible by micro_batches={m}: pick micro_batches "
                            f"from {fits} or a batch size that is a multiple of {m}")
        if problems:
            raise ValueError("invalid run config:\n  - " + "\n  - ".join(problems))

    def _format_problems(self) -> list[str]:
        problems = []
        if self.data_format not in DATA_FORMATS:
            problems.append(f"data_format={self.data_format!r} must be one of {', '.join(DATA_FORMATS)}")
        for name in ("text_field", "split", "eval_split"):
            value = getattr(self, name)
            if value is not None and (not isinstance(value, str) or not value.strip()):
                problems.append(f"{name}={value!r}: give a column name, or leave it unset" if name == "text_field" else
                                f"{name}={value!r}: give a split name (e.g. train), or leave it unset")
        if self.text_field is not None and self.data_format not in ("auto", "text"):
            problems.append(f"text_field={self.text_field!r} names the column of text records, but data_format is "
                            f"{self.data_format!r}: drop text_field (--text-field), or use data_format text")
        if self.eval_split is not None and self.eval_data is None:
            problems.append("eval_split picks a split of eval_data: add eval_data (--eval-data DIR), or drop it")
        return problems

    def _eval_problems(self) -> list[str]:
        problems = []
        if self.eval_data is not None and self.eval_fraction is not None:
            problems.append("eval_data and eval_fraction are two ways to get an eval set: pass one of them")
        if self.eval_data is not None:
            if not isinstance(self.eval_data, str) or not self.eval_data:
                problems.append(f"eval_data={self.eval_data!r}: give a file or a folder written by save_to_disk")
            elif not os.path.exists(self.eval_data):
                problems.append(f"eval_data={self.eval_data!r} does not exist; pass an existing file (.txt, .jsonl, "
                                ".json, .parquet, .arrow, .csv) or a folder written by datasets' save_to_disk")
        if self.eval_fraction is not None:
            f = self.eval_fraction
            if isinstance(f, bool) or not isinstance(f, (int, float)) or not 0 < f <= 0.5:
                problems.append(f"eval_fraction={f!r} must be a number in (0, 0.5], e.g. 0.05 to hold out 5% of the "
                                "data")
            elif self.data == "synthetic":
                problems.append("eval_fraction needs a dataset to hold sequences out of; synthetic data has none "
                                "(use eval_data)")
        if self.eval_every is not None:
            if not _is_int(self.eval_every) or self.eval_every < 1:
                problems.append(f"eval_every={self.eval_every!r} must be an integer >= 1")
            elif self.eval_data is None and self.eval_fraction is None:
                problems.append("eval_every needs an eval set: add eval_data (--eval-data FILE) or eval_fraction "
                                "(--eval-fraction F)")
        return problems

    def _save_problems(self) -> list[str]:
        problems = []
        for name in ("save_every", "save_total_limit"):
            value = getattr(self, name)
            if value is not None and (not _is_int(value) or value < 1):
                problems.append(f"{name}={value!r} must be an integer >= 1 (or unset)")
        if self.save_total_limit is not None and self.save_every is None:
            problems.append("save_total_limit limits the checkpoints save_every writes: add save_every "
                            "(--save-every N) or drop it")
        return problems

    @property
    def evaluates(self) -> bool:
        """Whether the run has an eval set."""
        return self.eval_data is not None or self.eval_fraction is not None

    @property
    def is_hf(self) -> bool:
        return self.model not in PRESETS and is_model_dir(self.model)

    def model_config(self) -> ModelConfig:
        """The preset's config (with overrides); a Hugging Face model's is read from its directory."""
        if self.is_hf:
            raise ValueError(f"{self.model} is a Hugging Face model directory, not a preset")
        return get_model_config(self.model, **self.model_overrides)


def is_model_dir(path: str) -> bool:
    """A directory holding a Hugging Face config.json (checked further when the model is loaded)."""
    return os.path.isfile(os.path.join(path, "config.json"))
