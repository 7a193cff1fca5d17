"""Model definitions: the in-house GPT decoder used by the named presets, the Hugging Face decoders as block
programs, and the exporters of both."""

from lohan.models.gpt import (
    GPT,
    Block,
    block_generator,
    block_seed,
    build_model,
    init_block_,
)

EXPORT_MARKER = "lohan_export.json"
"""A file every export directory lohan writes holds (and its ``.partial`` sibling from its first moment)."""

__all__ = [
    "EXPORT_MARKER",
    "GPT",
    "Block",
    "block_generator",
    "block_seed",
    "build_model",
    "init_block_",
]
