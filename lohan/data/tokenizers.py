"""Tokenizers: the :class:`Tokenizer` protocol the data pipeline needs, the byte-level :class:`ByteTokenizer` of
the presets, and :class:`HFTokenizer` around a Hugging Face tokenizer (with chat-template rendering)."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any, Protocol, runtime_checkable

import torch

__all__ = ["ByteTokenizer", "HFTokenizer", "Tokenizer"]

_CONVERT_CHAT = "convert the data to {prompt, response} lines"


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
