"""Model definitions: the in-house GPT decoder used by the named presets."""

from lohan.models.gpt import (
    GPT,
    Block,
    CausalSelfAttentionCore,
    Embed,
    Head,
    block_generator,
    block_seed,
    build_model,
    init_block_,
    lm_loss,
)

__all__ = [
    "GPT",
    "Block",
    "CausalSelfAttentionCore",
    "Embed",
    "Head",
    "block_generator",
    "block_seed",
    "build_model",
    "init_block_",
    "lm_loss",
]
