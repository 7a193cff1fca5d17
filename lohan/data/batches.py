"""Batches for training and evaluation: the seeded, resumable :class:`BatchIterator`, one ordered pass for
evaluation (:func:`eval_batches`), and random tokens for runs without data (:func:`synthetic_batches`)."""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import torch

from .dataset import Batch, TokenDataset, _epoch_seed
from .sources import IGNORE_INDEX, _check_positive, _is_int

__all__ = ["BatchIterator", "eval_batches", "synthetic_batches"]


class BatchIterator:
    """Seeded, resumable iterator over batches of packed windows.

    Each epoch visits ``batches_per_epoch = n_windows // batch_size`` batches (the remainder windows of
    an epoch are skipped so every batch has the same shape; with shuffling a different remainder is
    skipped each epoch). With ``shuffle=True`` the order of epoch ``e`` is a permutation drawn from a
    ``torch.Generator`` seeded from ``(seed, e)``: every epoch differs, and every run with the same seed
    sees the same batches. Iteration is infinite unless ``epochs`` is given; ``N`` epochs are
    ``N * batches_per_epoch`` batches (optimizer steps), and step ``k`` is batch
    ``divmod(k, batches_per_epoch)`` as ``(epoch, position)``.

    Over a :class:`TokenDataset` with a ``loss_mask``, masked targets are :data:`IGNORE_INDEX` (``-100``);
    the order of windows, and so resuming, does not depend on the mask. A batch in which every target is
    masked (chat windows that hold no assistant token) would train nothing: it is skipped, and counted in
    ``untrained_skipped``; the next batch is yielded in its place, so step ``k`` is then a later batch, and
    ``N`` epochs yield fewer than ``N * batches_per_epoch`` batches (a run that counts its steps as that reaches
    as far into the next pass).

    ``epoch`` and ``position`` name the *next* batch to be yielded; :meth:`state_dict` saves them and
    :meth:`load_state_dict` restores them, so a fresh iterator resumes exactly where a saved one was.

    Args:
        windows: ``[n_windows, seq_len + 1]`` tensor from :func:`pack_tokens`, or a :class:`TokenDataset`
            (whose ``loss_mask`` is applied to the targets).
        batch_size: Windows per batch.
        seed: Seed of the shuffling.
        shuffle: Shuffle windows each epoch; if False, batches follow the text order.
        epochs: Stop after this many epochs; None iterates forever.

    Yields:
        ``(idx, targets)``: ``int64`` tensors ``[batch_size, seq_len]``, ``targets`` shifted by one (and
        ``-100`` where masked).
    """

    def __init__(
        self,
        windows: torch.Tensor | TokenDataset,
        batch_size: int,
        seed: int = 0,
        shuffle: bool = True,
        epochs: int | None = None,
    ) -> None:
        loss_mask = None
        if isinstance(windows, TokenDataset):
            windows, loss_mask = windows.windows, windows.loss_mask
        _check_positive(batch_size=batch_size)
        if epochs is not None:
            _check_positive(epochs=epochs)
        if not _is_int(seed) or seed < 0:
            raise ValueError(f"seed={seed!r} must be a non-negative integer")
        n = windows.shape[0]
        if n < batch_size:
            raise ValueError(
                f"the text packs into {n:,} windows of seq_len+1={windows.shape[1]:,} tokens, fewer than "
                f"batch_size={batch_size:,}; use --batch-size {max(n, 1)} or less, a shorter seq_len, or a "
                f"longer text"
            )
        self.windows = windows
        self.loss_mask = loss_mask
        """``bool`` mask shaped like ``windows`` (True: a target), or None when nothing is masked."""
        self.batch_size = batch_size
        self.seed = seed
        self.shuffle = shuffle
        self.epochs = epochs
        self.epoch = 0
        """Epoch of the next batch (0-based)."""
        self.position = 0
        """Index of the next batch within its epoch, in ``[0, batches_per_epoch)``."""
        self._order: torch.Tensor | None = None
        self._order_epoch = -1
        self.untrained_skipped = 0
        """Batches skipped so far because none of their targets counts (all masked)."""

    @property
    def seq_len(self) -> int:
        """Model input length of the batches."""
        return self.windows.shape[1] - 1

    @property
    def batches_per_epoch(self) -> int:
        """Batches in one epoch, ``n_windows // batch_size``."""
        return self.windows.shape[0] // self.batch_size

    def _epoch_order(self, epoch: int) -> torch.Tensor:
        if self._order_epoch != epoch:
            n = self.windows.shape[0]
            if self.shuffle:
                g = torch.Generator().manual_seed(_epoch_seed(self.seed, epoch))
                self._order = torch.randperm(n, generator=g)
            else:
                self._order = torch.arange(n)
            self._order_epoch = epoch
        assert self._order is not None, "epoch order must be built before use"
        return self._order

    def __iter__(self) -> BatchIterator:
        return self

    def __next__(self) -> Batch:
        for _ in range(self.batches_per_epoch):
            idx, targets = self._next_batch()
            if self.loss_mask is None or bool((targets != IGNORE_INDEX).any()):
                return idx, targets
            self.untrained_skipped += 1
        raise ValueError(f"{self.batches_per_epoch} batches in a row have no target that counts (every token is "
                         "masked: prompt or non-assistant text only); check the data's prompt/response or chat "
                         "fields, or use longer windows (--seq-len) so that responses fall inside them")

    def _next_batch(self) -> Batch:
        if self.epochs is not None and self.epoch >= self.epochs:
            raise StopIteration
        start = self.position * self.batch_size
        rows = self._epoch_order(self.epoch)[start : start + self.batch_size]
        w = self.windows.index_select(0, rows)
        idx, targets = _shifted(w)
        if self.loss_mask is not None:
            keep = self.loss_mask.index_select(0, rows)[:, 1:]
            targets.masked_fill_(~keep, IGNORE_INDEX)
        self.position += 1
        if self.position == self.batches_per_epoch:
            self.epoch, self.position = self.epoch + 1, 0
        return idx, targets

    def state_dict(self) -> dict[str, Any]:
        """Position and identity of the stream, JSON-serializable (for checkpoints)."""
        return {
            "epoch": self.epoch,
            "position": self.position,
            "seed": self.seed,
            "shuffle": self.shuffle,
            "batch_size": self.batch_size,
            "n_windows": self.windows.shape[0],
            "seq_len": self.seq_len,
        }

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Resume at a saved position.

        Args:
            state: A :meth:`state_dict` of an iterator over the same data with the same settings.

        Raises:
            ValueError: If the saved stream differs from this one (listing every mismatch), since the
                saved position would then point at different batches.
        """
        problems = [
            f"{key}: checkpoint has {state.get(key)!r}, this run has {mine!r}"
            for key, mine in (
                ("seed", self.seed),
                ("shuffle", self.shuffle),
                ("batch_size", self.batch_size),
                ("n_windows", self.windows.shape[0]),
                ("seq_len", self.seq_len),
            )
            if state.get(key) != mine
        ]
        epoch, position = state.get("epoch"), state.get("position")
        if not _is_int(epoch) or epoch < 0:
            problems.append(f"epoch={epoch!r} must be a non-negative integer")
        if not _is_int(position) or not 0 <= position < self.batches_per_epoch:
            problems.append(f"position={position!r} must be an integer in [0, {self.batches_per_epoch})")
        if problems:
            raise ValueError(
                "cannot resume the data stream; the checkpoint was made with different data or settings "
                "(use the same text, seq_len, batch size and seed, or start a new run):\n  - "
                + "\n  - ".join(problems)
            )
        self.epoch, self.position = epoch, position


def _shifted(windows: torch.Tensor) -> Batch:
    """(inputs, targets) of windows [rows, seq_len + 1], each in memory of its own. Not ``.contiguous()``: a
    one-row slice already is contiguous, so inputs and targets would stay views of the same window, and
    masking the targets in place would write -100 into the inputs (and, for a slice of a dataset, into it)."""
    return windows[:, :-1].clone(), windows[:, 1:].clone()


def eval_batches(dataset: TokenDataset, batch_size: int, multiple: int = 1) -> Iterator[Batch]:
    """Every window of ``dataset`` once, in order, in batches of ``batch_size`` (for evaluation).

    The last batch holds the remainder, cut down to a multiple of ``multiple`` (the engine's micro-batch
    count, which must divide every batch); the fewer than ``multiple`` windows cut off are not evaluated.

    Yields:
        ``(idx, targets)`` like :class:`BatchIterator` (``-100`` where masked).
    """
    _check_positive(batch_size=batch_size, multiple=multiple)
    n = len(dataset)
    for start in range(0, n, batch_size):
        rows = min(batch_size, n - start) // multiple * multiple
        if rows == 0:
            return
        idx, targets = _shifted(dataset.windows[start : start + rows])
        if dataset.loss_mask is not None:
            targets.masked_fill_(~dataset.loss_mask[start : start + rows, 1:], IGNORE_INDEX)
        yield idx, targets


def synthetic_batches(
    vocab_size: int, batch_size: int, seq_len: int, seed: int = 0, start: int = 0
) -> Iterator[Batch]:
    """Infinite stream of uniformly random token batches, for presets and benchmarks without data.

    Batch ``k`` depends only on ``(seed, k)``, so the stream is reproducible and a resumed run continues
    it exactly with ``start=k``, without generating the skipped batches.

    Args:
        vocab_size: Token ids are drawn from ``[0, vocab_size)``.
        batch_size: Rows per batch.
        seq_len: Tokens per row.
        seed: Seed of the stream.
        start: Index of the first batch to yield.

    Yields:
        ``(idx, targets)``: ``int64`` tensors ``[batch_size, seq_len]``, ``targets`` shifted by one (as
        for real data, so the loss path is the same).
    """
    _check_positive(vocab_size=vocab_size, batch_size=batch_size, seq_len=seq_len)
    if not _is_int(start) or start < 0:
        raise ValueError(f"start={start!r} must be a non-negative integer")
    k = start
    while True:
        g = torch.Generator().manual_seed(_epoch_seed(seed, k))
        w = torch.randint(0, vocab_size, (batch_size, seq_len + 1), generator=g)
        yield w[:, :-1].contiguous(), w[:, 1:].contiguous()
        k += 1
