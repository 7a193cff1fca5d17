"""What the token cache saves a run at its start: reading a record source cold (tokenized with ``datasets.map`` into
the cache, what a first run does) vs warm (memory-mapped from it, what a resumed run does), next to the in-memory
``.jsonl`` path, which tokenizes at every start.

The records are the shipped ``sft_example.jsonl`` pairs (or ``chat_example.jsonl`` conversations, ``--format chat``)
repeated up to ``--mb`` megabytes of ``.jsonl``, numbered so no two are alike, written as ``.jsonl`` and as Parquet.
The tokenizer is the 110M Llama's (``scripts/make_tiny_hf.py --size 110m``: a 32,000-token BPE trained on the
corpus, with its chat template), or byte-level (``--tokenizer bytes``). Each round times, in this process:
``TokenDataset.from_file`` on the ``.jsonl`` (in memory), ``TokenDataset.from_source`` on the Parquet file with an
empty cache (cold) and then again (warm); every round starts from a new cache folder. The files are deleted at the
end. Reported: each time, their medians, the sizes, the hardware and versions.

Usage::

    .venv/bin/python benchmarks/token_cache.py             # -> results/token_cache/<machine>.{json,md} (~8 MB, ~1 min)
    .venv/bin/python benchmarks/token_cache.py --quick     # 2 MB, 2 rounds
"""

from __future__ import annotations

import argparse
import json
import platform
import shutil
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from benchmarks.bench_env import REPO, cpu_model, package_version, result_fields, result_path, save_report  # noqa: E402

SCRATCH = REPO / "benchmarks" / "scratch" / "token_cache"


def records(fmt: str, mb: float) -> list[dict]:
    """Shipped examples, numbered, repeated up to `mb` MB of JSON lines."""
    name = "sft_example.jsonl" if fmt == "prompt-response" else "chat_example.jsonl"
    base = [json.loads(line) for line in (REPO / "data" / name).read_text().splitlines() if line.strip()]
    out, size, i = [], 0, 0
    while size < mb * 1e6:
        row = json.loads(json.dumps(base[i % len(base)]))
        if "prompt" in row:
            row["prompt"] = f"({i}) {row['prompt']}"
        else:
            row["messages"][-2]["content"] = f"({i}) {row['messages'][-2]['content']}"
        out.append(row)
        size += len(json.dumps(row)) + 1
        i += 1
    return out


def tokenizer(kind: str):
    from lohan.data import ByteTokenizer, HFTokenizer

    if kind == "bytes":
        return ByteTokenizer()
    import importlib.util

    spec = importlib.util.spec_from_file_location("make_tiny_hf", REPO / "scripts" / "make_tiny_hf.py")
    make_tiny_hf = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(make_tiny_hf)
    return HFTokenizer(make_tiny_hf.train_tokenizer(REPO / "data" / "corpus.txt", 32000))


def measure(args: argparse.Namespace) -> dict:
    import pyarrow as pa
    import pyarrow.parquet as pq

    from lohan.data import TokenDataset

    shutil.rmtree(SCRATCH, ignore_errors=True)
    SCRATCH.mkdir(parents=True)
    rows = records(args.format, args.mb)
    jsonl, parquet = SCRATCH / "records.jsonl", SCRATCH / "records.parquet"
    jsonl.write_text("".join(json.dumps(r) + "\n" for r in rows))
    pq.write_table(pa.Table.from_pylist(rows), parquet)
    tok = tokenizer(args.tokenizer)
    rounds = []
    for r in range(args.rounds):
        root = SCRATCH / f"cache{r}"
        t0 = time.perf_counter()
        mem = TokenDataset.from_file(jsonl, args.seq_len, tok)
        t1 = time.perf_counter()
        cold = TokenDataset.from_source(parquet, args.seq_len, tok, cache_root=root)
        t2 = time.perf_counter()
        warm = TokenDataset.from_source(parquet, args.seq_len, tok, cache_root=root)
        t3 = time.perf_counter()
        assert len(mem) == len(cold) == len(warm) and bool((mem.windows == warm.windows).all())
        cache_bytes = sum(f.stat().st_size for f in root.rglob("*") if f.is_file())
        rounds.append({"in_memory_s": t1 - t0, "cold_s": t2 - t1, "warm_s": t3 - t2, "cache_bytes": cache_bytes})
        print(f"round {r}: in memory {t1 - t0:.3f} s, cold {t2 - t1:.3f} s, warm {t3 - t2:.4f} s")
    n_tokens = cold.windows.untyped_storage().nbytes() // 8
    shutil.rmtree(SCRATCH, ignore_errors=True)
    med = {k: statistics.median(r[k] for r in rounds) for k in ("in_memory_s", "cold_s", "warm_s")}
    return {"records": len(rows), "jsonl_bytes": jsonl_size(rows), "tokens": n_tokens, "windows": len(cold),
            "rounds": rounds, "median": med, "cache_bytes": rounds[-1]["cache_bytes"]}


def jsonl_size(rows: list[dict]) -> int:
    return sum(len(json.dumps(r)) + 1 for r in rows)


def markdown(report: dict, path: Path) -> None:
    r, m = report["result"], report["result"]["median"]
    lines = [
        "# Token cache: a run's data loading, cold vs warm", "",
        f"`{report['command']}` on {report['hardware']['cpu']} ({report['hardware']['cores']} cores), "
        f"{report['date']}", "",
        f"{r['records']:,} {report['settings']['format']} records, {r['jsonl_bytes'] / 1e6:.1f} MB of JSON lines, "
        f"{r['tokens']:,} tokens ({report['settings']['tokenizer']} tokenizer), {r['windows']:,} windows of "
        f"{report['settings']['seq_len']}; the cache folder holds {r['cache_bytes'] / 1e6:.1f} MB.", "",
        "| path | median s | rounds |", "|---|---|---|",
        f"| in memory (.jsonl, tokenized at every start) | {m['in_memory_s']:.3f} | {_each(r, 'in_memory_s')} |",
        f"| token cache, cold (tokenize with datasets.map, write the stream) | {m['cold_s']:.3f} | "
        f"{_each(r, 'cold_s')} |",
        f"| token cache, warm (a resumed run: map the stream) | {m['warm_s']:.4f} | {_each(r, 'warm_s')} |", "",
    ]
    path.write_text("\n".join(lines))


def _each(result: dict, key: str) -> str:
    return ", ".join(f"{x[key]:.4f}" for x in result["rounds"])


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--mb", type=float, default=8.0, help="megabytes of JSON lines to read")
    p.add_argument("--format", choices=["prompt-response", "chat"], default="prompt-response")
    p.add_argument("--tokenizer", choices=["bpe32k", "bytes"], default="bpe32k")
    p.add_argument("--seq-len", type=int, default=512)
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--quick", action="store_true", help="2 MB, 2 rounds")
    p.add_argument("--out", type=Path, default=None, help="JSON report (default benchmarks/results/token_cache/<machine>.json)")
    args = p.parse_args(argv)
    if args.quick:
        args.mb, args.rounds = 2.0, 2
    result = measure(args)
    variant = {"quick": args.quick, "format": args.format if args.format != "prompt-response" else None}
    report = {"benchmark": "token_cache", "date": time.strftime("%Y-%m-%d"),
              "command": " ".join([sys.executable, *sys.argv]),
              "settings": {k: getattr(args, k) for k in ("mb", "format", "tokenizer", "seq_len", "rounds")},
              "hardware": {"cpu": cpu_model(), "cores": __import__("os").cpu_count(), "platform": platform.platform()},
              "versions": {k: package_version(k) for k in ("torch", "datasets", "pyarrow", "tokenizers",
                                                           "transformers")},
              "result": result, **result_fields("token_cache", variant)}
    args.out = result_path("token_cache", variant, args.out)
    save_report(report, args.out, markdown, lambda report, path: None)
    print(args.out.with_suffix(".md").read_text())
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
