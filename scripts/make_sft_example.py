"""Build ``data/sft_example.jsonl``: prompt/response pairs cut from the shipped corpus.

Each pair takes a corpus paragraph of at least two sentences: the prompt is ``"Continue: "`` plus its
first sentence, the response is the sentence that follows. It exists to show and test the
prompt/response format (the loss is on the response only) offline; it is not a useful task. Same
source and license as ``data/corpus.txt`` (PSF License, ``data/LICENSE-PSF.txt``).

Usage::

    .venv/bin/python scripts/make_sft_example.py            # writes data/sft_example.jsonl
"""

from __future__ import annotations

import argparse
import json
import re
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
_SENTENCE = re.compile(r"(?<=[.!?])\s+(?=[A-Z])")


def pairs(corpus: str, limit: int) -> list[dict[str, str]]:
    out = []
    for para in corpus.split("\n\n"):
        sentences = [" ".join(s.split()) for s in _SENTENCE.split(para.strip())]
        if len(sentences) >= 2 and 20 <= len(sentences[0]) <= 200 and 10 <= len(sentences[1]) <= 200:
            out.append({"prompt": f"Continue: {sentences[0]}\n", "response": sentences[1] + "\n"})
        if len(out) == limit:
            break
    return out


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--corpus", type=Path, default=REPO / "data" / "corpus.txt")
    p.add_argument("--out", type=Path, default=REPO / "data" / "sft_example.jsonl")
    p.add_argument("--limit", type=int, default=600)
    args = p.parse_args(argv)
    rows = pairs(args.corpus.read_text(encoding="utf-8"), args.limit)
    args.out.write_text("".join(json.dumps(r) + "\n" for r in rows), encoding="utf-8")
    print(f"wrote {len(rows)} prompt/response pairs to {args.out}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
