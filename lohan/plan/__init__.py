"""Planning: pure, torch-free arithmetic over a model's shape and a machine (DESIGN.md §4.4-4.5).

- `hardware` (machines and their presets), `profile` (the activation profile), `lanes` (the lane vocabulary),
  `cost_model` (a swap set's step time), `activation_plan` (Algorithm 1), `gpu_memory` (the GPU memory plan),
  `capacity` (the capacity planner), `run_lanes` (a run's predicted lanes, what the SSDs cost); `planner` re-exports
  their names.
- `records`: the record geometry (P32 | m | v | P16 per block, 4 KiB-aligned sections), which the store lays out.
- `pools`: the engine's main-memory pools (`plan_host_memory`), which the engine allocates, the capacity planner
  prices and the run header prints.
- `run_plan`: a run's plan made once (`plan_run`: the whole EngineConfig, the store's geometry, the machine's
  memory): the pools, resident set, chunk, stash and their refusal, which the pre-flight and the dry run price
  (`capacity.plan_capacity`) and the engine executes.
- `memory`: the bound on a run's peak RSS (cpu_mem and what no budget covers).
- `clipping`: whether a clipped run's next step should speculate its update or defer it (the recent gradient
  norms against the cost model's, then the measured, costs of a deferred and a redone step).

Nothing here imports torch or touches a file beyond reading a hardware description: the dry run, the
capacity CLI and the run header price a plan before torch is loaded.
"""
