"""The lanes of a step: the cost model's vocabulary, which the engine's measured lanes (`runtime.step.StepStats.lanes`),
the metrics records and the benchmarks use too (the cost model's terms: `lohan.plan.cost_model`)."""

from __future__ import annotations

from collections.abc import Mapping

LANES = ("gpu", "g2m", "m2g", "ssd")
"""The forward lanes; backward has these and ``cpu`` (:data:`LANES_B`)."""
LANES_B = (*LANES, "cpu")
LANE_DOC = {
    "gpu": "GPU compute: forward FLOP_f; backward 2 FLOP_f + recomputation, at THP_G; int8 records' (de)quantization",
    "g2m": "PCIe device->host: swapped activations (f), G16 gradients to the CPU optimizer (b)",
    "m2g": "PCIe host->device: block params P16 (f and b; recompute reuses them), activations back (b)",
    "ssd": "SSD, reads + writes (simplex): P16 (f, b); P32,m,v read (but resident records') and P32,m,v,P16 "
           "written (b); activation overflow; effective bandwidth",
    "cpu": "CPU AdamW of every param (P32, m, v, P16 copy), under backward by active gradient offloading; the "
           "records' checksums (measured: AdamW's wall time, the hashing's CPU time)",
    "fill": "pipeline head and tail: one block's worth of every lane but the slowest",
}
"""One line per term of the cost model, printed under the plan (see the module docstring)."""
WAIT_LANES = ("param_wait", "provision_wait", "optimizer_tail", "gather", "reduce_wait")
"""What a step's measured lanes (`runtime.step.StepStats.lanes`) record beside :data:`LANES_B`: time the compute
thread waited (for streamed P16 being read or copied in, for the optimizer's update of a block the next forward
follows, for the optimizer pass after backward, for the other ranks), not work."""
LEGACY_LANES = {"compute": "gpu", "cpu_adam": "cpu"}
"""Measured lane names of lohan before the engine reported the cost model's: ``compute`` is ``gpu``, ``cpu_adam``
(AdamW alone) ``cpu``; they had no ``ssd`` (:func:`upgrade_lanes`)."""


def upgrade_lanes(lanes: Mapping[str, float]) -> dict[str, float]:
    """A step's measured lanes in the cost model's vocabulary: an older metrics record or commit note names them
    as :data:`LEGACY_LANES` says, and has no ``ssd``, which is then its reads' and writes' busy time added (the
    SSDs are simplex). Lanes already in the vocabulary are kept as they are."""
    out = {LEGACY_LANES.get(k, k): v for k, v in lanes.items() if not (k in LEGACY_LANES and
                                                                        LEGACY_LANES[k] in lanes)}
    if "ssd" not in out and ("ssd_read" in out or "ssd_write" in out):
        out["ssd"] = out.get("ssd_read", 0.0) + out.get("ssd_write", 0.0)
    return out
