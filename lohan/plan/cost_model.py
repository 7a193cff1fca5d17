"""Cost model of traffic-aware activation swapping (DESIGN §4.4): a swap set's step time, lane by lane.

Pure policy: no torch and no I/O (except the ``Profile.save``/``load`` JSON helpers), so plans can be
made, printed and tested on any machine. The engine executes a :class:`Plan`; this module never runs one.

Notation, per training step (bytes unless noted; the profile is for the whole step batch):

- ``P`` = ``param_count``; ``p16 = p16_itemsize * P`` (the "2P" of DESIGN: compute-precision params,
  and as many gradient bytes); ``states = (12 + p16_itemsize) * P`` (the "14P": P32, m, v and P16). In a
  compressed state format (`lohan.plan.formats`) the record's 12 bytes are ``Profile.record_bytes`` wherever
  12 appears below, and ``bf16-master`` stores no separate P16 (``Profile.separate_p16``).
- ``S``: the ops swapped in every block. The block inputs are always swapped (nothing inside a block
  can be recomputed without them); everything not in ``S`` is recomputed in backward.
- ``A_G2M(S) = (n_blocks - 1) * (input_bytes + sum(op.bytes for op in S))``: the last block's
  activations stay on the device because backward starts with it, so only n_blocks - 1 blocks move.
  With ``Profile.act_compress = "int8"`` every byte count of a record that leaves the device is its compressed one
  (``OpProfile.bytes_int8``, ``Profile.input_bytes_int8``: int8 codes plus an fp32 scale per row), and the ``gpu``
  lane pays ``R(S) / act_quant_bps`` in forward (quantizing them) and ``R(S) / act_dequant_bps`` in backward
  (dequantizing them), ``R(S) = (n_blocks - 1) * (input_bytes + sum(op.bytes for op in S))`` their raw bytes.
- ``FLOP_r(S) = n_blocks * sum(op.flops for op not in S)``: every block, the last included, recomputes.
- ``alpha = max(0, A_G2M - mem_avail)``: what main memory cannot hold goes on to SSD.

The lanes, each a resource that works in parallel with the others (the time one step keeps it busy):

- ``gpu``: forward ``flop_f / thp_g``; backward ``(2 flop_f + FLOP_r) / thp_g`` (backward is twice the
  forward, plus the recomputation of every op not swapped); with int8 records, plus their quantization (f) and
  dequantization (b).
- ``m2g`` (PCIe host -> device; the link is duplex, so each direction is its own lane): the block
  parameters P16 once in forward and once in backward (recomputation runs on the copy backward loads,
  so it moves nothing more), plus the swapped activations coming back in backward.
- ``g2m`` (PCIe device -> host): the swapped activations in forward; the G16 gradients in backward, which
  active gradient offloading hands to the CPU optimizer block by block.
- ``ssd`` (simplex: its reads and writes add): forward reads P16 and writes the activations main memory
  cannot hold; backward reads P16 again, the optimizer's P32, m, v (``store/states.py``: one record per block,
  ``P32 | m | v | P16``; the optimizer reads the first three and writes the whole record) and the
  overflowed activations, and writes P32, m, v, P16. So per step the SSDs read ``(12 + 2 s) P`` and write
  ``(12 + s) P`` bytes, at the *effective* bandwidths of :class:`Hardware` (see :class:`SsdSpec`); the
  records kept in main memory across steps (``Profile.resident_params``, ``pools.plan_resident``) are
  written but not read: ``12 R`` bytes less, nor is their P16 (copied from the record): ``2 s R`` less; and the
  P16 the parameter pool keeps over a turn
  (``Profile.kept_p16_params``, K) are read in neither pass: backward finds those forward read, the next forward
  those the update handed over: ``2 s K`` bytes less.
- ``cpu`` (backward only): the CPU AdamW, ``P / cpu_adam_params_per_s`` (the fp32 master, m and v
  updated and the P16 copy made). Active gradient offloading (DESIGN §4.3) runs the optimizer of block i
  while the GPU runs backward of block i-1, so it is one more lane of the backward phase. A rate of 0
  (a measured profile that does not know it) leaves the lane out: it reads 0.
- A LoRA step (``Profile.frozen``): the base takes no gradient, so backward's ``gpu`` lane is
  ``(flop_f + FLOP_r) / thp_g`` and ``g2m`` carries no G16; its optimizer fields are zero (``record_bytes`` 0, no
  separate P16, ``update_cost`` 0): no record is read or written and the ``cpu`` lane is empty.

Each phase is a pipeline over the ``n_blocks`` identical blocks: block i is on the SSD, then the link,
then the GPU (then, in backward, the link, the CPU and the SSD again) while its neighbours are on the
other lanes. ``n`` identical items through stages of per-item times ``L_k / n`` take
``max_k L_k + (sum_k L_k - max_k L_k) / n`` (the flow-shop makespan): the slowest lane for the whole
step plus one block's worth of every other lane to fill the pipeline and drain it (in backward: the first
block's backward before any gradient exists, and the last block's AdamW and write after the GPU is
done). That ``fill`` is the non-overlapped head and tail; the paper's equations (DESIGN §4.4) are the
``n -> infinity`` limit. It slightly over-counts the SSD reads of backward, which can run ahead::

    T_f = max(gpu, g2m, m2g, ssd)_f + fill_f
    T_b = max(gpu, g2m, m2g, ssd, cpu)_b + fill_b
    T_iter = T_f + T_b

With a durability interval (``persist_every`` N > 1, the next batch known), a step held in RAM updates the blocks
its backward has not reached in forward order once backward ends, the next forward following them, so that forward
hides under the cpu lane: such a step takes ``max(T_f + T_b0, T_b)`` (``T_b0``: backward without the optimizer),
and ``T_iter`` is the interval's mean, one durable step in N (`_held_iter`).

``t_serial`` is the same step with the optimizer after backward instead of under it (ZeRO-Infinity's
schedule, the engine's ``offload=serial``): backward without the optimizer's lanes, then a phase of
``cpu`` and the optimizer's SSD traffic; its forward reads every P16 (nothing is handed over). ``t_serial / t_iter`` is the gain of active gradient offloading.

Clipping (``engine.max_grad_norm`` > 0) needs the global gradient norm, known only when backward ends. ``T_iter``
is a *speculated* step that did not clip: every block updated at coefficient 1 under backward. Two more steps
are priced, each counted from its backward's start to the next step's (so its forward is the next step's, and
an unclipped step costs ``T_iter``; ``phase(L) = max(L) + (sum(L) - max(L)) / n``, the pipeline above):

- ``t_deferred``, a step whose update waits for the norm (``clip_mode: auto`` after a clipped step, ``defer``,
  and every step with ``slots=1``). Backward runs the lanes ``B0`` of ``t_serial``'s backward (no ``cpu``, the
  SSDs read P16 and the overflow); the SSD time the slowest of them leaves idle, ``idle = max(B0) - B0[ssd]``,
  takes first the READs of the records the read-ahead room holds (``Profile.readahead_params``), then, with
  ``follow`` and ``write_behind`` (two slots: the next batch's forward follows the update block by block, and
  the update's last writes complete during the next backward), the previous step's writes still in flight. The
  update phase ``U`` then runs AdamW over every block with the remaining READs and the writes, and with ``follow``
  (the next batch known; in place too) the next step's forward beside it, whose P16 come straight from the
  update (its ``gpu``, ``g2m`` and ``m2g`` lanes and its overflow writes, no P16 from the SSDs)::

      read  = 12 (P - R) / bw_s2m;  ahead = min(12 RA / bw_s2m, idle);  W = (12 + s) P / bw_m2s
      spill = min(W, idle - ahead) if follow and write_behind else 0
      B_def = B0 + {ssd: ahead + spill}
      U     = {cpu: P / rate, ssd: read - ahead + W - spill}  [+ T_f's gpu, g2m, m2g and alpha / bw_m2s: follow]
      t_deferred = [T_f if not follow] + phase(B_def) + phase(U)

  A deferred step's lanes (``Estimate.lanes_deferred``, what `Estimate.step_lanes` gives for a run that defers:
  `run_lanes.defers`) are ``B_def + U`` [+ T_f's lanes if not follow]: with follow, its forward's SSD lane holds
  only the overflow writes.

  The model counts the read-ahead under backward only as far as the SSDs are idle there: a READ beyond it would
  lengthen backward by as much as it shortens the update at best, and the read then counts in ``U``. So more
  read-ahead never lengthens ``t_deferred``. It is the cost in steady clipping: after a speculated step no
  write is behind, and the first deferred step is shorter by at most ``spill``. It can undercut ``T_iter`` when
  the SSDs bind: its forward reads no P16 from them.
- ``t_redo``, a speculated step that clipped: ``T_iter``, then the optimizer pass again from the previous slot
  (every record read, resident ones too: their buffers hold the wrong update) with the next forward beside it
  when ``follow``::

      R_redo = {cpu: P / rate, ssd: 12 P / bw_s2m + W}  [+ the next forward's lanes as in U: follow]
      t_redo = T_iter + phase(R_redo) - [T_f if follow]

The gradients a deferred or redone update takes are assumed in main memory (a stash spilled to the SSDs adds its
writes and reads). ``lohan.plan.clipping`` weighs ``t_deferred - T_iter`` against ``t_redo - T_iter`` to choose.

Algorithm 1, which walks the swap sets this prices, is `lohan.plan.activation_plan`; the lane names are
`lohan.plan.lanes`.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from lohan.plan.lanes import LANE_DOC, LANES, LANES_B
from lohan.plan.profile import Profile
from lohan.plan.units import gb, secs


@dataclass(frozen=True)
class Estimate:
    """Predicted step time of one swap set, with every lane's time so the bottleneck can be read off."""

    swap: tuple[str, ...]
    a_g2m: int
    flop_r: float
    alpha_bytes: int
    t_f: float
    t_b: float
    t_iter: float
    lanes_f: dict[str, float]
    lanes_b: dict[str, float]
    bottleneck_f: str
    bottleneck_b: str
    fill_f: float = 0.0
    """Pipeline head and tail of forward, included in ``t_f`` (module docstring)."""
    fill_b: float = 0.0
    """Pipeline head and tail of backward, included in ``t_b``."""
    t_serial: float = 0.0
    """The step with the optimizer after backward (ZeRO-Infinity's schedule) instead of under it."""
    traffic: dict[str, float] = dataclasses.field(default_factory=dict)
    """Bytes per step: ``m2g``/``g2m`` over PCIe, ``ssd_read``/``ssd_write``; ``adam_params`` updated."""
    t_deferred: float = 0.0
    """A clipped step: its update waits for the global norm (module docstring). 0: not priced (an old estimate)."""
    t_redo: float = 0.0
    """A speculated step that clipped: ``t_iter`` and its optimizer pass redone after backward."""
    read_ahead_bytes: int = 0
    """P32, m, v bytes the read-ahead room holds (``12 * Profile.readahead_params``), read ahead of a deferred update."""
    a_g2m_raw: int = 0
    """``a_g2m`` as the device holds those records before compression (= ``a_g2m`` without it)."""
    quant_s: float = 0.0
    """GPU seconds the forward ``gpu`` lane spends quantizing int8 records."""
    dequant_s: float = 0.0
    """GPU seconds the backward ``gpu`` lane spends dequantizing them."""
    lanes_serial: dict[str, float] = dataclasses.field(default_factory=dict)
    """Seconds each lane is busy in a whole step of the serial schedule (``t_serial``): forward, backward and the
    update after it. Empty: not priced (an old estimate)."""
    lanes_deferred: dict[str, float] = dataclasses.field(default_factory=dict)
    """Seconds each lane is busy in a whole deferred step (``t_deferred``'s: backward, then the update with the next
    forward beside it). Empty: not priced (an old estimate)."""

    def to_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)

    @staticmethod
    def from_dict(d: Mapping[str, Any]) -> Estimate:
        return Estimate(**{**d, "swap": tuple(d["swap"])})

    def step_lanes(self, mode: str = "optimized", deferred: bool = False) -> dict[str, float]:
        """Seconds each lane (:data:`LANES_B`) is busy in a whole step of the engine's ``mode``: forward and
        backward added, as the engine measures them (`runtime.step.StepStats.lanes`). ``naive`` and ``optimized``
        do the same work in another order; ``serial`` reads every P16 from the SSDs in forward (nothing is handed
        over) and runs the update after backward. ``deferred``: a step whose update runs after backward
        (``t_deferred``'s), whose forward takes the P16 from the update instead of the SSDs."""
        if mode == "serial" and self.lanes_serial:
            return dict(self.lanes_serial)
        if deferred and mode != "serial" and self.lanes_deferred:
            return dict(self.lanes_deferred)
        return {k: self.lanes_f.get(k, 0.0) + self.lanes_b.get(k, 0.0) for k in LANES_B}

    def format_lanes(self, clip: bool = True, defer: bool = False) -> str:
        """Seconds each lane is busy per step, forward and backward, one line per term, and the bottleneck; then
        what clipping costs (``clip``: the run clips), what an update after backward costs with clipping off
        (``defer``: the run may defer one, `pools.may_defer_unclipped`) and the optimizer after backward (serial
        mode)."""
        lines = [f"{'lane':<6}{'forward':>10}{'backward':>10}  term"]
        for lane in LANES_B:
            f, b = self.lanes_f.get(lane), self.lanes_b.get(lane)
            cell_f = "-" if f is None else secs(f)
            cell_b = "-" if b is None else secs(b)
            phases = "/".join(ph for ph, slow in (("f", self.bottleneck_f), ("b", self.bottleneck_b)) if slow == lane)
            mark = f"  <- bottleneck ({phases})" if phases else ""
            lines.append(f"{lane:<6}{cell_f:>10}{cell_b:>10}  {LANE_DOC[lane]}{mark}")
        lines.append(f"{'fill':<6}{secs(self.fill_f):>10}{secs(self.fill_b):>10}  {LANE_DOC['fill']}")
        lines.append(f"T_f = {secs(self.t_f)} (bottleneck {self.bottleneck_f}), T_b = {secs(self.t_b)} "
                     f"(bottleneck {self.bottleneck_b}), T_iter = {secs(self.t_iter)}")
        lines += self._clip_lines(clip, defer)
        return "\n".join(lines)

    def _clip_lines(self, clip: bool, defer: bool = False) -> list[str]:
        """What clipping costs (when the run clips and the estimate prices it), or an update after backward with
        clipping off, and the serial schedule's step."""
        def ratio(t: float) -> str:
            return f"{secs(t)} ({t / self.t_iter:.2f}x)" if self.t_iter else secs(t)
        lines = []
        if clip and self.t_deferred:
            ahead = f"{gb(self.read_ahead_bytes)} read ahead" if self.read_ahead_bytes else "no read-ahead room"
            lines += [f"clipping: a step whose update waits for the global norm ({ahead} during backward) takes "
                      f"{ratio(self.t_deferred)};",
                      f"          a speculated step that clipped after all (its optimizer pass redone) "
                      f"{ratio(self.t_redo)}; one that did not clip, T_iter"]
        elif defer and self.t_deferred:
            lines.append(f"clipping off: an update after backward, beside the next forward, takes "
                         f"{ratio(self.t_deferred)}; clip_mode auto runs it there where it measures faster than "
                         "under backward (T_iter)")
        if self.t_serial:
            lines.append(f"optimizer after backward (serial mode): {ratio(self.t_serial)}")
        return lines


def _pipeline(lanes: Mapping[str, float], n_blocks: int) -> tuple[float, float]:
    """(slowest lane, fill): ``n_blocks`` identical blocks through the lanes take ``max + (sum - max) / n``."""
    slowest = max(lanes.values())
    return slowest, (sum(lanes.values()) - slowest) / max(1, n_blocks)


def _phase(lanes: Mapping[str, float], n_blocks: int) -> float:
    """A phase's time: its pipeline's slowest lane plus the fill."""
    return sum(_pipeline(lanes, n_blocks))


def _clipped(profile: Profile, lanes_f: Mapping[str, float], serial_b: Mapping[str, float], cpu: float,
             alpha: int, t_f: float, t_iter: float) -> tuple[float, float, dict[str, float]]:
    """(t_deferred, t_redo, the deferred step's lanes), the module docstring's equations: ``serial_b`` is backward
    without the optimizer (``B0``), ``cpu`` the AdamW lane, ``alpha`` the activation overflow. The lanes are a whole
    deferred step's, as the engine measures one in steady state: its backward, its update and the forward beside
    it (with ``follow``: the next step's, whose P16 the SSDs do not read), else its own forward."""
    hw, n, p = profile.hardware, profile.n_blocks, profile.param_count
    writes = profile.states_written / hw.bw_m2s
    read = profile.record_bytes * (p - profile.resident_params) / hw.bw_s2m
    idle = max(serial_b.values()) - serial_b["ssd"]
    # READs issued ahead fill the SSD time backward leaves idle; write-behind (with follow) takes what they leave
    ahead = min(profile.record_bytes * profile.readahead_params / hw.bw_s2m, idle)
    spill = min(writes, idle - ahead) if profile.follow and profile.write_behind else 0.0
    backward = {**serial_b, "ssd": serial_b["ssd"] + ahead + spill}
    # with follow, the next forward runs beside the update: its P16 come from it, not from the SSDs
    beside = {k: lanes_f[k] for k in ("gpu", "g2m", "m2g")} if profile.follow else {}
    overflow = alpha / hw.bw_m2s if profile.follow else 0.0
    update = {**beside, "cpu": cpu, "ssd": read - ahead + writes - spill + overflow}
    t_deferred = (0.0 if profile.follow else t_f) + _phase(backward, n) + _phase(update, n)
    # a redo reads every record from the previous slot: resident buffers hold the speculated update
    redo = {**beside, "cpu": cpu, "ssd": profile.record_bytes * p / hw.bw_s2m + writes + overflow}
    t_redo = t_iter + _phase(redo, n) - (t_f if profile.follow else 0.0)
    forward = {} if profile.follow else lanes_f
    lanes = {k: backward.get(k, 0.0) + update.get(k, 0.0) + forward.get(k, 0.0) for k in LANES_B}
    return t_deferred, t_redo, lanes


def _evaluate(profile: Profile, swap: tuple[str, ...], a_g2m: int, flop_r: float, a_raw: int | None = None
              ) -> Estimate:
    """The lanes of one swap set: ``a_g2m`` bytes leave the device as the tiers hold them, ``a_raw`` as the device
    made them (quantized on the way out with int8 records; None: the same bytes)."""
    hw = profile.hardware
    a_raw = a_g2m if a_raw is None else a_raw
    quant, dequant = profile.quant_seconds(a_raw)
    p16, states, n = profile.p16, profile.states_written, profile.n_blocks
    # P32, m, v: what the optimizer reads of each record, but of those kept in memory across steps
    opt_read = profile.record_bytes * (profile.param_count - profile.resident_params)
    alpha = max(0, a_g2m - hw.mem_avail)
    cpu = profile.update_cost * profile.param_count / hw.cpu_adam_params_per_s if hw.cpu_adam_params_per_s else 0.0
    # P16 read from the SSDs in each pass: what the parameter pool does not keep over the turn, and not a resident
    # record's (copied from the record: `runtime.params.ParamStreamer.prefetch`) (Profile)
    p = max(1, profile.param_count)
    p16_read = p16 * max(0.0, 1 - (profile.kept_p16_params + profile.resident_params) / p)
    lanes_f = {"gpu": profile.flop_f / hw.thp_g + quant, "g2m": a_g2m / hw.bw_g, "m2g": p16 / hw.bw_g,
               "ssd": p16_read / hw.bw_s2m + alpha / hw.bw_m2s}
    grads = 0 if profile.frozen else p16  # G16 to the host (none: frozen weights)
    lanes_b = {"gpu": ((1 if profile.frozen else 2) * profile.flop_f + flop_r) / hw.thp_g + dequant,
               "g2m": grads / hw.bw_g,
               "m2g": (p16 + a_g2m) / hw.bw_g, "ssd": (p16_read + opt_read + alpha) / hw.bw_s2m + states / hw.bw_m2s,
               "cpu": cpu}
    (slow_f, fill_f), (slow_b, fill_b) = _pipeline(lanes_f, n), _pipeline(lanes_b, n)
    t_f, t_b = slow_f + fill_f, slow_b + fill_b
    # The optimizer after backward: backward keeps its own traffic, then the optimizer's lanes run alone; its
    # forward reads every P16 but the resident records' (nothing handed over)
    serial_f = {**lanes_f, "ssd": p16 * (1 - profile.resident_params / p) / hw.bw_s2m + alpha / hw.bw_m2s}
    serial_b = {**lanes_b, "cpu": 0.0, "ssd": (p16_read + alpha) / hw.bw_s2m}
    serial_opt = {"cpu": cpu, "ssd": opt_read / hw.bw_s2m + states / hw.bw_m2s}
    t_serial = sum(_pipeline(serial_f, n)) + _phase(serial_b, n) + _phase(serial_opt, n)
    lanes_serial = {k: serial_f.get(k, 0.0) + serial_b.get(k, 0.0) + serial_opt.get(k, 0.0) for k in LANES_B}
    t_iter = _held_iter(profile, t_f, t_b, _phase(serial_b, n))
    t_deferred, t_redo, lanes_deferred = _clipped(profile, lanes_f, serial_b, cpu, alpha, t_f, t_iter)
    traffic = {"m2g": 2.0 * p16 + a_g2m, "g2m": float(a_g2m + grads),
               "ssd_read": float(2 * p16_read + opt_read + alpha), "ssd_write": float(states + alpha),
               "adam_params": float(profile.param_count)}
    return Estimate(swap, a_g2m, flop_r, alpha, t_f, t_b, t_iter, lanes_f, lanes_b,
                    max(LANES, key=lanes_f.__getitem__), max(LANES_B, key=lanes_b.__getitem__),
                    fill_f, fill_b, t_serial, traffic, t_deferred, t_redo,
                    int(profile.record_bytes * profile.readahead_params), a_raw, quant, dequant, lanes_serial,
                    lanes_deferred)


def _held_iter(profile: Profile, t_f: float, t_b: float, t_b0: float) -> float:
    """``T_iter`` on average over a durability interval: a durable step ``T_f + T_b``; a step between durable ones
    (held in RAM, the next batch known) updates in backward order while gradients come and the rest in forward order
    with the next forward following (`runtime.step.StepPlan.tail_follows`), so that forward hides under the cpu
    lane's tail: ``max(T_f + T_b0, T_b)``, ``T_b0`` being backward without the optimizer."""
    every = max(1, profile.persist_every)
    if every == 1 or not profile.follow:
        return t_f + t_b
    held = max(t_f + t_b0, t_b)
    return ((every - 1) * held + t_f + t_b) / every


def reprice(est: Estimate, profile: Profile) -> Estimate:
    """`est`'s point (its swap set, its bytes on each tier) priced again on `profile`: what a profile refined by
    the run's own measurements (the optimizer's CPU rate in its steps) says of the same plan."""
    return _evaluate(profile, est.swap, est.a_g2m, est.flop_r, est.a_g2m_raw)


def estimate(profile: Profile, swap: Sequence[str]) -> Estimate:
    """Cost of swapping the block inputs plus the ops named in ``swap`` in every block."""
    by_name = {op.name: op for op in profile.ops}
    unknown = [s for s in swap if s not in by_name]
    if unknown:
        raise ValueError(f"unknown op(s) {unknown}; valid ops are: {', '.join(by_name)}")
    chosen = tuple(dict.fromkeys(swap))
    moved = profile.n_blocks - 1
    a_g2m = moved * (profile.swap_input_bytes + sum(profile.swap_bytes(by_name[s]) for s in chosen))
    a_raw = moved * (profile.input_bytes + sum(by_name[s].bytes for s in chosen))
    flop_r = profile.n_blocks * sum(op.flops for op in profile.ops if op.name not in chosen)
    return _evaluate(profile, chosen, a_g2m, flop_r, a_raw)
