"""Where a lohan step's time goes: the disk and the cores, sampled every 10 ms beside the engine's phases.

    .venv/bin/python benchmarks/step_timeline.py --quick                # 110M Llama, 2 warm-up + 4 steps
    .venv/bin/python benchmarks/step_timeline.py                        # 3 warm-up + 10 steps
    .venv/bin/python benchmarks/step_timeline.py --compare heap_reuse=true,false --rounds 3
    .venv/bin/python benchmarks/step_timeline.py --set max_inflight_blocks=2 --model-dir DIR

What one run is. lohan trains `vs_deepspeed.py`'s 110M Llama (or `--model-dir`, a local Hugging Face model)
with `finetune.py`'s defaults, as `vs_deepspeed.py` runs it (the same batches, lr, clipping; each step is
told the next batch), in a child process. The child marks when each step and its phases begin and end;
this process samples the child from outside every `--interval` seconds (no GIL shared with it): the SSD
holding the states (`/proc/diskstats`: bytes read and written, time busy), the machine's cores
(`/proc/stat`: user, system), and each of the child's threads (CPU time, minor page faults). The child
names its OS threads after their Python threads, so CPU time is attributed to the main thread, torch's
intra-op threads (unnamed, they carry the process's name), the optimizer worker (`lohan-ago*`) and the
I/O lanes (`io_engine-*`).

Phases of a step (`Engine.step`): **backward** (from the step's start to the end of `BlockPasses.backward`: the
forward too, when the step before did not run it beside its own update), **after gate** (`_finish_updates`:
the optimizer pass that waited for the gradient norm, with the next step's forward beside it), **rest**
(settling the norm, commit, metrics). Per phase: seconds, cores busy (user and system), GB read and
written, seconds the disk was busy, CPU seconds per thread role, minor page faults. Medians over the
timed steps. `--compare KEY=A,B[,C]` runs the variants interleaved (A, B, A, B, ...; `--rounds` each), each
in its own process, so that only ratios measured in the same minutes are compared: the disk's speed drifts.

Linux only (/proc). Report: `benchmarks/results/step_timeline[/<variant>]/<machine>.{json,md,png}`, the variant made of
`quick`, the `--model-dir` model and the `--compare` key.
"""

from __future__ import annotations

import argparse
import ctypes
import datetime as dt
import json
import os
import platform
import statistics
import subprocess
import sys
import threading
import time
from pathlib import Path
from typing import Any

import vs_deepspeed as vd  # sibling module (the script's own directory)
from bench_env import cpu_model, portable, result_fields, result_path

REPO = Path(__file__).resolve().parent.parent
PHASES = ("backward", "after_gate", "rest")
PAGE = os.sysconf("SC_PAGE_SIZE")


# ------------------------------------------------------------------------------------------ child
def _name_os_threads() -> None:
    """Give each Python thread started from now on its name as its OS thread name (prctl PR_SET_NAME), so
    /proc/<pid>/task/<tid>/comm tells the threads apart."""
    libc = ctypes.CDLL(None)
    start = threading.Thread._bootstrap_inner  # type: ignore[attr-defined]

    def named(self: threading.Thread) -> None:
        libc.prctl(15, self.name[:15].encode(), 0, 0, 0)
        start(self)

    threading.Thread._bootstrap_inner = named  # type: ignore[attr-defined]


def child(a: argparse.Namespace) -> int:
    _name_os_threads()
    import lohan.runtime.engine as E
    import lohan.runtime.passes as P

    marks: list[tuple[str, float, float]] = []

    def timed(cls: type, name: str, mark: str) -> None:
        f = getattr(cls, name)

        def g(self: Any, *args: Any, **kwargs: Any) -> Any:
            t0 = time.monotonic()
            try:
                return f(self, *args, **kwargs)
            finally:
                marks.append((mark, t0, time.monotonic()))
        setattr(cls, name, g)

    # (the step's backward is its passes' since the engine was split; the mark keeps its old name)
    for cls, name, mark in ((E.Engine, "step", "step"), (P.BlockPasses, "backward", "_backward"),
                            (E.Engine, "_finish_updates", "_finish_updates")):
        timed(cls, name, mark)
    settings = json.loads(a.settings)
    step, close, info = vd.build_lohan(Path(a.model_dir), Path(a.work), settings, "bf16")
    vocab = json.loads((Path(a.model_dir) / "config.json").read_text())["vocab_size"]
    gen = vd.batches(vocab, a.batch, a.seq, a.seed)
    data = [next(gen) for _ in range(a.warmup + a.steps + 1)]
    for k in range(a.warmup + a.steps):
        if k == a.warmup:
            marks.clear()
        step(*data[k], data[k + 1])
    close()
    Path(a.result).write_text(json.dumps({"marks": marks, "info": info, "pid": os.getpid()}))
    return 0


# ------------------------------------------------------------------------------------------ sampling
def _disk_of(path: Path) -> tuple[int, int] | None:
    """(major, minor) of the block device holding `path`, or None (tmpfs, overlay: no disk statistics)."""
    st = os.stat(path)
    major, minor = os.major(st.st_dev), os.minor(st.st_dev)
    return (major, minor) if major != 0 else None


def _sample(pid: int, disk: tuple[int, int] | None) -> dict[str, Any] | None:
    t = time.monotonic()
    d = None
    if disk is not None:
        with open("/proc/diskstats") as f:
            for ln in f:
                x = ln.split()
                if (int(x[0]), int(x[1])) == disk:  # sectors read, sectors written, ms busy
                    d = (int(x[5]) * 512, int(x[9]) * 512, int(x[12]) / 1e3)
    with open("/proc/stat") as f:
        cpu = [int(v) for v in f.readline().split()[1:9]]
    threads: dict[str, tuple[str, int, int, int]] = {}
    try:
        with open(f"/proc/{pid}/statm") as f:
            rss = int(f.read().split()[1]) * PAGE
        for tid in os.listdir(f"/proc/{pid}/task"):
            try:
                with open(f"/proc/{pid}/task/{tid}/stat") as f:
                    s = f.read()
            except OSError:
                continue
            rest = s[s.rindex(")") + 2:].split()  # fields from the 3rd on
            threads[tid] = (s[s.index("(") + 1:s.rindex(")")], int(rest[11]), int(rest[12]), int(rest[7]))
    except OSError:
        return None
    return {"t": t, "disk": d, "cpu": cpu, "threads": threads, "rss": rss}


def _role(tid: str, comm: str, pid: int, main_comm: str) -> str:
    if int(tid) == pid:
        return "main"
    if comm == main_comm:
        return "intra-op"  # torch's OpenMP threads, unnamed
    return comm.rstrip("0123456789").rstrip("_")  # lohan-ago_0 -> lohan-ago


def window(s0: dict[str, Any], s1: dict[str, Any], pid: int, main_comm: str, hz: int) -> dict[str, Any]:
    """What happened between two samples."""
    dt_s = s1["t"] - s0["t"]
    c = [b - a for a, b in zip(s0["cpu"], s1["cpu"])]
    total = sum(c) or 1
    ncpu = os.cpu_count() or 1
    out: dict[str, Any] = {"seconds": dt_s,
                           "cores_user": (c[0] + c[1]) / total * ncpu,
                           "cores_system": (c[2] + c[5] + c[6]) / total * ncpu}
    if s0["disk"] and s1["disk"]:
        out["read_gb"] = (s1["disk"][0] - s0["disk"][0]) / 1e9
        out["write_gb"] = (s1["disk"][1] - s0["disk"][1]) / 1e9
        out["disk_busy_s"] = s1["disk"][2] - s0["disk"][2]
    roles: dict[str, float] = {}
    sys_s, faults = 0.0, 0
    for tid, (comm, ut, st, flt) in s1["threads"].items():
        if tid not in s0["threads"]:
            continue
        _, ut0, st0, flt0 = s0["threads"][tid]
        role = _role(tid, comm, pid, main_comm)
        roles[role] = roles.get(role, 0.0) + (ut - ut0 + st - st0) / hz
        sys_s += (st - st0) / hz
        faults += flt - flt0
    out["thread_cpu_s"] = {k: round(v, 3) for k, v in sorted(roles.items(), key=lambda kv: -kv[1]) if v > 0}
    out["process_system_cpu_s"] = sys_s
    out["minor_faults"] = faults
    return out


def run_once(settings: dict[str, Any], model_dir: Path, work: Path, a: argparse.Namespace) -> dict[str, Any]:
    work.mkdir(parents=True, exist_ok=True)
    result = work / "marks.json"
    result.unlink(missing_ok=True)
    cmd = [sys.executable, str(Path(__file__).resolve()), "--child", "--model-dir", str(model_dir),
           "--work", str(work), "--settings", json.dumps(settings), "--result", str(result),
           "--warmup", str(a.warmup), "--steps", str(a.steps), "--batch", str(a.batch), "--seq", str(a.seq),
           "--seed", str(a.seed)]
    env = {**os.environ, "DS_ACCELERATOR": os.environ.get("DS_ACCELERATOR", "cpu")}
    log = open(work / "child.log", "w")
    proc = subprocess.Popen(cmd, cwd=REPO, env=env, stdout=log, stderr=subprocess.STDOUT)
    disk = _disk_of(work)
    samples: list[dict[str, Any]] = []
    while proc.poll() is None:
        s = _sample(proc.pid, disk)
        if s is not None:
            samples.append(s)
        time.sleep(a.interval)
    log.close()
    if proc.returncode != 0 or not result.exists():
        tail = (work / "child.log").read_text()[-3000:]
        raise RuntimeError(f"the lohan child failed (exit {proc.returncode}):\n{tail}")
    got = json.loads(result.read_text())
    return {"samples": samples, "marks": got["marks"], "info": got["info"], "pid": proc.pid,
            "disk_stats": disk is not None}


def analyze(run: dict[str, Any]) -> list[dict[str, Any]]:
    """Per timed step: its seconds and a window per phase."""
    samples, pid = run["samples"], run["pid"]
    main_comm = next((v[0] for s in samples for tid, v in s["threads"].items() if int(tid) == pid), "")
    hz = os.sysconf("SC_CLK_TCK")

    def at(t: float) -> dict[str, Any]:
        return min(samples, key=lambda s: abs(s["t"] - t))

    steps = []
    for _, a, b in (m for m in run["marks"] if m[0] == "step"):
        inside = {n: (x, y) for n, x, y in run["marks"] if a <= x and y <= b and n != "step"}
        bwd_end = inside.get("_backward", (a, a))[1]
        gate = inside.get("_finish_updates")
        spans = {"backward": (a, bwd_end), "after_gate": gate or (bwd_end, bwd_end),
                 "rest": ((gate[1] if gate else bwd_end), b)}
        row: dict[str, Any] = {"seconds": b - a}
        for ph, (x, y) in spans.items():
            s0, s1 = at(x), at(y)
            row[ph] = window(s0, s1, pid, main_comm, hz) if s1["t"] > s0["t"] else {"seconds": y - x}
            row[ph]["seconds"] = y - x  # the marks' span; the samples' own span is within an interval of it
        row["step"] = window(at(a), at(b), pid, main_comm, hz)
        row["peak_rss_bytes"] = max((s["rss"] for s in samples if a <= s["t"] <= b and "rss" in s), default=None)
        steps.append(row)
    return steps


def summarize(steps: list[dict[str, Any]]) -> dict[str, Any]:
    """Medians over steps, per phase and metric."""
    def med(vals: list[float]) -> float | None:
        vals = [v for v in vals if v is not None]
        return statistics.median(vals) if vals else None

    peaks = [s["peak_rss_bytes"] for s in steps if s.get("peak_rss_bytes")]
    out: dict[str, Any] = {"s_per_step": med([s["seconds"] for s in steps]),
                           "peak_rss_bytes": max(peaks) if peaks else None}  # sampled every interval
    for ph in (*PHASES, "step"):
        keys = {k for s in steps for k in s[ph] if k != "thread_cpu_s"}
        out[ph] = {k: med([s[ph].get(k) for s in steps]) for k in sorted(keys)}
        roles = {r for s in steps for r in s[ph].get("thread_cpu_s", {})}
        out[ph]["thread_cpu_s"] = {r: med([s[ph].get("thread_cpu_s", {}).get(r, 0.0) for s in steps])
                                   for r in sorted(roles)}
    return out


# ------------------------------------------------------------------------------------------ report
def _fmt(v: Any, unit: str = "", nd: int = 3) -> str:
    return "-" if v is None else f"{v:.{nd}f}{unit}"


def markdown(report: dict[str, Any]) -> str:
    lines = [f"# Step timeline ({report['timestamp']})", "",
             f"`{report['command']}` on {report['hardware']['cpu_count']} cores ({report['hardware']['cpu_model']}); "
             f"model `{report['model']}`, batch {report['settings']['batch']} x {report['settings']['seq']}, "
             f"{report['settings']['warmup']} warm-up + {report['settings']['steps']} timed steps per run, "
             f"medians over the steps of every run of a variant.", ""]
    for name, v in report["variants"].items():
        runs = " / ".join(_fmt(r, " s") for r in v["s_per_step_per_round"])
        peak = v["summary"].get("peak_rss_bytes")
        lines += [f"## {name}: {_fmt(v['summary']['s_per_step'], ' s')} per step (rounds: {runs}), peak RSS "
                  f"{_fmt(peak / 2**30 if peak else None, ' GiB', 2)} (sampled in the timed steps)", "",
                  "| phase | s | cores user | cores system | read GB | write GB | disk busy s | minor faults "
                  "| CPU s by thread |", "|---|---|---|---|---|---|---|---|---|"]
        for ph in (*PHASES, "step"):
            p = v["summary"][ph]
            threads = ", ".join(f"{r} {s:.2f}" for r, s in sorted(p["thread_cpu_s"].items(), key=lambda kv: -kv[1])
                                if s >= 0.005)
            lines.append(f"| {ph} | {_fmt(p.get('seconds'))} | {_fmt(p.get('cores_user'), nd=2)} | "
                         f"{_fmt(p.get('cores_system'), nd=2)} | {_fmt(p.get('read_gb'))} | "
                         f"{_fmt(p.get('write_gb'))} | {_fmt(p.get('disk_busy_s'))} | "
                         f"{_fmt(p.get('minor_faults'), nd=0)} | {threads} |")
        lines.append("")
    if len(report["variants"]) > 1:
        base, *others = report["variants"].items()
        for name, v in others:
            r = v["summary"]["s_per_step"] / base[1]["summary"]["s_per_step"]
            lines.append(f"- {name} / {base[0]}: {r:.3f}x the step time (interleaved rounds)")
        lines.append("")
    lines += ["Phases: backward = step start to the end of `Engine._backward` (with the forward when the step "
              "before did not run it); after_gate = `Engine._finish_updates` (the deferred optimizer pass, the "
              "next forward beside it); rest = the remainder. Cores are the whole machine's (/proc/stat); "
              "disk columns are the device holding the states; thread CPU is the lohan process's, by role."]
    return "\n".join(lines) + "\n"


def plot(report: dict[str, Any], run: dict[str, Any], path: Path) -> Path | None:
    try:
        import matplotlib
        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return None
    steps = [m for m in run["marks"] if m[0] == "step"][:3]
    if not steps:
        return None
    t0, t1 = steps[0][1], steps[-1][2]
    S = [s for s in run["samples"] if t0 - 0.05 <= s["t"] <= t1 + 0.05]
    ts, rd, wr, cores = [], [], [], []
    ncpu = os.cpu_count() or 1
    for a, b in zip(S, S[1:]):
        dtt = b["t"] - a["t"]
        ts.append((a["t"] + b["t"]) / 2 - t0)
        if a["disk"] and b["disk"]:
            rd.append((b["disk"][0] - a["disk"][0]) / dtt / 1e9)
            wr.append((b["disk"][1] - a["disk"][1]) / dtt / 1e9)
        c = [y - x for x, y in zip(a["cpu"], b["cpu"])]
        cores.append((1 - (c[3] + c[4]) / (sum(c) or 1)) * ncpu)
    fig, (ax1, ax2) = plt.subplots(2, 1, figsize=(11, 5.5), sharex=True)
    if rd:
        ax1.plot(ts, rd, label="read GB/s", lw=0.9)
        ax1.plot(ts, wr, label="write GB/s", lw=0.9)
    ax1.set_ylabel("SSD GB/s")
    ax1.legend(loc="upper right", fontsize=8)
    k = 5  # /proc/stat counts 10 ms ticks: a 50 ms moving average makes the share readable
    smooth = [sum(cores[max(0, i - k // 2):i + k // 2 + 1]) / len(cores[max(0, i - k // 2):i + k // 2 + 1])
              for i in range(len(cores))]
    ax2.plot(ts, smooth, color="k", lw=0.9)
    ax2.set_ylabel("cores busy (50 ms mean)")
    ax2.set_ylim(0, ncpu + 0.1)
    ax2.set_xlabel("seconds")
    colors = {"_backward": "tab:blue", "_finish_updates": "tab:orange"}
    for n, x, y in run["marks"]:
        if n in colors and t0 <= x <= t1:
            for ax in (ax1, ax2):
                ax.axvspan(x - t0, y - t0, color=colors[n], alpha=0.12, lw=0)
    ax1.set_title(f"{report['model']}: 3 steps of '{next(iter(report['variants']))}' "
                  "(blue: backward, orange: after the gate)", fontsize=10)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path


def _value(v: str) -> Any:
    return {"true": True, "false": False}.get(v.lower(), int(v) if v.lstrip("-").isdigit() else
                                              (float(v) if v.replace(".", "", 1).lstrip("-").isdigit() else v))


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--child", action="store_true", help=argparse.SUPPRESS)
    p.add_argument("--work", help=argparse.SUPPRESS)
    p.add_argument("--settings", default="{}", help=argparse.SUPPRESS)
    p.add_argument("--result", help=argparse.SUPPRESS)
    p.add_argument("--model-dir", help="a local Hugging Face model (default: vs_deepspeed.py's 110M Llama)")
    p.add_argument("--quick", action="store_true", help="2 warm-up + 4 timed steps")
    p.add_argument("--warmup", type=int, default=None, help="discarded steps per run (default 3, quick 2)")
    p.add_argument("--steps", type=int, default=None, help="timed steps per run (default 10, quick 4)")
    p.add_argument("--batch", type=int, default=1)
    p.add_argument("--seq", type=int, default=512)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--set", action="append", default=[], metavar="KEY=VALUE",
                   help="an EngineConfig field for every run, e.g. max_inflight_blocks=2 (repeatable)")
    p.add_argument("--compare", metavar="KEY=A,B", help="variants of one EngineConfig field, run interleaved")
    p.add_argument("--rounds", type=int, default=1, help="runs of each variant (default 1)")
    p.add_argument("--interval", type=float, default=0.01, help="seconds between samples (default 0.01)")
    p.add_argument("--scratch", type=Path, default=REPO / "benchmarks" / "scratch" / "step_timeline")
    p.add_argument("--out", type=Path, default=None, help="report path (.json; .md and .png next to it)")
    a = p.parse_args(argv)
    if a.warmup is None:
        a.warmup = 2 if a.quick else 3
    if a.steps is None:
        a.steps = 4 if a.quick else 10
    if a.child:
        return child(a)
    if not os.path.exists("/proc/diskstats"):
        p.error("step_timeline.py samples /proc: it runs on Linux only")
    base: dict[str, Any] = {}
    for kv in a.set:
        k, sep, v = kv.partition("=")
        if not sep:
            p.error(f"--set {kv!r}: expected KEY=VALUE")
        base[k] = _value(v)
    variants: dict[str, dict[str, Any]] = {"defaults" if not base else ",".join(a.set): base}
    if a.compare:
        k, sep, vs = a.compare.partition("=")
        if not sep or "," not in vs:
            p.error(f"--compare {a.compare!r}: expected KEY=A,B[,C...]")
        variants = {f"{k}={v}": {**base, k: _value(v)} for v in vs.split(",")}
    # vs_deepspeed.py's model, made on first use and kept (vs_deepspeed.py --keep-models finds it too)
    model_dir = Path(a.model_dir) if a.model_dir else vd.ensure_model("110m", REPO / "benchmarks" / "scratch"
                                                                      / "vs_deepspeed", [])
    results: dict[str, dict[str, Any]] = {n: {"settings": s, "runs": []} for n, s in variants.items()}
    first_run: dict[str, Any] | None = None
    for r in range(a.rounds):
        for name, s in variants.items():
            print(f"step_timeline: {name}, round {r + 1}/{a.rounds} ...", flush=True)
            run = run_once(s, model_dir, a.scratch / "work", a)
            first_run = first_run or run
            steps = analyze(run)
            results[name]["runs"].append(steps)
            print(f"  {statistics.median(x['seconds'] for x in steps):.3f} s per step", flush=True)
    variants_out: dict[str, Any] = {}
    for name, v in results.items():
        every = [s for steps in v["runs"] for s in steps]
        variants_out[name] = {"settings": v["settings"], "summary": summarize(every),
                              "s_per_step_per_round": [statistics.median(x["seconds"] for x in st) for st in v["runs"]],
                              "steps": v["runs"]}
    report = {"timestamp": dt.datetime.now(dt.timezone.utc).isoformat(timespec="seconds"),
              "command": "python benchmarks/step_timeline.py " + " ".join(portable(x) for x in sys.argv[1:]),
              "hardware": {"cpu_count": os.cpu_count(), "cpu_model": cpu_model(), "kernel": platform.release()},
              "model": model_dir.name, "disk_stats": bool(first_run and first_run["disk_stats"]),
              "settings": {"batch": a.batch, "seq": a.seq, "warmup": a.warmup, "steps": a.steps,
                           "interval_s": a.interval, "rounds": a.rounds},
              "lohan": first_run["info"] if first_run else None, "variants": variants_out}
    if len(variants_out) > 1:
        (b, bv), *rest = variants_out.items()
        report["ratio_vs_first"] = {n: v["summary"]["s_per_step"] / bv["summary"]["s_per_step"] for n, v in rest}
    variant = {"quick": a.quick, "model": report["model"] if a.model_dir else None,
               "compare": a.compare.partition("=")[0] if a.compare else None}
    report.update(result_fields("step_timeline", variant))
    out = result_path("step_timeline", variant, a.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(report, indent=1) + "\n")
    out.with_suffix(".md").write_text(markdown(report))
    png = plot(report, first_run, out.with_suffix(".png")) if first_run else None
    print(markdown(report))
    print(f"wrote {out}, {out.with_suffix('.md')}" + (f", {png}" if png else ""))
    return 0


if __name__ == "__main__":
    sys.exit(main())
