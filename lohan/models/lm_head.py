"""The LM head and its loss as the engine runs them: vocabulary padded for tensor cores, loss in token chunks.

:func:`head_loss` equals ``lm_loss(F.linear(h, weight), targets)`` (``lohan.models.gpt.lm_loss``) and its
gradients, bit for bit in fp32 on the CPU (tests/unit/models/test_vocab_pad.py), while

- the GEMMs run on the vocabulary padded to ``plan.vocab.padded_vocab`` (issue 38: GPT-2's 50257 rows made
  cuBLAS take ``align1`` kernels): one GEMM on the weight's first rows, a multiple of 64 (a view), one on its
  last rows padded with zero rows to 64 (a copy of under 64 rows, not of the weight). The padding exists only
  inside this function: the stored weight, its gradient (exactly the real rows: no padded row's gradient
  reaches the optimizer), the loss and every export keep the real vocabulary, and stores made before still
  open. The padded logit columns are sliced off before the softmax, so they take no part in the loss.
- the fp32 logits are never whole: forward takes ``log_softmax`` chunk by chunk (``plan.vocab.loss_chunk_tokens``
  tokens) and keeps one fp32 log-probability per token; backward recomputes each chunk's logits and writes
  their gradient, in the compute dtype, into one buffer of every token's padded logits. A forward with grad of
  one chunk (its backward follows: the engines run the head with grad just before its backward) keeps that
  chunk's graph instead, so its logits are computed once; a weight that takes no gradient (LoRA's frozen head)
  costs no GEMM in backward.

Why the whole gradient buffer and not a running sum of the weight's gradient over chunks: the weight's
gradient is a sum over tokens, and summing it chunk by chunk changes its rounding (the tied embedding would
then differ from plain PyTorch's). Each chunk's rows are exact (a GEMM row and a softmax row do not depend on
the other rows), so one GEMM over the buffer gives the unchunked gradient's bits. In bf16 that buffer is 2
bytes per logit against the 14 the unchunked loss's backward holds; ``plan.vocab.head_loss_bytes`` prices it.

The hidden states' gradient sums over the vocabulary. On the CPU that GEMM takes the real vocabulary: a
padded reduction changes the BLAS's blocking of the sum (measured with MKL: the last bits differ), and a CPU
gains nothing from the alignment. On CUDA it takes the padded one, so that every GEMM of the head is aligned
(cuBLAS picks kernels by shape there anyway: no two shapes promise the same bits).

The loss is the mean over the counted tokens taken by ``F.nll_loss`` over the per-token log-probabilities,
the reduction ``F.cross_entropy`` ends with, on the same values in the same order: the same bits.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import NamedTuple

import torch
import torch.nn.functional as F
from torch import Tensor

from lohan.plan.vocab import VOCAB_MULTIPLE, loss_chunk_tokens, padded_vocab

__all__ = ["IGNORE", "head_loss"]

IGNORE = -100
"""Target of a position that is not predicted (``F.cross_entropy``'s default ``ignore_index``)."""

PostFn = Callable[[Tensor], Tensor]
"""Elementwise ops on the logits before the loss (Gemma's final soft-capping), in the compute dtype."""


class _Split(NamedTuple):
    """The weight as the head's GEMMs take it: its first rows, a multiple of 64 (a view, no copy), and the
    rest padded with zero rows to 64 (a copy of under 64 rows; None when there is no rest). A GEMM per part
    keeps every GEMM's rows aligned without copying the whole weight (1.2 GB at 175b)."""

    main: Tensor
    tail: Tensor | None


def _split(weight: Tensor) -> _Split:
    vocab = weight.shape[0]
    cut = vocab // VOCAB_MULTIPLE * VOCAB_MULTIPLE
    if cut == vocab:
        return _Split(weight, None)
    return _Split(weight[:cut], F.pad(weight[cut:], (0, 0, 0, padded_vocab(vocab) - vocab)))


def _padded_logits(h: Tensor, w: _Split) -> Tensor:
    """``h @ weight.T`` with the padded vocabulary's columns (zeros past the real ones)."""
    z = h.mm(w.main.t())
    return z if w.tail is None else torch.cat([z, h.mm(w.tail.t())], dim=1)


def head_loss(h: Tensor, weight: Tensor, targets: Tensor, post: PostFn | None = None,
              chunk_tokens: int | None = None) -> Tensor:
    """Mean cross-entropy of the logits ``post(h @ weight.T)`` against ``targets``, ignoring -100, in fp32.

    Args:
        h: The head's input (after its final norm), ``(..., d)``.
        weight: The LM head (or tied embedding) weight ``(vocab, d)``.
        targets: Next-token ids ``(...)``, -100 where not predicted.
        post: Elementwise ops on the logits (soft-capping), or None.
        chunk_tokens: Tokens per chunk of the softmax (default ``plan.vocab.loss_chunk_tokens``).

    Returns:
        The scalar loss, as ``lohan.models.gpt.lm_loss`` gives it for the unpadded logits: 0 (and no
        gradient) for a window without any target.
    """
    device = h.device.type
    if torch.is_autocast_enabled(device):  # F.linear's autocast: both operands in the autocast dtype
        dtype = torch.get_autocast_dtype(device)
    elif h.dtype != weight.dtype:
        raise RuntimeError(f"head_loss: h is {h.dtype} but the weight is {weight.dtype}; "
                           "they must match outside autocast (as F.linear requires)")
    else:
        dtype = h.dtype
    flat = targets.reshape(-1)
    chunk = chunk_tokens or loss_chunk_tokens(weight.shape[0])
    # a forward whose backward follows (with grad, and one chunk): its graph is kept rather than recomputed
    keep = torch.is_grad_enabled() and (h.requires_grad or weight.requires_grad) and flat.numel() <= chunk
    with torch.autocast(device, enabled=False):  # the dtypes are explicit from here
        picked = _ChunkedHead.apply(h.reshape(-1, h.shape[-1]), weight, flat, dtype, post, chunk, keep)
        # the reduction F.cross_entropy ends with, over the same values: one column, the target 0 or ignored
        loss = F.nll_loss(picked, torch.where(flat == IGNORE, IGNORE, 0), ignore_index=IGNORE)
    # a window of prompt tokens only: see lm_loss (selected on the device, no host synchronization)
    return torch.where((targets != IGNORE).any(), loss, torch.zeros((), dtype=loss.dtype, device=loss.device))


def _hidden_grad(dz: Tensor, w: _Split, wc: Tensor, padded: bool) -> Tensor:
    """The head input's gradient from the padded logits' ``dz``: a sum over the vocabulary, padded (aligned
    GEMMs, for CUDA) or real (the unpadded sum's bits, for the CPU; see the module's docstring)."""
    if padded and w.tail is not None:
        cut = w.main.shape[0]
        return torch.addmm(dz[:, cut:].mm(w.tail), dz[:, :cut], w.main)
    return dz[:, :wc.shape[0]].mm(wc)


def _chunk_log_probs(z: Tensor, vocab: int, post: PostFn | None) -> Tensor:
    """fp32 log-softmax of a chunk's logits ``z`` (padded columns sliced off), as ``lm_loss`` takes it."""
    z = z[:, :vocab]
    if post is not None:
        z = post(z)
    return F.log_softmax(z.float(), dim=1)


class _ChunkedHead(torch.autograd.Function):
    """``h2d``, ``weight`` -> each token's fp32 log-probability of its target ``(tokens, 1)`` (anything for an
    ignored token, whose gradient the loss makes zero), chunk by chunk over the padded vocabulary.

    ``keep`` (one chunk, and a backward to follow): the forward keeps its chunk's graph from the logits to the
    log-probabilities for backward, which then neither recomputes the logits' GEMM nor the log-softmax (a
    backward holds that chunk's logits and log-softmax anyway, so its peak is the same). Backward computes only
    the gradients asked for: a frozen weight (LoRA) costs no GEMM."""

    @staticmethod
    def forward(ctx, h2d: Tensor, weight: Tensor, targets: Tensor, dtype: torch.dtype, post: PostFn | None,
                chunk: int, keep: bool = False) -> Tensor:
        vocab = weight.shape[0]
        w, hc = _split(weight.to(dtype)), h2d.to(dtype)
        # an ignored target picks column 0; any other invalid id fails in gather, as nll_loss would
        index = torch.where(targets == IGNORE, 0, targets).unsqueeze(1)
        picked = h2d.new_empty((h2d.shape[0], 1), dtype=torch.float32)  # new_*: the simulated device's tensors too
        ctx.kept = None
        for lo in range(0, h2d.shape[0], chunk):
            z = _padded_logits(hc[lo:lo + chunk], w)
            with torch.enable_grad():  # (z a leaf: the graph is the log-softmax's, as backward's recomputation)
                logp = _chunk_log_probs(z.requires_grad_(keep), vocab, post).gather(1, index[lo:lo + chunk])
            picked[lo:lo + chunk] = logp.detach()
            if keep:
                ctx.kept = (z, logp)
            del z, logp
        ctx.save_for_backward(h2d, weight, index)
        ctx.dtype, ctx.post, ctx.chunk = dtype, post, chunk
        return picked

    @staticmethod
    def backward(ctx, grad: Tensor) -> tuple[Tensor | None, ...]:
        h2d, weight, index = ctx.saved_tensors
        vocab, dtype = weight.shape[0], ctx.dtype
        wc, hc = weight.to(dtype), h2d.to(dtype)
        w, tokens, cut = _split(wc), h2d.shape[0], weight.shape[0] // VOCAB_MULTIPLE * VOCAB_MULTIPLE
        # one chunk: its gradient is the buffer (no copy, so no more memory than the unchunked loss's backward)
        dz = hc.new_empty((tokens, padded_vocab(vocab))) if tokens > ctx.chunk else None
        for lo in range(0, tokens, ctx.chunk):
            hi = lo + ctx.chunk
            with torch.enable_grad():
                if ctx.kept is not None:  # forward's graph of its one chunk (`keep`), used once
                    (z, logp), ctx.kept = ctx.kept, None
                else:
                    z = _padded_logits(hc[lo:hi], w).requires_grad_()
                    logp = _chunk_log_probs(z, vocab, ctx.post).gather(1, index[lo:hi])
                # gather's backward scatters into zeros, as nll_loss's does: log_softmax's backward sees the
                # same dense gradient, and the padded columns get exact zeros from the slice's backward
                (dzc,) = torch.autograd.grad(logp, z, grad[lo:hi])
            del z, logp
            if dz is None:
                dz = dzc
            else:
                dz[lo:hi] = dzc
            del dzc
        need_h, need_w = ctx.needs_input_grad[:2]
        dw = dh = None
        if need_w:  # the GEMMs autograd runs for mm(h, w.t()) (mm_mat1_backward / mm_mat2_backward), per part
            dw = wc.new_empty(wc.shape)
            torch.mm(dz[:, :cut].t(), hc, out=dw[:cut])
            if w.tail is not None:
                dw[cut:] = dz[:, cut:].t().mm(hc)[:vocab - cut]
            dw = dw.to(weight.dtype)
        if need_h:
            dh = _hidden_grad(dz, w, wc, padded=dz.is_cuda).to(h2d.dtype)
        return dh, dw, None, None, None, None, None
