"""An Engine for a local Hugging Face model directory: the HF counterpart of `lohan.init`.

`lohan.models.hf` describes the model (blocks, checkpoint names) and never imports the engine; this
module puts the two together.
"""

from __future__ import annotations

import os
from collections.abc import Callable

from lohan.config import EngineConfig
from lohan.models import hf, hf_checkpoint
from lohan.plan.run_plan import RunPlan
from lohan.runtime.engine import Engine
from lohan.runtime.lora_engine import LoraEngine

__all__ = ["init_from_hf"]


def init_from_hf(path: str | os.PathLike, config: EngineConfig | dict | None = None, *, resume: bool = False,
                 overwrite: bool = False, progress: Callable[[int, int], None] | None = None,
                 n_layer: int | None = None, plan: RunPlan | None = None) -> Engine | LoraEngine:
    """An Engine that fine-tunes the HF model in directory `path` (weights imported block by block).

    `config` is an EngineConfig or a dict of its fields. With `resume=True` an existing store of the
    same model continues where it stopped (the weights in `path` are not read then). `n_layer` trains
    the first N decoder layers only (a slice of the real width; their weights are imported). `plan`: the run
    plan a pre-flight made for it (`engine.plan_engine`), which the engine executes. With `lora_r` > 0 in
    `config`, a `LoraEngine`: the weights a frozen base, LoRA adapters trained (it plans itself: `plan.lora`).
    """
    cfg = config if isinstance(config, EngineConfig) else EngineConfig(**(config or {}))
    program = hf.load_hf_skeleton(path, n_layer)
    # looked up at call time, so a test can wrap the import hook
    init_block = hf_checkpoint.make_init_block(program, path)
    if cfg.lora.lora_r:  # --lora R: the weights are a frozen base and only adapters train (lohan.runtime.lora_engine)
        return LoraEngine(program, cfg, hf.model_meta(program), init_block, flops_per_token=program.flops_per_token,
                          resume=resume, overwrite=overwrite, progress=progress)
    return Engine(program, cfg, hf.model_meta(program), init_block, flops_per_token=program.flops_per_token,
                  resume=resume, overwrite=overwrite, progress=progress, plan=plan)
