"""`EngineConfig`: the engine's settings as typed sections, with the flat names of the settings (every YAML and
``--set`` written before the sections) accepted and aliased, and the checks that span sections."""

from __future__ import annotations

import dataclasses
import os
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from lohan.config.choices import (
    ACT_COMPRESSIONS,
    ACT_POLICIES,
    BACKENDS,
    CLIP_MODES,
    COMPUTE_DTYPES,
    DEVICES,
    MODES,
    NO_DECAY_KINDS,
    SCHEDULERS,
    SLOTS,
    STATE_FORMATS,
)
from lohan.config.sections import (
    ActivationConfig,
    ExecutionConfig,
    LoraConfig,
    MemoryConfig,
    ScheduleConfig,
    StabilityConfig,
    StoreConfig,
)
from lohan.config.units import is_finite, is_int, parse_bytes, store_name_problem

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
        if not is_int(lora.lora_r) or lora.lora_r < 0:
            problems.append(f"lora_r={lora.lora_r!r} must be an integer >= 0 (the adapters' rank; 0: full fine-tuning)")
        if not (is_finite(lora.lora_alpha) and lora.lora_alpha > 0):
            problems.append(f"lora_alpha={lora.lora_alpha!r} must be a finite positive number (PEFT's default: 8)")
        if not (is_finite(lora.lora_dropout) and 0 <= lora.lora_dropout < 1):
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
        if is_int(mem.gpu_mem) and mem.gpu_mem == 0:
            problems.append("gpu_mem=0: give the device memory the run must fit in, e.g. 24GiB, or leave it unset "
                            "(the device's own)")
        if is_int(mem.opt_chunk_bytes) and mem.opt_chunk_bytes == 0:
            problems.append("opt_chunk_bytes=0: give the largest piece of a record the optimizer updates at once, "
                            "e.g. 512MiB")
        # io_engine.align.ALIGN (this layer imports nothing): every transfer is O_DIRECT, in 4 KiB units
        if is_int(store.stripe_bytes) and (store.stripe_bytes == 0 or store.stripe_bytes % 4096):
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
            if not is_int(value) or value < 1:
                problems.append(f"{name}={value!r} must be an integer >= 1")
        for name in (f.name for cls in ENGINE_SECTIONS.values() for f in dataclasses.fields(cls)
                     if f.type in ("bool", bool)):
            if not isinstance(self.get(name), bool):
                problems.append(f"{name}={self.get(name)!r} must be true or false")
        if mem.resident_mem not in (0, "auto") and not mem.resident_records:
            problems.append(f"resident_mem={mem.resident_mem} needs resident_records=true")
        if not (ex.persist_every == "auto" or (is_int(ex.persist_every) and ex.persist_every >= 1)):
            problems.append(f"persist_every={ex.persist_every!r} must be an integer >= 1 (steps between durable "
                            "commits) or 'auto'")
        if not is_int(ex.gc_every) or ex.gc_every < 0:
            problems.append(f"gc_every={ex.gc_every!r} must be an integer >= 0 (steps between full collections of "
                            "Python's garbage collector; 0: Python's own schedule)")
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
        if not is_int(sch.warmup_steps) or sch.warmup_steps < 0:
            problems.append(f"warmup_steps={sch.warmup_steps!r} must be an integer >= 0")
        if sch.total_steps is not None and (not is_int(sch.total_steps) or sch.total_steps < 1):
            problems.append(f"total_steps={sch.total_steps!r} must be a positive integer or None")
        # NaN fails every comparison and inf passes `> 0`: both would train on garbage, so ask for finite numbers
        if not (is_finite(sch.lr) and sch.lr > 0):
            problems.append(f"lr={sch.lr!r} must be a finite positive number, e.g. 3.0e-4")
        b = tuple(sch.betas) if isinstance(sch.betas, list | tuple) else (sch.betas,)
        self._normalize("betas", b)
        if len(b) != 2 or not all(isinstance(x, int | float) and 0 <= x < 1 for x in b):
            problems.append(f"betas={sch.betas!r} must be two numbers in [0, 1)")
        if not (is_finite(sch.eps) and sch.eps > 0):
            problems.append(f"eps={sch.eps!r} must be positive (YAML reads 1e-8 as a string; write 1.0e-8)")
        if not (is_finite(sch.weight_decay) and sch.weight_decay >= 0):
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
            if not (is_finite(sch.warmup_ratio) and 0 <= sch.warmup_ratio <= 1):
                problems.append(f"warmup_ratio={sch.warmup_ratio!r} must be a number in [0, 1], e.g. 0.03")
            elif sch.warmup_steps:
                problems.append(f"warmup_steps={sch.warmup_steps!r} and warmup_ratio={sch.warmup_ratio!r} both set the "
                                "warm-up: give one (--warmup-steps N, or --warmup-ratio R for a share of the steps)")
        if sch.min_lr is not None and sch.min_lr_ratio is not None:
            problems.append(f"min_lr={sch.min_lr!r} and min_lr_ratio={sch.min_lr_ratio!r} both set where the decay "
                            "ends: give one (--min-lr as a learning rate, or --min-lr-ratio as a share of --lr)")
        elif sch.min_lr is not None:
            if not (is_finite(sch.min_lr) and sch.min_lr >= 0):
                problems.append(f"min_lr={sch.min_lr!r} must be a finite number >= 0 (in YAML write 1.0e-5)")
            elif is_finite(sch.lr) and sch.min_lr > sch.lr:
                problems.append(f"min_lr={sch.min_lr:g} is above the peak lr={sch.lr:g}: the decay ends below "
                                "where it starts; lower --min-lr or raise --lr")
        elif sch.min_lr_ratio is None:
            self._normalize("min_lr_ratio", 0.1)
        elif not (is_finite(sch.min_lr_ratio) and 0 <= sch.min_lr_ratio <= 1):
            problems.append(f"min_lr_ratio={sch.min_lr_ratio!r} must be in [0, 1]")
        if not (is_finite(sch.decay_ratio) and 0 < sch.decay_ratio <= 1):
            problems.append(f"decay_ratio={sch.decay_ratio!r} must be a number in (0, 1], e.g. 0.1 (the last 10% of "
                            "the steps decay)")
        return problems

    def _stability_problems(self) -> list[str]:
        """Clipping, the fp16 loss scale and the limit on non-finite steps in a row."""
        store, stab = self.store, self.stability
        problems: list[str] = []
        if not (is_finite(stab.max_grad_norm) and stab.max_grad_norm >= 0):
            problems.append(f"max_grad_norm={stab.max_grad_norm!r} must be a finite number >= 0 (0: no clipping)")
        if stab.clip_mode not in CLIP_MODES:
            problems.append(f"clip_mode={stab.clip_mode!r}: choose one of auto, speculate, defer")
        elif stab.clip_mode == "speculate" and store.slots == 1 and stab.max_grad_norm:
            problems.append("clip_mode=speculate needs slots=2 (a wrong guess is undone from the previous slot, "
                            "which slots=1 overwrites); use clip_mode=defer or auto")
        if not (is_finite(stab.loss_scale) and stab.loss_scale > 0):
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

