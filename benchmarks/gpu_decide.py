"""The GPU decision run of issue 38 (every lane overlapped on a GPU box), one phase per call; `gpu_decide.sh` runs
them all with a timeout each on a lent GPU box. Each phase appends JSON records to ``$OUT/results.jsonl``.

Phases (``python benchmarks/gpu_decide.py PHASE [DIR]``):

- ``copy``: the engine's `Device` (an upload and a download stream) against one copy stream carrying both
  directions, on a compute loop the size of a 6b block's forward at 8 x 2048 (ms per iteration, each way).
- ``fifo DIR``: a 25 MiB read (a P16 block) issued behind 4 GiB of queued record READs on one directory, as
  ``URGENT`` (how the engine now asks for P16) and as ``READ`` (what it was: first in, first out): its latency.
- ``disk DIR``: serial vs optimized on the 350m preset, batch 1 x 512, records streamed from DIR, clipping off,
  with each step's lanes (`StepStats.lanes`: gpu, m2g, g2m, ssd, cpu and the waits) and the disk's own busy time.
- ``ram350 DIR`` / ``ram1b DIR``: states in RAM (DIR on tmpfs), 350m at 8 x 2048 and 1b at 16 x 2048, one step
  under torch.profiler: GPU idle fraction and copy overlap (gpu_timeline's arithmetic); the 1b also with the records
  written and committed every step (``persist_every: 1``) against the default interval (``auto``), issue 39.
- ``predict``: the cost model's lanes for the same runs on this box's measured rates (`planner.predict_lanes`),
  to set beside the measured ones (runs anywhere; no GPU needed).
"""

from __future__ import annotations

import json
import os
import statistics
import sys
import time
from pathlib import Path
from typing import Any

import torch

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))
sys.path.insert(0, str(Path(__file__).resolve().parent))

OUT = Path(os.environ.get("OUT", "gpu_decide_out"))
LANES = ("gpu", "m2g", "g2m", "ssd", "cpu", "param_wait", "optimizer_tail", "checksum")


def emit(rec: dict[str, Any]) -> None:
    OUT.mkdir(parents=True, exist_ok=True)
    with open(OUT / "results.jsonl", "a") as f:
        f.write(json.dumps(rec, default=str) + "\n")
    print(json.dumps(rec, default=str)[:400], flush=True)


def disk_busy(path: str) -> tuple[float, int]:
    """(busy seconds, bytes moved) so far of the block device holding `path` (/proc/diskstats)."""
    dev = os.stat(path).st_dev
    with open("/proc/diskstats") as f:
        for line in f:
            p = line.split()
            if (int(p[0]), int(p[1])) == (os.major(dev), os.minor(dev)):
                return int(p[12]) / 1e3, (int(p[5]) + int(p[9])) * 512
    return 0.0, 0


def batches(vocab: int, b: int, s: int, n: int) -> list[tuple[torch.Tensor, torch.Tensor]]:
    g = torch.Generator().manual_seed(0)
    xs = [torch.randint(0, vocab, (b, s + 1), generator=g) for _ in range(n)]
    return [(x[:, :-1], x[:, 1:]) for x in xs]


def profiled_step(engine: Any, batch: Any, nxt: Any) -> dict[str, Any]:
    """One step under torch.profiler: GPU idle and copy overlap in gpu_timeline's terms."""
    import gpu_timeline as gt
    from torch.profiler import ProfilerActivity, profile, record_function

    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
        with record_function(gt.STEP_PREFIX + "0"):
            engine.step(batch, next_batch=nxt)
            torch.cuda.synchronize()
    path = OUT / "trace.json"
    prof.export_chrome_trace(str(path))
    events = json.loads(path.read_text())
    path.unlink()
    trace = gt.classify(events["traceEvents"] if isinstance(events, dict) else events)
    window = trace.windows[gt.STEP_PREFIX + "0"]
    stats = gt.window_stats(trace, window)
    stats["top"] = gt.top_kernels(trace, [window], 5)
    return stats


def run(tag: str, model: str, bs: int, seq: int, root: str, variants: list[tuple[str, dict]], steps: int = 3,
        warm: int = 2, prof: bool = False, **base: Any) -> None:
    """Make a store once, then per variant a fresh engine: `warm` steps, `steps` measured (lanes, disk busy)."""
    import lohan
    from lohan.config import EngineConfig, get_model_config

    mcfg = get_model_config(model, seq_len=seq)
    data = batches(mcfg.vocab_size, bs, seq, 64)
    cfg = EngineConfig(nvme=(root,), name=f"decide{tag.replace('_', '')[:40]}", device="cuda", backend="threads",
                       lr=1e-5, max_grad_norm=0.0, **base)
    t0 = time.perf_counter()
    lohan.init(mcfg, cfg, overwrite=True).close()
    emit({"tag": tag, "store_init_s": time.perf_counter() - t0})
    k = 0
    for name, over in variants:
        t0 = time.perf_counter()
        engine = lohan.init(mcfg, cfg.with_overrides(**over), resume=True)
        recs = []
        for i in range(warm + steps):
            d0 = disk_busy(root)
            engine.step(data[k], next_batch=data[k + 1])
            d1 = disk_busy(root)
            k += 1
            s = engine.last_stats
            if i >= warm:
                recs.append({"step_s": s.step_s, "lanes": s.lanes, "read_bytes": s.ssd_read_bytes,
                             "write_bytes": s.ssd_write_bytes, "disk_busy_s": d1[0] - d0[0],
                             "disk_bytes": d1[1] - d0[1], "deferred": s.deferred,
                             "next_forward_overlapped": s.next_forward_overlapped})
        rec = {"tag": tag, "variant": name, "open_s": time.perf_counter() - t0,
               "median_step_s": statistics.median(r["step_s"] for r in recs), "steps": recs,
               "kept_hits": engine.streamer.kept_hits, "handed_over": engine.streamer.handed_over}
        if prof:
            rec["gpu"] = profiled_step(engine, data[k], data[k + 1])
            k += 1
        engine.close()
        emit(rec)


def copy_streams(n: int = 24) -> None:
    """The engine's two copy streams against one stream for both directions, around the same compute."""
    from lohan.runtime.device import Device

    dev = Device("cuda")
    a = torch.randn(16384, 4096, device="cuda", dtype=torch.bfloat16)
    w = torch.randn(4096, 4096, device="cuda", dtype=torch.bfloat16) / 64
    p16 = torch.empty(400 << 20, dtype=torch.uint8).pin_memory()
    act = torch.empty(a.numel() * 2, dtype=torch.uint8).pin_memory()
    one = torch.cuda.Stream()

    def compute() -> torch.Tensor:
        x = a
        for _ in range(15):
            x = x @ w
        return x

    def one_stream_round(y: torch.Tensor) -> None:  # what the engine did before: both directions on one stream
        one.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(one):
            act.copy_(y.view(torch.uint8).reshape(-1), non_blocking=True)
            nxt = p16.to("cuda", non_blocking=True)
        nxt.record_stream(torch.cuda.current_stream())
        torch.cuda.current_stream().wait_stream(one)

    def go(two: bool) -> float:
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        tr = dev.to_device(p16)
        for _ in range(n):
            dev.wait(tr.event)
            y = compute()
            if two:
                dev.to_host(y.view(torch.uint8).reshape(-1), act)
                tr = dev.to_device(p16)
            else:
                one_stream_round(y)
        torch.cuda.synchronize()
        return (time.perf_counter() - t0) / n

    torch.cuda.synchronize()
    t0 = time.perf_counter()
    for _ in range(n):
        compute()
    torch.cuda.synchronize()
    c = (time.perf_counter() - t0) / n
    go(True)  # warm-up
    emit({"tag": "copy_streams", "compute_ms": 1e3 * c, "one_stream_ms": 1e3 * go(False),
          "two_streams_ms": 1e3 * go(True)})


def fifo(root: str) -> None:
    """A P16-sized read behind 4 GiB of queued record READs: its latency as URGENT and as READ."""
    from io_engine import Priority, Volume, aligned_empty

    rec_bytes, small = 151 << 20, 25 << 20
    os.makedirs(root, exist_ok=True)
    vol = Volume([root], capacity_bytes=6 << 30, name="decidefifo", backend="threads")
    big, dst = aligned_empty(4 << 30), aligned_empty(small)  # O_DIRECT: no staging copy
    res: dict[str, Any] = {"tag": "fifo"}
    try:
        for cls in (Priority.URGENT, Priority.READ):
            hs = [vol.read_into(big[j * rec_bytes:(j + 1) * rec_bytes], j * rec_bytes, priority=Priority.READ)
                  for j in range((4 << 30) // rec_bytes)]
            t0 = time.perf_counter()
            vol.read_into(dst, 5 << 30, priority=cls).wait()
            res[f"p16_read_{cls.name.lower()}_s"] = time.perf_counter() - t0
            for h in hs:
                h.wait()
            res[f"queue_{cls.name.lower()}_s"] = time.perf_counter() - t0
    finally:
        vol.close()
    emit(res)


def predict() -> None:
    """The cost model's lanes for the decision runs on the lent box's presets (an H100, one disk measured by
    this run's `disk` phase when it saved a profile, else 2.37 GB/s as the last H100 box measured)."""
    from lohan.app.fit import measure_cpu_adam
    from lohan.config import get_model_config
    from lohan.plan.planner import HARDWARE_PRESETS, Hardware, predict_lanes

    gpu = HARDWARE_PRESETS["h100"]
    cpu = measure_cpu_adam(compute_dtype="bf16")
    hw = Hardware("h100+1ssd", thp_g=gpu.flops, bw_g=gpu.link_bw, bw_s2m=2.37e9, bw_m2s=2.37e9, mem_avail=64 << 30,
                  cpu_adam_params_per_s=cpu)
    for tag, model, bs, seq, resident in (("disk_350m_1x512", "350m", 1, 512, 0),
                                          ("ram_350m_8x2048", "350m", 8, 2048, "all"),
                                          ("ram_1b_16x2048", "1b", 16, 2048, "all")):
        mcfg = get_model_config(model, seq_len=seq)
        emit({"tag": f"predict_{tag}", "cpu_adam_params_per_s": cpu,
              "lanes": {mode: predict_lanes(mcfg, hw, bs, seq, mode, resident_mem=resident)
                        for mode in ("serial", "optimized")}})


def main(argv: list[str]) -> int:
    what = argv[0] if argv else ""
    if what == "copy":
        copy_streams()
    elif what == "fifo":
        fifo(argv[1])
    elif what == "disk":  # records streamed from the disk, as ago_bench_gpu_h100
        run("disk_350m_1x512", "350m", 1, 512, argv[1],
            [("serial", {"mode": "serial"}), ("optimized", {"mode": "optimized"}),
             ("optimized_defer", {"mode": "optimized", "clip_mode": "defer"})],
            steps=2, cpu_mem="8GiB", resident_mem=0, clip_mode="speculate")
    elif what == "ram350":  # states in RAM, a GPU-sized batch; checksums on and off
        for ck in (True, False):
            run(f"ram_350m_8x2048_ck{int(ck)}", "350m", 8, 2048, argv[1], [("optimized", {})], prof=True,
                cpu_mem="24GiB", resident_mem="all", clip_mode="speculate", checksums=ck, mode="optimized")
    elif what == "ram1b":  # optimized at persist_every auto (the default) and every step: issue 39, item 5
        run("ram_1b_16x2048", "1b", 16, 2048, argv[1], [("serial", {"mode": "serial"}),
            ("optimized", {"mode": "optimized"}), ("optimized_persist1", {"mode": "optimized", "persist_every": 1})],
            prof=True, cpu_mem="48GiB", resident_mem="all", clip_mode="speculate", steps=2)
    elif what == "predict":
        predict()
    else:
        print(__doc__)
        return 2
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
