"""LoRA adapters on a block program's projections, computed as PEFT computes them.

Each targeted projection (a `nn.Linear`, or transformers' `Conv1D` of GPT-2) of a decoder block gets two fp32
matrices, A [r, in] and B [out, r], and a forward hook that turns its output `y` into

    y + B(A(x)) * (alpha / r)          (then cast back to y's dtype)

with the very ops of `peft.tuners.lora.Linear.forward` (the input cast to the adapters' dtype, `F.linear` twice,
the scaling as a Python float, one addition; `lora_dropout` on the input first when ``lora_dropout`` > 0), so a model
with these hooks computes PEFT's bits. The hooks leave the
module tree alone (STYLE.md 10: reversible hooks, never forked model code): the blocks' parameters, which the store
lays out and the streamer swaps, stay the base weights under their own names, and the adapters are parameters of
their own (`LoraAdapters.params`), never seen by `named_parameters()` of a block.

Initialization is PEFT's (`init_lora_weights=True`): A kaiming-uniform with a = sqrt(5), B zero, so the model
starts as the base. Each A is drawn from a generator of its own, seeded from (seed, block, index of the target in
the block), so a module's draw depends on nothing else. PEFT draws from the global generator in module order:
an exactness test copies the initial adapters across (`peft_state_dict`).

Dropout (``lora_dropout`` > 0, in training): each mask is drawn from a generator of its own, seeded from (seed, step,
micro-batch, block, target; `mask_seed`), which the engine sets (`LoraAdapters.step`, `.micro_batch`): a block
recomputed in backward draws its forward's masks again (no RNG state to carry from one to the other), and a resumed
run the masks of the run it continues. PEFT draws from the global generator: an exactness test draws its masks by
the same rule (`lora_dropout`).
"""

from __future__ import annotations

import hashlib
import json
import math
import os
import re
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import torch
import torch.nn.functional as F  # noqa: N812
from torch import Tensor, nn

PEFT_PREFIX = "base_model.model."
"""What PEFT puts before a module's name in a saved adapter (`get_peft_model_state_dict`)."""


@dataclass(frozen=True)
class Target:
    """One adapted projection: where it is and its adapter's shapes."""

    block: int
    path: str
    """The module's name inside its block (e.g. ``self_attn.q_proj``)."""
    in_features: int
    out_features: int
    conv1d: bool
    """transformers' Conv1D (GPT-2): weight [in, out]; PEFT sets ``fan_in_fan_out`` for it."""


def _is_projection(module: nn.Module) -> tuple[int, int, bool] | None:
    """(in, out, conv1d) of a module LoRA can adapt, or None."""
    if isinstance(module, nn.Linear):
        return module.in_features, module.out_features, False
    if type(module).__name__ == "Conv1D" and hasattr(module, "nf"):  # transformers.pytorch_utils.Conv1D
        w = module.weight
        return int(w.shape[0]), int(w.shape[1]), True
    return None


def _matches(path: str, targets: Sequence[str]) -> bool:
    """PEFT's ``target_modules`` rule: the name itself, or a dotted suffix of it."""
    return any(path == t or path.endswith("." + t) for t in targets)


def find_targets(modules: Sequence[nn.Module], targets: Sequence[str] = ()) -> list[Target]:
    """The projections of the decoder blocks (every block but the first, the embedding, and the last, the head) that
    get adapters: those named in `targets`, or all of them (empty: PEFT's ``all-linear``). ValueError when a name
    in `targets` matches nothing, or nothing is found."""
    found: list[Target] = []
    for i in range(1, len(modules) - 1):
        for path, m in modules[i].named_modules():
            shape = _is_projection(m)
            if shape is not None and (not targets or _matches(path, targets)):
                found.append(Target(i, path, *shape))
    missing = [t for t in targets if not any(_matches(x.path, [t]) for x in found)]
    if missing or not found:
        have = sorted({p.rpartition(".")[2] for i in range(1, len(modules) - 1)
                       for p, m in modules[i].named_modules() if _is_projection(m) is not None})
        what = f"--lora-targets {', '.join(missing)} matches" if missing else "the model has"
        raise ValueError(f"{what} no linear projection of the decoder layers; choose among {', '.join(have) or '-'}")
    return found


def projections(modules: Sequence[nn.Module], targets: Sequence[str] = ()) -> list[tuple[int, int]]:
    """The (in, out) widths of every projection `find_targets` adapts: what a plan prices the adapters by
    (`lohan.plan.lora.adapter_params`). ValueError as `find_targets`."""
    return [(t.in_features, t.out_features) for t in find_targets(modules, targets)]


class LoraAdapters:
    """The adapters of a block program, their hooks and their names (module docstring)."""

    def __init__(self, modules: Sequence[nn.Module], r: int, alpha: float, targets: Sequence[str] = (),
                 seed: int = 0, put: Callable[[Tensor], Tensor] = lambda t: t, dropout: float = 0.0) -> None:
        """`put` moves a new CPU tensor to the compute device (`Device.put`); `dropout`: PEFT's ``lora_dropout``
        (`lora_dropout`: its masks drawn by (seed, `step`, `micro_batch`, block, target), which the engine sets)."""
        if r < 1:
            raise ValueError(f"LoRA rank {r}: give a rank >= 1")
        if not 0 <= dropout < 1:
            raise ValueError(f"LoRA dropout {dropout}: give a probability in [0, 1)")
        self.r, self.alpha, self.dropout, self.seed = int(r), float(alpha), float(dropout), int(seed)
        self.training = True  # dropout on (False: evaluation, as PEFT's model.eval())
        self.step = self.micro_batch = 0  # what a dropout mask is drawn for
        self.scaling = self.alpha / self.r  # PEFT: lora_alpha / r (not rsLoRA)
        self.targets = find_targets(modules, targets)
        self.modules = list(modules)
        self.A: list[nn.Parameter] = []
        self.B: list[nn.Parameter] = []
        self.index: list[int] = []  # each target's place among its block's targets
        per_block: dict[int, int] = {}
        for t in self.targets:
            k = per_block.get(t.block, 0)
            per_block[t.block] = k + 1
            self.index.append(k)
            a = torch.empty(self.r, t.in_features, dtype=torch.float32)
            gen = torch.Generator().manual_seed(_seed_of(seed, t.block, k))
            nn.init.kaiming_uniform_(a, a=math.sqrt(5), generator=gen)  # PEFT's reset_lora_parameters
            self.A.append(nn.Parameter(put(a)))
            self.B.append(nn.Parameter(put(torch.zeros(t.out_features, self.r, dtype=torch.float32))))
        self._hooks: list[torch.utils.hooks.RemovableHandle] = []

    @property
    def params(self) -> list[nn.Parameter]:
        """Every adapter matrix in PEFT's `parameters()` order (module by module, A then B)."""
        return [p for pair in zip(self.A, self.B) for p in pair]

    def block_params(self, block: int) -> list[nn.Parameter]:
        """Block `block`'s adapter matrices, in `params` order."""
        return [p for t, a, b in zip(self.targets, self.A, self.B) if t.block == block for p in (a, b)]

    @property
    def blocks(self) -> list[int]:
        """The blocks with adapters."""
        return sorted({t.block for t in self.targets})

    @property
    def numel(self) -> int:
        return sum(p.numel() for p in self.params)

    def attach(self) -> None:
        """Hook every target (once): its output gains the adapter's term."""
        if self._hooks:
            return
        for j, (t, a, b) in enumerate(zip(self.targets, self.A, self.B)):
            module = self.modules[t.block].get_submodule(t.path)
            self._hooks.append(module.register_forward_hook(_hook(a, b, self.scaling, self._dropper(j))))

    def _dropper(self, j: int) -> Callable[[Tensor, torch.dtype], Tensor | None]:
        """Target j's dropout: its input cast to the adapters' dtype with PEFT's ``lora_dropout`` applied (PEFT casts,
        then drops), or None where there is none (p = 0, or evaluation)."""
        block, k = self.targets[j].block, self.index[j]

        def drop(x: Tensor, dtype: torch.dtype) -> Tensor | None:
            if not (self.dropout and self.training):
                return None
            x = x.to(dtype) if x.dtype != dtype else x
            return lora_dropout(x, self.dropout, mask_seed(self.seed, self.step, self.micro_batch, block, k))
        return drop

    def detach(self) -> None:
        for h in self._hooks:
            h.remove()
        self._hooks = []

    # ---------------------------------------------------------------- PEFT
    def module_names(self, root: nn.Module) -> list[str]:
        """Each target's name in the whole model `root` (e.g. ``model.layers.0.self_attn.q_proj``)."""
        names: dict[int, str] = {}
        for name, m in root.named_modules(remove_duplicate=False):
            names.setdefault(id(m), name)
        return [names[id(self.modules[t.block].get_submodule(t.path))] for t in self.targets]

    def peft_names(self, root: nn.Module) -> list[str]:
        """PEFT's saved names of `params` (``base_model.model.<module>.lora_A.weight``) in the whole model `root`."""
        return [f"{PEFT_PREFIX}{m}.lora_{ab}.weight" for m in self.module_names(root) for ab in "AB"]

    def peft_state_dict(self, root: nn.Module) -> dict[str, Tensor]:
        """The adapters under PEFT's saved names, on the CPU (what `adapter_model.safetensors` holds)."""
        return {n: p.detach().cpu().contiguous() for n, p in zip(self.peft_names(root), self.params)}

    def target_names(self) -> list[str]:
        """The targets' last names, for ``target_modules`` of a PEFT config (which matches them as suffixes)."""
        return sorted({t.path.rpartition(".")[2] for t in self.targets})

    def delta(self, k: int) -> Tensor:
        """Target k's merged update in its weight's layout (PEFT's `get_delta_weight`: (B @ A) * scaling, transposed
        for Conv1D)."""
        d = (self.B[k].detach().float() @ self.A[k].detach().float()) * self.scaling
        return d.T if self.targets[k].conv1d else d


def _seed_of(seed: int, block: int, k: int) -> int:
    """A generator seed per (run seed, block, target in the block)."""
    return (int(seed) * 1_000_003 + block * 4099 + k) % (1 << 63)


def mask_seed(seed: int, step: int, micro_batch: int, block: int, k: int) -> int:
    """The seed of a dropout mask: one per (run seed, step, micro-batch of the step over every rank, block, target in
    the block), so a block's recomputation in backward draws its forward's masks again, and a resumed run the
    masks of the run it continues."""
    key = f"{int(seed)},{int(step)},{int(micro_batch)},{int(block)},{int(k)}".encode()
    return int.from_bytes(hashlib.blake2b(key, digest_size=8).digest(), "little") & ((1 << 63) - 1)


def lora_dropout(x: Tensor, p: float, seed: int) -> Tensor:
    """PEFT's ``lora_dropout`` (`nn.Dropout(p)` in training, the CPU kernel's ops: a Bernoulli(1 - p) mask divided
    by 1 - p, times x), its mask drawn from a generator of its own seeded with `seed` (`mask_seed`)."""
    gen = torch.Generator(device=x.device).manual_seed(seed)
    noise = torch.empty_like(x).bernoulli_(1 - p, generator=gen)
    noise.div_(1 - p)
    return x * noise


def _hook(a: nn.Parameter, b: nn.Parameter, scaling: float, drop: Callable[[Tensor, torch.dtype], Tensor | None]):
    """The forward hook of one target: peft.tuners.lora.Linear.forward's vanilla-LoRA path, op for op (`drop`:
    its dropout)."""
    def hook(module: nn.Module, args: tuple, result: Tensor) -> Tensor:
        x = args[0]
        result_dtype = result.dtype
        dev = result.device.type
        dropped = drop(x, a.dtype)
        if dropped is not None:
            x = dropped
        if torch.is_autocast_enabled(dev):
            # autocast runs both linears in its lower precision: cast here, as it would, but never through its
            # cache of leaf casts, which makes a no-grad forward and the recomputation with grad issue different op
            # sequences (the activation records are replayed by op sequence). (x: lower precision already, or
            # PEFT's cast to fp32 then autocast's back: the same values.)
            low = torch.get_autocast_dtype(dev)
            with torch.autocast(dev, enabled=False):
                h = F.linear(F.linear(x.to(low), a.to(low)), b.to(low))
        else:
            if x.dtype != a.dtype:  # PEFT's _cast_input_dtype
                x = x.to(dtype=a.dtype)
            h = F.linear(F.linear(x, a), b)  # lora_B(lora_A(dropout(x)))
        result = result + h * scaling
        return result.to(result_dtype)
    return hook


ADAPTER_CONFIG, ADAPTER_WEIGHTS = "adapter_config.json", "adapter_model.safetensors"
"""The files of a PEFT adapter folder (`peft.PeftModel.from_pretrained(base, folder)` reads them)."""


def peft_config(adapters: LoraAdapters, root: nn.Module, base: str, dropout: float = 0.0) -> dict:
    """The ``adapter_config.json`` of `adapters` (a PEFT ``LoraConfig``): its targets as a pattern that matches exactly
    the adapted modules (PEFT full-matches a string ``target_modules`` against every module's name), so a leaf name
    that also names a module outside the decoder layers adapts nothing more."""
    pattern = "|".join(re.escape(m) for m in adapters.module_names(root))
    return {"peft_type": "LORA", "task_type": "CAUSAL_LM", "base_model_name_or_path": base, "r": adapters.r,
            "lora_alpha": adapters.alpha, "lora_dropout": float(dropout), "target_modules": f"^({pattern})$",
            "bias": "none", "fan_in_fan_out": any(t.conv1d for t in adapters.targets), "inference_mode": True,
            "init_lora_weights": True, "use_rslora": False, "use_dora": False, "modules_to_save": None,
            "layers_to_transform": None, "layers_pattern": None, "rank_pattern": {}, "alpha_pattern": {}}


def write_peft_adapter(adapters: LoraAdapters, root: nn.Module, base: str, out: str | os.PathLike,
                       dropout: float = 0.0) -> None:
    """Write `adapters` as a PEFT adapter folder into `out` (an existing folder the caller owns): its config and
    its weights under PEFT's saved names, fp32 as PEFT keeps them."""
    from safetensors.torch import save_file

    with open(os.path.join(out, ADAPTER_CONFIG), "w") as f:
        json.dump(peft_config(adapters, root, base, dropout), f, indent=2, sort_keys=True)
    save_file(adapters.peft_state_dict(root), os.path.join(out, ADAPTER_WEIGHTS), metadata={"format": "pt"})
