"""Build ``data/chat_example.jsonl``: short multi-turn conversations cut from the shipped corpus.

Each conversation takes a corpus paragraph of at least three sentences: the user asks to continue its
first sentence, the assistant answers with the next one, the user asks for more and the assistant gives
the sentence after that (up to three assistant turns); every third conversation opens with a system
message. Like ``scripts/make_sft_example.py`` it exists to show and test the ``{"messages": [...]}`` format
offline (rendered with the model's chat template, the loss on the assistant turns only); it is not a useful
task. Same source and license as ``data/corpus.txt`` (PSF License, ``data/LICENSE-PSF.txt``).

Usage::

    .venv/bin/python scripts/make_chat_example.py            # writes data/chat_example.jsonl
"""

from __future__ import annotations

import argparse
import json
import re
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
_SENTENCE = re.compile(r"(?<=[.!?])\s+(?=[A-Z])")
SYSTEM = "You continue passages of the Python documentation, one sentence at a time."
FOLLOW_UPS = ("And then?", "Go on.", "What comes next?")
MAX_TURNS = 3


def conversations(corpus: str, limit: int) -> list[dict[str, list[dict[str, str]]]]:
    out: list[dict[str, list[dict[str, str]]]] = []
    for para in corpus.split("\n\n"):
        sentences = [" ".join(s.split()) for s in _SENTENCE.split(para.strip())]
        sentences = sentences[: MAX_TURNS + 1]
        if len(sentences) < 3 or not 20 <= len(sentences[0]) <= 200 or any(
            not 10 <= len(s) <= 200 for s in sentences[1:]
        ):
            continue
        n = len(out)
        messages = [{"role": "system", "content": SYSTEM}] if n % 3 == 0 else []
        messages.append({"role": "user", "content": f"Continue: {sentences[0]}"})
        for k, answer in enumerate(sentences[1:]):
            if k:
                messages.append({"role": "user", "content": FOLLOW_UPS[(n + k) % len(FOLLOW_UPS)]})
            messages.append({"role": "assistant", "content": answer})
        out.append({"messages": messages})
        if len(out) == limit:
            break
    return out


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--corpus", type=Path, default=REPO / "data" / "corpus.txt")
    p.add_argument("--out", type=Path, default=REPO / "data" / "chat_example.jsonl")
    p.add_argument("--limit", type=int, default=300)
    args = p.parse_args(argv)
    rows = conversations(args.corpus.read_text(encoding="utf-8"), args.limit)
    args.out.write_text("".join(json.dumps(r) + "\n" for r in rows), encoding="utf-8")
    turns = sum(m["role"] == "assistant" for r in rows for m in r["messages"])
    print(f"wrote {len(rows)} conversations ({turns} assistant turns) to {args.out}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
