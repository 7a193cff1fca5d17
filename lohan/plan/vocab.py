"""The LM head's shape on the device: the vocabulary padded for tensor cores, the loss taken in token chunks.

Torch-free arithmetic shared by the head's loss (``lohan.models.lm_head``) and the GPU memory plan
(``planner.gpu_need``), so the plan prices exactly the tensors the loss makes.

- A vocabulary that is not a multiple of 8 (GPT-2's 50257) makes the logits' rows misaligned for the GPU's
  vectorized loads, and cuBLAS falls back to ``align1`` GEMM kernels for all three of the head's GEMMs (15 of
  44 ms of a 125m step on an H100, issue 38). The head computes its logits over :func:`padded_vocab` columns (a multiple
  of :data:`VOCAB_MULTIPLE`; the weight's last rows padded with zero rows); the stored weight, its gradient,
  the loss and every export keep the real vocabulary.
- The fp32 logits of a whole micro-batch (tokens x vocab x 4 bytes, and three more such tensors in the loss's
  backward) are never materialized: :func:`loss_chunk_tokens` tokens at a time.
"""

from __future__ import annotations

VOCAB_MULTIPLE = 64
"""Rows the head's weight is padded to a multiple of. 8 bf16 elements (16 bytes) is what cuBLAS needs for
aligned kernels; 64 also fills whole tensor-core tiles (Karpathy's nanoGPT pads 50257 to 50304 for this)."""

LOSS_CHUNK_BYTES = 256 * 2**20
"""fp32 bytes of one chunk's logits in the head's loss. Several fp32 tensors of this size live at once in a
chunk's backward; at GPT-2's vocabulary it is 1280 tokens, enough rows to keep a GPU's GEMM efficient."""

_SCALARS = 256
"""Bytes of the loss's scalars (the loss, nll_loss's total weight, the empty-window selection), rounded up."""

_CHUNK_ALIGN = 64
"""A chunk's tokens are a multiple of this (row offsets stay aligned; the GEMMs see round sizes)."""


def padded_vocab(vocab: int, multiple: int = VOCAB_MULTIPLE) -> int:
    """``vocab`` rounded up to a multiple of ``multiple`` (itself when it already is one)."""
    if vocab < 1 or multiple < 1:
        raise ValueError(f"padded_vocab: vocab {vocab} and multiple {multiple} must be >= 1")
    return -(-vocab // multiple) * multiple


def loss_chunk_tokens(vocab: int, chunk_bytes: int = LOSS_CHUNK_BYTES) -> int:
    """Tokens per chunk of the head's loss: as many as keep one chunk's fp32 logits (padded vocabulary) within
    ``chunk_bytes``, rounded down to a multiple of 64, and at least 64."""
    per_token = 4 * padded_vocab(vocab)
    return max(_CHUNK_ALIGN, chunk_bytes // per_token // _CHUNK_ALIGN * _CHUNK_ALIGN)


def head_loss_bytes(vocab: int, tokens: int, s: int, d_model: int = 0, chunk_tokens: int | None = None) -> int:
    """Device bytes the head's loss holds at its peak for one micro-batch of ``tokens`` in compute itemsize
    ``s`` (``lohan.models.lm_head.head_loss``), beyond its inputs and the gradients it returns.

    Backward holds one chunk's temporaries: its padded logits recomputed, their fp32 upcast and log-softmax,
    the log-softmax's incoming and outgoing fp32 gradients and the gradient in ``s`` padded back, ``s + 12``
    bytes per padded logit at their peak (the unchunked loss held this for every token). With more than one
    chunk it also holds the gradient of every token's padded logits in ``s`` (one GEMM each then makes the
    hidden states' and the weight's gradient, so that they are the unchunked ones bit for bit); with one, that
    chunk's gradient is the buffer. With ``d_model``, a padded vocabulary adds the copy of the weight's last rows
    padded to 64 (the rest is used in place). Per token: its fp32 log-probability and gradient, its target's index and
    nll_loss's target (int64): 24 bytes; and a few scalars. ``chunk_tokens``: the loss's (default :func:`loss_chunk_tokens`).
    Traced on the CPU with a dispatch mode (tests/unit/plan/test_gpu_memory_plan.py).
    """
    vp = padded_vocab(vocab)
    chunk = chunk_tokens or loss_chunk_tokens(vocab)
    whole = tokens * vp * s if tokens > chunk else 0
    padding = VOCAB_MULTIPLE * d_model * s if vp != vocab else 0
    return whole + min(tokens, chunk) * vp * (s + 12) + padding + 24 * tokens + _SCALARS
