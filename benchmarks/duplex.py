"""Do the SSDs' reads and writes add up or overlap? Read alone, write alone, then both at once.

    .venv/bin/python benchmarks/duplex.py                       # -> results/duplex/<machine>.{json,md}
    .venv/bin/python benchmarks/duplex.py --dir /mnt/nvme0/lohan --size-gib 4

Why: a clipped step's deferred optimizer pass reads P32, m, v of the blocks it could not prefetch and
writes every record back while the next forward waits on it (README "Performance"). Whether that window
costs read + write time or the larger of the two depends on the device. Each round moves `--size-gib` GiB
each way through io_engine (the engine's default backend, queue depth and block size, O_DIRECT), in
`--request-mib` requests all issued at once: read alone, write alone (to another region), both at once;
rounds repeat with the order rotated and medians are reported.

`overlap` = (read alone + write alone - both) / min(read alone, write alone): 0 when the device serves one
direction at a time (both = the sum: half duplex), 1 when both run at full speed side by side (both = the
larger one). Noisy disks: compare values of one run.
"""

from __future__ import annotations

import argparse
import datetime as dt
import json
import os
import statistics
import sys
import time
from pathlib import Path

import torch
from bench_env import (  # sibling module (this directory)
    REPO,
    cpu_model,
    package_version,
    portable,
    result_fields,
    result_path,
)

sys.path.insert(0, str(REPO))
from io_engine import open_volume  # noqa: E402

GiB = 1 << 30


def _timed(handles_of) -> float:
    t0 = time.perf_counter()
    for h in handles_of():
        h.wait()
    return time.perf_counter() - t0


def measure(directory: Path, size: int, request: int, rounds: int, backend: str) -> dict:
    vol = open_volume([str(directory)], 2 * size, backend=backend, name="duplex")
    try:
        pool = vol.buffer_pool(2 * size)
        src, dst = pool.acquire(size), pool.acquire(size)
        src.tensor.copy_(torch.randint(0, 256, (size,), dtype=torch.uint8))
        offsets = range(0, size, request)
        vol.write(src.tensor[:size], 0).wait()  # the read region exists before it is read
        vol.sync()

        def reads():
            return [vol.read_into(dst.tensor[o:o + request], o) for o in offsets]

        def writes():
            return [vol.write(src.tensor[o:o + request], size + o) for o in offsets]

        def both():
            r, w = iter(reads()), iter(writes())  # interleaved issue: neither direction gets a head start
            return [h for pair in zip(r, w) for h in pair]

        kinds = {"read": reads, "write": writes, "both": both}
        seconds: dict[str, list[float]] = {k: [] for k in kinds}
        order = list(kinds)
        for k in range(rounds):
            for name in order[k % 3:] + order[:k % 3]:
                seconds[name].append(_timed(kinds[name]))
                vol.sync()
        src.release()
        dst.release()
        backend_name = vol.backend.name
    finally:
        vol.close()
        for suffix in (".slab", ".volume.json"):
            path = directory / f"duplex{suffix}"
            if path.exists():
                path.unlink()
    med = {k: statistics.median(v) for k, v in seconds.items()}
    overlap = (med["read"] + med["write"] - med["both"]) / min(med["read"], med["write"])
    return {"backend": backend_name, "seconds": seconds, "median_s": med,
            "gbps": {"read": size / med["read"] / 1e9, "write": size / med["write"] / 1e9,
                     "both": 2 * size / med["both"] / 1e9},
            "overlap": overlap}


def markdown(report: dict) -> str:
    r, a = report["result"], report["args"]
    m = r["median_s"]
    return "\n".join([
        f"# duplex: do reads and writes overlap? — {report['timestamp']}", "",
        f"`{report['command']}` ({r['backend']} backend, {a['size_gib']} GiB each way in {a['request_mib']} MiB "
        f"requests, {a['rounds']} rounds, medians; {report['cpu_count']} CPUs {report['cpu_model']}, torch "
        f"{report['torch']})", "",
        "| | seconds | GB/s |", "|---|---|---|",
        f"| read alone | {m['read']:.3f} | {r['gbps']['read']:.2f} |",
        f"| write alone | {m['write']:.3f} | {r['gbps']['write']:.2f} |",
        f"| both at once | {m['both']:.3f} | {r['gbps']['both']:.2f} (both directions) |",
        f"| read alone + write alone | {m['read'] + m['write']:.3f} | |", "",
        f"**overlap = {r['overlap']:.2f}** (0: reads and writes add up, half duplex; 1: they run side by side)", "",
        "Raw seconds per round: " + json.dumps({k: [round(x, 3) for x in v] for k, v in r["seconds"].items()}), ""])


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--dir", type=Path, default=REPO / "benchmarks" / "scratch" / "duplex",
                   help="a directory on the SSD to test (created if missing)")
    p.add_argument("--size-gib", type=float, default=1.0, help="GiB moved each way per measurement")
    p.add_argument("--request-mib", type=int, default=64, help="size of each request (all issued at once)")
    p.add_argument("--rounds", type=int, default=5)
    p.add_argument("--backend", choices=["auto", "aio", "threads"], default="auto")
    p.add_argument("--out", type=Path, default=None, help="JSON report (default benchmarks/results/duplex/<machine>.json)")
    a = p.parse_args(argv)
    request = a.request_mib << 20
    size = max(request, int(a.size_gib * GiB) // request * request)
    if a.rounds < 1:
        p.error("--rounds must be >= 1")
    a.dir.mkdir(parents=True, exist_ok=True)
    result = measure(a.dir, size, request, a.rounds, a.backend)
    report = {"timestamp": dt.datetime.now(dt.timezone.utc).isoformat(timespec="seconds"),
              "command": " ".join(["python", *sys.argv]), "cpu_count": os.cpu_count(), "cpu_model": cpu_model(),
              "torch": package_version("torch"),
              "args": {"size_gib": size / GiB, "request_mib": a.request_mib, "rounds": a.rounds},
              "result": result, **result_fields("duplex")}
    a.out = result_path("duplex", out=a.out)
    report = portable(report)
    a.out.parent.mkdir(parents=True, exist_ok=True)
    a.out.write_text(json.dumps(report, indent=2) + "\n")
    a.out.with_suffix(".md").write_text(markdown(report))
    m = result["median_s"]
    print(f"read {m['read']:.3f} s, write {m['write']:.3f} s, both {m['both']:.3f} s (sum {m['read'] + m['write']:.3f})"
          f" -> overlap {result['overlap']:.2f}; wrote {a.out} and .md")
    return 0


if __name__ == "__main__":
    sys.exit(main())
