"""Training data from local files to tokens: read ``.txt`` and ``.jsonl`` files, check every example (text,
prompt/response, chat), encode the examples into one token stream with its loss mask, and pack a stream into
windows of ``seq_len + 1`` tokens."""

from __future__ import annotations

import json
from array import array
from collections.abc import Iterable, Iterator, Mapping, Sequence
from pathlib import Path
from typing import Any

import torch

from .formats import CHAT_ROLES, _example_problem, _show, to_example
from .tokenizers import _CONVERT_CHAT, ByteTokenizer, Tokenizer

__all__ = [
    "CHAT_ROLES",
    "DEFAULT_CORPUS",
    "IGNORE_INDEX",
    "TEXT_SUFFIXES",
    "encode_examples",
    "load_jsonl",
    "load_text",
    "pack_tokens",
]

DEFAULT_CORPUS = Path(__file__).resolve().parents[2] / "data" / "corpus.txt"
"""The corpus shipped with the repository (prose from Python's stdlib docstrings, PSF License)."""

TEXT_SUFFIXES = (".txt", ".text", ".md")
"""Extensions :meth:`TokenDataset.from_file` reads as plain text (``.jsonl`` is read as examples)."""

IGNORE_INDEX = -100
"""Target value of a token that is not a prediction target (PyTorch's ``cross_entropy`` default)."""

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
        text = data.decode("utf-8")
    except UnicodeDecodeError as e:
        raise ValueError(
            f"training text {str(p)!r} is not valid UTF-8 (byte {e.start}: {data[e.start : e.start + 1]!r}); "
            f"convert it first, e.g. `iconv -f latin1 -t utf-8 in.txt > out.txt`"
        ) from None
    # NUL is valid UTF-8 but never occurs in text: a file full of zeros (or a binary that happens to decode)
    # would otherwise train silently on garbage
    nul = data.find(b"\x00")
    if nul >= 0:
        raise ValueError(
            f"training text {str(p)!r} contains NUL bytes (the first at byte {nul:,}): it is a binary file, not "
            f"text; pass a UTF-8 .txt file"
        )
    return text


def load_jsonl(path: str | Path, data_format: str = "auto", text_field: str | None = None) -> list[dict[str, Any]]:
    """Read and check a local ``.jsonl`` file of training examples.

    Each non-blank line is one JSON object: ``{"text": "..."}`` (plain text: every token is a target),
    ``{"prompt": "...", "response": "..."}`` (only the response tokens are targets) or
    ``{"messages": [{"role": "system"|"user"|"assistant", "content": "..."}, ...]}`` (a conversation,
    rendered with the model's chat template; only the assistant turns are targets); Alpaca and ShareGPT
    records are read as prompt/response and chat examples (:mod:`~lohan.data.formats`). The forms may be
    mixed; other keys (ids, metadata, other message fields) are ignored; blank lines are skipped.

    Args:
        path: The ``.jsonl`` file (UTF-8; a leading byte-order mark is accepted).
        data_format: How to read each line (:data:`~lohan.data.formats.DATA_FORMATS`); ``auto``: by its keys.
        text_field: The key of the text, for ``text`` lines whose text is not under ``"text"``.

    Returns:
        The examples in file order, each reduced to its ``text``, ``prompt``/``response`` or ``messages``
        (of ``role``/``content``) keys.

    Raises:
        FileNotFoundError: If ``path`` does not exist.
        IsADirectoryError: If ``path`` is a directory.
        ValueError: On the first bad line (not UTF-8, invalid JSON, not an object, missing or conflicting
            keys, a non-string or empty value; for a conversation: no messages, an unknown role, an empty
            content, no assistant turn), naming the file, the 1-based line number and the problem.
    """
    return [ex for _, ex in iter_jsonl(path, data_format, text_field)]


def iter_jsonl(path: str | Path, data_format: str = "auto",
               text_field: str | None = None) -> Iterator[tuple[int, dict[str, Any]]]:
    """:func:`load_jsonl` one line at a time, with the 1-based line number of each example: a file larger than
    memory streams through (the token cache reads ``.jsonl`` files with it)."""
    p = Path(path).expanduser()
    if not p.exists():
        raise FileNotFoundError(f"training data {str(p)!r} does not exist; pass an existing .jsonl file")
    if p.is_dir():
        raise IsADirectoryError(f"training data {str(p)!r} is a directory; pass one .jsonl file inside it")
    with p.open("rb") as f:
        for lineno, raw in enumerate(f, start=1):
            raw = raw.rstrip(b"\n")  # lines end at b"\n" only, as bytes.split(b"\n") numbered them
            if lineno == 1 and raw.startswith(b"\xef\xbb\xbf"):
                raw = raw[3:]
            where = f"{str(p)!r} line {lineno}"
            try:
                line = raw.decode("utf-8")
            except UnicodeDecodeError as e:
                raise ValueError(f"{where}: not valid UTF-8 (byte {e.start} of the line)") from None
            if not line.strip():
                continue
            try:
                obj = json.loads(line)
            except json.JSONDecodeError as e:
                raise ValueError(
                    f"{where}: invalid JSON ({e.msg} at column {e.colno}): {_show(line.strip(), 80)}"
                ) from None
            try:
                yield lineno, to_example(obj, data_format, text_field, unit="line")
            except ValueError as e:
                raise ValueError(f"{where}: {e}") from None


def _read_jsonl(path: str | Path) -> list[tuple[int, dict[str, Any]]]:
    """:func:`load_jsonl` with the 1-based line number of each example."""
    return list(iter_jsonl(path))


def _encode_all(tokenizer: Tokenizer, texts: list[str]) -> list[list[int]]:
    encode_batch = getattr(tokenizer, "encode_batch", None)
    if encode_batch is not None:
        return [list(ids) for ids in encode_batch(texts)]
    return [tokenizer.encode(t) for t in texts]


def encode_examples(
    examples: Iterable[Mapping[str, Any]], tokenizer: Tokenizer | None = None, names: Sequence[str] | None = None
) -> tuple[torch.Tensor, torch.Tensor]:
    """Tokenize examples into one token stream with a parallel loss mask.

    Example layout (``bos``/``eos`` only where the tokenizer has them, see :class:`Tokenizer`)::

        {"text": t}                   -> [bos] + encode(t) + [eos]                mask: all True
        {"prompt": p, "response": r}  -> [bos] + encode(p) + encode(r) + [eos]    mask: False on bos and
                                                                                  prompt, True on the rest
        {"messages": m}               -> the chat template's rendering of m       mask: True on the
                                                                                  assistant turns only

    The prompt and the response are encoded separately, so the mask boundary is exact (no token straddles
    it); put any separator (e.g. a trailing space or newline) in the prompt or the response. The EOS is a
    target, so the model learns to stop after a response. Conversations get no BOS/EOS from here: their
    chat template writes its own special tokens (see :meth:`HFTokenizer.encode_chats`; the
    :class:`ByteTokenizer` refuses them).

    Args:
        examples: Dicts as returned by :func:`load_jsonl` (extra keys are ignored).
        tokenizer: Default :class:`ByteTokenizer`.
        names: Name of each example in error messages (file and line); default ``example <index>``.

    Returns:
        ``(ids, mask)``: ``int64`` and ``bool`` tensors of the same length (the examples concatenated);
        ``mask[j]`` is True if token ``j`` is a prediction target.

    Raises:
        ValueError: If an example is malformed (naming it), or the tokenizer cannot render a conversation.
    """
    tokenizer = tokenizer or ByteTokenizer()
    examples = list(examples)
    names = list(names) if names is not None else [f"example {i}" for i in range(len(examples))]
    for name, ex in zip(names, examples):
        problem = _example_problem(ex)
        if problem is not None:
            raise ValueError(f"{name}: {problem}")
    chat_rows = [i for i, ex in enumerate(examples) if "messages" in ex]
    chats: dict[int, tuple[list[int], list[bool]]] = {}
    if chat_rows:
        encode_chats = getattr(tokenizer, "encode_chats", None)
        if encode_chats is None:
            raise ValueError(f"{names[chat_rows[0]]}: the tokenizer {type(tokenizer).__name__} cannot render chat "
                             f"messages (it has no encode_chats); use an HFTokenizer with a chat template, or "
                             f"{_CONVERT_CHAT}")
        rendered = encode_chats([examples[i]["messages"] for i in chat_rows], [names[i] for i in chat_rows])
        chats = dict(zip(chat_rows, rendered))
    plain = [ex for ex in examples if "messages" not in ex]
    bos, eos = getattr(tokenizer, "bos_id", None), tokenizer.eos_id
    # One batched encode call per field: the prompt texts ("" for text examples) and the target texts.
    prompts = iter(_encode_all(tokenizer, [ex.get("prompt", "") for ex in plain]))
    targets = iter(_encode_all(tokenizer, [ex["text"] if "text" in ex else ex["response"] for ex in plain]))
    ids, mask = array("q"), bytearray()
    for i, ex in enumerate(examples):
        if i in chats:
            chat_ids, is_target = chats[i]
            ids.extend(chat_ids)
            mask.extend(bytes(is_target))
            continue
        p_ids, t_ids = next(prompts), next(targets)
        if "text" in ex:
            head = [bos] if bos is not None else []
            head_mask = 1  # plain text: every token (also the BOS after the previous EOS) is a target
        else:
            head = ([bos] if bos is not None else []) + p_ids
            head_mask = 0
        tail = t_ids + ([eos] if eos is not None else [])
        ids.extend(head)
        ids.extend(tail)
        mask.extend(bytes([head_mask]) * len(head))
        mask.extend(b"\x01" * len(tail))
    if not ids:
        return torch.zeros(0, dtype=torch.long), torch.zeros(0, dtype=torch.bool)
    # frombuffer views the compact arrays (8 bytes and 1 byte per token); clone so the tensors own them.
    return torch.frombuffer(ids, dtype=torch.long).clone(), torch.frombuffer(mask, dtype=torch.bool).clone()


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
