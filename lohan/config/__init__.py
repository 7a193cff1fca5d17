"""Typed configuration dataclasses and the named model presets.

This package deliberately does not import torch: configs are parsed, validated, printed and planned
(``--dry-run``, the capacity planner) on machines where importing torch is slow or pointless.

The presets are one table ``name -> dims`` (:data:`PRESETS`). Paper sizes come from the LoHan paper,
Table IV (seq 1024, vocab 50257); the small ones are for CPU boxes and tests. Tests shrink a real
architecture instead of inventing one: ``get_model_config("13b", n_layer=2, d_model=64, n_head=4)``.

`EngineConfig` is made of typed sections (`ENGINE_SECTIONS`: store, memory, execution, schedule, stability, lora,
activations); a choice is a ``Literal`` type, written once, whose values the tuples of `choices` (`MODES`...) are. A
field declared with `setting` also has a command-line flag, which `lohan.app.cli` builds from the field.

The settings live in modules of one idea each: `units` (sizes, store names), `model` (`ModelConfig`,
:data:`PRESETS`), `choices` (the ``Literal`` choices, `setting`), `sections` (`EngineConfig`'s sections),
`engine_config` (`EngineConfig`, the flat aliases) and `run_config` (`RunConfig`). This package re-exports the names
used outside it, the sections and `setting` (``from lohan.config import X`` is the way to import those); the rest
are imported from their module.
"""

from __future__ import annotations

from lohan.config.choices import (
    ACT_COMPRESSIONS,
    ACT_POLICIES,
    BACKENDS,
    CLIP_MODES,
    COMPUTE_DTYPES,
    DEVICES,
    FINETUNE_LR,
    FINETUNE_WARMUP,
    LORA_LR,
    MODES,
    NO_DECAY_KINDS,
    SCHEDULERS,
    STATE_FORMATS,
    Flag,
    setting,
)
from lohan.config.engine_config import _DERIVED as _DERIVED  # (scripts/config_reads.py)
from lohan.config.engine_config import (
    ENGINE_SECTIONS,
    FLAT_KEYS,
    SCHEDULE_FIELDS,
    EngineConfig,
    flat_engine_settings,
)
from lohan.config.model import (
    MAX_LAYERS,
    MAX_PARAMS,
    PRESETS,
    ModelConfig,
    get_model_config,
)
from lohan.config.run_config import (
    DATA_FORMATS,
    MAX_STEPS,
    TRACKERS,
    RunConfig,
    is_model_dir,
    parse_report_to,
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
from lohan.config.units import (
    SIZE_FIELDS,
    parse_bytes,
    steps_share,
    store_name_problem,
    unitless_size_problems,
)

__all__ = [
    "store_name_problem",
    "parse_bytes",
    "SIZE_FIELDS",
    "unitless_size_problems",
    "steps_share",
    "MAX_LAYERS",
    "MAX_PARAMS",
    "ModelConfig",
    "PRESETS",
    "get_model_config",
    "MODES",
    "COMPUTE_DTYPES",
    "STATE_FORMATS",
    "SCHEDULERS",
    "CLIP_MODES",
    "BACKENDS",
    "NO_DECAY_KINDS",
    "DEVICES",
    "ACT_COMPRESSIONS",
    "ACT_POLICIES",
    "Flag",
    "setting",
    "FINETUNE_LR",
    "LORA_LR",
    "FINETUNE_WARMUP",
    "StoreConfig",
    "MemoryConfig",
    "ExecutionConfig",
    "ScheduleConfig",
    "StabilityConfig",
    "LoraConfig",
    "ActivationConfig",
    "ENGINE_SECTIONS",
    "FLAT_KEYS",
    "SCHEDULE_FIELDS",
    "flat_engine_settings",
    "EngineConfig",
    "DATA_FORMATS",
    "MAX_STEPS",
    "TRACKERS",
    "parse_report_to",
    "RunConfig",
    "is_model_dir",
]
