"""Swapped activations on CUDA, per attention kernel: a swapping policy trains like recompute-all on the same GPU
with the same SDPA backend, bit for bit with MATH, within stated tolerances with the fused kernels.

Why per kernel. The engine runs each block's forward under no_grad, records the outputs of the swapped ops
(SDPA's among them) and replays them when it recomputes the block with grad in backward (lohan/runtime/activation_store.py).
On CUDA the memory-efficient and cuDNN attention kernels compute the logsumexp their backward needs only when
grad is enabled (aten's `should_compute_logsumexp`); flash always returns it, MATH is plain ops. A record
taken under no_grad then lacks it, and the replayed SDPA's backward runs without it: wrong gradients, or an
error. Each backend is forced with `sdpa_kernel` around both runs (its flags are process-wide, so every call
of the engine sees them); "default" is PyTorch's own choice for the shape and dtype (flash or cuDNN in bf16,
memory-efficient in fp32 on sm80+). A backend that cannot run the model's shape and dtype is skipped with the
reason PyTorch gives (cuDNN and flash need fp16/bf16; flash takes no attention mask).

Models: the project's GPT (causal SDPA without a mask; records on the CPU tier, in pinned memory, and on the
SSD tier, act_mem 4096), and a Mistral-family HF model whose sliding window (8) is shorter than the sequence
(32), so HF hands SDPA an explicit mask (the CPU tier).

Gradients. The engine's gradients live in host buffers the API does not expose; one AdamW step shows them.
With eps = 1, no weight decay and no clipping, the first step moves each weight by exactly
u = lr * g / (|g| + 1) (bias-corrected m = g and sqrt(v) = |g|), so g = (u / lr) / (1 - |u| / lr) is read back
from the weights before and after the step, to within a few ulps of the weight / lr (`first_step_gradients`;
checked against autograd in `test_gradient_readout_is_the_gradient`). The later steps (Adam with eps 1:
momentum SGD at lr 0.1, stable on these models) give a loss curve.

Exactness with MATH: under `use_deterministic_algorithms` with TF32 off, every kernel is deterministic, so the
recorded outputs are the recomputed ones and the two runs agree bit for bit: losses, gradient norms, weights.
Tolerances with the fused kernels (`TOLERANCE`): their backward kernels may sum with atomics (run-to-run
noise of a few ulps), so gradients agree to rounding: per tensor, ||g_swap - g_keep|| <= rtol ||g_keep|| +
(the readout's resolution, 8 ulps of the tensor's largest weight / lr per element, in L2). A replay without
the logsumexp moves them by O(1). The first step's loss is a forward on identical inputs (expected equal);
the later losses follow from gradients that agree to rounding.
"""

from __future__ import annotations

import contextlib
import functools
import math
import warnings
from collections.abc import Callable, Iterator
from dataclasses import dataclass

import pytest
import torch
import torch.nn.functional as F
from torch.nn.attention import SDPBackend, sdpa_kernel

import lohan
from tests.integration.test_engine_equivalence import batches, engine_config, ref_name, tiny_cfg

pytestmark = pytest.mark.gpu  # skipped without CUDA (tests/conftest.py)

BACKENDS: dict[str, list[SDPBackend] | None] = {
    "math": [SDPBackend.MATH],
    "efficient": [SDPBackend.EFFICIENT_ATTENTION],
    "cudnn": [SDPBackend.CUDNN_ATTENTION],
    "flash": [SDPBackend.FLASH_ATTENTION],
    "default": None,  # PyTorch's own choice
}
TIERS = {"cpu": "256MiB", "ssd": 4096}  # act_mem: room for every record in pinned memory, or for none
TOLERANCE = {  # dtype -> (rtol of step 1's gradients per tensor, rel. loss at step 1, rel. loss at steps 2..)
    "fp32": (1e-4, 1e-6, 1e-4),
    "bf16": (3e-2, 1e-3, 2e-3),
}
STEPS = 3
LR = 0.1
BATCH, SEQ = 4, 64
GPT = dict(n_layer=3, d_model=64, n_head=4, seq_len=SEQ)  # head_dim 16: every fused kernel takes it
HF_SEQ, HF_WINDOW = 32, 8


# ------------------------------------------------------------------------------------------ helpers
@contextlib.contextmanager
def kernel(backend: str) -> Iterator[None]:
    """Force the SDPA backend (MATH: also deterministic algorithms and no TF32, for bit-exactness)."""
    forced = BACKENDS[backend]
    with contextlib.ExitStack() as stack:
        if forced is not None:
            stack.enter_context(sdpa_kernel(forced))
        if backend == "math":
            stack.enter_context(_deterministic())
        yield


@contextlib.contextmanager
def _deterministic() -> Iterator[None]:
    saved = (torch.are_deterministic_algorithms_enabled(), torch.is_deterministic_algorithms_warn_only_enabled(),
             torch.backends.cuda.matmul.allow_tf32, torch.backends.cudnn.allow_tf32)
    # warn_only: cuBLAS asks for CUBLAS_WORKSPACE_CONFIG (gpu_suite.sh sets it) before its first handle exists,
    # which in a pytest process may be before this test; the kernels chosen are the deterministic ones either way
    torch.use_deterministic_algorithms(True, warn_only=True)
    torch.backends.cuda.matmul.allow_tf32 = False
    torch.backends.cudnn.allow_tf32 = False
    try:
        yield
    finally:
        torch.use_deterministic_algorithms(saved[0], warn_only=saved[1])
        torch.backends.cuda.matmul.allow_tf32, torch.backends.cudnn.allow_tf32 = saved[2], saved[3]


def unavailable(backend: str, dtype: torch.dtype, mask: bool) -> str | None:
    """Why the forced backend cannot run attention like the model's (q, k, v of [B, H, T, 16] in `dtype`, causal,
    or with a boolean [B, 1, T, T] mask), forward without and with grad and backward; None when it can."""
    if BACKENDS[backend] is None:
        return None
    if backend == "cudnn" and not torch.backends.cudnn.is_available():
        return "cuDNN is not available to this torch"
    t = HF_SEQ if mask else SEQ
    g = torch.Generator(device="cuda").manual_seed(0)
    q, k, v = (torch.randn(2, 4, t, 16, device="cuda", dtype=dtype, generator=g).requires_grad_() for _ in range(3))
    attn_mask = torch.ones(2, 1, t, t, dtype=torch.bool, device="cuda").tril() if mask else None
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        try:
            with sdpa_kernel(BACKENDS[backend]):
                if backend == "cudnn" and not torch.backends.cuda.cudnn_sdp_enabled():
                    return "cuDNN attention stays disabled in this torch build (cudnn_sdp_enabled() is False)"
                with torch.no_grad():
                    F.scaled_dot_product_attention(q, k, v, attn_mask=attn_mask, is_causal=not mask)
                F.scaled_dot_product_attention(q, k, v, attn_mask=attn_mask, is_causal=not mask).sum().backward()
        except RuntimeError as e:
            if "No available kernel" not in str(e):
                raise
            why = "; ".join(str(w.message).splitlines()[0] for w in caught)[:300]
            return f"{backend} attention cannot run {str(dtype).removeprefix('torch.')}" + \
                f"{' with a mask' if mask else ''} here: {why or str(e).splitlines()[0]}"
    return None


def _no_kernel(e: BaseException) -> bool:
    while e is not None:
        if "No available kernel" in str(e):
            return True
        e = e.__cause__ or e.__context__
    return False


@dataclass
class Run:
    losses: list[float]
    grad_norms: list[float]
    grads: dict[str, tuple[torch.Tensor, float]]
    """Step 1's gradient of every parameter, read back from the update, with the readout's resolution."""
    params: dict[str, torch.Tensor]
    activations: dict
    """The first step's activation metrics (policy, swapped ops, blocks per tier)."""


def first_step_gradients(before: dict[str, torch.Tensor], after: dict[str, torch.Tensor],
                         lr: float) -> dict[str, tuple[torch.Tensor, float]]:
    """Step 1's gradients from the weights around an AdamW step with eps 1, no decay, no clipping (see above)."""
    out = {}
    for name, p0 in before.items():
        u = (p0.double() - after[name].double()) / lr
        g = u / (1 - u.abs()).clamp_min(1e-12)
        # p1 = fl(p0 - lr * u'): the subtraction rounds to half an ulp of the larger weight
        top = max(float(p0.abs().max()), float(after[name].abs().max())) if p0.numel() else 0.0
        resolution = 8 * torch.finfo(torch.float32).eps * top / lr
        out[name] = (g, resolution)
    return out


def train(build: Callable, ecfg, data) -> Run:
    losses, norms = [], []
    with build(ecfg) as engine:
        p0 = engine.state_dict_fp32()
        for k, batch in enumerate(data):
            losses.append(engine.step(batch))
            norms.append(engine.last_stats.grad_norm)
            if k == 0:
                grads = first_step_gradients(p0, engine.state_dict_fp32(), ecfg.lr)
                acts = dict(engine.last_stats.activations)
        params = engine.state_dict_fp32()
    return Run(losses, norms, grads, params, acts)


def readout_config(ecfg):
    """eps 1 (the first step's update is lr * g / (|g| + 1)), no decay, no clipping, a constant lr."""
    return ecfg.with_overrides(lr=LR, eps=1.0, weight_decay=0.0, max_grad_norm=0.0, warmup_steps=0,
                               total_steps=None)


def compare(swap: Run, keep: Run, dtype: str, label: str) -> None:
    """Bit for bit (MATH) is asserted by the caller; this checks the stated tolerances and prints what was seen."""
    rtol, rtol_loss1, rtol_loss = TOLERANCE[dtype]
    worst, bad = 0.0, []
    for name, (gk, res) in keep.grads.items():
        gs = swap.grads[name][0]
        err = float((gs - gk).norm())
        bound = rtol * float(gk.norm()) + res * math.sqrt(gk.numel())
        worst = max(worst, err / bound)
        if err > bound:
            bad.append(f"{name}: |diff| {err:.3e} > {bound:.3e} (|g| {float(gk.norm()):.3e})")
    print(f"{label}: worst gradient difference {worst:.3g} x its bound; losses swap {swap.losses} keep {keep.losses}")
    assert not bad, f"{label}: step 1's gradients differ beyond rtol {rtol}:\n  " + "\n  ".join(bad)
    assert math.isclose(swap.losses[0], keep.losses[0], rel_tol=rtol_loss1), (swap.losses, keep.losses)
    for a, b in zip(swap.losses[1:], keep.losses[1:]):
        assert math.isclose(a, b, rel_tol=rtol_loss), f"{label}: loss curves diverge: {swap.losses} vs {keep.losses}"
    for a, b in zip(swap.grad_norms, keep.grad_norms):
        assert math.isclose(a, b, rel_tol=rtol), f"{label}: gradient norms {swap.grad_norms} vs {keep.grad_norms}"


def assert_bit_exact(swap: Run, keep: Run) -> None:
    assert swap.losses == keep.losses
    assert swap.grad_norms == keep.grad_norms
    for k, v in keep.params.items():
        assert torch.equal(swap.params[k], v), f"{k}: max |diff| {(swap.params[k] - v).abs().max():.3e}"


def assert_swapped(run: Run, tier: str, n_blocks: int) -> None:
    """The policy did swap: the blocks' records on `tier` (the last block's stays on the device: backward starts
    with it), the attention op's outputs among them."""
    act = run.activations
    assert act["tiers"][tier] >= 1 and act["tiers"][tier] + act["tiers"]["keep"] == n_blocks, act
    assert any("attn" in op for op in act["swap"]), f"attention was not swapped: {act['swap']}"


# The recompute-all run of each (model, backend, dtype) serves both tiers
_KEEP: dict[tuple[str, str, str], Run | str] = {}


def keep_run(key: tuple[str, str, str], build: Callable, ecfg, data) -> Run:
    if key not in _KEEP:
        try:
            with kernel(key[1]):
                _KEEP[key] = train(build, ecfg.with_overrides(act_policy="recompute-all", name="keep"), data)
        except RuntimeError as e:
            if not _no_kernel(e):
                raise
            _KEEP[key] = f"{key[1]} attention cannot run this model: {str(e).splitlines()[0][:200]}"
    hit = _KEEP[key]
    if isinstance(hit, str):
        pytest.skip(hit)
    return hit


# ------------------------------------------------------------------------------------------ the readout
def test_gradient_readout_is_the_gradient(make_dirs):
    """first_step_gradients gives autograd's gradients of the same model on the same GPU (fp32, MATH)."""
    from lohan.models.gpt import build_model

    mcfg = tiny_cfg(**GPT)
    data = list(batches(1, BATCH, SEQ, mcfg.vocab_size))
    ecfg = readout_config(engine_config(make_dirs(1), device="cuda", act_policy="recompute-all"))
    with kernel("math"):
        run = train(functools.partial(lohan.init, mcfg), ecfg, data)
        model = build_model(mcfg, device="cpu", seed=ecfg.seed).to("cuda")
        x, y = data[0]
        model(x.cuda(), y.cuda())[1].backward()
    ref = {n: p.grad.double().cpu() for n, p in model.named_parameters()}
    assert {ref_name(k) for k in run.grads} == set(ref)
    for name, (g, res) in run.grads.items():
        r = ref[ref_name(name)]
        err = float((g - r).norm())
        assert err <= 1e-5 * float(r.norm()) + res * math.sqrt(r.numel()), f"{name}: {err:.3e} vs |g| {r.norm():.3e}"
    assert math.isclose(run.grad_norms[0], float(torch.stack([g.norm() for g in ref.values()]).norm()), rel_tol=1e-5)


# ------------------------------------------------------------------------------------------ the GPT
@pytest.mark.parametrize("tier", sorted(TIERS))
@pytest.mark.parametrize("dtype", ["fp32", "bf16"])
@pytest.mark.parametrize("backend", list(BACKENDS))
def test_gpt_swapped_activations_per_sdpa_backend(make_dirs, backend, dtype, tier):
    why = unavailable(backend, torch.float32 if dtype == "fp32" else torch.bfloat16, mask=False)
    if why:
        pytest.skip(why)
    mcfg = tiny_cfg(**GPT)
    data = list(batches(STEPS, BATCH, SEQ, mcfg.vocab_size))
    ecfg = readout_config(engine_config(make_dirs(1, f"{backend}-{dtype}-{tier}"), device="cuda",
                                        compute_dtype=dtype))
    build = functools.partial(lohan.init, mcfg)
    keep = keep_run(("gpt", backend, dtype), build, ecfg, data)
    with kernel(backend):
        swap = train(build, ecfg.with_overrides(act_policy="swap-all", act_mem=TIERS[tier], name="swap"), data)
    assert_swapped(swap, tier, mcfg.n_layer)
    assert keep.activations["tiers"]["keep"] == mcfg.n_layer
    if backend == "math":
        assert_bit_exact(swap, keep)
    else:
        compare(swap, keep, dtype, f"gpt {backend} {dtype} {tier}")


# ------------------------------------------------------------------------------------------ a sliding window
@pytest.fixture(scope="module")
def mistral_dir(tmp_path_factory) -> str:
    """A tiny Mistral (sliding window 8 < sequence 32: HF passes SDPA a mask), as tests/unit/models/test_hf.py makes models."""
    transformers = pytest.importorskip("transformers")
    from tests.unit.models.test_hf import VOCAB, save_tokenizer

    path = tmp_path_factory.mktemp("mistral")
    cfg = transformers.MistralConfig(vocab_size=VOCAB, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                                     num_attention_heads=4, num_key_value_heads=4, max_position_embeddings=64,
                                     sliding_window=HF_WINDOW, tie_word_embeddings=False, bos_token_id=1,
                                     eos_token_id=2, pad_token_id=0)
    torch.manual_seed(0)
    model = transformers.AutoModelForCausalLM.from_config(cfg, dtype=torch.float32)
    with torch.no_grad():
        for p in model.parameters():
            p.add_(torch.randn_like(p) * 0.05)
    model.save_pretrained(path)
    save_tokenizer(path)
    return str(path)


@pytest.mark.parametrize("dtype", ["fp32", "bf16"])
@pytest.mark.parametrize("backend", list(BACKENDS))
def test_sliding_window_hf_model_per_sdpa_backend(make_dirs, mistral_dir, backend, dtype):
    from lohan.runtime.hf_engine import init_from_hf
    from tests.unit.models.test_hf import batches as hf_batches
    from tests.unit.models.test_hf import engine_config as hf_engine_config

    why = unavailable(backend, torch.float32 if dtype == "fp32" else torch.bfloat16, mask=True)
    if why:
        pytest.skip(why)
    data = list(hf_batches(STEPS, batch=BATCH, seq=HF_SEQ))
    ecfg = readout_config(hf_engine_config(make_dirs(1, f"{backend}-{dtype}"), device="cuda", compute_dtype=dtype))
    build = functools.partial(init_from_hf, mistral_dir)
    keep = keep_run(("mistral", backend, dtype), build, ecfg, data)
    with kernel(backend):
        swap = train(build, ecfg.with_overrides(act_policy="swap-all", act_mem=TIERS["cpu"], name="swap"), data)
    assert_swapped(swap, "cpu", 2)
    if backend == "math":
        assert_bit_exact(swap, keep)
    else:
        compare(swap, keep, dtype, f"mistral (sliding window) {backend} {dtype}")
