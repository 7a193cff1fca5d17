"""Data pipeline: text file -> byte tokens -> packed windows -> seeded, resumable batches.

Deliberately small: LoHan's subject is where model states live, not tokenization, so the default
pipeline is a byte-level tokenizer over a local ``.txt`` file (``data/corpus.txt`` ships with the
repository) with fixed-length packing, like nanoGPT's ``shakespeare_char``. Everything here is
deterministic given a seed, and :class:`BatchIterator` can save and restore its position so a resumed
run sees exactly the batches an uninterrupted run would have seen.

Shapes: a *window* is ``seq_len + 1`` consecutive tokens; the model input is ``window[:-1]`` and the
target is ``window[1:]`` (next-token prediction). Batches are ``(idx, targets)``, both ``int64`` of shape
``[batch_size, seq_len]``, on the CPU; the engine moves them to the device.
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from pathlib import Path
from typing import Any

import torch

__all__ = [
    "Batch",
    "BatchIterator",
    "ByteTokenizer",
    "DEFAULT_CORPUS",
    "TokenDataset",
    "load_text",
    "pack_tokens",
    "split_micro_batches",
    "synthetic_batches",
]

Batch = tuple[torch.Tensor, torch.Tensor]
"""``(idx, targets)``: two ``int64`` tensors of shape ``[batch_size, seq_len]``."""

DEFAULT_CORPUS = Path(__file__).resolve().parent.parent / "data" / "corpus.txt"
"""The corpus shipped with the repository (prose from Python's stdlib docstrings, PSF License)."""


def _is_int(value: object) -> bool:
    # bool is a subclass of int; `batch_size=True` is a bug, not a batch of one.
    return isinstance(value, int) and not isinstance(value, bool)


def _check_positive(**values: object) -> None:
    problems = [
        f"{name}={value!r} must be a positive integer"
        for name, value in values.items()
        if not (_is_int(value) and value > 0)  # type: ignore[operator]
    ]
    if problems:
        raise ValueError("; ".join(problems))


# ------------------------------------------------------------------------------------------ tokenizer


class ByteTokenizer:
    """Byte-level tokenizer: token ids are the UTF-8 bytes of the text (vocabulary of 256).

    No special tokens: the training stream is one packed document stream, and paragraphs in the
    corpus are already separated by blank lines, so an end-of-text id would add nothing. Any model with
    ``vocab_size >= 256`` can be trained on these ids; with a larger vocabulary (e.g. the presets'
    50257) the unused embedding rows simply never receive a token.
    """

    @property
    def vocab_size(self) -> int:
        """Number of distinct token ids, 256."""
        return 256

    def encode(self, text: str) -> list[int]:
        """Token ids of ``text``: its UTF-8 encoding, one id in ``[0, 255]`` per byte.

        Args:
            text: Any string; non-ASCII characters become 2 to 4 ids.

        Returns:
            The list of byte values.
        """
        return list(text.encode("utf-8"))

    def decode(self, ids: Sequence[int] | torch.Tensor) -> str:
        """Text of a sequence of ids.

        Args:
            ids: Byte values in ``[0, 255]`` (a list or a 1-D tensor). A sequence cut in the middle of a
                multi-byte character (as model samples can be) decodes with U+FFFD replacement characters
                instead of raising.

        Returns:
            The decoded string.

        Raises:
            ValueError: If an id is outside ``[0, 255]``.
        """
        if isinstance(ids, torch.Tensor):
            ids = ids.tolist()
        try:
            data = bytes(ids)
        except ValueError:
            bad = next(i for i in ids if not 0 <= i < 256)
            raise ValueError(
                f"token id {bad} is not a byte; ByteTokenizer ids are in [0, 255] (a model with a larger "
                f"vocab_size produced an id the tokenizer never emits)"
            ) from None
        return data.decode("utf-8", errors="replace")


# -------------------------------------------------------------------------------------------- text


def load_text(path: str | Path) -> str:
    """Read a local UTF-8 text file for training.

    Args:
        path: A ``.txt`` file (any extension is accepted; the content must be UTF-8 text).

    Returns:
        The whole file as a string.

    Raises:
        FileNotFoundError: If ``path`` does not exist.
        IsADirectoryError: If ``path`` is a directory.
        ValueError: If the file is empty or not valid UTF-8.
    """
    p = Path(path).expanduser()
    if not p.exists():
        raise FileNotFoundError(
            f"training text {str(p)!r} does not exist; pass an existing .txt file, or omit the data path "
            f"to use the shipped corpus ({DEFAULT_CORPUS.name} in the repository's data/ directory)"
        )
    if p.is_dir():
        raise IsADirectoryError(f"training text {str(p)!r} is a directory; pass one .txt file inside it")
    data = p.read_bytes()
    if not data.strip():
        raise ValueError(
            f"training text {str(p)!r} is empty ({len(data)} bytes); it needs some text to train on"
        )
    try:
        return data.decode("utf-8")
    except UnicodeDecodeError as e:
        raise ValueError(
            f"training text {str(p)!r} is not valid UTF-8 (byte {e.start}: {data[e.start : e.start + 1]!r}); "
            f"convert it first, e.g. `iconv -f latin1 -t utf-8 in.txt > out.txt`"
        ) from None


# ----------------------------------------------------------------------------------------- packing


def pack_tokens(ids: Sequence[int] | torch.Tensor, seq_len: int) -> torch.Tensor:
    """Cut a token stream into training windows of ``seq_len + 1`` tokens.

    Consecutive windows overlap by one token (stride ``seq_len``), so every token after the first is a
    prediction target exactly once; the ragged tail that does not fill a window is dropped.

    Args:
        ids: The token stream (list or 1-D tensor).
        seq_len: Model input length; each window holds ``seq_len + 1`` tokens.

    Returns:
        An ``int64`` tensor ``[n_windows, seq_len + 1]`` with ``n_windows = (len(ids) - 1) // seq_len``;
        window ``i`` is ``ids[i * seq_len : i * seq_len + seq_len + 1]``.

    Raises:
        ValueError: If ``seq_len`` is not positive or the stream is shorter than one window.
    """
    _check_positive(seq_len=seq_len)
    stream = torch.as_tensor(ids, dtype=torch.long).reshape(-1)
    n = stream.numel()
    if n < seq_len + 1:
        hint = f"or use --seq-len {n - 1} or less" if n >= 2 else "there is nothing to train on"
        raise ValueError(
            f"the text is {n:,} tokens long but seq_len={seq_len:,} needs at least {seq_len + 1:,} tokens "
            f"for one window (input plus the target shifted by one); use a longer text {hint}"
        )
    # unfold is a strided view; clone so the windows own contiguous memory (pinning, indexing).
    return stream.unfold(0, seq_len + 1, seq_len).clone()


class TokenDataset:
    """A tokenized text packed into windows; ``dataset[i]`` is the ``(input, target)`` pair of window ``i``.

    Args:
        windows: ``int64`` tensor ``[n_windows, seq_len + 1]``, as returned by :func:`pack_tokens`.
    """

    def __init__(self, windows: torch.Tensor) -> None:
        if windows.dim() != 2 or windows.shape[1] < 2 or windows.dtype != torch.long:
            raise ValueError(
                f"windows must be an int64 tensor [n_windows, seq_len + 1] with seq_len >= 1, got "
                f"{windows.dtype} {list(windows.shape)}; build it with pack_tokens(ids, seq_len)"
            )
        self.windows = windows
        """The packed windows, ``[n_windows, seq_len + 1]``."""

    @classmethod
    def from_text(cls, text: str, seq_len: int, tokenizer: ByteTokenizer | None = None) -> TokenDataset:
        """Tokenize ``text`` (byte-level by default) and pack it into windows of ``seq_len + 1``."""
        tokenizer = tokenizer or ByteTokenizer()
        return cls(pack_tokens(tokenizer.encode(text), seq_len))

    @classmethod
    def from_file(
        cls, path: str | Path = DEFAULT_CORPUS, seq_len: int = 1024, tokenizer: ByteTokenizer | None = None
    ) -> TokenDataset:
        """:func:`load_text` then :meth:`from_text`; the default path is the shipped corpus."""
        return cls.from_text(load_text(path), seq_len, tokenizer)

    @property
    def seq_len(self) -> int:
        """Model input length (window length minus one)."""
        return self.windows.shape[1] - 1

    def __len__(self) -> int:
        return self.windows.shape[0]

    def __getitem__(self, i: int) -> Batch:
        w = self.windows[i]
        return w[:-1], w[1:]


# ----------------------------------------------------------------------------------------- batches


def _epoch_seed(seed: int, epoch: int) -> int:
    # Mix instead of `seed + epoch`, so (seed 0, epoch 1) and (seed 1, epoch 0) get different orders.
    return (seed * 0x9E3779B97F4A7C15 + epoch * 0xBF58476D1CE4E5B9 + 1) % (2**63)


class BatchIterator:
    """Seeded, resumable iterator over batches of packed windows.

    Each epoch visits ``batches_per_epoch = n_windows // batch_size`` batches (the remainder windows of
    an epoch are skipped so every batch has the same shape; with shuffling a different remainder is
    skipped each epoch). With ``shuffle=True`` the order of epoch ``e`` is a permutation drawn from a
    ``torch.Generator`` seeded from ``(seed, e)``: every epoch differs, and every run with the same seed
    sees the same batches. Iteration is infinite unless ``epochs`` is given.

    ``epoch`` and ``position`` name the *next* batch to be yielded; :meth:`state_dict` saves them and
    :meth:`load_state_dict` restores them, so a fresh iterator resumes exactly where a saved one was.

    Args:
        windows: ``[n_windows, seq_len + 1]`` tensor from :func:`pack_tokens`, or a :class:`TokenDataset`.
        batch_size: Windows per batch.
        seed: Seed of the shuffling.
        shuffle: Shuffle windows each epoch; if False, batches follow the text order.
        epochs: Stop after this many epochs; None iterates forever.

    Yields:
        ``(idx, targets)``: ``int64`` tensors ``[batch_size, seq_len]``, ``targets`` shifted by one.
    """

    def __init__(
        self,
        windows: torch.Tensor | TokenDataset,
        batch_size: int,
        seed: int = 0,
        shuffle: bool = True,
        epochs: int | None = None,
    ) -> None:
        if isinstance(windows, TokenDataset):
            windows = windows.windows
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
        if self.epochs is not None and self.epoch >= self.epochs:
            raise StopIteration
        start = self.position * self.batch_size
        rows = self._epoch_order(self.epoch)[start : start + self.batch_size]
        w = self.windows.index_select(0, rows)
        self.position += 1
        if self.position == self.batches_per_epoch:
            self.epoch, self.position = self.epoch + 1, 0
        return w[:, :-1].contiguous(), w[:, 1:].contiguous()

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


def split_micro_batches(idx: torch.Tensor, targets: torch.Tensor, n: int) -> list[Batch]:
    """Split a batch along dim 0 into ``n`` equal micro-batches (gradient accumulation).

    Args:
        idx: Inputs ``[batch_size, seq_len]``.
        targets: Targets, same shape as ``idx``.
        n: Number of micro-batches; must divide ``batch_size``.

    Returns:
        ``n`` pairs ``(idx_i, targets_i)`` of shape ``[batch_size // n, seq_len]`` (views, no copy).

    Raises:
        ValueError: If the shapes differ or ``n`` does not divide ``batch_size``; the message lists
            the valid values.
    """
    if idx.shape != targets.shape:
        raise ValueError(f"idx {list(idx.shape)} and targets {list(targets.shape)} must have the same shape")
    if idx.dim() < 1:
        raise ValueError("idx must have a batch dimension")
    batch_size = idx.shape[0]
    if not _is_int(n) or n <= 0 or batch_size % n != 0:
        divisors = [d for d in range(1, batch_size + 1) if batch_size % d == 0]
        valid_n = _is_int(n) and n > 0
        detail = f"does not divide batch_size={batch_size}" if valid_n else "is not a positive integer"
        multiples = ""
        if valid_n:
            lo, hi = (batch_size // n) * n, (batch_size // n + 1) * n
            example = f"{lo} or {hi}" if lo > 0 else f"{hi}"
            multiples = f", or change batch_size to a multiple of {n} (e.g. {example})"
        raise ValueError(
            f"micro_batches={n!r} {detail}; every micro-batch must have the same size: pick micro_batches "
            f"from {divisors}{multiples}"
        )
    return list(zip(idx.chunk(n, dim=0), targets.chunk(n, dim=0)))
