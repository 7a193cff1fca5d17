"""The choices of the settings, each written once as a ``Literal`` type (the tuples are its values), and the
field maker of a setting with a command-line flag (:func:`setting`)."""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Any, Literal, get_args

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
