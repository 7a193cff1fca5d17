"""`EngineConfig`'s sections: one typed dataclass per concern (store, memory, execution, schedule, stability, lora,
activations), each field with its docstring, its flag where it has one, and its checks."""

from __future__ import annotations

from dataclasses import dataclass

from lohan.config.choices import (
    ACT_POLICIES,
    FINETUNE_LR,
    FINETUNE_WARMUP,
    ActCompress,
    Backend,
    ClipMode,
    ComputeDtype,
    Device,
    Mode,
    NoDecayKind,
    Scheduler,
    Slots,
    StateFormat,
    setting,
)
from lohan.config.units import steps_share


@dataclass(frozen=True)
class StoreConfig:
    """Where and how the model states are stored: the SSD directories, the store's name and layout
    (fixed when the store is created: ``slots``, ``checksums``, ``state_format``) and the I/O settings.

    Part of :class:`EngineConfig` (``engine.store``), which validates it.
    """

    nvme: tuple[str, ...] = setting(
        ("./runs/nvme",), group="memory and storage", metavar="DIR",
        help="one directory per SSD (striped)")
    """One directory per SSD; the store is striped over all of them."""

    name: str = "lohan"
    """Store name: file stem of the slab files and records in the NVMe directories (``<nvme>/<name>.slab``, ...).
    A file name, not a path: letters, digits, ``_`` and ``-`` (`store_name_problem`)."""

    slots: Slots = setting(
        2, group="memory and storage",
        help="2: crash-consistent alternate slots; 1: in place")
    """2: a step's states go to the alternate slot and become current with an atomic commit record
    (crash-consistent, 2x SSD space). 1: in place (needs periodic checkpoints to survive a crash)."""

    checksums: bool = True
    """Hash every record section the store writes (XXH3-64, committed with the step) and verify every read,
    so bytes damaged on the SSDs stop the run instead of training on. Fixed when the store is created."""

    state_format: StateFormat = setting(
        "exact", group="memory and storage",
        help="optimizer states on the SSDs: exact (fp32, 14 B/param), bf16-moments (10), 8bit-moments "
             "(8), bf16-master (4; stochastic rounding, needs --compute-dtype bf16); fixed at creation")
    """How the optimizer states are stored (README "Smaller states"; fixed when the store is created):
    ``exact`` (fp32 master, m, v and the P16 copy: bit-exact with PyTorch's AdamW, 14 bytes per parameter),
    ``bf16-moments`` (m and v in bf16: 10), ``8bit-moments`` (m and v 8-bit block-wise, as bitsandbytes' and
    torchao's 8-bit Adam: 8.03) or ``bf16-master`` (bf16 weights updated with stochastic rounding, seeded by
    ``seed``, no separate P16, 8-bit moments: 4.03; needs compute_dtype bf16, which ``auto`` picks for it)."""

    backend: Backend = setting("auto", group="memory and storage", help="NVMe I/O backend")
    """io_engine backend: ``auto``, ``aio`` or ``threads``."""

    stripe_bytes: int | str = "1MiB"
    """Stripe unit over the SSD directories (each volume's striping; the optimizer's unit is `opt_chunk_bytes`)."""

    emulate_ssd_gbps: float | None = None
    """Pace every NVMe directory to this many GB/s (reads and writes share it), to emulate slower
    or fewer SSDs on a fast disk in benchmarks and ablations. Results measured so are emulated."""


@dataclass(frozen=True)
class MemoryConfig:
    """Main and device memory: the budgets and how the engine's host pools use them.

    Part of :class:`EngineConfig` (``engine.memory``), which validates it.
    """

    cpu_mem: int | str = setting(
        "8GiB", group="memory and storage",
        help="main-memory budget of the engine, e.g. 8GiB")
    """Main-memory budget for every buffer the engine owns (parameter prefetch, optimizer working
    set, gradients, and the rooms that take what is left: resident records, read-ahead, the gradient stash). It
    must hold the engine's pools (`lohan.plan.pools.plan_host_memory`: the P16 of the blocks in use, the gradient
    buffers, ``max_inflight_blocks`` optimizer records, or chunks of ``opt_chunk_bytes``, and their fp32 scratch);
    a smaller one is refused before anything is written, with what each pool takes."""

    gpu_mem: int | str | None = setting(
        None, group="memory and storage",
        help="device memory the plan must fit in, e.g. 24GiB (default: the device's)")
    """Device memory the run must fit in (the planner checks it before anything is written);
    None: the device's own (main memory when the device is the CPU)."""

    prefetch_depth: int = setting(2, group="memory and storage", help="blocks of parameters read ahead")
    """Blocks whose parameters are read ahead of the one computing (forward and backward)."""

    max_inflight_blocks: int = 3
    """Blocks the optimizer pipeline holds at once (each needs its P32, m, v, P16 record in memory)."""

    opt_chunk_bytes: int | str = "512MiB"
    """Largest piece of a block's optimizer record (P32, m, v, P16) the CPU optimizer works on at once.
    Blocks with bigger records (a 175B layer's is 25 GB) are updated in chunks, so the optimizer's
    memory is ``max_inflight_blocks`` chunks, not whole records."""

    resident_records: bool = True
    """Keep the optimizer records (P32, m, v, P16) of some blocks in the record pool from one step to the next,
    so that only the others are read from the SSDs each step (every record is still written: the commit
    needs it there). The pool streams the other records through `max_inflight_blocks` buffers beside the
    records bigger than those (a tied embedding's: one buffer for it instead of `max_inflight_blocks`,
    `plan.pools.record_pool_bytes`), and `resident_mem` gives it room for more. With `resident_mem: 0` the 110M
    Llama reads 1.0 instead of 1.3 GB per step; with the default every record stays and nothing is read.
    False: every record is read every step, through `max_inflight_blocks` buffers of the largest."""

    resident_mem: int | str = "auto"
    """Main memory beyond the record pool for more resident records (part of ``cpu_mem``; never more than
    all of them take). ``auto``: half of what ``cpu_mem`` and the machine's available memory leave after the
    engine's other pools and the gradient stash (the other half stays for swapped activations); ``all``: as
    much as keeps every record resident (the optimizer states then live in RAM, as with ZeRO-Offload, and are
    still written every step); ``0``: none, the leanest setting. Fewer bytes are read, and the update after a
    deferred gate waits for fewer READs: the 110M Llama, whose records are 1.53 GB, keeps them all with
    ``auto`` (within an 8 GiB ``cpu_mem``) and steps in 1.14 instead of 1.58 s with ``0``, at 2.93 instead of
    2.09 GiB peak RSS. A value other than ``auto`` and ``0`` needs ``resident_records``."""

    readahead_mem: int | str = "auto"
    """Main memory (part of ``cpu_mem``) for optimizer records READ ahead of their update, in ``optimized`` mode:
    during backward, ahead of an update that waits for the global gradient norm (a clipped step's deferred
    update, every update with ``slots=1``), so those READs run under backward instead of after it; and ahead of
    the gradients when the update runs during backward (the SSDs' pace evens out). ``auto``: what ``resident_mem:
    auto`` leaves of its half of the memory ``cpu_mem`` and the machine's available memory leave after the other
    pools and the gradient stash (so with ``resident_mem: 0`` that whole half), never more than reading every
    record ahead takes; ``0``: only the record pool's ``max_inflight_blocks`` buffers read ahead. Resident records
    serve the same purpose and more (their READs are never made), so ``auto`` gives them the memory first."""

    heap_reuse: bool = True
    """Have glibc's malloc serve every allocation from its heap and keep what is freed there for reuse
    (`runtime/heap.py`, `reuse_heap`), instead of mapping each tensor over 32 MiB afresh and unmapping it when it is
    freed. A step's biggest temporaries (the logits, the embedding's gradient) are then not page-faulted in
    again every step: the 110M Llama's step spent ~0.3 s of its two cores' time in the kernel doing that.
    Process-wide, and set when the engine is built; False leaves the allocator as it is. No effect where
    the C library is not glibc."""


@dataclass(frozen=True)
class ExecutionConfig:
    """How a step runs: the offloading mode, the precision, the device, gradient accumulation,
    the seed and when steps become durable.

    Part of :class:`EngineConfig` (``engine.execution``), which validates it.
    """

    mode: Mode = setting("optimized", group="memory and storage", help="gradient offloading mode")
    """Active gradient offloading mode: ``serial`` (optimizer after backward, ZeRO-Infinity style),
    ``naive`` (per block READ -> ADAM -> WRITE during backward) or ``optimized`` (READ of block i-1
    issued before WRITE of block i, paper Fig. 3b)."""

    compute_dtype: ComputeDtype = setting(
        "auto", group="model",
        help="device compute precision. auto: bf16 on a GPU and on a CPU with native bf16 (AMX or "
             "AVX-512 bf16), fp32 on other CPUs, where bf16 runs ~10x slower (the header says which and "
             "why); fp16 uses dynamic loss scaling")
    """``bf16``: bf16 parameters on the device under autocast, fp32 master weights and Adam states.
    ``fp32``: everything fp32 (bit-exact with a plain PyTorch fp32 loop). ``fp16``: with dynamic loss scaling.
    ``auto``: bf16 on a GPU and on a CPU with native bf16 (AMX or AVX-512 bf16), fp32 on other CPUs, where bf16
    runs ~10x slower; bf16 for ``state_format`` bf16-master; a resume keeps the store's. The engine and the run
    resolve it once (`lohan.plan.compute_dtype.choose`) and the header says which and why."""

    micro_batches: int = setting(1, group="data", help="gradient accumulation: micro-batches per step")
    """Gradient accumulation: each batch is split into this many micro-batches."""

    device: Device = setting(
        "auto", group="model",
        help="compute device (sim: the CPU simulating a separate GPU, to test lohan's device code)")
    """``auto`` (CUDA when available), ``cpu``, ``cuda``, or ``sim``: the CPU simulating a separate device, whose
    tensors do not mix with host buffers and whose copies complete late (lohan/runtime/simdevice.py; for tests)."""

    sim_gpu: str | None = setting(
        None, group="model", metavar="SPEC",
        help="with --device sim: run at a modeled GPU's pace, e.g. rtx4090, h100 or "
             "tflops=150,h2d=25GB/s,d2h=25GB/s,hbm=1000GB/s (default: LOHAN_SIM_GPU, else order only)")
    """A GPU the simulated device models the timing of; only with device ``sim`` (README "The simulated device"):
    a name of the planner's GPU presets (``rtx4090``, ``h100``, ...) and/or ``key=value`` rates over it
    (``tflops=150,h2d=25GB/s,d2h=25GB/s,hbm=1000GB/s``; lohan/runtime/simgpu.py). None: ``LOHAN_SIM_GPU`` when
    set, else the simulated device checks order only, not time."""

    seed: int = setting(0, group="optimization", help="initialization and data-order seed")
    """Seed of the model's initialization, of the data order (the batches' shuffle, the synthetic tokens) and of
    the eval set held out by ``eval_fraction``."""

    write_behind: bool = True
    """When a step's optimizer pass runs after backward with the next step's forward beside it (a deferred
    update, two slots, one process), hold each updated record's WRITE back until the READs that forward
    waits for are done, and let the writes still held at the end, and the step's commit, complete during
    the next step's backward (where the SSDs are otherwise idle once its read-ahead is done). A step is then
    durable once the next step's backward has begun, or at `flush()` / `close()`; a crash in between
    resumes from the step before. False: every step is committed before `step` returns."""

    persist_every: int | str = setting(
        "auto", group="memory and storage", metavar="N|auto", parse="count-or-auto",
        help="durability interval: write and commit the records every N steps (between, a step commits "
             "nothing to the SSDs and a kill replays it); only with every record resident; auto (default): "
             "the least N that keeps the writes under ~10%% of the run's time")
    """The durability interval: every this many steps the optimizer records are written to the SSDs and committed;
    the steps between commit nothing there and keep their states in RAM. Only where every record stays resident
    (``resident_records``, enough memory), two slots and one process: records streamed from the SSDs are written
    every step anyway (a slot must hold one step's records, all of them). A kill resumes from the last durable step
    and replays the steps after it (bit-identical); Ctrl-C, SIGTERM, ``close``, evaluations, exports and
    checkpoints persist first. A step that is not durable defers its update until the gradient norm is known (its
    states have no copy on the SSDs to redo or skip from). ``auto``: 1 while any record streams; with every record
    resident, the least interval that keeps the persist writes under ~10% of the run's time
    (`lohan.plan.durability.persist_interval`, from the first step's profile). An integer N > 1 where records stream
    is lowered to 1 (said in the header: the same config runs on machines with less memory)."""

    gc_every: int = 50
    """Steps between full collections of Python's cyclic garbage collector. While an engine is open, automatic
    collection is off: each step's end collects the young generations, and after the first step what lives is
    frozen, so that these full collections walk only what was made since (lohan/runtime/gc_policy.py). Python's
    own schedule runs a full collection wherever allocation counts say, holding the GIL for ~0.2 s in a lohan
    process: the thread that feeds the device stops meanwhile. 0: Python's own schedule."""


@dataclass(frozen=True)
class ScheduleConfig:
    """AdamW's hyper-parameters and the learning-rate schedule: the settings a resume may change (the
    run state saves them and the header says what changed) and that a preset other than the default config's
    does not take from that config.

    Part of :class:`EngineConfig` (``engine.schedule``), which validates it.
    """

    lr: float = setting(
        3e-4, group="optimization",
        help="peak learning rate (a local Hugging Face model without --config: "
             f"{FINETUNE_LR:g}; a preset other than the config's: 3e-4)")
    """Peak learning rate."""

    lr_scheduler: Scheduler = setting(
        "cosine", group="optimization",
        help="after the warm-up: cosine or linear decay, constant, or wsd (stable, then a 1-sqrt decay over "
             "the last --decay-ratio of the steps)")
    """The lr after the warm-up (`lohan.runtime.optim.lr_factor`), down to the floor (``min_lr`` or ``lr *
    min_lr_ratio``) at ``total_steps``: ``cosine`` (half a cosine), ``linear`` (a straight line; with
    ``min_lr_ratio: 0`` it is the Hugging Face Trainer's ``linear``), ``constant`` (the peak lr throughout, no
    floor), or ``wsd`` (warm-up, stable, decay: the peak lr until the last ``decay_ratio`` of ``total_steps``,
    then a 1-sqrt decay to the floor, the cooldown Hägele et al. 2024, "Scaling Laws and Compute-Optimal
    Training Beyond Fixed Training Durations", found best)."""

    warmup_steps: int = setting(
        0, group="optimization",
        help="linear warmup steps (a local Hugging Face model without "
             f"--config: {FINETUNE_WARMUP * 100:.0f}%% of --steps)")
    """Linear warmup from lr/warmup_steps to lr over this many steps."""

    warmup_ratio: float | None = setting(
        None, group="optimization", metavar="R",
        help="warm-up: a share of the steps (or --warmup-steps)")
    """The warm-up as a share of ``total_steps``, in [0, 1]: ``ceil(warmup_ratio * total_steps)`` steps (as the
    Hugging Face Trainer counts it). Exclusive with a nonzero ``warmup_steps``; None: ``warmup_steps`` decides."""

    total_steps: int | None = setting(
        None, group="optimization",
        help="length of the schedule (default: the run's steps)")
    """Length of the schedule (including warmup); None keeps the lr constant after warmup (the command line
    sets it to the run's steps)."""

    min_lr_ratio: float | None = setting(None, group="optimization", help="the decay ends at lr x this")
    """The decay ends at lr * min_lr_ratio at total_steps. None: 0.1, unless ``min_lr`` gives the floor
    (the two are exclusive; after validation it is None only when ``min_lr`` is set)."""

    min_lr: float | None = setting(
        None, group="optimization",
        help="the decay ends at this lr (instead of --min-lr-ratio)")
    """The decay's floor as a learning rate (the Hugging Face name), in [0, lr]; exclusive with
    ``min_lr_ratio``."""

    decay_ratio: float = setting(
        0.1, group="optimization", metavar="R",
        help="wsd: the final decay's share of the steps")
    """``wsd`` only: the share of ``total_steps``, in (0, 1], that the final decay takes
    (``ceil(decay_ratio * total_steps)`` steps, at most those after the warm-up); 0.1 as in MiniCPM's WSD."""

    weight_decay: float = setting(0.01, group="optimization", help="AdamW decoupled weight decay")
    """Decoupled (AdamW) weight decay, applied to every parameter except those `no_decay` names."""

    betas: tuple[float, float] = setting(
        (0.9, 0.999), group="optimization", metavar=("B1", "B2"),
        help="Adam betas")
    """Adam betas."""

    eps: float = setting(1e-8, group="optimization", help="Adam epsilon")
    """Adam epsilon."""

    no_decay: tuple[NoDecayKind, ...] = ("bias", "norm")
    """Parameters AdamW does not decay, by kind: ``bias`` (every bias), ``norm`` (weights of LayerNorm /
    RMSNorm modules), ``embedding`` (token and position embeddings, and a head tied to them). The
    Hugging Face Trainer's default is ``bias`` and ``norm``; ``[]`` decays everything."""

    @property
    def warmup(self) -> int:
        """Warm-up steps: ``warmup_steps``, or ``warmup_ratio`` of ``total_steps`` (none while that is None)."""
        if self.warmup_ratio is None:
            return self.warmup_steps
        return steps_share(self.warmup_ratio, self.total_steps) if self.total_steps else 0

    @property
    def floor_ratio(self) -> float:
        """Where the decay ends, as a share of ``lr`` (from ``min_lr`` or ``min_lr_ratio``)."""
        return self.min_lr / self.lr if self.min_lr is not None else self.min_lr_ratio


@dataclass(frozen=True)
class StabilityConfig:
    """Gradient clipping, the fp16 loss scale and the limit on non-finite steps in a row.

    Part of :class:`EngineConfig` (``engine.stability``), which validates it.
    """

    max_grad_norm: float = setting(
        1.0, group="optimization", metavar="NORM",
        help="clip gradients to this global L2 norm (0 turns clipping off)")
    """Clip the gradients to this global L2 norm before the update, exactly as
    `torch.nn.utils.clip_grad_norm_` (0 turns clipping off). Under active gradient offloading the norm is
    only known at the end of backward: see `clip_mode`."""

    clip_mode: ClipMode = setting(
        "auto", group="optimization",
        help="clipping under overlapped updates: speculate and redo, or defer updates")
    """How updates overlap backward when clipping (every choice gives the same bits). ``speculate``: update each
    block with coefficient 1 as its gradients arrive and redo the step's optimizer pass from the previous slot
    (kept gradients, exact coefficient) when the step's norm says clipping applies: best when steps rarely clip,
    a clipped step costs a second pass. ``defer``: read ahead during backward (up to ``readahead_mem``) and update
    once the norm is known, in forward order with the next step's forward beside it: best when most steps clip
    (early fine-tuning). ``auto``: choose per step (`runtime/clip_schedule.py`): speculate when the chance that
    the step clips, estimated from the recent norms, times a redo's cost is below what deferring costs, both
    measured as the run goes (the cost model's figures until then); data parallel ranks speculate after an
    unclipped step and defer after a clipped one. With ``slots=1`` only ``defer`` is possible.

    With clipping off (``max_grad_norm`` 0) nothing is redone, and the choice is where the update runs: under
    backward (``speculate``), or after it beside the next step's forward (``defer``; one process, two slots, not
    serial mode; the step's gradients are kept meanwhile). ``auto`` plans room for them only where they all fit
    in what cpu_mem leaves, and then defers where that measures faster (a CPU device whose cores the optimizer
    shares: the update fills the forward's idle time); elsewhere it updates under backward."""

    loss_scale: float = 65536.0
    """fp16 only: the initial dynamic loss scale (`torch.amp.GradScaler`'s ``init_scale``). The loss is
    multiplied by it before backward and the gradients divided by it after; a step whose gradients overflow
    is skipped (the previous slot stands) and the scale halved; after ``loss_scale_growth_interval`` steps
    without overflow it doubles."""

    loss_scale_growth_interval: int = 2000
    """fp16 only: steps without overflow before the loss scale doubles (GradScaler's ``growth_interval``)."""

    max_bad_steps: int = 8
    """A step whose loss or gradients are not finite is never committed (the previous states stand, its
    batch is skipped); after this many such steps in a row the run stops."""


@dataclass(frozen=True)
class LoraConfig:
    """LoRA: the adapters' rank, scaling, dropout and targets (rank 0: full fine-tuning).

    Part of :class:`EngineConfig` (``engine.lora``), which validates it.
    """

    lora_r: int = setting(
        0, group="optimization", flag="lora", metavar="R",
        help="LoRA of rank R: the weights stay frozen (stored once as read-only P16 and streamed), only "
             "adapters of the decoder layers' projections train, as PEFT's; fixed when the store is created")
    """LoRA rank (``--lora R``; 0: full fine-tuning). With R > 0 the model's weights are a frozen base, stored once
    as read-only P16 and streamed, and only rank-R adapters (A, B) of the targeted projections are trained, as PEFT's
    LoRA (`lohan.runtime.lora_engine`). Fixed when the store is created: a resume with other LoRA settings is
    refused."""

    lora_alpha: float = setting(
        8.0, group="optimization", metavar="A",
        help="LoRA scaling alpha / R (default 8, PEFT's)")
    """LoRA scaling numerator: the adapters' update is scaled by ``lora_alpha / lora_r`` (PEFT's ``lora_alpha``,
    whose default is 8 whatever the rank)."""

    lora_dropout: float = setting(
        0.0, group="optimization", metavar="P",
        help="dropout on the adapters' input (only 0 so far)")
    """Dropout on the adapters' input (PEFT's ``lora_dropout``), in [0, 1); its masks are drawn per (seed, step,
    micro-batch, block, target), so a recomputed block draws its forward's again (`lohan.models.lora.mask_seed`)."""

    lora_targets: tuple[str, ...] = setting(
        (), group="optimization", metavar="NAMES", parse="names",
        help="comma-separated module names to adapt, e.g. q_proj,v_proj (default: every linear projection "
             "of the decoder layers, attention and MLP)")
    """Names of the modules that get adapters, matched against each module's name inside a decoder layer as PEFT's
    ``target_modules`` (the last part, or a dotted suffix: ``q_proj``, ``self_attn.o_proj``); empty: every linear
    projection of the decoder layers, attention and MLP (PEFT's ``all-linear``), never the embedding or the head."""


@dataclass(frozen=True)
class ActivationConfig:
    """Which activations leave the device between forward and backward, where they wait, and how.

    Part of :class:`EngineConfig` (``engine.activations``), which validates it.
    """

    act_policy: str = setting(
        "plan", group="memory and storage",
        help=f"activations: {' | '.join(ACT_POLICIES)} | ops:NAME,...")
    """Which activations leave the device between forward and backward (DESIGN.md §4.4):
    ``plan`` (the traffic-aware planner, Algorithm 1, on a profile measured at the first step),
    ``interblock`` (block inputs only, the rest recomputed; ZeRO-Infinity style), ``swap-all``
    (every op's outputs; G10 style) or ``recompute-all`` (block inputs stay on the device)."""

    act_mem: int | str | None = setting(
        None, group="memory and storage",
        help="main memory for swapped activations (the rest goes to the SSDs)")
    """Main memory for swapped activations; what does not fit goes on to the SSDs. None: what
    ``cpu_mem`` and the machine's free memory leave after the engine's own pools."""

    act_compress: ActCompress = setting(
        "none", group="memory and storage",
        help="int8: swapped activations travel and wait as int8 codes with a scale per row (lossy)")
    """``int8``: activation records leaving the device for main memory or the SSDs carry their floating tensors as
    int8 codes with an fp32 scale per row (symmetric, PyAO's scheme; quantized on the device before the copy,
    dequantized there just before use): ~1/4 of the bytes of fp32, ~1/2 of bf16, lossy. ``none``: as they are."""

    profile_from: str | None = None
    """A saved profile (JSON) to plan from instead of measuring one at the first step."""

