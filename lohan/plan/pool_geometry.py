"""What the host pools are sized from (`lohan.plan.pools`, which re-exports these): a model's records, its tied
weights and a data-parallel rank's shards (:class:`PoolGeometry`), and the gradients a CPU compute device holds
beside the pools (:func:`device_grad_bytes`). Pure and torch-free."""

from __future__ import annotations

from dataclasses import dataclass

from io_engine.align import ALIGN, align_up
from lohan.config import ModelConfig
from lohan.plan.records import StoreLayout, layout_of

__all__ = ["PoolGeometry", "model_geometry", "device_grad_bytes"]


@dataclass(frozen=True)
class PoolGeometry:
    """What the pools are sized from: the records, the tied weights and, data parallel, the rank's shards.

    Attributes:
        layout: the whole blocks (their element counts and P16 item size).
        local: the rank's store, its shards of each block (data parallel); None: `layout` (one process).
        p16_bytes: each block's P16 buffer as streamed (data parallel: gathered from every rank's shard);
            None: each block's P16 section.
        tied: the element count of each tied weight a block borrows, once per borrowing.
        owners: blocks a tied weight is borrowed from (their P16 stays all step).
        align: the padding of each section and buffer: ALIGN in the engine, 1 to price a model unpadded.
        largest: the element count of the model's largest parameter; None: the layout's (its parameters).
    """

    layout: StoreLayout
    local: StoreLayout | None = None
    p16_bytes: tuple[int, ...] | None = None
    tied: tuple[int, ...] = ()
    owners: int = 0
    align: int = ALIGN
    largest: int | None = None

    @property
    def store(self) -> StoreLayout:
        """The layout this process's records have (its shards, or the whole blocks)."""
        return self.local if self.local is not None else self.layout

    @property
    def p16(self) -> tuple[int, ...]:
        if self.p16_bytes is not None:
            return self.p16_bytes
        return tuple(align_up(b.p16_itemsize * b.numel, self.align) for b in self.layout.blocks)

    @property
    def largest_param(self) -> int:
        if self.largest is not None:
            return self.largest
        return max(p.numel for b in self.layout.blocks for p in b.params)


def model_geometry(cfg: ModelConfig, compute_dtype: str = "bf16", slots: int = 2, align: int = 1,
                   state_format: str = "exact") -> PoolGeometry:
    """The geometry of the in-house GPT's blocks (`models.adapter.GPTBlocks`): the embedding, `n_layer`
    transformer blocks and the head, whose tied LM weight is the embedding's `wte` (borrowed, not stored twice).
    `align=1` (default): the capacity planner's unpadded figures; `align=ALIGN`: the engine's, exactly."""
    numels = [cfg.embed_param_count(), *[cfg.block_param_count()] * cfg.n_layer, cfg.head_param_count()]
    names = ["embed", *(f"block{i}" for i in range(cfg.n_layer)), "head"]
    tied = (cfg.vocab_size * cfg.d_model,) if cfg.tie_embeddings else ()
    d = cfg.d_model  # the largest parameter: wte (or an untied lm_head), wpe, qkv or an MLP weight
    largest = max(cfg.vocab_size * d, cfg.seq_len * d, 3 * d * d, cfg.mlp_hidden * d) if cfg.n_layer else \
        max(cfg.vocab_size * d, cfg.seq_len * d)
    return PoolGeometry(layout_of(numels, compute_dtype, slots, names, state_format), tied=tied, owners=len(tied),
                        align=align, largest=largest)


def device_grad_bytes(geometry: PoolGeometry, micro_batches: int = 1, grad_size: int | None = None) -> int:
    """Bytes of gradients a CPU compute device holds beside the host pools at backward's peak: autograd's
    gradients of a block (in the parameters' dtype; summed into the host buffer at once, no copy in flight), or,
    after them, the fp32 upcast of its largest parameter the gradient norms take from a bf16 buffer
    (`runtime.passes._param_norms`), whichever is larger; plus the tied weights' borrowed gradients, autograd's,
    per micro-batch, held from their borrower's backward to their owner's. ``grad_size``: the host gradient
    buffers' itemsize (None: the P16's, as with one micro-batch and one rank in bf16)."""
    s = geometry.layout.blocks[0].p16_itemsize
    g = s if grad_size is None else grad_size
    autograd = max(s * b.numel for b in geometry.layout.blocks)
    upcast = 4 * geometry.largest_param if g < 4 else 0
    return max(autograd, upcast) + micro_batches * s * sum(geometry.tied)
