"""The packed dataset: :class:`TokenDataset`, windows of tokens with an optional loss mask, built from text,
examples or a file, and split into a training part and a held-out part."""

from __future__ import annotations

import os
from collections.abc import Iterable, Mapping, Sequence
from pathlib import Path
from typing import Any

import torch

from .records import source_kind
from .sources import (
    DEFAULT_CORPUS,
    IGNORE_INDEX,
    TEXT_SUFFIXES,
    _check_positive,
    _read_jsonl,
    encode_examples,
    load_text,
    pack_tokens,
)
from .token_cache import load_stream
from .tokenizers import ByteTokenizer, Tokenizer

__all__ = ["Batch", "TokenDataset"]

Batch = tuple[torch.Tensor, torch.Tensor]
"""``(idx, targets)``: two ``int64`` tensors of shape ``[batch_size, seq_len]``."""


def _epoch_seed(seed: int, epoch: int) -> int:
    # Mix instead of `seed + epoch`, so (seed 0, epoch 1) and (seed 1, epoch 0) get different orders.
    return (seed * 0x9E3779B97F4A7C15 + epoch * 0xBF58476D1CE4E5B9 + 1) % (2**63)


def _check_ids(id_range: tuple[int, int] | None, vocab_size: int | None, source: str) -> None:
    """ValueError unless every token id of `id_range` (smallest, largest) is an id of a `vocab_size` vocabulary."""
    if vocab_size is None or id_range is None:
        return
    lo, hi = id_range
    if lo < 0 or hi >= vocab_size:
        bad = lo if lo < 0 else hi
        raise ValueError(f"{source}: the tokenizer made token id {bad:,}, outside the model's vocabulary of "
                         f"{vocab_size:,} (ids 0 to {vocab_size - 1:,}); train with the model's own tokenizer, or a "
                         "model whose vocabulary covers this one's")


class TokenDataset:
    """A tokenized text packed into windows; ``dataset[i]`` is the ``(input, target)`` pair of window ``i``.

    With a ``loss_mask``, the targets are :data:`IGNORE_INDEX` (``-100``) where the target token is
    masked (``loss_mask[i, j + 1]`` is False for ``target[j]``). Packing may split an example across two
    windows (and a window may hold the end of one example and the start of the next); the mask travels
    with the tokens, so each token is a target or not wherever it lands.

    Args:
        windows: ``int64`` tensor ``[n_windows, seq_len + 1]``, as returned by :func:`pack_tokens`.
        loss_mask: Optional ``bool`` tensor of the same shape, True where the token is a prediction
            target; None means every token is one.
    """

    def __init__(self, windows: torch.Tensor, loss_mask: torch.Tensor | None = None, *,
                 description: str | None = None) -> None:
        if windows.dim() != 2 or windows.shape[1] < 2 or windows.dtype != torch.long:
            raise ValueError(
                f"windows must be an int64 tensor [n_windows, seq_len + 1] with seq_len >= 1, got "
                f"{windows.dtype} {list(windows.shape)}; build it with pack_tokens(ids, seq_len)"
            )
        if loss_mask is not None and (loss_mask.dtype != torch.bool or loss_mask.shape != windows.shape):
            raise ValueError(
                f"loss_mask must be a bool tensor shaped like windows {list(windows.shape)}, got "
                f"{loss_mask.dtype} {list(loss_mask.shape)}"
            )
        self.windows = windows
        """The packed windows, ``[n_windows, seq_len + 1]``."""
        self.loss_mask = loss_mask
        """``bool`` ``[n_windows, seq_len + 1]``, True where the token is a target; None: all are."""
        self.description = description
        """What the windows were made from (source, format, counts, token cache), for the run's header; or None."""

    @classmethod
    def from_text(cls, text: str, seq_len: int, tokenizer: Tokenizer | None = None) -> TokenDataset:
        """Tokenize ``text`` (byte-level by default) as one document and pack it into windows.

        The document is ``[bos] + encode(text) + [eos]`` (BOS/EOS only where the tokenizer has them, so
        byte-level ids are exactly the UTF-8 bytes); every token is a target.
        """
        tokenizer = tokenizer or ByteTokenizer()
        ids, _ = encode_examples([{"text": text}], tokenizer)
        return cls(pack_tokens(ids, seq_len))

    @classmethod
    def from_examples(
        cls,
        examples: Iterable[Mapping[str, Any]],
        seq_len: int,
        tokenizer: Tokenizer | None = None,
        source: str = "the dataset",
        names: Sequence[str] | None = None,
    ) -> TokenDataset:
        """Tokenize text, prompt/response and chat examples with :func:`encode_examples` and pack them.

        The examples are concatenated in order and packed like :func:`pack_tokens` (windows of
        ``seq_len + 1`` with stride ``seq_len``; the ragged tail is dropped) with the loss mask alongside.
        ``loss_mask`` is None when nothing is masked (only ``text`` examples).

        Args:
            examples: Dicts with a ``text``, ``prompt`` and ``response``, or ``messages`` keys.
            seq_len: Model input length.
            tokenizer: Default :class:`ByteTokenizer`.
            source: Name of the data in error messages (the file name for :meth:`from_jsonl`).
            names: Name of each example in error messages (:meth:`from_jsonl`: file and line).

        Raises:
            ValueError: If an example is malformed, the examples are too short for one window (the
                message gives the token count and the tokens a window needs), or no token is a target.
        """
        _check_positive(seq_len=seq_len)
        examples = list(examples)
        ids, mask = encode_examples(examples, tokenizer, names)
        return cls._packed(ids, mask, seq_len, source, len(examples), copy=True)

    @classmethod
    def _packed(cls, ids: torch.Tensor, mask: torch.Tensor, seq_len: int, source: str, n_examples: int,
                copy: bool, description: str | None = None) -> TokenDataset:
        """Windows of a token stream and its mask (like :func:`pack_tokens`), checked: long enough for one window,
        something to train on. With ``copy=False`` the windows are views of the stream (overlapping rows of stride
        ``seq_len``), so a memory-mapped stream stays on disk until batches read it."""
        n, need = ids.numel(), seq_len + 1
        if n < need:
            if n_examples:
                what = f"{n_examples:,} example(s) tokenize to {n:,} tokens"
            else:
                what = "no examples (0 tokens; blank lines are skipped)"
            hint = f"use --seq-len {n - 1} or less or add examples" if n >= 2 else "add examples"
            raise ValueError(
                f"{source}: {what}, but seq_len={seq_len:,} needs at least {need:,} tokens for one window "
                f"(input plus the target shifted by one); {hint}"
            )
        windows, masks = ids.unfold(0, need, seq_len), mask.unfold(0, need, seq_len)
        if copy:  # windows that own contiguous memory, as pack_tokens makes them
            windows, masks = windows.clone(), masks.clone()
        if not masks[:, 1:].any():
            raise ValueError(
                f"{source}: no token of the {len(windows):,} windows is a prediction target (every response "
                f"is empty and the tokenizer has no EOS, or no assistant turn falls inside a window), so there "
                f"is no loss to train on"
            )
        return cls(windows, None if bool(masks.all()) else masks, description=description)

    @classmethod
    def from_jsonl(cls, path: str | Path, seq_len: int, tokenizer: Tokenizer | None = None) -> TokenDataset:
        """:func:`load_jsonl` then :meth:`from_examples` (loss on ``text``, ``response`` and assistant tokens
        only); a conversation the tokenizer cannot render is named by its line."""
        source = repr(str(Path(path).expanduser()))
        rows = _read_jsonl(path)
        return cls.from_examples([ex for _, ex in rows], seq_len, tokenizer, source=source,
                                 names=[f"{source} line {lineno}" for lineno, _ in rows])

    @classmethod
    def from_file(
        cls, path: str | Path = DEFAULT_CORPUS, seq_len: int = 1024, tokenizer: Tokenizer | None = None
    ) -> TokenDataset:
        """Load a local file, dispatched on its extension; the default path is the shipped corpus.

        ``.jsonl`` (any case): :meth:`from_jsonl`. :data:`TEXT_SUFFIXES`: :func:`load_text` then
        :meth:`from_text`. Any other extension is refused (ValueError), so a ``.json`` or ``.csv`` file is
        not trained on as if it were prose.
        """
        suffix = Path(path).suffix.lower()
        if suffix == ".jsonl":
            return cls.from_jsonl(path, seq_len, tokenizer)
        if suffix not in TEXT_SUFFIXES and Path(path).expanduser().is_file():  # load_text names the other cases
            # a .json, .csv or .parquet read as plain text would "train" on its syntax; say what is read instead
            raise ValueError(
                f"training data {str(path)!r} has the extension {suffix or '(none)'!r}; from_file reads plain text "
                f"({', '.join(TEXT_SUFFIXES)}) and JSON lines (.jsonl: {{\"text\"}}, {{\"prompt\", \"response\"}} or "
                f"{{\"messages\"}} per line) in memory: read it with TokenDataset.from_source (JSON, Parquet, Arrow, "
                "CSV, save_to_disk folders), or convert or rename the file"
            )
        return cls.from_text(load_text(path), seq_len, tokenizer)

    @classmethod
    def from_source(
        cls,
        path: str | os.PathLike,
        seq_len: int,
        tokenizer: Tokenizer | None = None,
        *,
        data_format: str = "auto",
        text_field: str | None = None,
        split: str | None = None,
        cache_root: str | os.PathLike | None = None,
        write_cache: bool = True,
        vocab_size: int | None = None,
    ) -> TokenDataset:
        """Load any source lohan trains on (what ``--data`` takes), with its :attr:`description` set.

        Plain text (:data:`TEXT_SUFFIXES`) is read in memory like :meth:`from_file`. Every other source (``.jsonl``,
        ``.json``, ``.parquet``, ``.arrow``, ``.csv``, a save_to_disk folder: :mod:`~lohan.data.records`) goes through
        the token cache (:mod:`~lohan.data.token_cache`): tokenized once with ``datasets.map``, then memory-mapped,
        and the windows are views of the mapped stream. Its windows and mask are exactly those :meth:`from_examples`
        makes of the same records.

        Args:
            path: The file or folder.
            seq_len: Model input length.
            tokenizer: Default :class:`ByteTokenizer`.
            data_format: One of :data:`~lohan.data.formats.DATA_FORMATS` (``auto``: by the records' keys).
            text_field: The text column, if not ``"text"``.
            split: The split of a ``DatasetDict`` folder (default ``train``).
            cache_root: The token cache's folder (default: :func:`~lohan.data.token_cache.default_cache_root`).
            write_cache: False for a dry run: nothing that lasts is written (a cached stream is still used).
            vocab_size: The model's vocabulary: every token id must be below it (checked here, from the range the
                token cache recorded, so an id out of range is refused before anything is trained, never met by
                the embedding as an IndexError).

        Raises:
            FileNotFoundError, IsADirectoryError: If nothing, or a folder that is no saved dataset, is at ``path``.
            ValueError: If the source cannot be read, a record is malformed (named by its line or number), the flags
                do not fit the source, the data is too short for one window or has no target, or a token id is not
                below `vocab_size`.
        """
        _check_positive(seq_len=seq_len)
        source = repr(str(Path(path).expanduser()))
        if source_kind(path) == "text":
            given = [f"--{k.replace('_', '-')} {v}" for k, v in (("data_format", data_format),
                                                                  ("text_field", text_field), ("split", split))
                     if v not in (None, "auto", "text")]
            if given:
                raise ValueError(f"{str(path)!r} is plain text, trained on as one document: {', '.join(given)} "
                                 "applies to files of records (.jsonl, .json, .parquet, .arrow, .csv) and saved "
                                 "datasets; drop it")
            ds = cls.from_text(load_text(path), seq_len, tokenizer)
            ds.description = f"{path}: plain text, {len(ds):,} windows of {seq_len + 1:,} tokens (read in memory)"
            _check_ids((int(ds.windows.min()), int(ds.windows.max())), vocab_size, source)
            return ds
        stream = load_stream(path, tokenizer, data_format=data_format, text_field=text_field, split=split,
                             cache_root=cache_root, write=write_cache)
        _check_ids(stream.id_range, vocab_size, source)
        return cls._packed(stream.ids, stream.mask, seq_len, source, stream.n_examples, copy=False,
                           description=stream.description)

    @property
    def seq_len(self) -> int:
        """Model input length (window length minus one)."""
        return self.windows.shape[1] - 1

    @property
    def n_targets(self) -> int:
        """Number of target positions that count in the loss, over all windows."""
        if self.loss_mask is None:
            return self.windows.shape[0] * self.seq_len
        return int(self.loss_mask[:, 1:].sum())

    def __len__(self) -> int:
        return self.windows.shape[0]

    def __getitem__(self, i: int) -> Batch:
        w = self.windows[i]
        if self.loss_mask is None:
            return w[:-1], w[1:]
        return w[:-1], w[1:].masked_fill(~self.loss_mask[i, 1:], IGNORE_INDEX)

    def split(self, fraction: float, seed: int = 0) -> tuple[TokenDataset, TokenDataset]:
        """Hold out a seeded share of the windows for evaluation: ``(train, held_out)``.

        Whole packed windows are held out (``round(fraction * len(self))``, at least one), chosen by a
        permutation seeded from ``seed`` alone, so the same data, ``seq_len`` and seed always hold out the
        same windows (a resumed run trains on the same rest). Both parts keep the windows' original order.
        A held-out window shares its first input token with the end of the window before it (packing
        stride ``seq_len``), and an example cut by a window boundary may lie on both sides.

        Raises:
            ValueError: If ``fraction`` is not in ``(0, 1)`` or nothing would be left to train on.
        """
        n = len(self)
        if isinstance(fraction, bool) or not isinstance(fraction, (int, float)) or not 0 < fraction < 1:
            raise ValueError(f"fraction={fraction!r} must be a number in (0, 1)")
        k = max(1, round(fraction * n))
        if k >= n:
            raise ValueError(f"the data packs into {n:,} windows of {self.seq_len:,} tokens: holding out {k:,} for "
                             "evaluation leaves none to train on; use more data, a shorter --seq-len or a smaller "
                             "--eval-fraction")
        # -1: a stream no epoch order (epochs >= 0) draws from
        g = torch.Generator().manual_seed(_epoch_seed(seed, -1))
        held = torch.zeros(n, dtype=torch.bool)
        held[torch.randperm(n, generator=g)[:k]] = True

        def take(rows: torch.Tensor, description: str | None) -> TokenDataset:
            return TokenDataset(self.windows[rows], None if self.loss_mask is None else self.loss_mask[rows],
                                description=description)

        return take(~held, self.description), take(held, None)
