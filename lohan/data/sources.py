"""Data pipeline: local file -> tokens (+ loss mask) -> packed windows -> seeded, resumable batches.

Deliberately small: LoHan's subject is where model states live, not tokenization. The default pipeline
is a byte-level tokenizer over a local ``.txt`` file (``data/corpus.txt`` ships with the repository)
with fixed-length packing, like nanoGPT's ``shakespeare_char``. A Hugging Face tokenizer can be used
instead through :class:`HFTokenizer`, and a ``.jsonl`` file of ``{"text": ...}`` or
``{"prompt": ..., "response": ...}`` examples gives instruction tuning with the loss on the responses
only (see :meth:`TokenDataset.from_jsonl`); ``{"messages": [...]}`` conversations are rendered with the
model's chat template and trained on the assistant turns only (:meth:`HFTokenizer.encode_chats`).
Everything here is deterministic given a seed, and :class:`BatchIterator` can save and restore its
position so a resumed run sees exactly the batches an uninterrupted run would have seen.
:meth:`TokenDataset.split` holds out a seeded share of the windows for evaluation, and
:func:`eval_batches` walks a dataset once, in order.

Shapes: a *window* is ``seq_len + 1`` consecutive tokens; the model input is ``window[:-1]`` and the
target is ``window[1:]`` (next-token prediction). Batches are ``(idx, targets)``, both ``int64`` of shape
``[batch_size, seq_len]``, on the CPU; the engine moves them to the device. A target of
:data:`IGNORE_INDEX` (``-100``) is not a prediction target: ``F.cross_entropy(..., ignore_index=-100)``
skips it (prompt tokens of a prompt/response example).
"""

from __future__ import annotations

import json
from array import array
from collections.abc import Iterable, Iterator, Mapping, Sequence
from pathlib import Path
from typing import Any, Protocol, runtime_checkable

import torch

__all__ = [
    "Batch",
    "BatchIterator",
    "ByteTokenizer",
    "DEFAULT_CORPUS",
    "HFTokenizer",
    "IGNORE_INDEX",
    "CHAT_ROLES",
    "TokenDataset",
    "Tokenizer",
    "encode_examples",
    "eval_batches",
    "load_jsonl",
    "load_text",
    "pack_tokens",
    "split_micro_batches",
    "synthetic_batches",
]

Batch = tuple[torch.Tensor, torch.Tensor]
"""``(idx, targets)``: two ``int64`` tensors of shape ``[batch_size, seq_len]``."""

DEFAULT_CORPUS = Path(__file__).resolve().parents[2] / "data" / "corpus.txt"
"""The corpus shipped with the repository (prose from Python's stdlib docstrings, PSF License)."""

TEXT_SUFFIXES = (".txt", ".text", ".md")
"""Extensions :meth:`TokenDataset.from_file` reads as plain text (``.jsonl`` is read as examples)."""

IGNORE_INDEX = -100
"""Target value of a token that is not a prediction target (PyTorch's ``cross_entropy`` default)."""

CHAT_ROLES = ("system", "user", "assistant")
"""Roles a ``{"messages": [...]}`` example may use; the loss is on the ``assistant`` turns."""

_CONVERT_CHAT = "convert the data to {prompt, response} lines"


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


@runtime_checkable
class Tokenizer(Protocol):
    """What the data pipeline needs from a tokenizer (:class:`ByteTokenizer` and :class:`HFTokenizer`).

    ``encode`` must not add special tokens; the pipeline adds them itself: ``eos_id`` (if not None) is
    appended to every document / example, and an optional ``bos_id`` attribute (if present and not None)
    is prepended to it. ``decode`` is optional (used for samples).
    """

    @property
    def vocab_size(self) -> int:
        """Number of distinct token ids; every id is in ``[0, vocab_size)``."""
        ...

    @property
    def eos_id(self) -> int | None:
        """End-of-text id appended to each document / example, or None for no separator."""
        ...

    def encode(self, text: str) -> list[int]:
        """Token ids of ``text``, without special tokens."""
        ...


class ByteTokenizer:
    """Byte-level tokenizer: token ids are the UTF-8 bytes of the text (vocabulary of 256).

    No special tokens (``eos_id`` and ``bos_id`` are None): all 256 ids are bytes, so there is no spare
    id for an end-of-text marker. For a ``.txt`` corpus this loses nothing (paragraphs are already
    separated by blank lines); in a ``.jsonl`` file the examples are packed back to back, so end each
    response with a newline (or any delimiter) if the model should learn where an answer stops. Any model
    with ``vocab_size >= 256`` can be trained on these ids; with a larger vocabulary (e.g. the presets'
    50257) the unused embedding rows simply never receive a token.
    """

    eos_id: int | None = None
    """No end-of-text id (see the class docstring)."""
    bos_id: int | None = None
    """No beginning-of-text id."""

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

    def encode_chats(
        self, conversations: Sequence[Sequence[Mapping[str, str]]], names: Sequence[str] | None = None
    ) -> list[tuple[list[int], list[bool]]]:
        """Always raises: bytes have no chat template (see :meth:`HFTokenizer.encode_chats`)."""
        raise ValueError(
            "the byte-level tokenizer of the presets has no chat template, and chat data ({\"messages\": [...]} "
            "lines) is rendered with the model's: use a Hugging Face model directory whose tokenizer_config.json "
            f"has one (--model DIR), or {_CONVERT_CHAT}"
        )


class HFTokenizer:
    """A Hugging Face ``transformers`` tokenizer behind the :class:`Tokenizer` protocol.

    ``encode`` never adds special tokens itself (``add_special_tokens=False``); the data pipeline adds
    them per document / example: ``bos_id`` in front (if the tokenizer has a BOS token) and ``eos_id`` at
    the end (if it has an EOS token). The exception is a tokenizer whose BOS *is* its EOS (GPT-2's single
    ``<|endoftext|>``): then ``bos_id`` is None, so examples are separated by one ``<|endoftext|>``, not two.

    Args:
        tok: A loaded tokenizer object (e.g. ``AutoTokenizer.from_pretrained(path)`` or a
            ``PreTrainedTokenizerFast``); see :meth:`from_pretrained` to load one by name or path.

    Raises:
        TypeError: If ``tok`` is not a tokenizer object (e.g. a path string).
    """

    def __init__(self, tok: Any) -> None:
        if isinstance(tok, (str, Path)) or not callable(tok) or not hasattr(tok, "decode"):
            raise TypeError(
                f"HFTokenizer wraps a loaded transformers tokenizer object, got {type(tok).__name__} "
                f"{tok!r:.80}; use HFTokenizer.from_pretrained(name_or_path) to load one"
            )
        self.tok = tok
        """The wrapped ``transformers`` tokenizer."""

    @classmethod
    def from_pretrained(cls, name_or_path: str | Path, **kwargs: Any) -> HFTokenizer:
        """Load a tokenizer with ``transformers.AutoTokenizer.from_pretrained`` and wrap it.

        Args:
            name_or_path: A local directory with the tokenizer files (or a Hub name, which needs network
                access or a populated cache).
            **kwargs: Passed to ``AutoTokenizer.from_pretrained`` (e.g. ``local_files_only=True``).
        """
        from transformers import AutoTokenizer  # lazy: transformers is slow to import

        return cls(AutoTokenizer.from_pretrained(str(name_or_path), **kwargs))

    @property
    def vocab_size(self) -> int:
        """``len(tok)``: the base vocabulary plus added tokens (the model's embedding must cover it)."""
        return len(self.tok)

    @property
    def eos_id(self) -> int | None:
        """The tokenizer's ``eos_token_id`` (None if it has no EOS token)."""
        eos = self.tok.eos_token_id
        return None if eos is None else int(eos)

    @property
    def bos_id(self) -> int | None:
        """The tokenizer's ``bos_token_id``, prepended to each document; None if absent or equal to EOS."""
        bos = self.tok.bos_token_id
        return None if bos is None or bos == self.tok.eos_token_id else int(bos)

    def encode(self, text: str) -> list[int]:
        """Token ids of ``text`` without special tokens (and without the model-max-length warning)."""
        return list(self.tok(text, add_special_tokens=False, verbose=False)["input_ids"])

    def encode_batch(self, texts: Sequence[str]) -> list[list[int]]:
        """:meth:`encode` of each text, in one call (fast tokenizers encode a batch in parallel)."""
        if not texts:
            return []
        encoded = self.tok(list(texts), add_special_tokens=False, verbose=False)["input_ids"]
        return [list(ids) for ids in encoded]

    def decode(self, ids: Sequence[int] | torch.Tensor) -> str:
        """Text of a sequence of ids (special tokens are kept, e.g. ``</s>``)."""
        if isinstance(ids, torch.Tensor):
            ids = ids.tolist()
        return str(self.tok.decode(list(ids), skip_special_tokens=False))

    @property
    def source(self) -> str:
        """Where the tokenizer was loaded from (its ``name_or_path``), for messages."""
        return str(getattr(self.tok, "name_or_path", "") or "this tokenizer")

    def encode_chats(
        self, conversations: Sequence[Sequence[Mapping[str, str]]], names: Sequence[str] | None = None
    ) -> list[tuple[list[int], list[bool]]]:
        """Render conversations with the tokenizer's chat template; mark the assistant turns as targets.

        How the assistant spans are found: each conversation is rendered whole, and for its assistant
        message ``k`` twice more, ``messages[:k]`` with the generation prompt (the text up to where the
        assistant starts to write) and ``messages[:k+1]`` (the text through the end of its turn). The
        characters between the two lengths are the turn: its content and whatever the template closes the
        turn with (an end-of-turn token such as ``</s>``, ``<|eot_id|>`` or ``<|im_end|>``, and a newline
        in ChatML). Those closing tokens *are* targets: the model must learn to stop. Every prefix must be
        a prefix of the whole rendering, and the turn must contain the message's content; a template that
        rewrites earlier turns (e.g. drops the reasoning of past turns) is refused instead of guessed at.
        The spans are taken in characters, not by diffing token counts of the prefixes, because a
        tokenizer may merge characters across a turn boundary (BPE pre-tokenizers treat ``"\\n\\n"``
        before a word differently from ``"\\n\\n"`` at the end of a text); the whole conversation is
        tokenized once, so the ids are exactly what the model sees at inference, and a token is a target
        when its characters (``offset_mapping``) overlap a turn. ``return_assistant_tokens_mask`` was the
        alternative, but it only works with templates that mark turns with ``{% generation %}``, which
        almost no released template does.

        Special tokens come from the template (a BOS, if the template writes one); nothing is added.

        Args:
            conversations: Lists of ``{"role", "content"}`` messages, checked by :func:`load_jsonl`.
            names: One name per conversation for error messages (file and line); default its index.

        Returns:
            ``(ids, is_target)`` per conversation.

        Raises:
            ValueError: If the tokenizer has no chat template or is not a fast tokenizer (no character
                offsets), or the template fails on a conversation or does not render it prefix by prefix.
        """
        template = getattr(self.tok, "chat_template", None)
        if not template:
            raise ValueError(
                f"the tokenizer of {self.source} has no chat template, so {{\"messages\": [...]}} lines cannot be "
                "rendered: use a model directory whose tokenizer_config.json (or chat_template.jinja) has one, "
                f"or {_CONVERT_CHAT}"
            )
        if not getattr(self.tok, "is_fast", False):
            raise ValueError(
                f"the tokenizer of {self.source} is a slow (Python) tokenizer; chat data needs a fast one (a "
                f"tokenizer.json in the model directory) to map the assistant turns to tokens, or {_CONVERT_CHAT}"
            )
        texts, spans = [], []
        for n, messages in enumerate(conversations):
            text, turns = self._assistant_spans(list(messages), names[n] if names else f"conversation {n}")
            texts.append(text)
            spans.append(turns)
        if not texts:
            return []
        enc = self.tok(texts, add_special_tokens=False, return_offsets_mapping=True, verbose=False)
        out = []
        for ids, offsets, turns in zip(enc["input_ids"], enc["offset_mapping"], spans):
            is_target, k = [], 0
            for start, end in offsets:  # offsets ascend, and so do the turns: one merge-like walk
                end = max(end, start + 1)  # a token with no characters of its own counts at its position
                while k < len(turns) and turns[k][1] <= start:
                    k += 1
                is_target.append(k < len(turns) and turns[k][0] < end)
            out.append((list(ids), is_target))
        return out

    def _assistant_spans(self, messages: list[Mapping[str, str]], name: str) -> tuple[str, list[tuple[int, int]]]:
        """The rendered conversation and the character span of each assistant turn in it."""

        def render(msgs: list[Mapping[str, str]], generation_prompt: bool) -> str:
            try:
                return str(self.tok.apply_chat_template([dict(m) for m in msgs], tokenize=False,
                                                        add_generation_prompt=generation_prompt))
            except Exception as e:  # jinja2's TemplateError, or raise_exception() inside the template
                raise ValueError(f"{name}: the chat template of {self.source} failed on the first {len(msgs)} "
                                 f"message(s): {type(e).__name__}: {e}") from None

        full = render(messages, False)
        turns = []
        for k, msg in enumerate(messages):
            if msg["role"] != "assistant":
                continue
            head, turn = render(messages[:k], True), render(messages[: k + 1], False)
            if not (full.startswith(turn) and turn.startswith(head)):
                raise ValueError(
                    f"{name}: the chat template of {self.source} does not render this conversation prefix by "
                    f"prefix (the first {k + 1} messages are not the start of the whole conversation), so the "
                    f"assistant turns cannot be located; fix the template or {_CONVERT_CHAT}"
                )
            if msg["content"].strip() not in turn[len(head):]:
                raise ValueError(
                    f"{name}: the chat template of {self.source} does not write the content of message {k + 1} "
                    f"(assistant) where the assistant turn is expected; fix the template or {_CONVERT_CHAT}"
                )
            turns.append((len(head), len(turn)))
        return full, turns


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


def _show(value: object, limit: int) -> str:
    try:
        text = json.dumps(value, ensure_ascii=False)
    except (TypeError, ValueError):
        text = repr(value)
    return text if len(text) <= limit else text[: limit - 3] + "..."


def _chat_problem(messages: object) -> str | None:
    """What is wrong with the ``messages`` of a chat example, or None."""
    if not isinstance(messages, list) or not messages:
        return (f'the "messages" value must be a non-empty list of {{"role", "content"}} objects, got '
                f"{type(messages).__name__} {_show(messages, 40)}")
    for n, msg in enumerate(messages, start=1):
        if not isinstance(msg, Mapping):
            return f'message {n}: expected a {{"role", "content"}} object, got {type(msg).__name__} {_show(msg, 40)}'
        role = msg.get("role")
        if role not in CHAT_ROLES:
            return f'message {n}: the role {_show(role, 30)} is not one of "system", "user", "assistant"'
        content = msg.get("content")
        if not isinstance(content, str):
            return (f'message {n} ({role}): the "content" must be a string, got {type(content).__name__} '
                    f"{_show(content, 40)}")
        if not content.strip():
            return f"message {n} ({role}): the content is empty; fill it in or drop the message"
    roles = [m["role"] for m in messages]
    if "assistant" not in roles:
        return "has no assistant message: the loss is on the assistant turns, so there is nothing to train on"
    first = next((n for n, r in enumerate(roles, start=1) if r != "system"), None)
    if roles[first - 1] == "assistant":  # first is set: there is an assistant message
        return (f"message {first} is an assistant turn before any user message; start the conversation with a "
                "user message (after an optional system message)")
    return None


def _example_problem(obj: object) -> str | None:
    """What is wrong with one example, or None if it is a valid text, prompt/response or chat example."""
    if not isinstance(obj, Mapping):
        return f"expected a JSON object, got {type(obj).__name__} {_show(obj, 60)}"
    has_text, has_prompt, has_response = "text" in obj, "prompt" in obj, "response" in obj
    if "messages" in obj:
        if has_text or has_prompt or has_response:
            return 'has "messages" and "text"/"prompt"/"response" keys; use one form per example'
        return _chat_problem(obj["messages"])
    if has_text and (has_prompt or has_response):
        return 'has both "text" and "prompt"/"response" keys; use one form per example'
    if not (has_text or has_prompt or has_response):
        return (f'needs a "text" key or "prompt" and "response" keys (or a "messages" list); it has keys '
                f"{sorted(map(str, obj))}")
    if not has_text and not (has_prompt and has_response):
        have, missing = ("prompt", "response") if has_prompt else ("response", "prompt")
        return f'has a "{have}" key but no "{missing}" key'
    for key in ("text",) if has_text else ("prompt", "response"):
        if not isinstance(obj[key], str):
            value = obj[key]
            return f'the "{key}" value must be a string, got {type(value).__name__} {_show(value, 40)}'
    return None


def load_jsonl(path: str | Path) -> list[dict[str, Any]]:
    """Read and check a local ``.jsonl`` file of training examples.

    Each non-blank line is one JSON object: ``{"text": "..."}`` (plain text: every token is a target),
    ``{"prompt": "...", "response": "..."}`` (only the response tokens are targets) or
    ``{"messages": [{"role": "system"|"user"|"assistant", "content": "..."}, ...]}`` (a conversation,
    rendered with the model's chat template; only the assistant turns are targets). The forms may be
    mixed; other keys (ids, metadata, other message fields) are ignored; blank lines are skipped.

    Args:
        path: The ``.jsonl`` file (UTF-8; a leading byte-order mark is accepted).

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
    return [ex for _, ex in _read_jsonl(path)]


def _read_jsonl(path: str | Path) -> list[tuple[int, dict[str, Any]]]:
    """:func:`load_jsonl` with the 1-based line number of each example."""
    p = Path(path).expanduser()
    if not p.exists():
        raise FileNotFoundError(f"training data {str(p)!r} does not exist; pass an existing .jsonl file")
    if p.is_dir():
        raise IsADirectoryError(f"training data {str(p)!r} is a directory; pass one .jsonl file inside it")
    examples: list[tuple[int, dict[str, Any]]] = []
    for lineno, raw in enumerate(p.read_bytes().split(b"\n"), start=1):
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
        problem = _example_problem(obj)
        if problem is not None:
            raise ValueError(f"{where}: {problem}")
        if "messages" in obj:  # checked by _chat_problem, empty contents included
            messages = [{"role": m["role"], "content": m["content"]} for m in obj["messages"]]
            examples.append((lineno, {"messages": messages}))
            continue
        keys = ("text",) if "text" in obj else ("prompt", "response")
        # an empty target trains nothing (or, with an EOS, only to stop at once): in a file it is a mistake
        # made while preparing the data, so name the line instead of training around it
        target = keys[0] if keys == ("text",) else "response"
        if not obj[target].strip():
            raise ValueError(f'{where}: the "{target}" is empty; fill it in or drop the line')
        examples.append((lineno, {k: obj[k] for k in keys}))
    return examples


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

    With a ``loss_mask``, the targets are :data:`IGNORE_INDEX` (``-100``) where the target token is
    masked (``loss_mask[i, j + 1]`` is False for ``target[j]``). Packing may split an example across two
    windows (and a window may hold the end of one example and the start of the next); the mask travels
    with the tokens, so each token is a target or not wherever it lands.

    Args:
        windows: ``int64`` tensor ``[n_windows, seq_len + 1]``, as returned by :func:`pack_tokens`.
        loss_mask: Optional ``bool`` tensor of the same shape, True where the token is a prediction
            target; None means every token is one.
    """

    def __init__(self, windows: torch.Tensor, loss_mask: torch.Tensor | None = None) -> None:
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
        n, need = ids.numel(), seq_len + 1
        if n < need:
            if examples:
                what = f"{len(examples):,} example(s) tokenize to {n:,} tokens"
            else:
                what = "no examples (0 tokens; blank lines are skipped)"
            hint = f"use --seq-len {n - 1} or less or add examples" if n >= 2 else "add examples"
            raise ValueError(
                f"{source}: {what}, but seq_len={seq_len:,} needs at least {need:,} tokens for one window "
                f"(input plus the target shifted by one); {hint}"
            )
        windows = pack_tokens(ids, seq_len)
        masks = mask.unfold(0, need, seq_len).clone()
        if not masks[:, 1:].any():
            raise ValueError(
                f"{source}: no token of the {len(windows):,} windows is a prediction target (every response "
                f"is empty and the tokenizer has no EOS, or no assistant turn falls inside a window), so there "
                f"is no loss to train on"
            )
        return cls(windows, None if bool(masks.all()) else masks)

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
                f"training data {str(path)!r} has the extension {suffix or '(none)'!r}; lohan reads plain text "
                f"({', '.join(TEXT_SUFFIXES)}) and JSON lines (.jsonl: {{\"text\"}}, {{\"prompt\", \"response\"}} or "
                f"{{\"messages\"}} per line): convert or rename the file"
            )
        return cls.from_text(load_text(path), seq_len, tokenizer)

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

        def take(rows: torch.Tensor) -> TokenDataset:
            return TokenDataset(self.windows[rows], None if self.loss_mask is None else self.loss_mask[rows])

        return take(~held), take(held)


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
