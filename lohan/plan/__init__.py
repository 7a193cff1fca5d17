"""Planning: pure, torch-free arithmetic over a model's shape and a machine (DESIGN.md §4.4-4.5).

- `planner`: hardware descriptions, the activation profile, the cost model and Algorithm 1, the capacity
  planner and the GPU memory plan.
- `memory`: what a run holds in main memory, and the bound on its peak RSS.

Nothing here imports torch or touches a file beyond reading a hardware description: the dry run, the
capacity CLI and the run header price a plan before torch is loaded.
"""
