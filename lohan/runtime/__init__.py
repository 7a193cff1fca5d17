"""Executing a step (DESIGN.md §4.2-4.4): the engine and the components it drives.

- `engine`: `Engine.step`, forward and backward block by block, settlement and commit.
- `offload`: active gradient offloading, the CPU optimizer pipeline fed during backward; `optim` its AdamW.
- `params`: streaming P16 blocks to the device.
- `activations`: the activation plan carried out per block (`ActivationManager`); `activation_store`: where
  swapped activations live (device, CPU, SSD) and how they are recorded and replayed; `profiler`: the
  first step's measurements the plan is made from.
- `device`, `simdevice`: the one place tensors cross between host and device, and the simulated device.
- `parallel`: torchrun data parallelism; `heap`: glibc heap settings; `hf_engine`: engines for HF models.
"""
