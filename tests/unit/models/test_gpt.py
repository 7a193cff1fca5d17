"""Tests for the in-house GPT: exact parameter counts, free meta builds, forward semantics, seeded init."""

from __future__ import annotations

import math
import time

import pytest
import torch
import torch.nn.functional as F

from lohan.config import PRESETS, ModelConfig, get_model_config
from lohan.models import GPT, Block, block_generator, block_seed, build_model, init_block_

BLOCK_OPS = ["ln1", "qkv", "attn", "proj", "ln2", "fc", "act", "fc_proj"]


def _count(model: torch.nn.Module) -> int:
    return sum(p.numel() for p in model.parameters())


@pytest.fixture(scope="module")
def tiny() -> tuple[ModelConfig, GPT]:
    cfg = get_model_config("tiny")
    return cfg, build_model(cfg, device="cpu", seed=0)


def small_cfg(**overrides: object) -> ModelConfig:
    """A real architecture (175b) shrunk to a few thousand parameters: fast, every op exercised."""
    kw = dict(n_layer=2, d_model=32, n_head=4, vocab_size=97, seq_len=16)
    kw.update(overrides)
    return get_model_config("175b", **kw)


# ------------------------------------------------------------------------------ parameter counts


@pytest.mark.parametrize(
    "cfg",
    [get_model_config("tiny"), get_model_config("175b", n_layer=2, d_model=96, n_head=4)],
    ids=["tiny", "175b-shrunk"],
)
def test_param_count_equals_materialized_module(cfg: ModelConfig) -> None:
    model = build_model(cfg, device="cpu", seed=0)
    # parameters() deduplicates shared tensors, so a tied weight would be counted once here too.
    assert _count(model) == cfg.param_count()


@pytest.mark.parametrize("name", list(PRESETS))
def test_param_count_equals_meta_module_for_every_preset(name: str) -> None:
    cfg = get_model_config(name)
    assert _count(build_model(cfg, device="meta")) == cfg.param_count()


def test_untied_head_owns_lm_head() -> None:
    cfg = small_cfg(tie_embeddings=False)
    model = build_model(cfg, device="cpu", seed=0)
    assert _count(model) == cfg.param_count()
    assert _count(model.head) == cfg.head_param_count() == 2 * 32 + 97 * 32
    idx = torch.randint(0, cfg.vocab_size, (2, 8))
    assert model(idx).shape == (2, 8, cfg.vocab_size)
    with pytest.raises(ValueError, match="untied"):
        model.head(torch.zeros(1, 1, 32), model.embed.wte.weight)


# ------------------------------------------------------------------------------ meta builds


def test_175b_meta_build_allocates_nothing_and_is_fast() -> None:
    build_model(small_cfg(), device="meta")  # first meta construction pays one-off lazy imports (~1 s)
    cfg = get_model_config("175b")
    start = time.perf_counter()
    model = build_model(cfg, device="meta")
    elapsed = time.perf_counter() - start
    tensors = list(model.parameters()) + list(model.buffers())
    assert tensors and all(t.is_meta for t in tensors), "a 175B parameter was allocated on a real device"
    assert _count(model) == cfg.param_count()
    assert elapsed < 1.0, f"building the 175b skeleton took {elapsed:.2f} s; it should be ~0.05 s"


def test_meta_build_respects_dtype() -> None:
    model = build_model(small_cfg(), device="meta", dtype=torch.bfloat16)
    assert {p.dtype for p in model.parameters()} == {torch.bfloat16}


# ------------------------------------------------------------------------------ structure


def test_block_modules_order_and_ownership() -> None:
    cfg = small_cfg()
    model = build_model(cfg, device="meta")
    blocks = model.block_modules()
    assert blocks[0] is model.embed and blocks[-1] is model.head
    assert blocks[1:-1] == list(model.blocks) and len(blocks) == cfg.n_layer + 2
    # Every parameter belongs to exactly one block: the store's partition is complete and disjoint.
    owned = [id(p) for b in blocks for p in b.parameters()]
    assert sorted(owned) == sorted(id(p) for p in model.parameters())
    assert _count(blocks[0]) == cfg.embed_param_count()
    assert all(_count(b) == cfg.block_param_count() for b in blocks[1:-1])
    # Tied: the head owns only ln_f.
    assert [n for n, _ in model.head.named_parameters()] == ["ln_f.weight", "ln_f.bias"]


def test_block_ops_are_named_submodules_in_forward_order() -> None:
    block = build_model(small_cfg(), device="meta").blocks[0]
    assert [name for name, _ in block.named_children()] == BLOCK_OPS
    assert _count(block.attn) == 0 and _count(block.act) == 0
    assert block.act.approximate == "none"
    # Forward really runs the ops in that order (hooks record the call order).
    cpu_block = Block(small_cfg())
    calls: list[str] = []
    for name in BLOCK_OPS:
        getattr(cpu_block, name).register_forward_hook(lambda m, i, o, name=name: calls.append(name))
    cpu_block(torch.randn(1, 4, 32))
    assert calls == BLOCK_OPS


# ------------------------------------------------------------------------------ forward semantics


def test_forward_shapes_and_init_loss(tiny: tuple[ModelConfig, GPT]) -> None:
    cfg, model = tiny
    gen = torch.Generator().manual_seed(1)
    idx = torch.randint(0, cfg.vocab_size, (2, 64), generator=gen)
    targets = torch.randint(0, cfg.vocab_size, (2, 64), generator=gen)
    with torch.no_grad():
        logits = model(idx)
        logits2, loss = model(idx, targets)
        loss_only = model.loss(idx, targets)
    assert logits.shape == (2, 64, cfg.vocab_size)
    assert torch.equal(logits, logits2) and torch.equal(loss, loss_only)
    assert loss.shape == () and torch.isfinite(loss)
    # Small init -> near-uniform predictions -> loss close to ln(vocab) = 10.82.
    assert abs(loss.item() - math.log(cfg.vocab_size)) < 0.15, loss.item()


def test_loss_is_mean_cross_entropy_and_ignores_minus_100() -> None:
    cfg = small_cfg()
    model = build_model(cfg, device="cpu", seed=0)
    idx = torch.randint(0, cfg.vocab_size, (2, 8))
    targets = torch.randint(0, cfg.vocab_size, (2, 8))
    logits, loss = model(idx, targets)
    torch.testing.assert_close(loss, F.cross_entropy(logits.reshape(-1, cfg.vocab_size), targets.reshape(-1)))
    masked = targets.clone()
    masked[:, :4] = -100
    expected = F.cross_entropy(logits[:, 4:].reshape(-1, cfg.vocab_size), targets[:, 4:].reshape(-1))
    torch.testing.assert_close(model.loss(idx, masked), expected)


def test_causal_mask(tiny: tuple[ModelConfig, GPT]) -> None:
    cfg, model = tiny
    t = 20
    idx = torch.randint(0, cfg.vocab_size, (2, 48), generator=torch.Generator().manual_seed(2))
    changed = idx.clone()
    changed[:, t + 1] = (changed[:, t + 1] + 1) % cfg.vocab_size
    with torch.no_grad():
        a, b = model(idx), model(changed)
    torch.testing.assert_close(a[:, : t + 1], b[:, : t + 1], rtol=0, atol=1e-6)
    assert not torch.allclose(a[:, t + 1 :], b[:, t + 1 :]), "the changed token had no effect at all"


def test_attention_matches_explicit_softmax_reference() -> None:
    cfg = small_cfg()
    block = build_model(cfg, device="cpu", seed=3).blocks[0].double()
    x = torch.randn(2, 10, cfg.d_model, dtype=torch.float64)
    qkv = block.qkv(block.ln1(x))
    q, k, v = (z.view(2, 10, cfg.n_head, cfg.head_dim).transpose(1, 2) for z in qkv.split(cfg.d_model, dim=2))
    scores = q @ k.transpose(-1, -2) / math.sqrt(cfg.head_dim)
    scores = scores.masked_fill(torch.ones(10, 10, dtype=torch.bool).triu(1), float("-inf"))
    attn = (scores.softmax(-1) @ v).transpose(1, 2).reshape(2, 10, cfg.d_model)
    h = x + block.proj(attn)
    expected = h + block.fc_proj(F.gelu(block.fc(block.ln2(h))))
    torch.testing.assert_close(block(x), expected)


def test_sequence_longer_than_positions_raises() -> None:
    cfg = small_cfg()
    model = build_model(cfg, device="cpu", seed=0)
    with pytest.raises(ValueError, match="exceeds the model's 16 position embeddings"):
        model(torch.zeros(1, 17, dtype=torch.long))


def test_tied_head_gradient_reaches_every_vocab_row() -> None:
    cfg = small_cfg()
    model = build_model(cfg, device="cpu", seed=0)
    idx = torch.zeros(1, 8, dtype=torch.long)  # the embedding lookup touches only row 0
    model.loss(idx, torch.ones(1, 8, dtype=torch.long)).backward()
    grad = model.embed.wte.weight.grad
    # Rows never looked up still get gradient: only through the head, so the weight is really tied.
    assert grad is not None and bool((grad[1:].abs().sum(dim=1) > 0).all())


# ------------------------------------------------------------------------------ initialization


def test_seeded_init_is_deterministic() -> None:
    cfg = get_model_config("175b", n_layer=2, d_model=96, n_head=4)
    a, b = build_model(cfg, "cpu", seed=0), build_model(cfg, "cpu", seed=0)
    for (name, pa), (_, pb) in zip(a.named_parameters(), b.named_parameters(), strict=True):
        assert torch.equal(pa, pb), name
    c = build_model(cfg, "cpu", seed=1)
    assert not torch.equal(a.blocks[0].qkv.weight, c.blocks[0].qkv.weight)
    assert not torch.equal(a.embed.wte.weight, c.embed.wte.weight)


def test_block_by_block_init_equals_full_build() -> None:
    cfg = small_cfg(n_layer=3)
    full = build_model(cfg, "cpu", seed=7)
    skeleton = build_model(cfg, "meta")
    # Reverse order on purpose: a block's values must not depend on which blocks were initialized before.
    for index, block in reversed(list(enumerate(skeleton.block_modules()))):
        block.to_empty(device="cpu")
        init_block_(block, cfg, block_generator(7, index))
    expected = full.state_dict()
    got = skeleton.state_dict()
    assert list(got) == list(expected)
    for name in expected:
        assert torch.equal(got[name], expected[name]), name


def test_blocks_get_distinct_random_streams() -> None:
    model = build_model(small_cfg(), "cpu", seed=0)
    assert not torch.equal(model.blocks[0].qkv.weight, model.blocks[1].qkv.weight)
    seeds = {block_seed(s, i) for s in range(4) for i in range(100)}
    assert len(seeds) == 400


def test_init_statistics(tiny: tuple[ModelConfig, GPT]) -> None:
    cfg, model = tiny
    residual_std = 0.02 / math.sqrt(2 * cfg.n_layer)
    for block in model.blocks:
        for ln in (block.ln1, block.ln2):
            assert torch.equal(ln.weight, torch.ones_like(ln.weight)) and not ln.bias.any()
        for lin in (block.qkv, block.proj, block.fc, block.fc_proj):
            assert not lin.bias.any()
        assert block.qkv.weight.std().item() == pytest.approx(0.02, rel=0.05)
        assert block.fc.weight.std().item() == pytest.approx(0.02, rel=0.05)
        assert block.proj.weight.std().item() == pytest.approx(residual_std, rel=0.05)
        assert block.fc_proj.weight.std().item() == pytest.approx(residual_std, rel=0.05)
    assert model.embed.wte.weight.std().item() == pytest.approx(0.02, rel=0.02)
    assert model.embed.wpe.weight.std().item() == pytest.approx(0.02, rel=0.05)
    assert torch.equal(model.head.ln_f.weight, torch.ones(cfg.d_model)) and not model.head.ln_f.bias.any()


def test_init_values_do_not_depend_on_dtype() -> None:
    cfg = small_cfg()
    fp32 = build_model(cfg, "cpu", seed=0)
    bf16 = build_model(cfg, "cpu", seed=0, dtype=torch.bfloat16)
    for (name, p32), (_, p16) in zip(fp32.named_parameters(), bf16.named_parameters(), strict=True):
        assert p16.dtype == torch.bfloat16
        assert torch.equal(p32.to(torch.bfloat16), p16), name


def test_init_block_rejects_meta_parameters() -> None:
    cfg = small_cfg()
    skeleton = build_model(cfg, "meta")
    with pytest.raises(ValueError, match="to_empty"):
        init_block_(skeleton.blocks[0], cfg, block_generator(0, 1))


def test_init_block_rejects_unknown_parameters() -> None:
    cfg = small_cfg()
    block = Block(cfg)
    block.scale = torch.nn.Parameter(torch.empty(3))  # a parameter init_block_ has no rule for
    with pytest.raises(ValueError, match="scale"):
        init_block_(block, cfg, block_generator(0, 1))


def test_loss_of_a_window_without_targets_is_zero_not_nan():
    """A micro-batch of prompt tokens only (every target -100) must not make the step NaN."""
    import torch

    from lohan.models.gpt import lm_loss

    logits = torch.randn(2, 5, 7, requires_grad=True)
    loss = lm_loss(logits, torch.full((2, 5), -100))
    loss.backward()
    assert loss.item() == 0.0 and torch.equal(logits.grad, torch.zeros_like(logits))
    some = torch.full((2, 5), -100)
    some[0, 1] = 3
    assert torch.isfinite(lm_loss(logits, some))
