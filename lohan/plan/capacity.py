"""The capacity planner (DESIGN §4.5): whether a (model, batch, seq) fits a machine's GPU, main memory and SSDs, what
each tier needs and why not if it does not (:class:`Capacity`), for a design priced from keywords (:func:`capacity`)
or a run's own plan (:func:`plan_capacity`); the largest batch and model that fit."""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from lohan.config import PRESETS, ModelConfig
from lohan.plan import durability, formats, pools
from lohan.plan.activation_plan import Plan, algorithm1, forced_plan
from lohan.plan.gpu_memory import GPU_FIXES, gpu_need
from lohan.plan.hardware import Hardware
from lohan.plan.pools import OPT_CHUNK_BYTES, OS_RESERVE, ram_budget
from lohan.plan.profile import Profile, analytic_profile
from lohan.plan.run_plan import RunPlan, plan_run
from lohan.plan.units import gb, itemsize


def engine_pools(cfg: ModelConfig, compute_dtype: str = "bf16", prefetch_depth: int = 2,
                 max_inflight: int = 3, micro_batches: int = 1, block_grads: bool = True,
                 opt_chunk_bytes: int = OPT_CHUNK_BYTES, resident: bool = True) -> dict[str, int]:
    """Main-memory pools of the engine for a model: ``pools.plan_host_memory`` (the engine's own function) on the
    model's blocks (``pools.model_geometry``), without the 4 KiB padding of each buffer.

    params: current + k prefetched + k kept over the forward/backward turn + a borrowed tied block, at most every
    block; grads: two block buffers (one filling, one queued; ``pools.grad_dtype``; ``block_grads=False``: none,
    for a design that counts the gradients itself);
    optimizer: ``max_inflight`` records of the largest block, or of an ``opt_chunk_bytes`` chunk when records are
    bigger, with ``resident`` records no more than the records bigger than the streamed ones plus ``max_inflight``
    of those (a tied embedding stays: one buffer for it instead of ``max_inflight``), and the fp32 scratch bf16
    gradients are upcast into. Without clipping, resident_mem or a gradient stash (see :func:`capacity`).
    """
    ecfg = pools.pool_config(compute_dtype, micro_batches, prefetch_depth, max_inflight, resident=resident,
                             opt_chunk_bytes=opt_chunk_bytes)
    plan = pools.plan_host_memory(pools.model_geometry(cfg, compute_dtype), ecfg, check=False)
    return {"params": plan.params, "grads": plan.grads if block_grads else 0,
            "optimizer": plan.records + plan.upcast}


def _ram_budget(hw: Hardware) -> int:
    # A measured Hardware may not know the RAM size; its mem_avail is then the whole budget.
    return ram_budget(hw.ram) if hw.ram else hw.mem_avail


def reserve_engine_pools(hw: Hardware, cfg: ModelConfig, **pool_args: Any) -> Hardware:
    """``hw`` with ``mem_avail`` = RAM budget minus :func:`engine_pools` (what is left for activations)."""
    return dataclasses.replace(hw, mem_avail=max(0, _ram_budget(hw) - sum(engine_pools(cfg, **pool_args).values())))


@dataclass(frozen=True)
class Capacity:
    """Whether a (model, batch, seq) fits a machine, what each tier needs, and why not if it does not."""

    design: str
    model: str
    batch: int
    seq: int
    hardware: str
    fits: bool
    reasons: tuple[str, ...]
    gpu_bytes: int
    cpu_bytes: int
    ssd_bytes: int
    ssd_states_bytes: int
    ssd_act_bytes: int
    plan: Plan
    gpu_parts: dict[str, int]
    cpu_parts: dict[str, int]
    limits: dict[str, int]
    persist_every: int = 1
    """Steps per durable commit of the records (`engine.persist_every` as it applies to this plan: 1 unless every
    record is resident)."""
    persist_note: str = ""
    """Why ``persist_every`` is 1 where the run asked for more or ``auto``."""
    over_cpu_mem: bool = False
    """The engine's pools exceed ``cpu_mem`` (its refusal is the first reason), though the machine's RAM may not."""

    def format(self) -> str:
        def row(tier: str, need: int, parts: Mapping[str, int]) -> str:
            limit = self.limits[tier]
            verdict = "not checked (size unknown)" if not limit else "ok" if need <= limit else "TOO BIG"
            if tier == "cpu" and self.over_cpu_mem and need <= limit:  # RAM would hold it, cpu_mem does not
                verdict = "over cpu_mem"
            detail = ", ".join(f"{k} {gb(v)}" for k, v in parts.items())
            return f"  {tier:<4}{gb(need):>12} of {gb(limit):>11}  {verdict:<8} ({detail})"
        lines = [f"{self.design}: {self.model}, batch {self.batch} x seq {self.seq} on {self.hardware}",
                 row("gpu", self.gpu_bytes, self.gpu_parts), row("cpu", self.cpu_bytes, self.cpu_parts),
                 row("ssd", self.ssd_bytes, {"states": self.ssd_states_bytes, "activations": self.ssd_act_bytes}),
                 f"  activations: {self.plan.tier_summary()}",
                 "  => fits" if self.fits else "  => does NOT fit:"]
        lines += [f"     - {r}" for r in self.reasons]
        return "\n".join(lines)

def _judge(design: str, cfg: ModelConfig, batch: int, seq: int, hw: Hardware, plan: Plan,
           gpu_parts: dict[str, int], cpu_parts: dict[str, int], ssd_states: int, ssd_act: int) -> Capacity:
    limits = {"gpu": hw.gpu_mem, "cpu": _ram_budget(hw), "ssd": hw.ssd_bytes}
    gpu, cpu, ssd = sum(gpu_parts.values()), sum(cpu_parts.values()), ssd_states + ssd_act
    reasons = []
    if limits["gpu"] and gpu > limits["gpu"]:
        parts = ", ".join(f"{k} {gb(v)}" for k, v in gpu_parts.items())
        reasons.append(f"GPU memory: needs {gb(gpu)} ({parts}) but {gb(limits['gpu'])} is available (free on "
                       f"this device, the card's size for a described one, or engine.gpu_mem); try {GPU_FIXES}")
    if limits["cpu"] and cpu > limits["cpu"]:
        parts = ", ".join(f"{k} {gb(v)}" for k, v in cpu_parts.items())
        reasons.append(f"main memory: needs {gb(cpu)} ({parts}) but {gb(limits['cpu'])} is usable "
                       f"({gb(hw.ram)} RAM minus the {OS_RESERVE:.0%} OS reserve)")
    if limits["ssd"] and ssd > limits["ssd"]:
        reasons.append(f"SSD: needs {gb(ssd)} (states {gb(ssd_states)}, activations "
                       f"{gb(ssd_act)}) but the SSDs hold {gb(limits['ssd'])}")
    return Capacity(design, cfg.name, batch, seq, hw.name, not reasons, tuple(reasons), gpu, cpu, ssd,
                    ssd_states, ssd_act, plan, gpu_parts, cpu_parts, limits)


def resident_records(cfg: ModelConfig, compute_dtype: str, max_inflight: int, pool: int, extra: int | str,
                     opt_chunk_bytes: int = OPT_CHUNK_BYTES, micro_batches: int = 1,
                     clip: bool = False) -> tuple[int, int]:
    """(bytes `resident_mem` adds, parameters whose records then stay in memory) for the optimizer's share of
    the pools `pool` (:func:`engine_pools`' ``optimizer``: the record pool and the fp32 upcast scratch):
    ``pools.resident_extra`` and ``pools.plan_resident`` on the model's blocks, without alignment. `extra`:
    bytes, or ``all``. Records bigger than ``opt_chunk_bytes`` are updated in chunks and stay whole (every chunk)."""
    ecfg = pools.pool_config(compute_dtype, micro_batches, max_inflight=max_inflight, clip=clip, resident_mem=extra,
                             opt_chunk_bytes=opt_chunk_bytes)
    layout = pools.model_geometry(cfg, compute_dtype).store
    chunk = pools.optimizer_chunk_elems(layout, ecfg)
    g = pools.grad_itemsize(compute_dtype, micro_batches)
    records = pool - pools.upcast_bytes(layout, chunk, g, clip)
    add = pools.resident_extra(layout, ecfg, chunk, records, align=1)
    kept = pools.plan_resident(layout, records + add, max_inflight, chunk, align=1)
    return add, sum(layout.blocks[i].numel for i in kept)


def design_plan(cfg: ModelConfig, hw: Hardware, compute_dtype: str = "bf16", micro_batches: int = 1,
                prefetch_depth: int = 2, max_inflight: int = 3, slots: int = 2, keep_grads: bool = False,
                resident_mem: int | str = 0, cpu_mem: int | None = None, readahead_mem: int | str = "auto",
                clip_mode: str = "auto", state_format: str = "exact", act_compress: str = "none",
                host_device: bool = False, persist_every: int | str = 1, mode: str = "optimized",
                opt_chunk_bytes: int = OPT_CHUNK_BYTES) -> RunPlan:
    """The run plan of a design priced from settings given as keywords (:func:`capacity`'s, for a model and
    machine with no run behind them: the capacity CLI, the benchmarks), on the model's blocks without padding
    (``pools.model_geometry``), with cpu_mem the run's budget within what the machine's RAM gives
    (:func:`_ram_budget`), which is also the memory the ``auto`` rooms take half of. A run prices its own plan
    (`run_plan.plan_run` on the engine's geometry) with :func:`plan_capacity`."""
    budget = _ram_budget(hw)
    limit = min(cpu_mem, budget) if cpu_mem and budget else (cpu_mem or budget)
    ecfg = pools.pool_config(compute_dtype, micro_batches, prefetch_depth, max_inflight, slots=slots,
                             clip=keep_grads, resident_mem=resident_mem, cpu_mem=limit, readahead_mem=readahead_mem,
                             clip_mode=clip_mode, mode=mode, opt_chunk_bytes=opt_chunk_bytes)
    ecfg = ecfg.with_overrides(state_format=state_format, act_compress=act_compress, persist_every=persist_every)
    return plan_run(ecfg, pools.model_geometry(cfg, compute_dtype, slots, state_format=state_format),
                    free=budget, host_device=host_device)


def capacity(cfg: ModelConfig, hw: Hardware, batch: int, seq: int, compute_dtype: str = "bf16",
             micro_batches: int = 1, prefetch_depth: int = 2, max_inflight: int = 3, slots: int = 2,
             keep_grads: bool = False, resident_mem: int | str = 0, cpu_mem: int | None = None,
             readahead_mem: int | str = "auto", clip_mode: str = "auto", state_format: str = "exact",
             act_compress: str = "none", host_device: bool = False, persist_every: int | str = 1,
             mode: str = "optimized", opt_chunk_bytes: int = OPT_CHUNK_BYTES) -> Capacity:
    """LoHan: states on SSD (``slots`` copies: 2 for crash-consistent steps), activations in main memory
    and overflowing to SSD, gradients consumed per block by active gradient offloading (only two block
    buffers in main memory). With ``keep_grads`` (gradient clipping; the engine keeps them with ``slots=1`` too)
    the step's gradients are also kept, in fp32 unless bf16 with one micro-batch (``pools.grad_dtype``): in the
    main memory ``cpu_mem`` leaves after the pools (``grad_stash``), the rest on the SSDs (the engine's stash).

    The main-memory parts are ``pools.plan_host_memory``'s, the engine's own function; activations get what the
    RAM budget leaves after them. ``resident_mem`` (the engine's setting: bytes, ``all`` or ``auto``, then
    bounded by ``cpu_mem`` as the engine bounds it) keeps optimizer records in memory across steps: they are
    written each step but not read (``Profile.resident_params``). 0 (the default, and the paper's method) keeps
    only what the record pool holds beside its streaming buffers. ``readahead_mem`` (bytes or ``auto``, the
    engine's setting) is the room for records read during backward ahead of an update that waits for the norm,
    planned in optimized mode (``pools.reads_ahead``); the
    records it holds are ``Profile.readahead_params``, and the estimate's ``t_deferred`` prices them.
    ``state_format`` (`lohan.plan.formats`) prices the SSD bytes at rest and moved per step of a compressed
    format, and the main-memory pools of its records.
    ``act_compress`` (``int8``: the engine's setting) plans activation records that leave the device compressed:
    the tiers hold, and the links move, their int8 bytes, and the GPU pays their quantization; the GPU memory plan
    keeps counting them as the device makes them (an upper bound). ``host_device``: the CPU computes (its
    gradients are in main memory: the pools' ``auto`` rooms leave them out, ``gpu_need`` prices them as it holds
    them). ``persist_every`` (the engine's setting: steps, or ``auto``) writes the records once in that many
    steps where every one is resident (`lohan.plan.durability`); the plan's ``persist_every`` is the interval in
    force (``auto``: the least that keeps the writes under a tenth of the predicted step's time). ``mode`` and
    ``opt_chunk_bytes``: the engine's settings, which size the grads and record pools."""
    return plan_capacity(cfg, hw, batch, seq, design_plan(
        cfg, hw, compute_dtype, micro_batches, prefetch_depth, max_inflight, slots, keep_grads, resident_mem, cpu_mem,
        readahead_mem, clip_mode, state_format, act_compress, host_device, persist_every, mode, opt_chunk_bytes))


def plan_capacity(cfg: ModelConfig, hw: Hardware, batch: int, seq: int, run: RunPlan) -> Capacity:
    """:func:`capacity` of a run plan (`run_plan.plan_run`): its main-memory pools, as the engine allocates them
    (a run's own plan: on the engine's geometry, with the whole EngineConfig), every setting from ``run.engine``,
    and, where the pools exceed cpu_mem, the engine's refusal among the reasons, in its words. ``batch``: this
    process's (one rank's: ``hw`` then the rank's share of the machine, `app.fit.data_parallel_machine`)."""
    e, host = run.engine, run.host
    parts = {k: v for k, v in host.parts().items() if v or k != "resident"}
    # The plan is made on the whole batch: micro-batches interleave per block, so all their records coexist.
    reserved = dataclasses.replace(hw, mem_avail=max(0, _ram_budget(hw) - host.total))
    profile = analytic_profile(cfg, batch, seq, reserved, e.execution.compute_dtype)
    resident = min(run.resident_params, profile.param_count)
    # the room holds whole records (P32, m, v, P16) of parameters not resident
    fmt = formats.state_format(e.store.state_format)
    ahead = min(run.readahead_params, profile.param_count - resident)
    kept = round(profile.param_count * run.kept_p16)  # (in place nothing is kept)
    profile = dataclasses.replace(profile, resident_params=resident, readahead_params=ahead, kept_p16_params=kept,
                                  write_behind=run.write_behind, record_bytes=fmt.record(),
                                  separate_p16=fmt.keeps_p16(profile.p16_itemsize), update_cost=fmt.update_cost,
                                  act_compress=e.activations.act_compress)
    plan = algorithm1(profile)
    every, why_not = _persist_every(e.execution.persist_every, profile, plan, e.store.slots, host.has_stash,
                                    in_place=e.stability.max_grad_norm <= 0 and e.execution.compute_dtype != "fp16")
    if every > 1:
        plan = algorithm1(dataclasses.replace(profile, persist_every=every))
    gpu = gpu_need(cfg, batch, seq, hw, e.execution.compute_dtype, e.execution.micro_batches, e.memory.prefetch_depth, plan.swap, run.world,
                   host=run.host_device)
    states = round(e.store.slots * fmt.at_rest(itemsize(e.execution.compute_dtype)) * cfg.param_count())
    if host.has_stash:  # the gradients the stash cannot keep in main memory go to the SSDs
        states += max(0, host.grad_itemsize * cfg.param_count() - (host.stash_ram or 0))
    judged = _judge("LoHan (activations to main memory, overflow to SSD)", cfg, batch, seq, hw, plan, gpu,
                    {**parts, "activations": plan.cpu_bytes}, states, plan.ssd_bytes)
    if run.refusal is not None:  # the engine would refuse its pools: the same words
        judged = dataclasses.replace(judged, fits=False, reasons=(run.refusal, *judged.reasons),
                                     over_cpu_mem=run.over_cpu_mem)
    return dataclasses.replace(judged, persist_every=every, persist_note=why_not)


def _persist_every(asked: int | str, profile: Profile, plan: Plan, slots: int, has_stash: bool,
                   in_place: bool = False) -> tuple[int, str]:
    """The durability interval a run of `profile` keeps and, where it is 1 against what was asked, why
    (`durability.eligible`, `durability.persist_interval`; ``auto`` from the plan's step, every step durable)."""
    if asked == 1:
        return 1, ""
    why = durability.eligible(profile.resident_params >= profile.param_count, slots, True, has_stash, in_place)
    if why is not None:
        return 1, why
    if asked == "auto":
        n = durability.persist_interval(profile.states, profile.hardware.bw_m2s, plan.estimate.t_iter)
        return n, "" if n > 1 else "the writes take under a tenth of the step"
    return int(asked), ""


def activations_in_ram_capacity(cfg: ModelConfig, hw: Hardware, batch: int, seq: int,
                                compute_dtype: str = "bf16", micro_batches: int = 1, prefetch_depth: int = 2,
                                max_inflight: int = 3, grad_bytes_per_param: int | None = None) -> Capacity:
    """ZeRO-Infinity-style design: block-input checkpoints of every block held in main memory (no SSD tier
    for activations) and, because its CPU optimizer runs as a separate stage after backward, the whole
    model's gradients too (``grad_bytes_per_param * P``): by default the half-precision gradients (2P)
    plus the fp32 copy that DeepSpeed's CPU Adam consumes (4P), i.e. 6 bytes per parameter in bf16.
    That reproduces the paper's estimate of ~1.1 TB of main memory for 175B (§I) and its Fig. 2a
    (175B does not fit in 768 GB); counting only the 2P would contradict both.
    """
    s = itemsize(compute_dtype)
    grads = (s + 4 if grad_bytes_per_param is None else grad_bytes_per_param) * cfg.param_count()
    engine = engine_pools(cfg, compute_dtype, prefetch_depth, max_inflight, micro_batches, block_grads=False,
                          resident=False)
    profile = analytic_profile(cfg, batch, seq, hw, compute_dtype)
    # Activations never go to SSD in this design: plan as if main memory held them, then check it does.
    everything = dataclasses.replace(hw, mem_avail=cfg.n_layer * profile.input_bytes)
    plan = forced_plan(dataclasses.replace(profile, hardware=everything), "interblock")
    gpu = gpu_need(cfg, batch, seq, hw, compute_dtype, micro_batches, prefetch_depth, ())
    return _judge("activations in main memory (ZeRO-Infinity style)", cfg, batch, seq, hw, plan, gpu,
                  {**engine, "gradients": grads, "checkpoints": plan.cpu_bytes}, 2 * (12 + s) * cfg.param_count(), 0)


def max_batch(cfg: ModelConfig, hw: Hardware, seq: int, compute_dtype: str = "bf16", micro_batches: int = 1,
              prefetch_depth: int = 2, max_inflight: int = 3, limit: int = 1 << 16) -> int:
    """Largest batch (a multiple of ``micro_batches``) that :func:`capacity` accepts; 0 if none."""
    def fits(k: int) -> bool:
        return capacity(cfg, hw, k * micro_batches, seq, compute_dtype, micro_batches,
                        prefetch_depth, max_inflight).fits
    if not fits(1):
        return 0
    lo = 1
    while 2 * lo <= limit and fits(2 * lo):
        lo *= 2
    hi = min(2 * lo, limit + 1)  # first size known (or assumed) not to fit
    while hi - lo > 1:
        mid = (lo + hi) // 2
        lo, hi = (mid, hi) if fits(mid) else (lo, mid)
    return lo * micro_batches


def max_model(hw: Hardware, seq: int, batch: int = 1, presets: Mapping[str, Mapping[str, Any]] | None = None,
              compute_dtype: str = "bf16", prefetch_depth: int = 2, max_inflight: int = 3) -> str | None:
    """Name of the largest preset (by parameter count) that fits at this batch and sequence length.

    A preset with fewer position embeddings than ``seq`` is sized with ``seq`` of them.
    """
    table = PRESETS if presets is None else presets
    cfgs = [ModelConfig(name=name, **dims) for name, dims in table.items()]
    cfgs = [c.with_overrides(seq_len=max(c.seq_len, seq)) for c in cfgs]
    for cfg in sorted(cfgs, key=ModelConfig.param_count, reverse=True):
        if capacity(cfg, hw, batch, seq, compute_dtype, prefetch_depth=prefetch_depth,
                    max_inflight=max_inflight).fits:
            return cfg.name
    return None
