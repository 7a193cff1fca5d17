"""A GPU box's lanes on a CPU box (issue 38): serial and optimized active gradient offloading in four regimes, each
lane measured by the engine and predicted by the cost model, in one vocabulary (gpu, m2g, g2m, ssd, cpu).

The box is emulated: the simulated device (``device: sim``) with a timing model (``sim_gpu``: its compute stream
stays busy for the modeled time of its FLOPs, sleeping, and copies take their modeled PCIe time on separate
upload and download engines), the NVMe directory paced to a modeled SSD (``emulate_ssd_gbps``, reads and writes
sharing it), and a model whose real CPU compute is small (short sequences, fp32), so that compute no longer takes
the cores AdamW, hashing and the I/O need. The CPU lane's rate (AdamW and the records' hashing) is measured on
this box first, in serial steps per state format; each regime's modeled GPU and SSD are chosen from the cost model
(`planner.predict_lanes`) so that its lanes stand as the regime says; then the rate is measured again in serial
steps on each regime's own box (its paced store, its records resident or streamed: what the two cores also copy
and hash there), and the regime's GPU and SSD are chosen once more at that rate. Its lanes are priced at the rate measured so
again before each of its rounds (a separate store; the median over the rounds): the box's speed drifts by a tenth
or more between minutes, and a rate measured minutes before its runs missed them by as much.
(A rate measured per mode on that box was tried: on two cores the update shares them with the I/O threads' copies,
the hash threads and the device's dispatch, and how much of that runs beside it depends on the schedule; but three
calibration steps of one configuration spread by up to a third between runs, more than the schedules differ, and the
errors grew.) The regimes:

- ``disk``: records streamed from one paced directory, the ssd lane 5x the cpu lane (at 3x the host's whole CPU
  work, ~1.2-1.4 core-seconds a step on two cores, came to ~0.6 s of a ~0.8 s step: the cores, not the disk, set it);
- ``optimizer``: every record resident in main memory and written every few steps (``persist_every`` auto), a
  fast modeled GPU: the cpu lane binds;
- ``gpu``: a slow modeled GPU, its lane 3x the others;
- ``balanced``: the gpu, cpu and ssd lanes equal (as on the paper's box at 13B).

Per regime a store is made once; then rounds, each opening a fresh engine per mode (serial, optimized, in an
order rotated by the round) for ``--warmup-steps`` discarded and ``--steps`` measured steps. Medians per mode.

JSON keys: ``step_over_slowest_lane_{disk,optimizer,gpu}`` (optimized step / its slowest measured lane; target
<= 1.10), ``optimized_vs_serial_balanced`` (>= 1.3), ``optimized_vs_serial_disk`` (>= 1.0),
``gpu_idle_fraction_gpu_bound`` (1 - gpu lane / step, optimized; <= 0.10), ``p16_wait_fraction`` (max over
regimes of the optimized step's waits for P16 being read or copied in, forward and backward, over the step; <= 0.05;
a forward that follows the optimizer's pass waits for its updates instead, reported as ``provision_wait_fraction``),
``max_lane_prediction_error`` (max over regimes, modes and the lanes that are >= 10% of the step, of
|measured - predicted| / measured; <= 0.15); ``steal_fraction`` (not a target: the most of the box's CPU its
hypervisor took in any regime's measured steps or calibrations, which stretches wall-clock lanes while their work
stays); and every regime's raw figures under ``regimes``.

Without the timing model (a lohan whose EngineConfig has no ``sim_gpu``) the device's compute is the CPU's own
and the report says so (``timed_device: false``): its numbers are then not a GPU box's.

``--device-compute modeled`` (the default; ``sim_gpu`` ``compute=modeled``) skips the device's arithmetic and its
copies' bytes: each op takes only its modeled time. Run for real (``real``), the emulated GPU's math and memcpy take
the same two cores as AdamW, hashing and the I/O threads, a contention a GPU box does not have (there they run on
the GPU and its copy engines); modeled, only the host's own work (dispatch, the optimizer, hashing, I/O) runs.
Exactness is the equivalence suite's job (the simulated device computing for real). The report says which
(``device_compute``).

    python benchmarks/lane_bench.py --quick --nvme /mnt/scratch/lanes   # results/lane_bench/quick/<machine>.{json,md}
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import signal
import statistics
import sys
import time
from pathlib import Path
from typing import Any

from bench_env import (  # sibling module (the script's own directory)
    cpu_model,
    cpu_ticks,
    package_version,
    portable,
    result_fields,
    result_path,
    steal_fraction,
)

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))  # run as a script from a checkout, without installing the package

from ago_bench import make_batches, round_order  # noqa: E402  (a sibling: the same data stream and rotation)

GiB = 1 << 30
STORE_NAME = "lanebench"
CALIBRATION_STORE = "lanebench_cal"  # a regime's calibration before each round: its own store, the rounds' untouched
MODES = ("serial", "optimized")
MAIN_LANES = ("gpu", "m2g", "g2m", "ssd", "cpu")  # planner.LANES_B
REGIMES = ("disk", "optimizer", "gpu", "balanced")
PCIE = 25e9  # modeled PCIe per direction (B/s): the copies are not what these regimes study
CALIBRATION_STEPS = 4  # serial steps that measure the CPU lane's rate (the first one is not counted)
MATTERS = 0.10  # a lane counts in the prediction error from this share of the step
FIXED_SSD_GBPS = 2.0  # a regime's SSD where its shape does not solve it (the optimizer regime's, which persists rarely)
TARGETS = {"step_over_slowest_lane_disk": ("<=", 1.10), "step_over_slowest_lane_optimizer": ("<=", 1.10),
           "step_over_slowest_lane_gpu": ("<=", 1.10), "optimized_vs_serial_balanced": (">=", 1.3),
           "optimized_vs_serial_disk": (">=", 1.0), "gpu_idle_fraction_gpu_bound": ("<=", 0.10),
           "p16_wait_fraction": ("<=", 0.05), "max_lane_prediction_error": ("<=", 0.15)}


@dataclasses.dataclass(frozen=True)
class Regime:
    """One regime's emulated box: the modeled GPU (FLOP/s), the paced SSD (GB/s per directory), resident records."""

    name: str
    tflops: float
    ssd_gbps: float
    resident_mem: int | str
    state_format: str = "exact"
    persist_every: int | str = 1
    compute: str = "real"  # the device's arithmetic: run for real, or only its modeled time (--device-compute)

    @property
    def rate_key(self) -> str:
        """The CPU lane's calibration this regime is priced with (`calibrate_cpu`): its state format, and whether
        its steps hash records (every step durable) or keep them in RAM (`engine.persist_every` auto)."""
        return self.state_format if self.persist_every == 1 else f"{self.state_format}, in RAM"

    @property
    def sim_gpu(self) -> str:
        return sim_spec(self.tflops, self.compute)


def sim_spec(tflops: float, compute: str) -> str:
    """The modeled GPU: `tflops`, PCIe both ways, and whether its arithmetic runs (``compute=modeled``: no)."""
    return f"tflops={tflops:.6g},h2d={PCIE / 1e9:g}GB/s,d2h={PCIE / 1e9:g}GB/s" + (
        "" if compute == "real" else f",compute={compute}")


def default_nvme() -> str:
    """Where the emulated SSDs live by default: a tmpfs directory when the machine has one. The pacing of a
    directory (`emulate_ssd_gbps`) is only as exact as the medium under it keeps up: this project's disk reads
    ~1.3 GB/s and writes ~2.5 GB/s with a noisy spread (results/io_bench_quick.md), below what the balanced and
    optimizer regimes ask, while main memory keeps up with any rate here. The price: buffered I/O copies through
    the page cache on the CPU (O_DIRECT is refused there), a few tens of ms a step that the cores also spend."""
    shm = Path("/dev/shm")
    if shm.is_dir() and os.access(shm, os.W_OK):
        return str(shm / "lohan_lane_bench")
    return str(REPO / "benchmarks" / "scratch" / "lanes")


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--quick", action="store_true", help="3 rounds x (3 warm-up + 3 steps) per mode and regime")
    p.add_argument("--nvme", nargs="+", default=[default_nvme()],
                   help="the emulated SSDs' directories (default: a tmpfs one, see default_nvme)")
    p.add_argument("--model", default="125m")
    p.add_argument("--layers", type=int, default=12)
    p.add_argument("--d-model", type=int, default=768)
    p.add_argument("--vocab", type=int, default=4096)
    p.add_argument("--batch-size", type=int, default=1)
    p.add_argument("--seq-len", type=int, default=32)
    p.add_argument("--regimes", nargs="+", choices=REGIMES, default=list(REGIMES))
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--warmup-steps", type=int, default=2)
    p.add_argument("--steps", type=int, default=4)
    p.add_argument("--cpu-mem", default="4GiB")
    p.add_argument("--device-compute", choices=("real", "modeled"), default="modeled",
                   help="the emulated GPU's arithmetic: skipped, only its modeled time passing (modeled, the default: "
                        "a GPU box's host, whose cores the GPU's math does not take), or run on this CPU (real: "
                        "bit-exact, on the cores the CPU lanes need)")
    p.add_argument("--out", default=None, help="JSON path (default results/lane_bench[/quick]/<machine>.json)")
    a = p.parse_args(argv)
    if a.quick:
        # three warm-up steps: the first profiles and plans; the second runs the schedule the plan, priced at
        # the first step's measured CPU rate, chooses (clip_mode auto: updates during backward or after it); the
        # third may be the first of a schedule that changed, which runs a forward twice (a deferred step after a
        # speculated one: its own and the next one's) or not at all, so steady steps start at the fourth. Three
        # rounds: a regime's CPU rate moved by up to 40% between two of its rounds here (a VM whose hypervisor took
        # up to a third of its CPU in some minutes), and a median of three calibrations and nine steps per mode
        # lets one such round not set the price
        a.rounds, a.warmup_steps, a.steps = 3, 3, 3
    return a


# ------------------------------------------------------------------------------------------- the box
def timed_device() -> bool:
    """Whether this lohan's simulated device has a timing model (`EngineConfig.sim_gpu`)."""
    from lohan.config import EngineConfig

    return hasattr(EngineConfig, "sim_gpu")  # (a field, or since the config has sections its alias)


def hardware(regime: Regime, cpu_rates: dict[str, float], n_dirs: int) -> Any:
    """The cost model's description of a regime's emulated box. The planner prices a format's update as
    ``update_cost`` times exact's; the CPU lane's rate measured in the regime's own format (on its own box where
    `cpu_rates` has the regime's name, else on the unpaced calibration store) is given back as the exact rate it
    implies, so the lane is priced at what was measured."""
    from lohan.plan.formats import state_format
    from lohan.plan.planner import Hardware

    ssd = regime.ssd_gbps * 1e9 * n_dirs
    measured = cpu_rates.get(regime.name, cpu_rates.get(regime.rate_key))
    rate = measured * state_format(regime.state_format).update_cost
    return Hardware(f"lane_bench-{regime.name}", thp_g=regime.tflops * 1e12, bw_g=PCIE, bw_s2m=ssd, bw_m2s=ssd,
                    mem_avail=64 * GiB, cpu_adam_params_per_s=rate)


def predicted(args: argparse.Namespace, mcfg: Any, regime: Regime, cpu_rates: dict[str, float],
              mode: str, deferred: bool | None = None) -> dict[str, float]:
    """The cost model's lanes for `regime` in `mode`, for the schedule its plan says a run takes, or where
    `deferred` is given that one (the schedule the run's own measurements chose: `clip_schedule`)."""
    from lohan.config import parse_bytes
    from lohan.plan.planner import predict_lanes

    return predict_lanes(mcfg, hardware(regime, cpu_rates, len(args.nvme)), args.batch_size, args.seq_len, mode,
                         deferred=deferred, compute_dtype="fp32", resident_mem=regime.resident_mem, cpu_mem=parse_bytes(args.cpu_mem),
                         readahead_mem="auto" if mode == "optimized" else 0, state_format=regime.state_format,
                         persist_every=regime.persist_every)  # (serial runs the regime's interval too)


def calibrate_cpu(args: argparse.Namespace, mcfg: Any, state_format: str = "exact", persist_every: int | str = 1,
                  regime: Regime | None = None, name: str = STORE_NAME, steals: list[float] | None = None) -> float:
    """The CPU lane's rate as the engine runs it (parameters per second of AdamW and the records' hashing): the
    median of serial steps on an unpaced store with every record resident, or on `regime`'s own box (its paced
    store, modeled GPU, format, resident records: the two cores also copy what it reads and writes, and hash what it
    reads). With ``persist_every`` auto, the steps between durable ones instead (optimized mode), which hash no
    record: the optimizer regime's steps.
    `measure_cpu_adam` times the kernel
    alone on an idle machine; in a step it shares two cores with the I/O threads, the hash threads and the
    device's real compute, and ran ~4x slower here (benchmarks/results/lane_bench_quick.md), so a rate measured
    alone would put every regime's GPU and SSD where the lanes are not. The CPU time stolen from the box in each
    counted step goes into `steals` where given."""
    import lohan
    from lohan.config import EngineConfig

    if regime is not None:
        state_format, persist_every = regime.state_format, regime.persist_every
    in_ram = persist_every != 1
    mode = "optimized" if in_ram else "serial"
    cfg = engine_config(args, regime, mode, name) if regime is not None else EngineConfig(
        nvme=tuple(args.nvme), cpu_mem=args.cpu_mem, compute_dtype="fp32", backend="threads", device="sim", mode=mode,
        resident_mem="all", name=STORE_NAME, max_grad_norm=0.0, state_format=state_format,
        persist_every=persist_every, **({"sim_gpu": sim_spec(1000, args.device_compute)} if timed_device() else {}))
    data = make_batches(mcfg.vocab_size, args.batch_size, args.seq_len, CALIBRATION_STEPS + 1, seed=1)
    with lohan.init(mcfg, cfg, overwrite=True) as engine:
        cpu = []
        for k in range(CALIBRATION_STEPS):
            ticks = cpu_ticks()
            engine.step(data[k], next_batch=data[k + 1])
            if k and engine.last_stats.durable != in_ram:  # (the first step also profiles)
                cpu.append(engine.last_stats.lanes["cpu"])
                stolen = steal_fraction(ticks, cpu_ticks())
                if steals is not None and stolen is not None:
                    steals.append(stolen)
        params = engine.store.layout.param_count  # (the blocks the optimizer updates)
    if not cpu:
        raise RuntimeError(f"calibrating {state_format} (persist_every {persist_every}): no step of the kind "
                           "measured (every step durable: the records' writes too short for an interval?)")
    return params / statistics.median(cpu)


SHAPES = {  # regime: (state format, resident records, gpu lane / cpu lane, ssd lane / cpu lane (None: FIXED_SSD_GBPS),
    #            persist_every), the lanes predicted
    "disk": ("exact", 0, 0.9, 5.0, 1),
    # records in RAM, written every few steps (persist_every auto), so the SSD hardly works; a fast GPU: with
    # clipping off the steps between durable ones update in place during backward (lohan.runtime.held)
    "optimizer": ("8bit-moments", "all", 0.1, None, "auto"),
    "gpu": ("exact", 0, 6.0, 3.0, 1),
    "balanced": ("8bit-moments", 0, 1.0, 1.0, 1),
}
"""Why 8bit-moments where the cpu lane must meet or beat the ssd lane: exact's CPU update here runs ~180 M
params/s in a step, so an SSD lane as short as it needs ~5 GB/s of paced I/O, which two cores cannot copy
through tmpfs while they also run AdamW (the memcpy costs about what the update does). 8bit-moments' update
costs ~13x more CPU per parameter for half the bytes, so those lanes meet at ~1 GB/s. The GPU-bound regime asks
the SSD for 3x the cpu lane in exact (~1.7 GB/s on a Xeon box, ~2.8 on the EPYC), the disk-bound one for 5x (~1.7
on the EPYC), which tmpfs keeps; at 3x the disk-bound step was set by the two cores' whole work (the report's
``host CPU / cores``), not by the disk."""


def choose_regimes(args: argparse.Namespace, mcfg: Any, cpu_rates: dict[str, float]) -> list[Regime]:
    """Each regime's modeled GPU and SSD from the cost model (`SHAPES`): the gpu lane scales as 1 / FLOP/s and the
    ssd lane as 1 / GB/s, so a prediction at unit rates gives the rates that put the lanes where the regime wants
    them; the plan (what is swapped, recomputed) moves with the rates, so it is settled in three more rounds."""
    out = []
    for name in args.regimes:
        fmt, resident, gpu_x, ssd_x, persist = SHAPES[name]
        regime = Regime(name, 1.0, FIXED_SSD_GBPS if ssd_x is None else 1.0, resident, fmt, persist,
                        args.device_compute)
        for _ in range(4):
            got = predicted(args, mcfg, regime, cpu_rates, "optimized")
            ssd = regime.ssd_gbps if ssd_x is None else regime.ssd_gbps * got["ssd"] / (ssd_x * got["cpu"])
            regime = dataclasses.replace(regime, tflops=regime.tflops * got["gpu"] / (gpu_x * got["cpu"]),
                                         ssd_gbps=ssd)
        out.append(regime)
    return out


def command(argv: list[str]) -> str:
    """The command line as run, the paths of this machine (``--nvme``, ``--out``) written as placeholders."""
    words, hide = ["python", "benchmarks/lane_bench.py"], False
    for w in argv:
        if w.startswith("--"):
            hide = w in ("--nvme", "--out")
            words.append(w)
        else:
            words.append("<path>" if hide else w)
    return " ".join(words)


# ------------------------------------------------------------------------------------------- running
def engine_config(args: argparse.Namespace, regime: Regime, mode: str, name: str = STORE_NAME) -> Any:
    from lohan.config import EngineConfig

    sim = {"sim_gpu": regime.sim_gpu} if timed_device() else {}
    return EngineConfig(nvme=tuple(args.nvme), cpu_mem=args.cpu_mem, compute_dtype="fp32", backend="threads",
                        device="sim", mode=mode, resident_mem=regime.resident_mem, name=name,
                        emulate_ssd_gbps=regime.ssd_gbps, max_grad_norm=0.0, state_format=regime.state_format,
                        persist_every=regime.persist_every, **sim)


def run_opening(args: argparse.Namespace, mcfg: Any, regime: Regime, mode: str, rnd: int,
                data: list[tuple[Any, Any]], cursor: int) -> list[dict]:
    """A fresh engine on the regime's store in `mode`: warm-up, then measured steps; one record per step."""
    import lohan
    from lohan.runtime.heap import release_free_memory

    records = []
    with lohan.init(mcfg, engine_config(args, regime, mode), resume=True) as engine:
        for k in range(args.warmup_steps + args.steps):
            batch, nxt = data[(cursor + k) % len(data)], data[(cursor + k + 1) % len(data)]
            cpu0, ticks = time.process_time(), cpu_ticks()
            engine.step(batch, next_batch=nxt)
            s = engine.last_stats
            records.append({"regime": regime.name, "mode": mode, "round": rnd, "warmup": k < args.warmup_steps,
                            "step_s": s.step_s, "lanes": dict(s.lanes), "deferred": s.deferred,
                            "durable": s.durable, "host_cpu_s": time.process_time() - cpu0,
                            "steal": steal_fraction(ticks, cpu_ticks())})
    release_free_memory()  # the engine's freed pools would stay in the heap for the next opening
    return records


def run_regime(args: argparse.Namespace, mcfg: Any, regime: Regime,
               log: Any) -> tuple[list[dict], list[float], list[float | None]]:
    """Make the regime's store once, then interleave the modes in rounds, each opened by a calibration of the CPU
    lane's rate on the regime's box (its own store): the records, the rates per round, and the share of the box's
    CPU stolen in each round's calibration (`bench_env.steal_fraction`)."""
    import lohan

    lohan.init(mcfg, engine_config(args, regime, MODES[-1]), overwrite=True).close()
    n = args.rounds * len(MODES) * (args.warmup_steps + args.steps) + 1
    data = make_batches(mcfg.vocab_size, args.batch_size, args.seq_len, n, seed=0)
    records, cursor, rates, cal_steal = [], 0, [], []
    for rnd in range(args.rounds):
        steals: list[float] = []
        rates.append(calibrate_cpu(args, mcfg, regime=regime, name=CALIBRATION_STORE, steals=steals))
        cal_steal.append(median_of(steals))
        for _, mode in round_order([(regime.name, m) for m in MODES], rnd, args.rounds):
            recs = run_opening(args, mcfg, regime, mode, rnd, data, cursor)
            cursor += len(recs)
            records += recs
            measured = [r for r in recs if not r["warmup"]]
            med = statistics.median(r["step_s"] for r in measured)
            log(f"  {regime.name:9s} round {rnd} {mode:9s} step {med:.3f} s, cpu lane "
                f"{statistics.median(r['lanes'].get('cpu', 0.0) for r in measured):.3f} s, "
                f"stolen {percent(median_of(r['steal'] for r in measured))} (calibration "
                f"{rates[-1] / 1e6:.1f} M params/s, stolen {percent(cal_steal[-1])})")
    return records, rates, cal_steal


def median_of(values: Any) -> float | None:
    """The median of the values that are not None (None if there is none)."""
    xs = [v for v in values if v is not None]
    return statistics.median(xs) if xs else None


def percent(x: float | None) -> str:
    return "n/a" if x is None else f"{100 * x:.1f}%"


# ------------------------------------------------------------------------------------------- summary
def summarize(args: argparse.Namespace, mcfg: Any, regime: Regime, cpu_rates: dict[str, float],
              records: list[dict]) -> dict:
    """Per mode: the median step, the median of each measured lane, the cost model's lanes, their errors."""
    out: dict[str, Any] = {"regime": dataclasses.asdict(regime), "sim_gpu": regime.sim_gpu, "modes": {}}
    for mode in MODES:
        rs = [r for r in records if r["mode"] == mode and not r["warmup"]]
        step = statistics.median(r["step_s"] for r in rs)
        names = sorted({k for r in rs for k in r["lanes"]})
        lanes = {k: statistics.median(r["lanes"].get(k, 0.0) for r in rs) for k in names}
        # the lanes of the schedule most of the measured steps took (clip_mode auto tries both, then keeps the
        # faster: which one the run ends on is the measurements' choice, not the model's)
        deferred = sum(bool(r.get("deferred")) for r in rs) / len(rs)
        pred = predicted(args, mcfg, regime, cpu_rates, mode, deferred >= 0.5 if mode != "serial" else None)
        # every thread's CPU seconds over the cores: the host's whole work (AdamW, hashing, the emulated SSDs'
        # copies, the dispatch), a lane the cost model does not have (a GPU box has the cores to spare)
        host = statistics.median(r.get("host_cpu_s", 0.0) for r in rs) / (os.cpu_count() or 1)
        main = {k: lanes[k] for k in MAIN_LANES if k in lanes}
        slowest = max(main, key=main.__getitem__)
        errors = {k: abs(main[k] - pred[k]) / main[k] for k in main if main[k] >= MATTERS * step and main[k] > 0}
        out["modes"][mode] = {
            "steps": len(rs), "step_s": step, "step_s_all": [r["step_s"] for r in rs], "lanes": lanes,
            "predicted_lanes": pred, "predicted_slowest": max(pred, key=pred.__getitem__),
            "slowest_lane": slowest, "step_over_slowest_lane": step / main[slowest],
            "gpu_idle_fraction": 1 - main.get("gpu", 0.0) / step, "host_cpu_over_cores_s": host,
            # the steps whose update ran after backward, beside the next forward (clip_mode auto's choice)
            "deferred_fraction": deferred,
            # waits for P16 being read or copied in (what I/O priority is for); a forward that follows the
            # optimizer waits for its updates instead (`provision_wait`: the cpu lane binding, by the schedule)
            "p16_wait_fraction": lanes.get("param_wait", 0.0) / step,
            "provision_wait_fraction": lanes.get("provision_wait", 0.0) / step,
            # the box's CPU taken by the hypervisor in the measured steps: wall-clock lanes stretch by it
            "steal_fraction": median_of(r.get("steal") for r in rs),
            "lane_prediction_error": errors}
    m = out["modes"]
    out["optimized_vs_serial"] = m["serial"]["step_s"] / m["optimized"]["step_s"]
    return out


def headline(regimes: dict[str, dict]) -> dict[str, float | None]:
    """The issue's keys (module docstring); None for a key whose regime did not run."""
    def opt(name: str, key: str) -> float | None:
        return regimes[name]["modes"]["optimized"][key] if name in regimes else None

    errors = [e for r in regimes.values() for m in r["modes"].values() for e in m["lane_prediction_error"].values()]
    return {
        "step_over_slowest_lane_disk": opt("disk", "step_over_slowest_lane"),
        "step_over_slowest_lane_optimizer": opt("optimizer", "step_over_slowest_lane"),
        "step_over_slowest_lane_gpu": opt("gpu", "step_over_slowest_lane"),
        "optimized_vs_serial_balanced": regimes["balanced"]["optimized_vs_serial"] if "balanced" in regimes else None,
        "optimized_vs_serial_disk": regimes["disk"]["optimized_vs_serial"] if "disk" in regimes else None,
        "gpu_idle_fraction_gpu_bound": opt("gpu", "gpu_idle_fraction"),
        "p16_wait_fraction": max((r["modes"]["optimized"]["p16_wait_fraction"] for r in regimes.values()),
                                 default=None),
        "max_lane_prediction_error": max(errors, default=None),
    }


def box_steal(regimes: dict[str, dict]) -> float | None:
    """The most of the box's CPU stolen in any regime's measured steps or calibrations (medians over their steps;
    None where the machine does not say): the lanes are wall-clock, so a stolen share that moves between a
    calibration and the runs it prices moves the measured CPU lane against the predicted one by as much."""
    xs = [m["steal_fraction"] for r in regimes.values() for m in r["modes"].values()]
    xs += [x for r in regimes.values() for x in r.get("calibration_steal_fraction_rounds", [])]
    xs = [x for x in xs if x is not None]
    return max(xs, default=None)


def targets_met(keys: dict[str, float | None]) -> dict[str, bool | None]:
    return {k: None if keys[k] is None else (keys[k] <= t if op == "<=" else keys[k] >= t)
            for k, (op, t) in TARGETS.items()}


def markdown(report: dict) -> str:
    def f(x: Any, spec: str = ".3f") -> str:
        return "n/a" if x is None else format(x, spec)

    lines = [f"# lane_bench — {report['timestamp']}", "", f"`{report['command']}`", "",
             f"Emulated GPU box on {report['environment']['cpu_model']} ({report['environment']['cpu_count']} cores): "
             f"simulated device {'with' if report['timed_device'] else 'WITHOUT'} a timing model, SSD paced per "
             f"directory (tmpfs by default); model {report['model']}; the CPU lane's rate (the update and the records' "
             "hashing) measured in serial steps per state format on an unpaced store, then on each regime's box (and "
             "again before each of its rounds: the median of those prices its lanes), M params/s: " + ", ".join(
                 f"{k} {v / 1e6:.1f}" for k, v in report["cpu_update_params_per_s"].items())
             + f" (exact's kernel alone: {report['cpu_adam_params_per_s_alone'] / 1e6:.1f}).", "", "| key | value | target | met |", "|---|---|---|---|"]
    for k, (op, t) in TARGETS.items():
        lines.append(f"| {k} | {f(report[k])} | {op} {t} | {report['targets_met'][k]} |")
    lines += ["", f"CPU stolen from the box (most, over the regimes' measured steps and calibrations): "
              f"{percent(report.get('steal_fraction'))}.",
              "", "| regime | mode | step s | slowest | step/slowest | " + " | ".join(
        f"{k} meas/pred" for k in MAIN_LANES) + " | host CPU / cores | P16 wait | provision wait | deferred | stolen | max err |",
        "|---" * (11 + len(MAIN_LANES)) + "|"]
    for name, r in report["regimes"].items():
        for mode, m in r["modes"].items():
            cells = [f"{f(m['lanes'].get(k), '.3f')}/{f(m['predicted_lanes'].get(k), '.3f')}" for k in MAIN_LANES]
            lines.append(f"| {name} | {mode} | {m['step_s']:.3f} | {m['slowest_lane']} | "
                         f"{m['step_over_slowest_lane']:.2f} | " + " | ".join(cells) +
                         f" | {f(m.get('host_cpu_over_cores_s'))} | {m['p16_wait_fraction']:.3f} | {f(m.get('provision_wait_fraction'), '.3f')} | "
                         f"{f(m.get('deferred_fraction'), '.2f')} | {percent(m.get('steal_fraction'))} | "
                         f"{f(max(m['lane_prediction_error'].values(), default=None), '.2f')} |")
    lines += ["", "Modeled boxes (sim_gpu, SSD GB/s per directory, resident records, state format, persist_every): "
              + "; ".join(
        f"{n}: {r['sim_gpu']}, {r['regime']['ssd_gbps']:.3g} GB/s, resident {r['regime']['resident_mem']}, "
        f"{r['regime']['state_format']}, persist {r['regime'].get('persist_every', 1)}"
        for n, r in report["regimes"].items()), "",
        "Lanes are `engine.last_stats.lanes` (medians of the measured steps) and `planner.predict_lanes` for the "
        "same run; the error counts lanes >= 10% of the step. `host CPU / cores`: every thread's CPU seconds in the "
        "step over the cores, the host's whole work (AdamW, hashing, the emulated SSDs' copies, the dispatch), which "
        "the cost model does not price: where it nears the step, the cores, not the lanes, set it. `deferred`: the share of measured steps whose update "
        "ran after backward beside the next forward (clip_mode auto's choice; the others updated during backward). "
        "`stolen`: the share of the box's CPU time its hypervisor took in the measured steps (/proc/stat's steal): "
        "wall-clock lanes stretch by it while their work does not, so where it moves between a regime's "
        "calibrations and its runs, the cpu lane's prediction misses by about as much. "
        "Not modeled: kernel efficiency, the caching allocator, the real GPU's launch overheads. "
        + ("The device's arithmetic was skipped (`--device-compute modeled`): its ops took only their modeled time "
           "and its copies moved no bytes, as a GPU's take no host core; the host still ran every op's dispatch, "
           "the optimizer, hashing and I/O for real (losses not meaningful)."
           if report.get("device_compute") == "modeled" else
           "The CPU's compute of the model still ran for real (`--device-compute real`; short sequences keep it "
           "small), on the cores the CPU lanes also need.")]
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    t0 = time.perf_counter()

    def log(msg: str) -> None:
        print(f"[{time.perf_counter() - t0:7.1f}s] {msg}", flush=True)

    from lohan.config import get_model_config

    mcfg = get_model_config(args.model, n_layer=args.layers, d_model=args.d_model, n_head=max(1, args.d_model // 64),
                            vocab_size=args.vocab, seq_len=max(args.seq_len, 64))  # heads 64 wide, as GPT-2's
    for d in args.nvme:
        os.makedirs(d, exist_ok=True)
    # SIGTERM (a timeout, a kill) ends the run as Ctrl-C does, through the `finally` below: its default action would
    # leave the stores on tmpfs (lohan holds it while a step writes, and delivers it after)
    before = signal.signal(signal.SIGTERM, lambda *_: sys.exit(128 + signal.SIGTERM))
    try:
        return measure_and_report(args, argv, mcfg, log, t0)
    finally:  # on tmpfs by default: a store left there would hold GBs of main memory until the next boot
        from lohan.store.opening import remove_store

        for name in (STORE_NAME, CALIBRATION_STORE):
            remove_store(list(args.nvme), name)
        signal.signal(signal.SIGTERM, before)  # (main may be called in a process that has its own)


def measure_and_report(args: argparse.Namespace, argv: list[str] | None, mcfg: Any, log: Any, t0: float) -> int:
    """Calibrate, choose the regimes, run them, and write the report (`main`)."""
    from lohan.app.fit import measure_cpu_adam

    alone = measure_cpu_adam(compute_dtype="fp32", checksums=True)
    kinds = sorted({(SHAPES[r][0], SHAPES[r][4]) for r in args.regimes}, key=str)
    cpu_rates = {Regime("", 0, 0, 0, fmt, persist).rate_key: calibrate_cpu(args, mcfg, fmt, persist)
                 for fmt, persist in kinds}
    regimes = choose_regimes(args, mcfg, cpu_rates)
    # measured again on each regime's own box, whose lanes are then placed (and priced) at that rate
    cpu_rates.update({r.name: calibrate_cpu(args, mcfg, regime=r) for r in regimes})
    regimes = choose_regimes(args, mcfg, cpu_rates)
    rates = ", ".join(f"{fmt} {r / 1e6:.1f}" for fmt, r in cpu_rates.items())
    log(f"{mcfg.name}: {mcfg.param_count() / 1e6:.1f}M params, batch {args.batch_size} x {args.seq_len}; CPU update "
        f"in a serial step (M params/s): {rates} (exact alone {alone / 1e6:.1f}); timed device: {timed_device()}")
    results = {}
    for regime in regimes:
        log(f"regime {regime.name}: {regime.sim_gpu}, SSD {regime.ssd_gbps:.3g} GB/s, resident {regime.resident_mem}, "
            f"{regime.state_format}")
        records, rates, cal_steal = run_regime(args, mcfg, regime, log)
        # priced at the rate of the rounds it ran in: the box's speed drifts by a tenth or more between minutes
        priced = {**cpu_rates, regime.name: statistics.median(rates)}
        results[regime.name] = summarize(args, mcfg, regime, priced, records)
        results[regime.name].update(records=records, cpu_update_params_per_s_rounds=rates,
                                    calibration_steal_fraction_rounds=cal_steal)
    keys = headline(results)
    report = {**keys, "targets_met": targets_met(keys), "steal_fraction": box_steal(results),
              "timestamp": time.strftime("%Y-%m-%d %H:%M:%S"),
              "command": command(argv if argv is not None else sys.argv[1:]),
              "emulated": True, "timed_device": timed_device(), "device_compute": args.device_compute,
              "cpu_update_params_per_s": cpu_rates,
              "cpu_adam_params_per_s_alone": alone,
              "model": {"name": mcfg.name, "n_layer": mcfg.n_layer, "d_model": mcfg.d_model,
                        "vocab_size": mcfg.vocab_size, "params": mcfg.param_count(), "batch": args.batch_size,
                        "seq": args.seq_len},
              "environment": {"cpu_model": cpu_model(), "cpu_count": os.cpu_count(),
                              "torch": package_version("torch")},
              "wall_s": time.perf_counter() - t0, "regimes": results}
    report.update(result_fields("lane_bench", {"quick": args.quick}))
    out = result_path("lane_bench", {"quick": args.quick}, args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    report = portable(report)  # no path of this machine in a committed report
    out.write_text(json.dumps(report, indent=2, default=str) + "\n")
    out.with_suffix(".md").write_text(markdown(report))
    log(f"wrote {out} and {out.with_suffix('.md').name}: " + ", ".join(
        f"{k} {'n/a' if v is None else f'{v:.3f}'}" for k, v in keys.items()))
    return 0


if __name__ == "__main__":
    sys.exit(main())
