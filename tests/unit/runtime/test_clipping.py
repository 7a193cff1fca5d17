"""Stable training under overlapped updates: global-norm clipping, the non-finite guard and decay groups,
each equal to plain PyTorch (`clip_grad_norm_` + `AdamW` with the same parameter groups), bit for bit in fp32,
while the optimizer still runs during backward."""

from __future__ import annotations

import math

import pytest
import torch

import lohan
from lohan.config import EngineConfig, get_model_config
from lohan.models.gpt import build_model
from lohan.runtime.optim import decay_mask, lr_factor, param_groups
from lohan.runtime.step import NonFiniteError
from lohan.store.states import StateStore

STEPS = 8


def tiny_cfg(**kw):
    base = dict(vocab_size=256, n_layer=2, d_model=64, n_head=4, seq_len=32)
    base.update(kw)
    return get_model_config("tiny", **base)


def batches(steps: int, batch: int = 4, seq: int = 32, seed: int = 123):
    g = torch.Generator().manual_seed(seed)
    for _ in range(steps):
        x = torch.randint(0, 256, (batch, seq + 1), generator=g)
        yield x[:, :-1], x[:, 1:]


def config(dirs, **kw) -> EngineConfig:
    base = dict(nvme=tuple(dirs), cpu_mem="512MiB", compute_dtype="fp32", lr=1e-2, warmup_steps=2,
                total_steps=STEPS, weight_decay=0.1, betas=(0.9, 0.95), eps=1e-8, seed=5, backend="threads",
                max_grad_norm=1.5)
    base.update(kw)
    return EngineConfig(**base)


def reference(mcfg, ecfg: EngineConfig, data, poison: set[int] = frozenset()):
    """Plain PyTorch: clip_grad_norm_, AdamW with lohan's decay groups, a step with a non-finite loss or
    gradient norm skipped (its batch consumed, the schedule advanced). Returns losses, norms, weights."""
    model = build_model(mcfg, device="cpu", seed=ecfg.seed)
    opt = torch.optim.AdamW(param_groups(model, ecfg.weight_decay, ecfg.no_decay), lr=ecfg.lr, betas=ecfg.betas,
                            eps=ecfg.eps, fused=True)
    sched = torch.optim.lr_scheduler.LambdaLR(
        opt, lambda s: lr_factor(s, ecfg.warmup_steps, ecfg.total_steps, ecfg.min_lr_ratio))
    losses, norms = [], []
    for step, (idx, tgt) in enumerate(data):
        handle = model.embed.register_forward_hook(lambda m, a, out: out * math.nan) if step in poison else None
        total = 0.0
        for x, y in zip(idx.chunk(ecfg.micro_batches), tgt.chunk(ecfg.micro_batches)):
            loss = model(x, y)[1] / ecfg.micro_batches
            loss.backward()
            total += float(loss.detach())
        if handle:
            handle.remove()
        norm = torch.nn.utils.clip_grad_norm_(model.parameters(), ecfg.max_grad_norm or math.inf)
        if math.isfinite(total) and math.isfinite(float(norm)):
            opt.step()
        sched.step()
        opt.zero_grad(set_to_none=True)
        losses.append(total)
        norms.append(float(norm))
    return losses, norms, {n: p.detach() for n, p in model.named_parameters()}


def run_engine(mcfg, ecfg: EngineConfig, data, poison: set[int] = frozenset(), lookahead: bool = False):
    """`lookahead`: every step is told the next batch (its forward may run during a deferred or redone pass)."""
    losses, metrics = [], []
    data = list(data)
    with lohan.init(mcfg, ecfg) as engine:
        real = engine.program.run

        for step, batch in enumerate(data):
            if step in poison:
                engine.program.run = lambda i, x, t: real(i, x, t) * math.nan if i == 0 else real(i, x, t)
            nxt = data[step + 1] if lookahead and step + 1 < len(data) else None
            losses.append(engine.step(batch, next_batch=nxt))
            engine.program.run = real
            metrics.append(engine.last_stats.to_dict())
        params = engine.state_dict_fp32()
    return losses, metrics, params


def same_weights(ours: dict, ref: dict) -> None:
    def ref_name(k: str) -> str:
        block, _, rest = k.partition(".")
        return f"blocks.{block[5:]}.{rest}" if block.startswith("block") else k

    assert {ref_name(k) for k in ours} == set(ref)
    for k, v in ours.items():
        assert torch.equal(v, ref[ref_name(k)]), f"{k}: max |diff| {(v - ref[ref_name(k)]).abs().max():.3e}"


def check(mcfg, ecfg, data_args=(), poison=frozenset(), lookahead=False):
    ref_losses, ref_norms, ref_params = reference(mcfg, ecfg, batches(STEPS, *data_args), poison)
    losses, metrics, params = run_engine(mcfg, ecfg, batches(STEPS, *data_args), poison, lookahead)
    assert [str(x) for x in losses] == [str(x) for x in ref_losses]  # str: NaN == NaN
    assert [str(m["grad_norm"]) for m in metrics] == [str(x) for x in ref_norms]
    same_weights(params, ref_params)
    return metrics


@pytest.mark.parametrize("mode", ["serial", "naive", "optimized"])
@pytest.mark.parametrize("clip_mode", ["speculate", "defer", "auto"])
def test_clipping_is_bit_exact(make_dirs, mode, clip_mode):
    metrics = check(tiny_cfg(), config(make_dirs(1), mode=mode, clip_mode=clip_mode))
    coefs = [m["clip_coef"] for m in metrics]
    assert any(c < 1 for c in coefs) and any(c == 1 for c in coefs), coefs  # both regimes were exercised
    redone = [m["redone"] for m in metrics]
    if clip_mode == "defer":
        assert not any(redone)
    elif clip_mode == "speculate":
        assert redone == [c < 1 for c in coefs]  # exactly the clipped steps were redone
    else:  # auto: each step speculates or defers by the running norm and the costs; only a clipped one is redone
        assert all(c < 1 and not m["deferred"] for r, c, m in zip(redone, coefs, metrics) if r)
        assert metrics[0]["deferred"]  # nothing is known of the norm before the first step


@pytest.mark.parametrize("tied", [True, False])
def test_clipping_with_micro_batches_chunks_and_several_dirs(make_dirs, tied):
    ecfg = config(make_dirs(3), micro_batches=3, opt_chunk_bytes=4096 * 16, clip_mode="speculate")
    check(tiny_cfg(tie_embeddings=tied), ecfg, data_args=(6,))


@pytest.mark.parametrize("clip_mode", ["speculate", "defer", "auto"])
def test_next_forward_beside_the_deferred_or_redone_pass_is_bit_exact(make_dirs, clip_mode):
    """Told the next batch, a step whose optimizer pass runs after backward (deferred, or a redo) runs it in
    forward order with the next forward beside it, on each block's new parameters: the same bits."""
    metrics = check(tiny_cfg(), config(make_dirs(2), clip_mode=clip_mode), lookahead=True)
    deferred = [m["deferred"] for m in metrics]
    assert all(deferred) if clip_mode == "defer" else not any(deferred) if clip_mode == "speculate" else deferred[0]
    tails = [d or m["redone"] for d, m in zip(deferred, metrics)]  # a pass after backward
    follows = [m["next_forward_overlapped"] for m in metrics]
    assert follows[:-1] == tails[:-1] and not follows[-1], (follows, tails)  # the last step has no next batch
    assert any(tails[:-1]) and (clip_mode != "speculate" or not all(tails)), tails


@pytest.mark.parametrize("tied", [True, False])
def test_next_forward_with_micro_batches_chunks_dirs_and_spills(make_dirs, tied):
    mcfg = tiny_cfg(tie_embeddings=tied)
    ecfg = config(make_dirs(3), micro_batches=3, opt_chunk_bytes=4096 * 16, clip_mode="defer")
    metrics = check(mcfg, ecfg, data_args=(6,), lookahead=True)
    assert all(m["next_forward_overlapped"] for m in metrics[:-1])


def test_next_forward_is_dropped_for_another_batch(make_dirs):
    """A step given other ids than the batch it was told of runs its own forward: still exact."""
    mcfg, ecfg = tiny_cfg(), config(make_dirs(1), clip_mode="defer")
    data = list(batches(STEPS))
    ref_losses, _, ref_params = reference(mcfg, ecfg, data)
    decoy = (torch.flip(data[1][0], dims=[1]), data[1][1])
    with lohan.init(mcfg, ecfg) as engine:
        losses = [engine.step(data[0], next_batch=decoy)]
        assert engine.last_stats.next_forward_overlapped
        losses += [engine.step(b, next_batch=n) for b, n in zip(data[1:], data[2:] + [None])]
        params = engine.state_dict_fp32()
    assert losses == ref_losses
    same_weights(params, ref_params)


def test_clipping_in_place_defers_every_update(make_dirs):
    metrics = check(tiny_cfg(), config(make_dirs(2), slots=1, clip_mode="auto"))
    assert not any(m["redone"] for m in metrics)


def test_speculation_needs_two_slots():
    with pytest.raises(ValueError, match="clip_mode=speculate needs slots=2"):
        config(["d"], slots=1, clip_mode="speculate")


def test_clipping_off_takes_the_norm_anyway(make_dirs):
    metrics = check(tiny_cfg(), config(make_dirs(1), max_grad_norm=0.0))
    assert all(m["clip_coef"] is None and m["grad_norm"] > 0 for m in metrics)


@pytest.mark.parametrize("slots", [2, 1])
def test_non_finite_steps_are_skipped_exactly_like_a_guarded_loop(make_dirs, slots):
    metrics = check(tiny_cfg(), config(make_dirs(1), slots=slots), poison={2, 5, 6})
    assert [m["skipped"] for m in metrics] == [s in (2, 5, 6) for s in range(STEPS)]


def test_too_many_bad_steps_stop_the_run_with_the_last_good_state(make_dirs):
    dirs = make_dirs(1)
    ecfg = config(dirs, max_bad_steps=2)
    data = list(batches(5))
    with lohan.init(tiny_cfg(), ecfg) as engine:
        engine.step(data[0])
        engine.step(data[1])
        good = engine.state_dict_fp32()
        real = engine.program.run
        engine.program.run = lambda i, x, t: real(i, x, t) * math.inf if i == 0 else real(i, x, t)
        assert math.isnan(engine.step(data[2])) and engine.last_stats.skipped
        with pytest.raises(NonFiniteError, match="2 steps in a row .* last good update \\(2 updates\\)"):
            engine.step(data[3])
    store = StateStore.open(dirs, backend="threads")
    try:
        assert (store.step, store.commit_state.applied, store.commit_state.bad_streak) == (4, 2, 2)
        got = {f"{b.name}.{s.name}": t for b in store.layout.blocks for s, t in zip(b.params, store.read_params(b.index))}
    finally:
        store.close()
    assert all(torch.equal(got[k], good[k]) for k in good)


@pytest.mark.parametrize("no_decay", [(), ("bias",), ("bias", "norm", "embedding")])
def test_decay_groups_are_bit_exact(make_dirs, no_decay):
    check(tiny_cfg(), config(make_dirs(1), no_decay=no_decay, max_grad_norm=0.0, weight_decay=0.5))


def test_decay_classification():
    model = build_model(tiny_cfg(), device="meta")
    names = [n for n, _ in model.named_parameters()]
    mask = dict(zip(names, decay_mask(model, ("bias", "norm"))))
    assert not mask["blocks.0.qkv.bias"] and not mask["blocks.0.ln1.weight"] and not mask["head.ln_f.weight"]
    assert mask["blocks.0.qkv.weight"] and mask["embed.wte.weight"] and mask["embed.wpe.weight"]
    mask = dict(zip(names, decay_mask(model, ("embedding",))))
    assert not mask["embed.wte.weight"] and not mask["embed.wpe.weight"] and mask["blocks.0.ln1.weight"]
    transformers = pytest.importorskip("transformers")
    llama = transformers.LlamaForCausalLM(transformers.LlamaConfig(
        vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=1, num_attention_heads=2,
        num_key_value_heads=1))
    mask = dict(zip([n for n, _ in llama.named_parameters()], decay_mask(llama, ("bias", "norm"))))
    assert not mask["model.norm.weight"] and not mask["model.layers.0.input_layernorm.weight"]
    assert mask["model.layers.0.self_attn.q_proj.weight"] and mask["lm_head.weight"]


@pytest.mark.parametrize("clip_mode", ["speculate", "defer"])
def test_gradients_past_the_memory_budget_spill_to_the_ssds_exactly(make_dirs, clip_mode):
    """With cpu_mem too small to keep the step's gradients, the stash writes the rest to the SSDs and reads
    them back for the deferred or redone update: same bits as keeping them all in RAM."""
    mcfg = tiny_cfg()
    roomy = config(make_dirs(1, "probe"))
    with lohan.init(mcfg, roomy) as engine:
        plan = dict(engine.memory_plan)
    others = sum(v for k, v in plan.items() if k != "grad_stash")
    ecfg = config(make_dirs(2), clip_mode=clip_mode, cpu_mem=others + plan["grad_stash"] // 3)
    ref_losses, ref_norms, ref_params = reference(mcfg, ecfg, batches(STEPS))
    losses, spilled = [], 0
    with lohan.init(mcfg, ecfg) as engine:
        assert 0 < engine.memory_plan["grad_stash"] < plan["grad_stash"]
        for batch in batches(STEPS):
            losses.append(engine.step(batch))
        spilled = engine.stash.spilled_total
        params = engine.state_dict_fp32()
    assert spilled > 0
    assert losses == ref_losses
    same_weights(params, ref_params)


# ------------------------------------------------------------------------------ fp16 dynamic loss scaling
def reference_fp16(mcfg, ecfg: EngineConfig, data):
    """Plain PyTorch mixed precision: fp32 model, autocast fp16, GradScaler, unscale_, clip_grad_norm_, AdamW."""
    model = build_model(mcfg, device="cpu", seed=ecfg.seed)
    opt = torch.optim.AdamW(param_groups(model, ecfg.weight_decay, ecfg.no_decay), lr=ecfg.lr, betas=ecfg.betas,
                            eps=ecfg.eps, fused=True)
    sched = torch.optim.lr_scheduler.LambdaLR(
        opt, lambda s: lr_factor(s, ecfg.warmup_steps, ecfg.total_steps, ecfg.min_lr_ratio))
    scaler = torch.amp.GradScaler("cpu", init_scale=ecfg.loss_scale, growth_interval=ecfg.loss_scale_growth_interval)
    losses, scales, skipped = [], [], []
    for idx, tgt in data:
        total = 0.0
        scales.append(scaler.get_scale())
        for x, y in zip(idx.chunk(ecfg.micro_batches), tgt.chunk(ecfg.micro_batches)):
            with torch.autocast("cpu", dtype=torch.float16):
                loss = model(x, y)[1] / ecfg.micro_batches
            scaler.scale(loss).backward()
            total += float(loss.detach())
        scaler.unscale_(opt)
        torch.nn.utils.clip_grad_norm_(model.parameters(), ecfg.max_grad_norm)
        before = scaler.get_scale()
        scaler.step(opt)
        scaler.update()
        skipped.append(scaler.get_scale() < before)
        sched.step()
        opt.zero_grad(set_to_none=True)
        losses.append(total)
    return losses, scales, skipped, {n: p.detach() for n, p in model.named_parameters()}


@pytest.mark.parametrize("tied", [True, False])
def test_fp16_dynamic_loss_scaling_follows_grad_scaler(make_dirs, tied):
    """A scale of 2**21 overflows the fp16 gradients until it has been halved enough: those steps are skipped
    (nothing committed but the lower scale), exactly where GradScaler skips them; the scale then grows back
    every `growth_interval` clean steps; the loss curves agree to fp16 rounding noise."""
    mcfg = tiny_cfg(tie_embeddings=tied)
    ecfg = config(make_dirs(1), compute_dtype="fp16", loss_scale=2.0**21, loss_scale_growth_interval=3,
                  lr=3e-3, max_bad_steps=2)
    data = [next(batches(1))] * 14  # one batch, repeated: learnable
    ref_losses, ref_scales, ref_skipped, _ = reference_fp16(mcfg, ecfg, data)
    losses, metrics, _ = run_engine(mcfg, ecfg, data)
    assert [m["loss_scale"] for m in metrics] == ref_scales
    assert [m["skipped"] for m in metrics] == ref_skipped
    assert sum(ref_skipped) >= 3 and ref_scales[-1] > min(ref_scales)  # overflowed, then grew back
    assert all(m["overflow"] == m["skipped"] for m in metrics)  # overflows are not "bad steps"
    diffs = [abs(a - b) for a, b in zip(losses, ref_losses)]
    assert max(diffs) < 5e-3, diffs
    assert losses[-1] < losses[0] - 0.5


def test_fp16_scale_survives_a_resume(make_dirs):
    dirs = make_dirs(1)
    ecfg = config(dirs, compute_dtype="fp16", loss_scale=2.0**30, loss_scale_growth_interval=3)
    data = list(batches(6))
    with lohan.init(tiny_cfg(), ecfg) as engine:
        for b in data[:3]:
            engine.step(b)
        scale = engine.store.commit_state.loss_scale
        rest = [engine.step(b) for b in data[3:]]
    with lohan.init(tiny_cfg(), config(make_dirs(1, "b"), compute_dtype="fp16", loss_scale=2.0**30,
                                       loss_scale_growth_interval=3)) as engine:
        for b in data[:3]:
            engine.step(b)
    with lohan.init(tiny_cfg(), config(make_dirs(1, "b"), compute_dtype="fp16", loss_scale=2.0**30,
                                       loss_scale_growth_interval=3), resume=True) as engine:
        assert engine.store.commit_state.loss_scale == scale < 2.0**30
        assert [engine.step(b) for b in data[3:]] == rest


def test_fp16_scale_survives_a_failed_step(make_dirs, monkeypatch):
    """A step that fails (here: the optimizer pipeline refuses a gradient) rolls back to the last commit,
    loss scale and growth tracker included, so the next step runs on the scale GradScaler would have."""
    dirs = make_dirs(1)
    ecfg = config(dirs, compute_dtype="fp16", loss_scale=2.0**24, loss_scale_growth_interval=100)
    data = list(batches(20))
    with lohan.init(tiny_cfg(), ecfg) as engine:
        for b in data[:-1]:  # overflows halve the scale, then clean steps are counted
            engine.step(b)
            before = engine.store.commit_state
            if before.growth_tracker >= 2:
                break
        assert before.loss_scale < 2.0**24 and before.growth_tracker >= 2

        def refuse(i, grad):
            grad.release()
            raise RuntimeError("injected: the pipeline is gone")
        with monkeypatch.context() as m:
            m.setattr(engine.offloader, "submit", refuse)
            with pytest.raises(RuntimeError, match="injected"):
                engine.step(data[-1])
        after = engine.store.commit_state
        assert (after.step, after.slot, after.loss_scale, after.growth_tracker) == (
            before.step, before.slot, before.loss_scale, before.growth_tracker)
    store = StateStore.open(dirs, backend="threads")  # what a resume reads: the commit record on disk
    try:
        assert (store.commit_state.loss_scale, store.commit_state.growth_tracker) == (
            before.loss_scale, before.growth_tracker)
    finally:
        store.close()


@pytest.mark.parametrize("slots", [2, 1])
@pytest.mark.parametrize("mode", ["serial", "naive", "optimized"])
@pytest.mark.parametrize("readahead", ["auto", 0])
def test_every_step_clipped_is_bit_exact(make_dirs, slots, mode, readahead):
    """Early fine-tuning clips most steps: every step clips here (a tiny max_grad_norm), in place or with two slots,
    the next batch known (its forward runs beside each deferred pass), with the read-ahead room or without it."""
    ecfg = config(make_dirs(2), slots=slots, mode=mode, max_grad_norm=1e-3, readahead_mem=readahead)
    metrics = check(tiny_cfg(), ecfg, lookahead=True)
    assert all(m["clip_coef"] < 1 and m["deferred"] and not m["redone"] for m in metrics), metrics
    # (serial mode is the ablation's baseline: nothing runs beside its optimizer pass)
    assert [m["next_forward_overlapped"] for m in metrics] == [mode != "serial"] * (STEPS - 1) + [False]
