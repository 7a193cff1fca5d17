"""Record formats: what one training record looks like, and how each maps onto the three examples lohan trains.

lohan's own examples (what :func:`~lohan.data.sources.encode_examples` tokenizes) are ``{"text"}`` (every token a
target), ``{"prompt", "response"}`` (the loss on the response) and ``{"messages": [{"role", "content"}]}`` (a
conversation rendered with the model's chat template, the loss on the assistant turns). The formats fine-tuning
data usually comes in map onto them (:data:`DATA_FORMATS`, ``--data-format``):

- ``text``: a text column (``"text"``, or the one named by ``--text-field``) -> ``{"text"}``;
- ``prompt-response``: ``"prompt"`` and ``"response"`` -> ``{"prompt", "response"}``;
- ``messages``: ``"messages"`` of ``{"role", "content"}`` (roles system/user/assistant) -> ``{"messages"}``;
- ``alpaca``: ``"instruction"``, an optional ``"input"`` and ``"output"`` -> ``{"prompt", "response"}``: the
  prompt is the instruction (and input) in Stanford Alpaca's template (:data:`ALPACA_PROMPT`), the response
  the output, so the loss is on the output only;
- ``sharegpt``: ``"conversations"`` of ``{"from", "value"}`` turns -> ``{"messages"}``, ``from`` mapped by
  :data:`SHAREGPT_ROLES` (human -> user, gpt -> assistant, system -> system);
- ``auto`` (the default): each record's keys decide, in this order: ``messages``, ``conversations``,
  ``instruction`` + ``output``, then ``text`` or ``prompt`` + ``response`` (one of the two: a record with both is
  refused); with ``--text-field`` every record is text.

Other keys of a record are ignored. Every check names what is wrong; the caller adds where (file and line, or
record number). Torch-free.
"""

from __future__ import annotations

import json
from collections.abc import Iterable, Mapping
from typing import Any

from lohan.config import DATA_FORMATS

__all__ = [
    "ALPACA_PROMPT",
    "ALPACA_PROMPT_NO_INPUT",
    "CHAT_ROLES",
    "DATA_FORMATS",
    "SHAREGPT_ROLES",
    "check_columns",
    "to_example",
]

CHAT_ROLES = ("system", "user", "assistant")

# Stanford Alpaca's PROMPT_DICT (tatsu-lab/stanford_alpaca, train.py), verbatim: the template the Alpaca data was
# written for, and what most Alpaca fine-tunes (and the tools that read Alpaca data) render it with.
ALPACA_PROMPT = (
    "Below is an instruction that describes a task, paired with an input that provides further context. "
    "Write a response that appropriately completes the request.\n\n"
    "### Instruction:\n{instruction}\n\n### Input:\n{input}\n\n### Response:\n"
)
"""The prompt of an Alpaca record with a non-empty ``input``."""
ALPACA_PROMPT_NO_INPUT = (
    "Below is an instruction that describes a task. "
    "Write a response that appropriately completes the request.\n\n"
    "### Instruction:\n{instruction}\n\n### Response:\n"
)
"""The prompt of an Alpaca record whose ``input`` is missing, null or blank."""

SHAREGPT_ROLES = {"human": "user", "user": "user", "gpt": "assistant", "assistant": "assistant", "system": "system"}
"""ShareGPT's ``from`` values and the chat role each becomes (``user``/``assistant`` are accepted as themselves)."""

# the columns that identify each format, in the order `auto` tries them
_FORMAT_KEYS = (("messages", ("messages",)), ("sharegpt", ("conversations",)), ("alpaca", ("instruction", "output")),
                ("prompt-response", ("prompt", "response")), ("text", ("text",)))
_KNOWN = ('text ("text", or the column --text-field names), prompt-response ("prompt", "response"), messages '
          '("messages"), alpaca ("instruction", "input", "output") or sharegpt ("conversations")')


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


def to_example(record: object, data_format: str = "auto", text_field: str | None = None,
               unit: str = "line") -> dict[str, Any]:
    """One record as lohan's example: ``{"text"}``, ``{"prompt", "response"}`` or ``{"messages"}``.

    Args:
        record: A parsed JSON object or a row of a table (its missing values left out).
        data_format: One of :data:`DATA_FORMATS`; ``auto`` reads each record by its keys (module docstring).
        text_field: The key of the text (``text`` format); with ``auto`` it makes every record text.
        unit: What a record is called in the fix of a problem (``line`` in a ``.jsonl`` file, else ``record``).

    Returns:
        The example, holding only the keys lohan trains on (messages reduced to ``role``/``content``).

    Raises:
        ValueError: What is wrong with the record (not where: the caller names the file and the line or record),
            e.g. a missing or non-string field, an empty target, an unknown role.
    """
    if data_format not in DATA_FORMATS:
        raise ValueError(f"data_format={data_format!r} is not one of {', '.join(DATA_FORMATS)}")
    if not isinstance(record, Mapping):
        raise ValueError(f"expected a JSON object, got {type(record).__name__} {_show(record, 60)}")
    fmt = data_format if data_format != "auto" else _record_format(record, text_field)
    if fmt == "text":
        key = text_field or "text"
        return {"text": _target(record, key, unit)}
    if fmt == "alpaca":
        return _alpaca(record, unit)
    if fmt == "sharegpt":
        return {"messages": _sharegpt(record)}
    if fmt == "native":  # lohan's own forms, checked as a .jsonl line always was
        native = record
    else:  # a named format reads its keys and ignores the others
        need = dict(_FORMAT_KEYS)[fmt]
        if not all(k in record for k in need):
            raise ValueError(f"--data-format {fmt} needs the key(s) {', '.join(map(repr, need))}; it has keys "
                             f"{sorted(map(str, record))}")
        native = {k: record[k] for k in need}
    problem = _example_problem(native)
    if problem is not None:
        if not any(k in native for k in ("text", "prompt", "response", "messages")):
            problem += ('; Alpaca ("instruction", "output") and ShareGPT ("conversations") records are read too, '
                        "and --text-field NAME reads a text key of another name")
        raise ValueError(problem)
    if "messages" in native:
        return {"messages": [{"role": m["role"], "content": m["content"]} for m in native["messages"]]}
    if "text" in native:
        return {"text": _target(native, "text", unit)}
    return {"prompt": native["prompt"], "response": _target(native, "response", unit)}


def _record_format(record: Mapping, text_field: str | None) -> str:
    """The format `auto` reads a record in; "native" is lohan's own forms, checked by _example_problem."""
    if text_field is not None:
        return "text"
    if "messages" not in record and "conversations" in record:
        return "sharegpt"
    if "messages" not in record and "instruction" in record and "output" in record:
        return "alpaca"
    return "native"


def _target(record: Mapping, key: str, unit: str) -> str:
    """A text that is trained on: a non-empty string. An empty one trains nothing (with an EOS, only to stop at
    once): in a file it is a mistake made while preparing the data, so it is named instead of trained around."""
    if key not in record:
        raise ValueError(f'has no "{key}" key (the text to train on); it has keys {sorted(map(str, record))}')
    value = record[key]
    if not isinstance(value, str):
        raise ValueError(f'the "{key}" value must be a string, got {type(value).__name__} {_show(value, 40)}')
    if not value.strip():
        raise ValueError(f'the "{key}" is empty; fill it in or drop the {unit}')
    return value


def _alpaca(record: Mapping, unit: str) -> dict[str, str]:
    for key in ("instruction", "output"):
        if key not in record:
            raise ValueError(f'an Alpaca record needs "instruction" and "output" keys; it has keys '
                             f"{sorted(map(str, record))}")
    instruction = _target(record, "instruction", unit)
    extra = record.get("input")
    if extra is not None and not isinstance(extra, str):
        raise ValueError(f'the "input" value must be a string, got {type(extra).__name__} {_show(extra, 40)}')
    if extra and extra.strip():
        prompt = ALPACA_PROMPT.format(instruction=instruction, input=extra)
    else:
        prompt = ALPACA_PROMPT_NO_INPUT.format(instruction=instruction)
    return {"prompt": prompt, "response": _target(record, "output", unit)}


def _sharegpt(record: Mapping) -> list[dict[str, str]]:
    turns = record.get("conversations")
    if not isinstance(turns, list) or not turns:
        raise ValueError(f'the "conversations" value must be a non-empty list of {{"from", "value"}} objects, got '
                         f"{type(turns).__name__} {_show(turns, 40)}")
    messages = []
    for n, turn in enumerate(turns, start=1):
        if not isinstance(turn, Mapping):
            raise ValueError(f'turn {n}: expected a {{"from", "value"}} object, got {type(turn).__name__} '
                             f"{_show(turn, 40)}")
        who, value = turn.get("from"), turn.get("value")
        role = SHAREGPT_ROLES.get(who) if isinstance(who, str) else None
        if role is None:
            raise ValueError(f'turn {n}: the "from" value {_show(who, 30)} is not a ShareGPT role lohan trains on '
                             '("human", "gpt", "system"; or "user", "assistant")')
        if not isinstance(value, str):
            raise ValueError(f'turn {n} ({who}): the "value" must be a string, got {type(value).__name__} '
                             f"{_show(value, 40)}")
        messages.append({"role": role, "content": value})
    problem = _chat_problem(messages)
    if problem is not None:
        raise ValueError(f"as chat messages (human -> user, gpt -> assistant): {problem}")
    return messages


def check_columns(columns: Iterable[str], data_format: str = "auto", text_field: str | None = None,
                  source: str = "the data") -> str:
    """Check up front that a table's columns can hold records of the format, and describe what will be read.

    Args:
        columns: The table's column names.
        data_format: One of :data:`DATA_FORMATS`.
        text_field: The text column (``text`` format, or ``auto`` with a text column other than ``"text"``).
        source: The data's name in messages.

    Returns:
        What the records are read as, for the run's header, e.g. ``alpaca (instruction, input, output)``.

    Raises:
        ValueError: If no column identifies the format (listing the columns and the flags that fix it), or the
            columns the named format needs are missing.
    """
    cols = list(columns)
    shown = ", ".join(map(repr, cols)) or "none"
    if text_field is not None or data_format == "text":
        key = text_field or "text"
        if key not in cols:
            raise ValueError(f"{source} has no column {key!r} to read the text from; its columns are {shown}: name "
                             "the text column with --text-field NAME, or pick another --data-format")
        return f"text (column {key!r})"
    found = [(fmt, keys) for fmt, keys in _FORMAT_KEYS if all(k in cols for k in keys)]
    if data_format == "auto":
        if not found:
            raise ValueError(f"{source}: no column says what its records are; its columns are {shown}. lohan reads "
                             f"{_KNOWN}: rename the columns, or pass --data-format FORMAT (and --text-field NAME "
                             "for a text column of another name)")
        fmt, keys = found[0]
        # a table of mixed forms (e.g. a .jsonl of text and prompt/response lines, converted): a record whose first
        # format's columns are null is read by the next
        rest = f"; records without them: {', '.join(f for f, _ in found[1:])}" if len(found) > 1 else ""
        return f"{fmt} ({_shown(fmt, cols)}{rest})"
    need = dict(_FORMAT_KEYS)[data_format]
    missing = [k for k in need if k not in cols]
    if missing:
        raise ValueError(f"--data-format {data_format} needs the column(s) {', '.join(map(repr, need))}, but "
                         f"{source} has no {', '.join(map(repr, missing))}; its columns are {shown}; pick the "
                         "format that fits (or --data-format auto)")
    return f"{data_format} ({_shown(data_format, cols)})"


def _shown(fmt: str, cols: list[str]) -> str:
    """The columns a format reads, as the header shows them (Alpaca's optional input where there is one)."""
    if fmt == "alpaca" and "input" in cols:
        return "instruction, input, output"
    return ", ".join(dict(_FORMAT_KEYS)[fmt])
