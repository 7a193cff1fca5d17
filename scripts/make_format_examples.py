"""Build the small example files of each record format in ``data/``, cut from the shipped examples.

One file per format that ``--data-format`` names, each in another of the file types lohan reads, a few dozen
records each (a folder written by ``save_to_disk`` is made by the tests instead, from these records):

- ``alpaca_example.json``: a JSON array of Alpaca records (``instruction``, ``input``, ``output``) from
  ``sft_example.jsonl``: every other record has its sentence as the ``input``, the others an empty one;
- ``sharegpt_example.jsonl``: ShareGPT records (``conversations`` of ``from``/``value`` turns) from
  ``chat_example.jsonl`` (user -> human, assistant -> gpt);
- ``prompt_response_example.parquet``: ``prompt``/``response`` records from ``sft_example.jsonl``;
- ``messages_example.arrow``: ``messages`` conversations from ``chat_example.jsonl``, in an Arrow IPC file;
- ``text_example.csv``: paragraphs of ``corpus.txt`` in a column named ``body`` (read with ``--text-field body``).

They show and test the formats offline; they are not meaningful tasks. Same source and license as the corpus.
The output is a deterministic function of the inputs (and of pyarrow's version, which the Parquet and Arrow
files name in their metadata).

Usage::

    .venv/bin/python scripts/make_format_examples.py            # writes the five files into data/
"""

from __future__ import annotations

import argparse
import csv
import json
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
ROLES = {"user": "human", "assistant": "gpt", "system": "system"}


def _jsonl(path: Path) -> list[dict]:
    return [json.loads(line) for line in path.read_text(encoding="utf-8").splitlines() if line.strip()]


def alpaca(sft: list[dict], n: int) -> list[dict[str, str]]:
    out = []
    for i, row in enumerate(sft[:n]):
        sentence = row["prompt"].removeprefix("Continue: ").strip()
        if i % 2:
            out.append({"instruction": "Continue the passage with its next sentence.", "input": sentence,
                        "output": row["response"].strip()})
        else:
            out.append({"instruction": f"Continue: {sentence}", "input": "", "output": row["response"].strip()})
    return out


def sharegpt(chats: list[dict], n: int) -> list[dict]:
    return [{"conversations": [{"from": ROLES[m["role"]], "value": m["content"]} for m in row["messages"]]}
            for row in chats[:n]]


def paragraphs(corpus: str, n: int) -> list[str]:
    keep = [" ".join(p.split()) for p in corpus.split("\n\n")]
    return [p for p in keep if 150 <= len(p) <= 500][:n]


def main(argv: list[str] | None = None) -> int:
    import pyarrow as pa
    import pyarrow.parquet as pq

    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--out", type=Path, default=REPO / "data", help="folder to write into (default: data/)")
    p.add_argument("--records", type=int, default=40, help="records per file (conversations: three quarters)")
    args = p.parse_args(argv)
    data = REPO / "data"
    sft, chats = _jsonl(data / "sft_example.jsonl"), _jsonl(data / "chat_example.jsonl")
    n, n_chat = args.records, args.records * 3 // 4
    out: Path = args.out
    out.mkdir(parents=True, exist_ok=True)
    (out / "alpaca_example.json").write_text(json.dumps(alpaca(sft, n), indent=1) + "\n", encoding="utf-8")
    (out / "sharegpt_example.jsonl").write_text("".join(json.dumps(r) + "\n" for r in sharegpt(chats, n_chat)),
                                                encoding="utf-8")
    pq.write_table(pa.Table.from_pylist(sft[n:2 * n]), out / "prompt_response_example.parquet")
    table = pa.Table.from_pylist([{"messages": row["messages"]} for row in chats[n_chat:2 * n_chat]])
    with pa.OSFile(str(out / "messages_example.arrow"), "wb") as f, pa.ipc.new_file(f, table.schema) as writer:
        writer.write_table(table)
    with open(out / "text_example.csv", "w", newline="", encoding="utf-8") as f:
        w = csv.writer(f)
        w.writerow(["id", "body"])
        w.writerows(enumerate(paragraphs((data / "corpus.txt").read_text(encoding="utf-8"), n)))
    for name in ("alpaca_example.json", "sharegpt_example.jsonl", "prompt_response_example.parquet",
                 "messages_example.arrow", "text_example.csv"):
        print(f"wrote {out / name} ({(out / name).stat().st_size:,} bytes)")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
