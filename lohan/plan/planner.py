"""The planner's names in one place (DESIGN §4.4-4.5): a facade over the modules that hold them, so that
``from lohan.plan.planner import X`` keeps working for the names callers import (no others); new code may import
from the modules themselves.

- `hardware`: :class:`Hardware` and the presets a description is made of (:func:`parse_hardware`).
- `profile`: the activation profile (:class:`Profile`, :class:`OpProfile`, :func:`analytic_profile`).
- `lanes`: the lane vocabulary the cost model prices and the engine measures (:data:`LANES_B`, :func:`upgrade_lanes`).
- `cost_model`: a swap set's step time, lane by lane (:class:`Estimate`, :func:`estimate`, :func:`reprice`; its
  docstring has the equations).
- `activation_plan`: Algorithm 1 and the forced policies (:class:`Plan`, :func:`algorithm1`, :func:`make_plan`).
- `gpu_memory`: the GPU memory plan (:func:`gpu_need`, :func:`check_gpu_budget`).
- `capacity`: the capacity planner (:class:`Capacity`, :func:`capacity`, :func:`plan_capacity`, :func:`max_batch`).
- `run_lanes`: a run's predicted lanes and, where the SSDs bind, what they cost (:func:`predict_lanes`,
  :func:`ssd_cost`).

Pure policy: no torch and no I/O (except the ``Profile.save``/``load`` JSON helpers), so plans can be made,
printed and tested on any machine. The engine executes a :class:`Plan`; the planner never runs one.
"""

from __future__ import annotations

from lohan.plan.activation_plan import (
    POLICIES,
    Plan,
    algorithm1,
    forced_plan,
    make_plan,
    place_tiers,
    walk,
    walk_order,
)
from lohan.plan.capacity import (
    Capacity,
    activations_in_ram_capacity,
    capacity,
    engine_pools,
    max_batch,
    max_model,
    plan_capacity,
    reserve_engine_pools,
    resident_records,
)
from lohan.plan.cost_model import Estimate, estimate, reprice
from lohan.plan.gpu_memory import (
    CUBLAS_STREAMS,
    CUBLAS_WORKSPACE_BYTES,
    FRAGMENTATION,
    HOST_SHARED_PARTS,
    GpuMemoryPlanError,
    check_gpu_budget,
    gpu_need,
)
from lohan.plan.hardware import (
    DEFAULT_CPU,
    HARDWARE_PRESETS,
    QUANT_TRAFFIC,
    CpuSpec,
    GpuSpec,
    Hardware,
    SsdSpec,
    parse_hardware,
)
from lohan.plan.lanes import LANES_B, WAIT_LANES, upgrade_lanes
from lohan.plan.pools import OPT_CHUNK_BYTES
from lohan.plan.profile import OpProfile, Profile, ProfileError, analytic_profile
from lohan.plan.run_lanes import SsdCost, predict_lanes, ssd_cost

__all__ = [
    "Hardware", "OpProfile", "Profile", "ProfileError", "Estimate", "Plan", "Capacity", "GpuSpec", "SsdSpec",
    "CpuSpec", "POLICIES", "LANES_B", "DEFAULT_CPU", "HARDWARE_PRESETS", "OPT_CHUNK_BYTES", "QUANT_TRAFFIC",
    "estimate", "reprice", "WAIT_LANES", "upgrade_lanes", "predict_lanes", "SsdCost", "ssd_cost", "walk_order",
    "walk", "algorithm1", "forced_plan", "make_plan", "place_tiers", "analytic_profile", "parse_hardware",
    "engine_pools", "resident_records", "reserve_engine_pools", "capacity", "plan_capacity",
    "activations_in_ram_capacity", "max_batch", "max_model", "gpu_need", "check_gpu_budget", "GpuMemoryPlanError",
    "HOST_SHARED_PARTS", "CUBLAS_WORKSPACE_BYTES", "CUBLAS_STREAMS", "FRAGMENTATION",
]
