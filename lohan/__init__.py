"""lohan: fine-tune LLMs far larger than GPU and main memory, with model states on NVMe SSDs.

    import lohan
    engine = lohan.init("tiny", {"nvme": ["/mnt/nvme0", "/mnt/nvme1"], "cpu_mem": "8GiB"})
    for batch in batches:
        loss = engine.step(batch)

`lohan.config` imports no torch; the engine is imported on first use.
"""

from __future__ import annotations

from typing import Any


def init(*args: Any, **kwargs: Any):
    """Build a training Engine; see `lohan.runtime.engine.init`."""
    from lohan.runtime.engine import init as _init

    return _init(*args, **kwargs)


def init_from_hf(*args: Any, **kwargs: Any):
    """Build a training Engine for a local Hugging Face model directory; see `lohan.runtime.hf_engine.init_from_hf`."""
    from lohan.runtime.hf_engine import init_from_hf as _init_from_hf

    return _init_from_hf(*args, **kwargs)


__all__ = ["init", "init_from_hf"]
