"""Algorithm 1 of traffic-aware activation swapping (DESIGN §4.4): which ops every block swaps (the walk over
:func:`walk_order`, priced by `lohan.plan.cost_model`) and where each block's record lives (:func:`place_tiers`),
as a :class:`Plan`; and the forced baseline policies.

Why Algorithm 1 may stop at the first op that does not help: taking ops by decreasing offload benefit
``OB = flops/bytes`` makes ``FLOP_r`` a convex decreasing piecewise-linear function of ``A_G2M``; every
transfer lane is linear or (through ``alpha``) convex increasing in it, and sums and maxima of convex
functions are convex; the ``cpu`` lane does not depend on it. ``max + (sum - max) / n`` is
``(1 - 1/n) max + sum / n``, a positive combination of convex functions, so the pipeline fill keeps it
convex. So ``T_iter`` along the walk falls, then rises: the first rise is the minimum. With int8 records the walk
takes ops by ``(FLOP_l - thp_g bytes_l (1 / act_quant_bps + 1 / act_dequant_bps)) / bytes_int8_l`` instead (the
FLOPs a swap saves net of the GPU time its quantization and dequantization take, per byte moved): the backward
``gpu`` lane stays convex in ``A_G2M``, and the forward one grows by ``R / act_quant_bps`` nearly linearly (raw /
compressed bytes is about the itemsize for every op), so the first rise is still the minimum up to that. The GPU
time is why int8 records may swap *less* than uncompressed ones where the GPU binds (an op whose FLOPs per byte
are few, such as the QKV projection, costs more to quantize than to recompute there), and more where the links or
the SSDs bind: compression pays only there.
"""

from __future__ import annotations

import dataclasses
import itertools
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from lohan.config import ACT_POLICIES
from lohan.plan.cost_model import Estimate, _evaluate, estimate
from lohan.plan.profile import OpProfile, Profile
from lohan.plan.units import gb, secs

POLICIES = ACT_POLICIES


def walk_order(profile: Profile) -> list[OpProfile]:
    """Ops by decreasing offload benefit ``flops/bytes``; ties keep forward order. With int8 records, the FLOPs net
    of the quantization's GPU time per compressed byte (module docstring).

    Ops with no output bytes come first: swapping them moves nothing, so it can only save recomputation.
    """
    flops_per_s = profile.hardware.thp_g

    def key(item: tuple[int, OpProfile]) -> tuple[int, float, int]:
        i, op = item
        if op.bytes == 0:
            return (0, 0.0, i)
        net = op.flops - flops_per_s * sum(profile.quant_seconds(op.bytes))  # quantized forward, dequantized back
        return (1, -net / max(1, profile.swap_bytes(op)), i)
    return [op for _, op in sorted(enumerate(profile.ops), key=key)]


def walk(profile: Profile) -> list[Estimate]:
    """Point 0 swaps the block inputs only; point k adds the first k ops of :func:`walk_order`."""
    names = [op.name for op in walk_order(profile)]
    return [estimate(profile, names[:k]) for k in range(len(names) + 1)]


@dataclass(frozen=True)
class Plan:
    """What to swap in every block, where each block's activation record lives, and the predicted cost.

    ``block_tiers[i]`` is where block i's record (its input plus its swapped op outputs) stays between
    forward and backward: ``keep`` (device), ``cpu`` or ``ssd``. ``points`` is the whole walk. ``block_bytes`` is
    a record as the ``cpu`` and ``ssd`` tiers hold it (compressed, with int8 records); ``cpu_bytes`` and
    ``ssd_bytes`` are those tiers' totals.
    """

    policy: str
    swap: tuple[str, ...]
    block_tiers: tuple[str, ...]
    estimate: Estimate
    points: tuple[Estimate, ...]
    chosen: int
    case: int
    block_bytes: int
    cpu_bytes: int
    ssd_bytes: int

    def to_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)

    @staticmethod
    def from_dict(d: Mapping[str, Any]) -> Plan:
        return Plan(**{**d, "swap": tuple(d["swap"]), "block_tiers": tuple(d["block_tiers"]),
                       "estimate": Estimate.from_dict(d["estimate"]),
                       "points": tuple(Estimate.from_dict(p) for p in d["points"])})

    def tier_summary(self) -> str:
        """Runs of equal tiers, e.g. ``blocks 0-3: ssd, 4-10: cpu, 11: keep``."""
        runs, start = [], 0
        for tier, group in itertools.groupby(self.block_tiers):
            end = start + len(list(group)) - 1
            runs.append(f"{start}{'' if end == start else f'-{end}'}: {tier}")
            start = end + 1
        return "blocks " + ", ".join(runs)

    def format_table(self, clip: bool = True, defer: bool = False) -> str:
        """The walk, the tiers and the chosen point's lanes; ``clip``: the run clips, ``defer``: clipping off, it may
        update after backward (:meth:`Estimate.format_lanes`)."""
        rows = self.points or (self.estimate,)
        head = (f"{'':2}{'#':>2}  {'swap (cumulative)':<18}{'A_G2M':>11}{'to SSD':>11}{'FLOP_r':>12}"
                f"{'T_f':>10}{'T_b':>10}{'T_iter':>10}  bottleneck f/b")
        lines = [f"policy {self.policy}: " + ("Algorithm 1 walk" if self.points else "forced"), head]
        prev: tuple[str, ...] = ()
        for i, e in enumerate(rows):
            if not self.points:
                label = self.policy
            elif not e.swap:
                label = "inputs only"
            else:  # a walk: show what this point adds to the previous one
                label = "+" + ",".join(n for n in e.swap if n not in prev)
            prev = e.swap
            mark = "*" if (i == self.chosen or not self.points) else " "
            lines.append(f"{mark:<2}{i:>2}  {label:<18}{gb(e.a_g2m):>11}{gb(e.alpha_bytes):>11}"
                         f"{e.flop_r / 1e12:>9.2f} TF{secs(e.t_f):>10}{secs(e.t_b):>10}{secs(e.t_iter):>10}"
                         f"  {e.bottleneck_f}/{e.bottleneck_b}")
        swapped = ", ".join(("inputs", *self.swap)) if self.policy != "recompute-all" else "nothing"
        lines.append(f"swapped in every block: {swapped}; {gb(self.block_bytes)} per block record")
        est = self.estimate
        if est.a_g2m_raw > est.a_g2m:
            lines.append(f"int8 records: {gb(est.a_g2m)} leave the device per step instead of {gb(est.a_g2m_raw)}; "
                         f"quantizing them takes {secs(est.quant_s)} of the gpu lane in forward, dequantizing them "
                         f"{secs(est.dequant_s)} in backward" + ("" if est.quant_s else " (rate unknown: not priced)"))
        lines.append(f"{self.tier_summary()} (cpu {gb(self.cpu_bytes)}, ssd {gb(self.ssd_bytes)})")
        lines.append(_CASES.get(self.case, "") or f"forced policy {self.policy!r} (not chosen by Algorithm 1)")
        lines.append("lanes of the chosen point (seconds each resource is busy per step):")
        lines += ["  " + line for line in self.estimate.format_lanes(clip, defer).splitlines()]
        return "\n".join(lines)


_CASES = {
    1: "case 1 (PCIe/SSD-bound): any op swapped beyond the block inputs would lengthen the step, "
       "so only the block inputs are swapped and the rest is recomputed",
    2: "case 2 (compute-bound): every op that costs FLOPs to recompute is swapped",
    3: "case 3 (interior optimum): swapping stops where the transfer lanes would cost more than "
       "the recomputation they save",
}


def place_tiers(n_blocks: int, block_bytes: int, mem_avail: int, policy: str) -> tuple[str, ...]:
    """Where each block's record lives: last block ``keep``; earliest blocks ``ssd``, the rest ``cpu``.

    The earliest blocks are read back last in backward, so their slower SSD reads get the most time
    to prefetch. Placement is by whole blocks, so the SSD share may exceed the cost model's alpha by
    less than one block record.
    """
    if policy == "recompute-all":
        return ("keep",) * n_blocks
    movable = n_blocks - 1
    fit = movable if block_bytes <= 0 else max(0, mem_avail) // block_bytes
    k_ssd = max(0, movable - fit)
    return ("ssd",) * k_ssd + ("cpu",) * (movable - k_ssd) + ("keep",)


def _plan(profile: Profile, policy: str, est: Estimate, points: Sequence[Estimate] = (),
          chosen: int = -1, case: int = 0) -> Plan:
    # what one record of a block that leaves the device takes on its tier (compressed with int8 records)
    sizes = {op.name: profile.swap_bytes(op) for op in profile.ops}
    block_bytes = profile.swap_input_bytes + sum(sizes[s] for s in est.swap)
    tiers = place_tiers(profile.n_blocks, block_bytes, profile.hardware.mem_avail, policy)
    return Plan(policy, est.swap, tiers, est, tuple(points), chosen, case, block_bytes,
                tiers.count("cpu") * block_bytes, tiers.count("ssd") * block_bytes)


def algorithm1(profile: Profile) -> Plan:
    """DESIGN's Algorithm 1: walk ops by decreasing OB from interblock; stop at the first non-improvement.

    Case 1: no op with bytes and FLOPs is taken (PCIe/SSD-bound). Case 2: every such op is taken
    (compute-bound; zero-FLOP ops such as LayerNorm recompute for free, so they never help). Case 3: between.
    """
    order = walk_order(profile)
    points = walk(profile)
    # Zero-byte ops lead the order and never raise T_iter; taking them keeps a zero-FLOP one from
    # stopping the walk at a flat step before it reaches the ops that matter.
    k = sum(op.bytes == 0 for op in order)
    while k < len(order) and points[k + 1].t_iter < points[k].t_iter:
        k += 1
    taken = {op.name for op in order[:k]}
    useful = [op.name for op in order if op.flops > 0 and op.bytes > 0]
    if useful and all(n in taken for n in useful):
        case = 2
    elif not any(n in taken for n in useful):
        case = 1
    else:
        case = 3
    return _plan(profile, "plan", points[k], points, k, case)


def forced_plan(profile: Profile, policy: str) -> Plan:
    """Baseline policies: ``recompute-all`` (nothing leaves the device), ``interblock``
    (ZeRO-Infinity: block inputs only) and ``swap-all`` (G10: every op)."""
    if policy == "recompute-all":
        est = _evaluate(profile, (), 0, profile.n_blocks * sum(op.flops for op in profile.ops))
    elif policy == "interblock":
        est = estimate(profile, ())
    elif policy == "swap-all":
        est = estimate(profile, [op.name for op in profile.ops])
    else:
        raise ValueError(f"unknown forced policy {policy!r}; choose one of {', '.join(POLICIES[1:])}")
    return _plan(profile, policy, est)


def ops_plan(profile: Profile, ops: Sequence[str]) -> Plan:
    """Swap the block inputs and exactly ``ops`` in every block (ablations, sweeps): policy ``ops:a,b``."""
    est = estimate(profile, ops)
    return _plan(profile, "ops:" + ",".join(est.swap), est)


def make_plan(profile: Profile, policy: str) -> Plan:
    """``plan`` runs :func:`algorithm1`; the other :data:`POLICIES` are :func:`forced_plan`;
    ``ops:NAME,NAME`` is :func:`ops_plan`."""
    if policy.startswith("ops:"):
        return ops_plan(profile, [n.strip() for n in policy[4:].split(",") if n.strip()])
    if policy not in POLICIES:
        raise ValueError(f"unknown activation policy {policy!r}; choose one of {', '.join(POLICIES)} "
                         "or ops:NAME,NAME")
    return algorithm1(profile) if policy == "plan" else forced_plan(profile, policy)
