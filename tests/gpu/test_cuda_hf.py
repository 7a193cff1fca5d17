"""A Hugging Face model fine-tuned by lohan on CUDA: the loss curve of a plain PyTorch loop on the same GPU, and an
export that loads.

The model is tests/unit/models/test_hf.py's tiny Llama (untied, grouped-query attention, every weight perturbed), trained
on one repeated batch (learnable: the loss must fall). The reference is the same checkpoint loaded by
transformers, run whole on the GPU and updated like the engine updates it: fp32 master weights and torch's
fused AdamW on the CPU, the device copy refreshed from them after each step; in bf16 the device copy holds bf16
parameters under bf16 autocast, as the engine's P16 does (buffers such as the rotary frequencies stay fp32).
Default SDPA kernels on both sides (what a user gets).

Tolerances. The first loss is a forward of the same weights through the same HF modules and kernels (the
engine runs them block by block): within 1e-6 (fp32) or 1e-3 (bf16) relative. Later losses differ by the
fused attention backward's summation noise, which AdamW turns into +-lr moves of weights whose gradient is
nearly zero: |diff| <= 2e-3 (fp32) and 2e-2 (bf16, as tests/gpu/test_cuda_engine.py's GPT) over 8 steps at lr 3e-3.
The export holds exactly the engine's fp32 weights, and the loaded model's loss equals the engine's
evaluation of the same batch within 1e-5 (fp32) or 2e-2 (bf16: the engine computes in bf16, the export is fp32).
"""

from __future__ import annotations

import contextlib
import copy
import math

import pytest
import torch

from lohan.models.gpt import lm_loss
from lohan.runtime.optim import lr_factor, param_groups

pytestmark = pytest.mark.gpu  # skipped without CUDA (tests/conftest.py)

transformers = pytest.importorskip("transformers")

from lohan.models import hf  # noqa: E402
from lohan.runtime.hf_engine import init_from_hf  # noqa: E402
from tests.unit.models.test_hf import batches, engine_config, engine_hf_state, make_hf_dir, reference_model  # noqa: E402

STEPS = 8
TOLERANCE = {"fp32": (1e-6, 2e-3, 1e-5), "bf16": (1e-3, 2e-2, 2e-2)}
"""dtype -> (rel. first loss, abs. later losses, rel. loss of the exported model vs the engine's evaluation)"""


def cuda_hf_reference_run(path: str, ecfg, data, bf16: bool) -> list[float]:
    """The HF model whole on the GPU, updated like the engine: clip_grad_norm_ on the GPU (where the engine takes
    the norms), fp32 master weights and fused AdamW on the CPU, the device copy refreshed from them (bf16
    parameters under autocast for bf16)."""
    master = reference_model(path)
    model = copy.deepcopy(master).to("cuda")
    if bf16:
        for p in model.parameters():  # parameters only: buffers (rotary inv_freq) stay fp32, as in the engine
            p.data = p.data.to(torch.bfloat16)
    opt = torch.optim.AdamW(param_groups(master, ecfg.weight_decay, ecfg.no_decay), lr=ecfg.lr, betas=ecfg.betas,
                            eps=ecfg.eps, fused=True)
    sched = torch.optim.lr_scheduler.LambdaLR(
        opt, lambda s: lr_factor(s, ecfg.warmup_steps, ecfg.total_steps, ecfg.min_lr_ratio))
    losses = []
    m = ecfg.micro_batches
    for idx, tgt in data:
        total = 0.0
        for x, y in zip(idx.chunk(m), tgt.chunk(m)):
            with torch.autocast("cuda", dtype=torch.bfloat16) if bf16 else contextlib.nullcontext():
                loss = lm_loss(model(input_ids=x.to("cuda")).logits, y.to("cuda")) / m
            loss.backward()
            total += float(loss.detach())
        if ecfg.max_grad_norm > 0:  # on the GPU, as a plain GPU loop clips (and the engine takes the norm there)
            torch.nn.utils.clip_grad_norm_(model.parameters(), ecfg.max_grad_norm)
        for pm, pd in zip(master.parameters(), model.parameters(), strict=True):
            pm.grad = pd.grad.float().cpu()
            pd.grad = None
        opt.step()
        sched.step()
        opt.zero_grad(set_to_none=True)
        with torch.no_grad():
            for pm, pd in zip(master.parameters(), model.parameters()):
                pd.copy_(pm)
        losses.append(total)
    return losses


@pytest.mark.parametrize("dtype", ["fp32", "bf16"])
def test_hf_llama_fine_tuned_on_cuda_follows_a_torch_loop_and_exports(tmp_path, make_dirs, dtype):
    path = make_hf_dir(tmp_path / "llama", "llama")
    batch = next(batches(1, batch=4, seq=32))
    data = [batch] * STEPS
    ecfg = engine_config(make_dirs(1), device="cuda", compute_dtype=dtype, lr=3e-3, warmup_steps=2,
                         total_steps=STEPS)
    first_rtol, curve_atol, export_rtol = TOLERANCE[dtype]
    out = tmp_path / "export"
    losses = []
    with init_from_hf(path, ecfg) as engine:
        assert engine.device.is_cuda
        for b in data:
            losses.append(engine.step(b))
            assert engine.last_stats.gpu_mem_gib > 0
        hf.export_hf(engine, engine.program, path, out)
        state = engine_hf_state(engine, engine.program)
        eval_loss = engine.evaluate(batch)
    ref = cuda_hf_reference_run(path, ecfg, data, bf16=dtype == "bf16")
    diffs = [abs(a - b) for a, b in zip(losses, ref)]
    print(f"HF Llama on CUDA, {dtype}: engine {losses}\n  torch {ref}\n  max |diff| {max(diffs):.2e}")
    assert all(math.isfinite(v) for v in losses), losses
    assert losses[-1] < losses[0] - 0.5, f"the repeated batch was not learnt: {losses}"
    assert math.isclose(losses[0], ref[0], rel_tol=first_rtol), (losses[0], ref[0])
    assert max(diffs) <= curve_atol, f"loss curves diverge beyond {curve_atol}: {diffs}"

    # the export: the engine's weights, exactly, and a model that runs on the GPU with the engine's loss
    loaded = transformers.AutoModelForCausalLM.from_pretrained(out, dtype=torch.float32).eval()
    params = dict(loaded.named_parameters())
    assert set(params) == set(state)
    for name, t in state.items():
        assert torch.equal(params[name].detach(), t), name
    loaded.to("cuda")
    x, y = batch
    with torch.no_grad(), torch.autocast("cuda", dtype=torch.bfloat16, enabled=dtype == "bf16"):
        got = float(lm_loss(loaded(input_ids=x.to("cuda")).logits, y.to("cuda")))
    assert math.isclose(got, eval_loss, rel_tol=export_rtol), (got, eval_loss)
    assert got < losses[0] - 0.5  # the trained weights, not the checkpoint's
