"""Tests for lohan.plan.planner: cost model, Algorithm 1, tier placement, analytic profiles, capacity planner.

Pure and fast: synthetic profiles built by hand, no torch (but the last section, on lohan.app.fit).
"""

from __future__ import annotations

import dataclasses
import json
import math
import random

import pytest

from lohan.config import PRESETS, ModelConfig, get_model_config
from lohan.plan.planner import (
    HARDWARE_PRESETS,
    LANES_B,
    OPT_CHUNK_BYTES,
    POLICIES,
    CpuSpec,
    Estimate,
    Hardware,
    OpProfile,
    Plan,
    Profile,
    SsdSpec,
    activations_in_ram_capacity,
    algorithm1,
    analytic_profile,
    capacity,
    engine_pools,
    estimate,
    forced_plan,
    make_plan,
    max_batch,
    max_model,
    parse_hardware,
    place_tiers,
    reprice,
    reserve_engine_pools,
    resident_records,
    walk,
    walk_order,
)
from lohan.plan.pools import UPCAST_ELEMS
from lohan.plan.vocab import head_loss_bytes

PAPER_256 = "rtx4090,12xP5510,256GB"


def make_profile(ops: list[tuple[str, float, int]], *, n_blocks: int = 4, input_bytes: int = 0,
                 param_count: int = 0, flop_f: float = 0.0, thp_g: float = 1.0, bw_g: float = 1.0,
                 bw_s2m: float = 1.0, bw_m2s: float = 1.0, mem_avail: int = 10**18, cpu_adam: float = 0.0) -> Profile:
    hw = Hardware("synthetic", thp_g, bw_g, bw_s2m, bw_m2s, mem_avail, cpu_adam_params_per_s=cpu_adam)
    return Profile("synthetic", 1, 1, n_blocks, tuple(OpProfile(*op) for op in ops), input_bytes,
                   param_count, 2, flop_f, hw, "analytic")


def interior_profile() -> Profile:
    # n_blocks=2, no params: T = A/bw_g + max(FLOP_r, A/bw_g) + min(FLOP_r, A/bw_g) / 2 (the pipeline fill of
    # 2 blocks), A = swapped bytes, FLOP_r = 2 * unswapped flops. Walk a, b, c -> T = 30, 11.5, 7, 14: the
    # minimum is after b.
    return make_profile([("c", 1.0, 4), ("a", 10.0, 1), ("b", 4.0, 2)], n_blocks=2)


def random_profile(rng: random.Random) -> Profile:
    n_ops = rng.randint(1, 8)
    ops = [(f"op{i}", rng.choice([0.0, rng.uniform(0, 1e12)]), rng.choice([0, rng.randint(1, 10**9)]))
           for i in range(n_ops)]
    return make_profile(ops, n_blocks=rng.randint(1, 50), input_bytes=rng.randint(0, 10**8),
                        param_count=rng.randint(0, 10**9), flop_f=rng.uniform(0, 1e14),
                        thp_g=rng.uniform(1e12, 1e15), bw_g=rng.uniform(1e9, 5e10), bw_s2m=rng.uniform(1e9, 1e11),
                        bw_m2s=rng.uniform(1e9, 1e11), mem_avail=rng.randint(0, 10**11))


# ------------------------------------------------------------------------------- cost model

def test_estimate_matches_the_equations() -> None:
    p = make_profile([("x", 100.0, 7), ("y", 50.0, 3)], n_blocks=5, input_bytes=2, param_count=10,
                     flop_f=1000.0, thp_g=10.0, bw_g=2.0, bw_s2m=4.0, bw_m2s=8.0, mem_avail=20, cpu_adam=0.1)
    e = estimate(p, ["x"])
    a = 4 * (2 + 7)
    assert (e.a_g2m, e.flop_r, e.alpha_bytes) == (a, 5 * 50.0, a - 20)
    p16, states = 2 * 10, 14 * 10
    assert e.lanes_f == {"gpu": 100.0, "g2m": a / 2, "m2g": p16 / 2, "ssd": p16 / 4 + (a - 20) / 8}
    assert e.lanes_b == {"gpu": (2000 + 250) / 10, "g2m": p16 / 2, "m2g": (p16 + a) / 2,
                         "ssd": (states + a - 20) / 4 + states / 8, "cpu": 10 / 0.1}
    # Each phase: its slowest lane, plus one block (of 5) of every other lane to fill and drain the pipeline.
    assert e.fill_f == pytest.approx((a / 2 + p16 / 2 + 7) / 5)
    assert e.fill_b == pytest.approx((p16 / 2 + (p16 + a) / 2 + 56.5 + 100) / 5)
    assert e.t_f == pytest.approx(100.0 + e.fill_f) and e.bottleneck_f == "gpu"
    assert e.t_b == pytest.approx(225.0 + e.fill_b) and e.bottleneck_b == "gpu"
    assert e.t_iter == e.t_f + e.t_b
    # Optimizer after backward: backward reads P16 and overflow only; then AdamW and the optimizer's SSD traffic.
    serial_b = {"gpu": 225.0, "g2m": 10.0, "m2g": 28.0, "ssd": (p16 + a - 20) / 4}
    serial_opt = {"cpu": 100.0, "ssd": 12 * 10 / 4 + states / 8}
    def phase(lanes: dict[str, float]) -> float:
        return max(lanes.values()) + (sum(lanes.values()) - max(lanes.values())) / 5
    assert e.t_serial == pytest.approx(e.t_f + phase(serial_b) + phase(serial_opt))
    assert e.traffic == {"m2g": 2 * p16 + a, "g2m": a + p16, "ssd_read": p16 + states + a - 20,
                         "ssd_write": states + a - 20, "adam_params": 10}


def test_cpu_lane_can_bind_backward_and_unknown_rate_is_not_priced() -> None:
    kw = dict(n_blocks=4, param_count=100, flop_f=10.0, thp_g=1.0, bw_g=1e9, bw_s2m=1e9, bw_m2s=1e9)
    slow = estimate(make_profile([("x", 1.0, 1)], cpu_adam=1.0, **kw), [])
    assert slow.lanes_b["cpu"] == 100.0 and slow.bottleneck_b == "cpu" and slow.t_b > 100.0
    assert slow.t_serial > slow.t_iter  # the optimizer under backward saves the backward's GPU time
    unknown = estimate(make_profile([("x", 1.0, 1)], **kw), [])
    assert unknown.lanes_b["cpu"] == 0.0 and unknown.bottleneck_b == "gpu"
    assert "bottleneck (b)" in slow.format_lanes() and "CPU AdamW" in slow.format_lanes()


def test_a_held_step_hides_the_next_forward_under_the_cpu_lane() -> None:
    """With a durability interval, a step held in RAM takes max(T_f + T_b0, T_b): its forward (the next step's,
    following the optimizer's tail) hides under the cpu lane; T_iter is the interval's mean. Without the next batch
    (`follow` False) or without an interval, T_f + T_b as before."""
    kw = dict(n_blocks=4, param_count=100, flop_f=10.0, thp_g=1.0, bw_g=1e9, bw_s2m=1e9, bw_m2s=1e9)
    base = make_profile([("x", 1.0, 1)], cpu_adam=1.0, **kw)
    every = estimate(base, [])
    held = estimate(dataclasses.replace(base, persist_every=4), [])
    alone = estimate(dataclasses.replace(base, persist_every=4, follow=False), [])
    assert every.t_iter == every.t_f + every.t_b and alone.t_iter == alone.t_f + alone.t_b
    b0 = {k: v for k, v in held.lanes_b.items() if k != "cpu"}
    phase_b0 = max(b0.values()) + (sum(b0.values()) - max(b0.values())) / 4
    one = max(held.t_f + phase_b0, held.t_b)
    assert held.t_b > held.t_f + phase_b0  # (the cpu lane binds: the forward hides)
    assert held.t_iter == pytest.approx((3 * one + held.t_f + held.t_b) / 4)
    assert held.t_iter < held.t_f + held.t_b


def test_reprice_keeps_the_plan_and_prices_it_on_the_refined_profile() -> None:
    """`reprice`: the chosen point (swap set, tiers) priced again: the same estimate on the same profile; with the
    CPU rate a run measured, the CPU lane the plan's hardware could not price."""
    profile = analytic_profile(get_model_config("125m"), 4, 256, parse_hardware("rtx4090,1xP5510,64GB"))
    profile = dataclasses.replace(profile, hardware=dataclasses.replace(profile.hardware, cpu_adam_params_per_s=0.0))
    plan = algorithm1(profile)
    assert reprice(plan.estimate, profile) == plan.estimate
    rate = profile.param_count / 2.0  # the update takes 2 s
    refined = dataclasses.replace(profile, hardware=dataclasses.replace(profile.hardware, cpu_adam_params_per_s=rate))
    est = reprice(plan.estimate, refined)
    assert est.swap == plan.estimate.swap and est.a_g2m == plan.estimate.a_g2m
    assert plan.estimate.lanes_b["cpu"] == 0 and est.lanes_b["cpu"] == pytest.approx(2.0 * profile.update_cost)
    assert est.t_iter >= plan.estimate.t_iter


def clip_profile(follow: bool = True) -> Profile:
    """test_estimate_matches_the_equations' profile with 2 resident params and 4 read ahead of P = 10."""
    p = make_profile([("x", 100.0, 7), ("y", 50.0, 3)], n_blocks=5, input_bytes=2, param_count=10,
                     flop_f=1000.0, thp_g=10.0, bw_g=2.0, bw_s2m=4.0, bw_m2s=8.0, mem_avail=20, cpu_adam=0.1)
    return dataclasses.replace(p, resident_params=2, readahead_params=4, follow=follow)


def test_clipped_steps_match_the_equations() -> None:
    """t_deferred and t_redo, the module docstring's equations, on a hand-made profile (swap x: A_G2M 36, alpha 16).
    Backward without the optimizer (B0): gpu 225, g2m 10, m2g 28, ssd (P16 16 + alpha 16) / 4 = 8 (the 2 resident
    params' P16, 4 bytes, copied from their records), so 217 s of SSD idle; writes W = 140 / 8 = 17.5; the
    non-resident reads 12 * 8 / 4 = 24, of which 12 * 4 / 4 = 12 ahead. Forward: 100 + (18 + 10 + 16 / 4 + 2) / 5."""
    def phase(lanes: dict[str, float]) -> float:
        return max(lanes.values()) + (sum(lanes.values()) - max(lanes.values())) / 5

    e = estimate(clip_profile(), ["x"])
    assert e.t_f == pytest.approx(106.8) and e.read_ahead_bytes == 48
    # follow: the read-ahead (12) and all the writes (17.5) fit the idle SSD time of backward; the update phase has
    # the next forward beside AdamW (its P16 from the update: only its overflow writes, 16 / 8, on the SSDs)
    backward = {"gpu": 225.0, "g2m": 10.0, "m2g": 28.0, "ssd": 8 + 12 + 17.5, "cpu": 0.0}
    update = {"gpu": 100.0, "g2m": 18.0, "m2g": 10.0, "cpu": 100.0, "ssd": 24 - 12 + 17.5 - 17.5 + 2}
    assert e.t_deferred == pytest.approx(phase(backward) + phase(update))
    # the redo reads every record (resident ones too) and writes them, with the next forward beside it
    redo = {"gpu": 100.0, "g2m": 18.0, "m2g": 10.0, "cpu": 100.0, "ssd": 12 * 10 / 4 + 17.5 + 2}
    assert e.t_redo == pytest.approx(e.t_iter + phase(redo) - e.t_f)
    # slots=1: no write-behind, the update alone, then the next forward (T_f)
    one = estimate(clip_profile(follow=False), ["x"])
    backward = {"gpu": 225.0, "g2m": 10.0, "m2g": 28.0, "ssd": 8 + 12, "cpu": 0.0}
    update = {"cpu": 100.0, "ssd": 24 - 12 + 17.5}
    assert one.t_deferred == pytest.approx(e.t_f + phase(backward) + phase(update))
    assert one.t_redo == pytest.approx(e.t_iter + phase({"cpu": 100.0, "ssd": 30 + 17.5}))
    assert (one.t_iter, one.t_serial) == (e.t_iter, e.t_serial)  # the speculated step does not change


def test_a_deferred_steps_lanes_are_its_backward_its_update_and_the_forward_beside_it() -> None:
    """The lanes of a deferred step (``Estimate.lanes_deferred``, `step_lanes(deferred=True)`) are what its
    ``t_deferred`` runs: backward without the optimizer, the update, and with follow the next forward beside it,
    whose P16 come from the update (no P16 from the SSDs); without follow its own forward, P16 read included."""
    e = estimate(clip_profile(), ["x"])
    backward = {"gpu": 225.0, "g2m": 10.0, "m2g": 28.0, "ssd": 8 + 12 + 17.5, "cpu": 0.0}
    update = {"gpu": 100.0, "g2m": 18.0, "m2g": 10.0, "cpu": 100.0, "ssd": 24 - 12 + 17.5 - 17.5 + 2}
    deferred = {k: backward[k] + update[k] for k in LANES_B}
    assert e.step_lanes(deferred=True) == pytest.approx(deferred)
    assert e.step_lanes()["ssd"] > deferred["ssd"]  # the speculated step's forward reads its P16
    assert e.step_lanes("serial", deferred=True) == e.lanes_serial  # serial never defers
    one = estimate(clip_profile(follow=False), ["x"])
    backward["ssd"], update = 8 + 12, {"cpu": 100.0, "ssd": 24 - 12 + 17.5}
    own = {k: backward[k] + update.get(k, 0.0) + one.lanes_f.get(k, 0.0) for k in LANES_B}
    assert one.step_lanes(deferred=True) == pytest.approx(own)
    assert Estimate.from_dict({k: v for k, v in e.to_dict().items() if k != "lanes_deferred"}).step_lanes(
        deferred=True) == e.step_lanes()  # an old estimate: the speculated step's


def test_read_ahead_fills_only_the_idle_ssd_time_of_backward() -> None:
    """An SSD-bound backward has no idle SSD time: the read-ahead and the writes all stay in the update phase."""
    p = dataclasses.replace(clip_profile(), hardware=dataclasses.replace(clip_profile().hardware, bw_s2m=0.01))
    full, none = estimate(p, ["x"]), estimate(dataclasses.replace(p, readahead_params=0), ["x"])
    assert full.t_deferred == none.t_deferred and full.read_ahead_bytes == 48 and none.read_ahead_bytes == 0


@pytest.mark.parametrize("seed", range(40))
def test_clipped_step_costs_are_ordered_and_read_ahead_never_hurts(seed: int) -> None:
    """More read-ahead never lengthens a deferred step; with every record read ahead it costs no more than the
    optimizer after backward; a redone step costs more than an unclipped one."""
    rng = random.Random(seed)
    base = random_profile(rng)
    base = dataclasses.replace(base, hardware=dataclasses.replace(
        base.hardware, cpu_adam_params_per_s=rng.choice([0.0, rng.uniform(1e8, 1e10)])))
    resident = rng.randint(0, base.param_count)
    swap = [op.name for op in base.ops[:rng.randint(0, len(base.ops))]]
    for follow in (True, False):
        times = []
        for k in range(6):
            p = dataclasses.replace(base, resident_params=resident, follow=follow,
                                    readahead_params=(base.param_count - resident) * k // 5)
            times.append(estimate(p, swap).t_deferred)
        assert all(b <= a * (1 + 1e-12) for a, b in zip(times, times[1:])), times
        e = estimate(p, swap)
        assert e.t_deferred <= e.t_serial * (1 + 1e-12)
        assert e.t_redo >= e.t_iter


@pytest.mark.parametrize("model,batch", [("6b", 8), ("13b", 32), ("70b", 8)])
def test_on_the_paper_machine_a_clipped_step_costs_more_than_an_unclipped_one(model: str, batch: int) -> None:
    """Compute- or CPU-bound: speculating right is the fastest; deferring costs no more than a redo, nor than the
    optimizer after backward once the read-ahead room holds every record."""
    profile = analytic_profile(get_model_config(model), batch, 1024, parse_hardware("rtx4090,12xP5510,768GB"))
    e = estimate(profile, [])
    assert e.t_iter < e.t_deferred < e.t_redo and e.t_deferred < e.t_serial
    ahead = estimate(dataclasses.replace(profile, readahead_params=profile.param_count), [])
    assert ahead.t_deferred <= e.t_deferred


def test_clipping_lines_and_old_estimates() -> None:
    """The lanes end with what clipping costs (when the run clips) and the serial step; an estimate saved before
    t_deferred existed still loads, and prints no clipping line."""
    e = estimate(clip_profile(), ["x"])
    text = e.format_lanes()
    assert "clipping: a step whose update waits for the global norm (0.00 GB read ahead during backward)" in text
    assert f"{e.t_deferred / e.t_iter:.2f}x" in text and "its optimizer pass redone" in text
    assert "optimizer after backward (serial mode)" in text
    assert "clipping" not in e.format_lanes(clip=False) and "serial mode" in e.format_lanes(clip=False)
    old = {k: v for k, v in e.to_dict().items() if k not in ("t_deferred", "t_redo", "read_ahead_bytes")}
    loaded = Estimate.from_dict(json.loads(json.dumps(old)))
    assert loaded.t_deferred == 0.0 and "clipping" not in loaded.format_lanes()
    assert Estimate.from_dict(json.loads(json.dumps(e.to_dict()))) == e


def test_profile_read_ahead_is_validated_and_old_profiles_load() -> None:
    p = clip_profile(follow=False)
    assert Profile.from_dict(json.loads(json.dumps(p.to_dict()))) == p
    old = {k: v for k, v in p.to_dict().items() if k not in ("readahead_params", "follow")}
    assert Profile.from_dict(old).readahead_params == 0 and Profile.from_dict(old).follow
    with pytest.raises(ValueError, match="readahead_params"):
        dataclasses.replace(p, readahead_params=9)  # 2 resident + 9 > 10
    with pytest.raises(ValueError, match="readahead_params"):
        dataclasses.replace(p, readahead_params=-1)


def test_alpha_is_the_overflow_and_feeds_the_ssd_lanes() -> None:
    ops = [("x", 1.0, 100)]
    fits = make_profile(ops, n_blocks=3, input_bytes=10, mem_avail=220)
    over = make_profile(ops, n_blocks=3, input_bytes=10, mem_avail=150)
    e_fit, e_over = estimate(fits, ["x"]), estimate(over, ["x"])
    assert e_fit.a_g2m == e_over.a_g2m == 220
    assert e_fit.alpha_bytes == 0
    assert e_over.alpha_bytes == 220 - 150
    assert e_over.lanes_f["ssd"] - e_fit.lanes_f["ssd"] == pytest.approx(70 / 1.0)
    assert e_over.lanes_b["ssd"] - e_fit.lanes_b["ssd"] == pytest.approx(70 / 1.0)


def test_last_block_is_not_offloaded_but_recomputes() -> None:
    p = make_profile([("x", 3.0, 5), ("y", 2.0, 1)], n_blocks=6, input_bytes=4)
    e = estimate(p, ["y"])
    assert e.a_g2m == 5 * (4 + 1)
    assert e.flop_r == 6 * 3.0


def test_unknown_op_name_lists_valid_ones() -> None:
    p = interior_profile()
    with pytest.raises(ValueError, match=r"nope.*valid ops are: c, a, b"):
        estimate(p, ["a", "nope"])


def test_walk_order_by_offload_benefit_zero_bytes_first_ties_in_forward_order() -> None:
    p = make_profile([("low", 1.0, 10), ("tie1", 4.0, 2), ("free", 0.0, 0), ("tie2", 8.0, 4), ("high", 9.0, 1)])
    assert [op.name for op in walk_order(p)] == ["free", "high", "tie1", "tie2", "low"]
    points = walk(p)
    assert [e.swap for e in points] == [(), ("free",), ("free", "high"), ("free", "high", "tie1"),
                                        ("free", "high", "tie1", "tie2"),
                                        ("free", "high", "tie1", "tie2", "low")]
    assert all(a.a_g2m <= b.a_g2m for a, b in zip(points, points[1:]))


# -------------------------------------------------------------------------------- Algorithm 1

def test_case1_link_bound_swaps_only_block_inputs() -> None:
    # Slow device link binds both phases; the GPU is so fast that recomputation is free.
    p = make_profile([("a", 1e6, 100), ("b", 1e3, 100)], n_blocks=8, input_bytes=50, param_count=1000,
                     flop_f=1e6, thp_g=1e12, bw_g=1.0, bw_s2m=1e9, bw_m2s=1e9)
    plan = algorithm1(p)
    assert plan.swap == () and plan.case == 1 and plan.chosen == 0
    assert all(e.t_iter > plan.estimate.t_iter for e in plan.points[1:])


def test_case2_compute_bound_swaps_every_op_that_costs_flops() -> None:
    p = make_profile([("ln", 0.0, 10), ("mm", 1e9, 10), ("attn", 5e8, 20), ("free", 3.0, 0)], n_blocks=8,
                     input_bytes=10, param_count=100, flop_f=1e9, thp_g=1.0, bw_g=1e9, bw_s2m=1e9, bw_m2s=1e9)
    plan = algorithm1(p)
    assert plan.case == 2
    assert set(plan.swap) == {"free", "mm", "attn"}  # ln recomputes for free: swapping it only costs
    assert plan.estimate.flop_r == 0.0


def test_case2_takes_everything_when_every_op_helps() -> None:
    p = make_profile([("x", 1e9, 10), ("y", 1e8, 10)], thp_g=1.0, bw_g=1e9)
    plan = algorithm1(p)
    assert plan.case == 2 and set(plan.swap) == {"x", "y"} and plan.chosen == len(plan.points) - 1


def test_case3_interior_optimum_is_the_walk_argmin() -> None:
    p = interior_profile()
    plan = algorithm1(p)
    t = [e.t_iter for e in plan.points]
    assert t == [30.0, 11.5, 7.0, 14.0]
    assert plan.case == 3 and plan.chosen == 2 and plan.swap == ("a", "b")
    assert plan.estimate == plan.points[t.index(min(t))]


def _assert_unimodal(t: list[float]) -> None:
    tol = 1e-9 * max(t)
    k = t.index(min(t))
    assert all(b <= a + tol for a, b in zip(t[:k], t[1:k + 1])), t
    assert all(b >= a - tol for a, b in zip(t[k:], t[k + 1:])), t


@pytest.mark.parametrize("seed", range(40))
def test_walk_is_convex_and_algorithm1_finds_its_minimum(seed: int) -> None:
    p = random_profile(random.Random(seed))
    t = [e.t_iter for e in walk(p)]
    _assert_unimodal(t)
    assert algorithm1(p).estimate.t_iter == pytest.approx(min(t), rel=1e-9)


@pytest.mark.parametrize("model,batch,hw", [("13b", 32, "rtx4090,12xP5510,768GB"), ("175b", 1, PAPER_256),
                                            ("6b", 64, "rtx4090,1xP5510,128GB"), ("1b", 8, "h100,2xP5510,64GB")])
def test_analytic_walks_are_convex(model: str, batch: int, hw: str) -> None:
    cfg = get_model_config(model)
    p = analytic_profile(cfg, batch, 1024, reserve_engine_pools(parse_hardware(hw), cfg))
    t = [e.t_iter for e in walk(p)]
    _assert_unimodal(t)
    assert algorithm1(p).estimate.t_iter == pytest.approx(min(t))


# ------------------------------------------------------------------------------ policies, tiers

def _profiles() -> list[Profile]:
    cfg = get_model_config("13b")
    return [interior_profile(), make_profile([("x", 5.0, 3)], n_blocks=5, input_bytes=7, mem_avail=20),
            analytic_profile(cfg, 32, 1024, reserve_engine_pools(parse_hardware("rtx4090,2xP5510,256GB"), cfg))]


@pytest.mark.parametrize("policy", POLICIES)
def test_block_inputs_always_swapped_and_last_block_kept(policy: str) -> None:
    for p in _profiles():
        plan = make_plan(p, policy)
        assert len(plan.block_tiers) == p.n_blocks and plan.block_tiers[-1] == "keep"
        if policy == "recompute-all":
            assert set(plan.block_tiers) == {"keep"} and plan.estimate.a_g2m == 0
        else:
            assert plan.estimate.a_g2m >= (p.n_blocks - 1) * p.input_bytes
            assert "keep" not in plan.block_tiers[:-1]


def test_forced_policies() -> None:
    p = make_profile([("x", 5.0, 3), ("y", 2.0, 4)], n_blocks=5, input_bytes=7, mem_avail=0)
    assert forced_plan(p, "interblock").swap == ()
    assert forced_plan(p, "interblock").estimate.a_g2m == 4 * 7
    assert forced_plan(p, "swap-all").swap == ("x", "y")
    assert forced_plan(p, "swap-all").estimate.flop_r == 0.0
    none = forced_plan(p, "recompute-all").estimate
    assert (none.a_g2m, none.alpha_bytes, none.flop_r) == (0, 0, 5 * 7.0)
    assert make_plan(p, "plan") == algorithm1(p)
    assert all(make_plan(p, pol).case == 0 and make_plan(p, pol).chosen == -1 for pol in POLICIES[1:])


def test_unknown_policy_lists_valid_ones() -> None:
    with pytest.raises(ValueError, match="plan, interblock, swap-all, recompute-all"):
        make_plan(interior_profile(), "swap-some")
    with pytest.raises(ValueError, match="interblock, swap-all, recompute-all"):
        forced_plan(interior_profile(), "plan")


def test_place_tiers_earliest_blocks_to_ssd() -> None:
    assert place_tiers(12, 10, 35, "plan") == ("ssd",) * 8 + ("cpu",) * 3 + ("keep",)
    assert place_tiers(4, 10, 10**9, "interblock") == ("cpu", "cpu", "cpu", "keep")
    assert place_tiers(4, 10, 0, "swap-all") == ("ssd", "ssd", "ssd", "keep")
    assert place_tiers(4, 0, 0, "plan") == ("cpu", "cpu", "cpu", "keep")
    assert place_tiers(1, 10, 0, "plan") == ("keep",)
    assert place_tiers(3, 10, 100, "recompute-all") == ("keep",) * 3


@pytest.mark.parametrize("mem_avail", [0, 5, 33, 70, 10**6])
def test_plan_tier_totals(mem_avail: int) -> None:
    p = make_profile([("x", 5.0, 3)], n_blocks=9, input_bytes=7, mem_avail=mem_avail)
    for policy in ("interblock", "swap-all", "plan"):
        plan = make_plan(p, policy)
        assert plan.cpu_bytes <= mem_avail
        assert plan.cpu_bytes + plan.ssd_bytes == (p.n_blocks - 1) * plan.block_bytes
        assert plan.ssd_bytes >= plan.estimate.alpha_bytes
        tiers = plan.block_tiers[:-1]
        assert list(tiers) == sorted(tiers, key=["ssd", "cpu"].index)  # SSD blocks come first


# ---------------------------------------------------------------------------- serialization

def test_profile_json_round_trip(tmp_path) -> None:
    cfg = get_model_config("13b", n_layer=3)
    p = analytic_profile(cfg, 4, 512, parse_hardware(PAPER_256))
    path = tmp_path / f"{p.key()}.json"
    p.save(path)
    assert Profile.load(path) == p
    assert p.key() == "13b-b4-s512-w2-rtx4090_12xP5510_256GB"
    other = analytic_profile(cfg, 4, 512, parse_hardware(PAPER_256), "fp32")
    assert other.key() != p.key()


def test_plan_round_trip_and_table() -> None:
    plan = algorithm1(interior_profile())
    again = Plan.from_dict(json.loads(json.dumps(plan.to_dict())))
    assert again == plan
    table = plan.format_table()
    marked = [line for line in table.splitlines() if line.startswith("*")]
    assert len(marked) == 1 and marked[0].split()[1] == str(plan.chosen)
    assert "case 3" in table and "blocks 0: cpu, 1: keep" in table
    assert "lanes of the chosen point" in table and "T_iter = 7s" in table  # the chosen point's lanes follow
    forced = forced_plan(interior_profile(), "recompute-all").format_table()
    assert "forced" in forced and "recompute-all" in forced and "swapped in every block: nothing" in forced


def test_tier_summary_runs() -> None:
    p = make_profile([("x", 5.0, 3)], n_blocks=12, input_bytes=7, mem_avail=70)
    assert forced_plan(p, "swap-all").tier_summary() == "blocks 0-3: ssd, 4-10: cpu, 11: keep"


def test_invalid_profiles_and_hardware() -> None:
    with pytest.raises(ValueError, match="unique"):
        make_profile([("x", 1.0, 1), ("x", 2.0, 2)])
    with pytest.raises(ValueError, match="bw_g"):
        make_profile([("x", 1.0, 1)], bw_g=0.0)


# ------------------------------------------------------------------------------ analytic profile

def test_analytic_profile_formulas() -> None:
    cfg = get_model_config("13b", n_layer=3)
    b, t, d, h = 2, 128, cfg.d_model, cfg.mlp_hidden
    n = b * t
    p = analytic_profile(cfg, b, t, parse_hardware(PAPER_256))
    ops = {op.name: op for op in p.ops}
    assert [op.name for op in p.ops] == ["ln1", "qkv", "attn", "proj", "ln2", "fc", "act", "fc_proj"]
    assert ops["qkv"].flops == 2 * n * d * 3 * d and ops["qkv"].bytes == 3 * n * d * 2
    assert ops["attn"].flops == 4 * b * t * t * d and ops["attn"].bytes == n * d * 2 + b * cfg.n_head * t * 4
    assert ops["ln1"].bytes == n * d * 2 + 2 * n * 4 and ops["ln1"].flops == 0
    assert ops["act"].bytes == n * h * 2 and ops["fc"].flops == 2 * n * d * h
    assert p.input_bytes == n * d * 2 and p.param_count == cfg.param_count()
    # flop_f is the blocks' op FLOPs plus the LM head matmul.
    blocks = cfg.n_layer * sum(op.flops for op in p.ops)
    assert p.flop_f == pytest.approx(blocks + 2 * n * d * cfg.vocab_size)
    p32 = analytic_profile(cfg, b, t, parse_hardware(PAPER_256), "fp32")
    assert p32.p16_itemsize == 4 and p32.input_bytes == 2 * p.input_bytes


def test_analytic_profile_rejects_bad_inputs() -> None:
    cfg = get_model_config("tiny")
    hw = parse_hardware(PAPER_256)
    with pytest.raises(ValueError, match="position"):
        analytic_profile(cfg, 1, 512, hw)
    with pytest.raises(ValueError, match="bf16, fp16, fp32"):
        analytic_profile(cfg, 1, 128, hw, "int8")


# ------------------------------------------------------------------------------------ hardware

def test_parse_hardware_paper_machine() -> None:
    hw = parse_hardware(PAPER_256)
    assert hw.name == PAPER_256
    assert hw.thp_g == 165.2e12 and hw.gpu_mem == 24 * 2**30 and hw.bw_g == 25e9
    assert hw.bw_s2m == 12 * 6.5e9 and hw.bw_m2s == pytest.approx(12 * 3.4e9)
    assert hw.ssd_bytes == 12 * 3_840 * 10**9
    assert hw.ram == 256 * 10**9 and hw.mem_avail == int(0.9 * 256 * 10**9)


def test_parse_hardware_is_order_and_space_free() -> None:
    a = parse_hardware("rtx4090, 1xP5510, 128GiB")
    b = parse_hardware("128 GiB,1 x p5510 ,RTX4090")
    assert (a.thp_g, a.bw_s2m, a.ram) == (b.thp_g, b.bw_s2m, b.ram) == (165.2e12, 6.5e9, 128 * 2**30)
    assert parse_hardware("rtx4080,2xP5510,64GB").gpu_mem == 16 * 2**30


def test_parse_hardware_cpu_part() -> None:
    default = parse_hardware(PAPER_256)
    assert default.cpu_adam_params_per_s == pytest.approx(2 * 0.707e9)  # DEFAULT_CPU: the paper's 2x Gold 5320
    named = parse_hardware(PAPER_256 + ", 2xGold5320")
    assert named.cpu_adam_params_per_s == default.cpu_adam_params_per_s
    assert named.name == PAPER_256 + ",2xGold5320"
    assert parse_hardware("adam=3e9," + PAPER_256).cpu_adam_params_per_s == 3e9
    assert parse_hardware(PAPER_256 + ",1xgold5320").cpu_adam_params_per_s == pytest.approx(0.707e9)


def test_ssd_bandwidths_are_effective_and_every_derating_has_a_source() -> None:
    consumer = parse_hardware("rtx4090,2x980PRO,128GB")
    assert consumer.bw_s2m == pytest.approx(2 * 7.0e9) and consumer.bw_m2s == pytest.approx(2 * 5.0e9 * 0.30)
    for name, spec in HARDWARE_PRESETS.items():
        if isinstance(spec, SsdSpec):
            assert 0 < spec.read_eff <= 1 and 0 < spec.write_eff <= 1 and len(spec.eff_source) > 40, name
        if isinstance(spec, CpuSpec):
            assert spec.adam_params_per_s > 0 and len(spec.source) > 40, name


def test_hardware_without_the_cpu_rate_still_loads() -> None:
    old = {k: v for k, v in parse_hardware(PAPER_256).to_dict().items() if k != "cpu_adam_params_per_s"}
    assert Hardware.from_dict(old).cpu_adam_params_per_s == 0.0  # profiles saved before the field existed
    with pytest.raises(ValueError, match="cpu_adam_params_per_s"):
        Hardware("x", 1.0, 1.0, 1.0, 1.0, 0, cpu_adam_params_per_s=-1.0)


@pytest.mark.parametrize("desc,match", [
    ("rtx4090,1xP5510,64GB,adam=fast", "adam= takes"),
    ("rtx4090,1xP5510,64GB,1xGold5320,adam=1e9", "CPU at most once"),
    ("rtx9999,1xP5510,128GB", r"unknown component 'rtx9999'.*rtx4090"),
    ("rtx4090,1xFOO,128GB", r"unknown SSD 'foo'.*p5510"),
    ("rtx4090,128GB", "COUNTxMODEL"),
    ("rtx4090,1xP5510", "RAM size"),
    ("rtx4090,1xP5510,128", "RAM size"),
    ("rtx4090,rtx4080,1xP5510,128GB", "exactly one GPU"),
    ("", "exactly one GPU"),
])
def test_parse_hardware_errors(desc: str, match: str) -> None:
    with pytest.raises(ValueError, match=match):
        parse_hardware(desc)


# ----------------------------------------------------------------------------- capacity planner

def test_175b_fits_256gb_with_lohan_but_not_with_activations_in_ram() -> None:
    """Main memory (the paper's Fig. 2a), on a GPU that holds a 175B block's working set: the 4090 of the paper
    does not (gpu_need: four bf16 copies of a 3.6 GB block, two gradient accumulators, autograd's gradients)"""
    cfg, hw = get_model_config("175b"), parse_hardware("h100,12xP5510,256GB")
    on_4090 = capacity(cfg, parse_hardware(PAPER_256), 1, 1024)
    assert not on_4090.fits and all(r.startswith("GPU memory") for r in on_4090.reasons), on_4090.reasons
    lohan = capacity(cfg, hw, 1, 1024)
    assert lohan.fits, lohan.format()
    assert lohan.cpu_bytes <= 0.9 * hw.ram and lohan.gpu_bytes <= hw.gpu_mem
    assert lohan.ssd_states_bytes == 2 * 14 * cfg.param_count()
    zero = activations_in_ram_capacity(cfg, hw, 1, 1024)
    assert not zero.fits
    assert any("main memory" in r for r in zero.reasons), zero.reasons
    assert zero.cpu_parts["gradients"] == 6 * cfg.param_count()  # bf16 grads + DeepSpeed's fp32 copy
    assert "does NOT fit" in zero.format() and "fits" in lohan.format()
    # ... which reproduces the paper's ~1.1 TB estimate for 175B, and its Fig. 2a: not even 768 GB holds it.
    assert 1.0e12 < zero.cpu_bytes < 1.2e12
    assert not activations_in_ram_capacity(cfg, parse_hardware("h100,12xP5510,768GB"), 1, 1024).fits
    assert activations_in_ram_capacity(cfg, hw, 1, 1024, grad_bytes_per_param=2).cpu_parts["gradients"] == \
        2 * cfg.param_count()


def test_ops_policy_swaps_exactly_the_named_ops() -> None:
    profile = analytic_profile(get_model_config("1b"), 8, 1024, parse_hardware(PAPER_256))
    plan = make_plan(profile, "ops:fc, attn")
    assert plan.swap == ("fc", "attn") and plan.policy == "ops:fc,attn"
    assert plan.estimate == estimate(profile, ["fc", "attn"])
    with pytest.raises(ValueError, match="valid ops"):
        make_plan(profile, "ops:nope")


def test_max_batch_is_the_fitting_boundary() -> None:
    cfg, hw = get_model_config("13b"), parse_hardware(PAPER_256)
    b = max_batch(cfg, hw, 1024)
    assert b >= 1
    assert capacity(cfg, hw, b, 1024).fits and not capacity(cfg, hw, b + 1, 1024).fits


def test_max_batch_respects_micro_batches() -> None:
    cfg, hw = get_model_config("6b"), parse_hardware(PAPER_256)
    b = max_batch(cfg, hw, 1024, micro_batches=4)
    assert b >= 4 and b % 4 == 0
    assert not capacity(cfg, hw, b + 4, 1024, micro_batches=4).fits


def test_max_model_on_the_paper_machine() -> None:
    hw = parse_hardware(PAPER_256)
    name = max_model(hw, 1024)
    assert name is not None
    size = ModelConfig(name=name, **PRESETS[name]).param_count()
    # 70b at prefetch depth 2: the GPU memory plan (gpu_need) refuses 135b's and 175b's blocks on 24 GiB
    assert size >= get_model_config("70b").param_count()
    bigger = [n for n in PRESETS if get_model_config(n).param_count() > size]
    assert all(not capacity(get_model_config(n), hw, 1, 1024).fits for n in bigger)


def test_tiny_fits_and_absurd_does_not() -> None:
    tiny = capacity(get_model_config("tiny"), parse_hardware("rtx4080,1xP5510,16GB"), 8, 256)
    assert tiny.fits and tiny.reasons == ()
    absurd = capacity(get_model_config("412b"), parse_hardware("rtx4080,1xP5510,16GB"), 1, 1024)
    assert not absurd.fits
    text = " ".join(absurd.reasons)
    assert "GPU memory" in text and "main memory" in text and "SSD" in text
    huge = {k: PRESETS[k] for k in ("276b", "412b")}
    assert max_model(parse_hardware("rtx4080,1xP5510,16GB"), 1024, presets=huge) is None
    assert max_model(parse_hardware("rtx4080,1xP5510,16GB"), 1024, presets={"tiny": PRESETS["tiny"]}) == "tiny"


def test_max_batch_zero_when_nothing_fits() -> None:
    assert max_batch(get_model_config("412b"), parse_hardware("rtx4080,1xP5510,16GB"), 1024) == 0


def test_capacity_activations_overflow_to_ssd_when_ram_is_short() -> None:
    cfg = get_model_config("13b")
    roomy = capacity(cfg, parse_hardware("rtx4090,4xP5510,768GB"), 32, 1024, micro_batches=4)
    tight = capacity(cfg, parse_hardware("rtx4090,4xP5510,20GB"), 32, 1024, micro_batches=4)
    assert roomy.fits and tight.fits, tight.format()
    assert roomy.ssd_act_bytes == 0 and roomy.plan.cpu_bytes > 0
    assert tight.ssd_act_bytes > 0 and tight.plan.block_tiers[0] == "ssd"
    assert tight.cpu_bytes <= 0.9 * 20e9 and math.isfinite(tight.plan.estimate.t_iter)


def test_gpu_need_parts() -> None:
    """capacity() judges the GPU with gpu_need's parts (each part is tested in tests/unit/plan/test_gpu_memory_plan.py)."""
    cfg, hw = get_model_config("175b"), parse_hardware(PAPER_256)
    c = capacity(cfg, hw, 4, 1024, micro_batches=2, prefetch_depth=2)
    micro = analytic_profile(cfg, 2, 1024, hw)
    full = analytic_profile(cfg, 4, 1024, hw)
    sizes = {op.name: op.bytes for op in full.ops}
    big, tied = cfg.block_param_count(), cfg.vocab_size * cfg.d_model
    record = full.input_bytes + sum(sizes[n] for n in c.plan.swap)
    parts = {
        "params": 4 * 2 * big + 2 * cfg.embed_param_count(),
        "gradient accumulators": 2 * 4 * big,  # fp32: accumulated over 2 micro-batches
        "block gradients": 2 * big,
        "borrowed gradients": 2 * 2 * tied,
        "block activations": 2 * (micro.input_bytes + sum(op.bytes for op in micro.ops)),
        "last block kept": record,
        "next block's records": record,
        "logits": head_loss_bytes(cfg.vocab_size, 2 * 1024, 2, cfg.d_model),  # chunked, padded vocabulary
        "cuBLAS workspace": 64 * 2**20,
    }
    assert c.gpu_parts == {**parts, "fragmentation": int(0.1 * sum(parts.values()))}
    assert c.gpu_bytes == sum(c.gpu_parts.values())
    # 276b's blocks are too wide for prefetch depth 2 on a 24 GiB card.
    big = capacity(get_model_config("276b"), hw, 1, 1024)
    assert any(r.startswith("GPU memory") for r in big.reasons)


def test_engine_pools_come_off_the_ram_budget() -> None:
    cfg, hw = get_model_config("13b"), parse_hardware(PAPER_256)
    big = cfg.block_param_count()
    pools = engine_pools(cfg, "bf16", prefetch_depth=2, max_inflight=3, micro_batches=1)
    # a 13b block's record (4.4 GB) is bigger than the optimizer chunk: the pool holds 3 chunks (of a whole number
    # of 4096 elements, as the engine cuts them: a little under OPT_CHUNK_BYTES), and the optimizer upcasts the
    # bf16 gradients through a 16 MiB fp32 scratch; one micro-batch: bf16 gradient buffers (nothing to accumulate)
    chunk = OPT_CHUNK_BYTES // 14 // 4096 * 4096
    upcast = 4 * UPCAST_ELEMS
    # (the tied embedding's borrowed gradient is autograd's, on the device: not in the host's grads pool)
    assert pools == {"params": 6 * 2 * big, "grads": 2 * 2 * big, "optimizer": 3 * 14 * chunk + upcast}
    assert engine_pools(cfg, "bf16", micro_batches=2)["grads"] == 2 * 4 * big
    small = get_model_config("tiny")
    emb, block = 14 * small.embed_param_count(), 14 * small.block_param_count()
    assert engine_pools(small, resident=False)["optimizer"] == 3 * max(block, emb) + upcast
    # resident records: the embedding (the biggest record) stays, the layers stream through three buffers
    assert emb > block and engine_pools(small)["optimizer"] == min(3 * emb, emb + 3 * block) + upcast
    assert engine_pools(small)["params"] <= 2 * small.param_count()  # never more than the whole model
    assert reserve_engine_pools(hw, cfg).mem_avail == int(0.9 * hw.ram) - sum(pools.values())


def test_ssd_need_counts_the_store_slots() -> None:
    cfg, hw = get_model_config("13b"), parse_hardware(PAPER_256)
    two, one = capacity(cfg, hw, 1, 1024), capacity(cfg, hw, 1, 1024, slots=1)
    assert two.ssd_states_bytes == 2 * one.ssd_states_bytes == 2 * 14 * cfg.param_count()


# --------------------------------------------------------------- this machine (lohan.app.fit, uses torch)

def test_detect_hardware_measures_the_cpu_optimizer_and_reuses_a_measured_ssd(tmp_path) -> None:
    from lohan.app.fit import detect_hardware

    nvme = tmp_path / "nvme"
    nvme.mkdir()
    assumed = detect_hardware((str(nvme),), device="cpu")
    assert assumed.hardware.cpu_adam_params_per_s > 0 and any("CPU AdamW measured" in n for n in assumed.notes)
    assert any("assumed" in n for n in assumed.notes)
    hw = Hardware("cpu-x86_64-2c+1ssd", 1e12, 1e10, 1.23e9, 0.45e9, 10**9)  # as profiler.measure_hardware names it
    profile = analytic_profile(get_model_config("tiny"), 1, 64, hw)
    profile.save(nvme / "lohan.profile.json")
    measured = detect_hardware((str(nvme),), device="cpu")
    assert (measured.hardware.bw_s2m, measured.hardware.bw_m2s) == (1.23e9, 0.45e9)
    assert any("measured by a run's first step" in n for n in measured.notes)
    other = tmp_path / "other"
    other.mkdir()
    two = detect_hardware((str(nvme), str(other)), device="cpu")  # measured on one SSD: not these two
    assert two.hardware.bw_s2m == 2 * 2.0e9


def test_resident_records_are_written_but_not_read() -> None:
    """The SSD lanes read the P32, m, v of the records not kept in memory only, and their P16 in neither pass (a
    resident record holds it): 12 + 2 * 2 bytes less per resident parameter, the writes unchanged."""
    cfg = get_model_config("tiny")
    hw = parse_hardware("rtx4090,1xP5510,64GB")
    base = analytic_profile(cfg, 4, 256, hw)
    half = dataclasses.replace(base, resident_params=base.param_count // 2)
    a, b = estimate(base, []), estimate(half, [])
    assert a.traffic["ssd_read"] - b.traffic["ssd_read"] == (12 + 2 * 2) * (base.param_count // 2)
    assert a.traffic["ssd_write"] == b.traffic["ssd_write"]
    assert b.lanes_b["ssd"] < a.lanes_b["ssd"] and b.lanes_f["ssd"] < a.lanes_f["ssd"]
    assert {k: v for k, v in b.lanes_f.items() if k != "ssd"} == {k: v for k, v in a.lanes_f.items() if k != "ssd"}
    with pytest.raises(ValueError, match="resident_params"):
        dataclasses.replace(base, resident_params=base.param_count + 1)
    assert Profile.from_dict(half.to_dict()) == half


def test_capacity_prices_the_resident_records_the_engine_keeps() -> None:
    """The dry run's plan: records kept in memory across steps are written but not read. 0 keeps what the pool
    holds beside its streaming buffers (the embedding here), `all` every record, `auto` half of what cpu_mem
    leaves after the pools; the memory they take is a part of main memory's."""
    cfg, hw = get_model_config("tiny", n_layer=12), parse_hardware("rtx4090,1xP5510,64GB")
    s, n = 2, cfg.param_count()

    def read(cap):  # the states' part of the step's SSD reads (P16: read in each pass, the whole model here)
        t = cap.plan.estimate.traffic
        return t["ssd_read"] - cap.plan.estimate.alpha_bytes

    assert engine_pools(cfg)["params"] >= s * n  # the parameter pool keeps every block: no P16 read

    lean = capacity(cfg, hw, 4, 256, readahead_mem=0)
    every = capacity(cfg, hw, 4, 256, resident_mem="all", readahead_mem=0)
    assert read(lean) == 12 * (n - cfg.embed_param_count()) and "resident" not in lean.cpu_parts
    assert read(every) == 0 and every.cpu_parts["resident"] > 0
    assert every.cpu_bytes == lean.cpu_bytes + every.cpu_parts["resident"]
    roomy = capacity(cfg, hw, 4, 256, resident_mem="auto", cpu_mem=8 * 2**30, readahead_mem=0)
    assert read(roomy) == 0 and roomy.cpu_parts["resident"] == every.cpu_parts["resident"]
    pools = sum(engine_pools(cfg).values())
    tight = capacity(cfg, hw, 4, 256, resident_mem="auto", cpu_mem=pools + every.cpu_parts["resident"],
                     readahead_mem=0)
    assert tight.cpu_parts["resident"] == every.cpu_parts["resident"] // 2
    assert 0 < read(tight) < read(lean)
    add, kept = resident_records(cfg, "bf16", 3, engine_pools(cfg)["optimizer"], 0)
    assert add == 0 and kept == cfg.embed_param_count()


def test_capacity_prices_the_read_ahead_room_of_a_deferred_update() -> None:
    """Optimized mode gets the read-ahead room (`readahead_mem`, auto by default): main memory in `cpu_parts`, and
    the records it holds read during backward ahead of a deferred update in the estimate. None with
    readahead_mem 0."""
    cfg, hw = get_model_config("tiny", n_layer=12), parse_hardware("rtx4090,1xP5510,64GB")
    n, per = cfg.param_count(), 12 + 2
    roomy = capacity(cfg, hw, 4, 256, keep_grads=True, cpu_mem=8 * 2**30)
    room = roomy.cpu_parts["readahead"]
    assert room > 0 and roomy.plan.estimate.read_ahead_bytes == 12 * min(room // per, n - cfg.embed_param_count())
    assert 0 < roomy.plan.estimate.t_deferred
    tight = capacity(cfg, hw, 4, 256, keep_grads=True, cpu_mem=8 * 2**30, readahead_mem=room // 2)
    assert tight.cpu_parts["readahead"] == room // 2
    assert tight.plan.estimate.read_ahead_bytes == 12 * (room // 2 // per)
    assert tight.plan.estimate.t_deferred >= roomy.plan.estimate.t_deferred
    for kw in (dict(), dict(keep_grads=True, clip_mode="speculate")):  # (ahead of the gradients, then)
        assert capacity(cfg, hw, 4, 256, cpu_mem=8 * 2**30, **kw).cpu_parts["readahead"] > 0, kw
    cap = capacity(cfg, hw, 4, 256, cpu_mem=8 * 2**30, keep_grads=True, readahead_mem=0)
    assert "readahead" not in cap.cpu_parts and cap.plan.estimate.read_ahead_bytes == 0
    # slots=1 always defers, and its last writes do not complete behind (no write-behind): more than with two slots
    one = capacity(cfg, hw, 4, 256, slots=1, cpu_mem=8 * 2**30)
    assert one.cpu_parts["readahead"] > 0
    assert one.plan.estimate.t_deferred >= capacity(cfg, hw, 4, 256, keep_grads=True, cpu_mem=8 * 2**30,
                                                    slots=2).plan.estimate.t_deferred


def test_the_dry_run_report_says_what_clipping_costs() -> None:
    """fit_report: the clipping lines when the run clips; slots=1 predicts the deferred step (every update waits)."""
    from lohan.app.fit import described_hardware, fit_report
    cfg, machine = get_model_config("tiny", n_layer=12), described_hardware("rtx4090,1xP5510,64GB")
    clipped = fit_report(cfg, machine, 4, 256, keep_grads=True, cpu_mem=8 * 2**30)
    assert "clipping: a step whose update waits for the global norm" in clipped.format()
    assert clipped.step_s == clipped.capacity.plan.estimate.t_iter and not clipped.waits
    plain = fit_report(cfg, machine, 4, 256, cpu_mem=8 * 2**30)
    assert "clipping:" not in plain.format() and "optimizer after backward (serial mode)" in plain.format()
    one = fit_report(cfg, machine, 4, 256, slots=1, keep_grads=True, clips=False, cpu_mem=8 * 2**30)
    assert one.waits and one.step_s == one.capacity.plan.estimate.t_deferred and "clipping:" not in one.format()
    assert "every update waits for the global norm" in one.format()


def test_p16_the_parameter_pool_keeps_is_read_in_neither_pass_but_serial_forward_reads_it_all() -> None:
    """``Profile.kept_p16_params``: backward finds the blocks forward read, the next forward those the update during
    backward handed over; serial mode hands nothing over, so its forward reads every P16."""
    profile = analytic_profile(get_model_config("1b"), 8, 1024, parse_hardware(PAPER_256))
    p16 = profile.p16
    base = estimate(profile, [])
    kept = estimate(dataclasses.replace(profile, kept_p16_params=profile.param_count), [])
    assert kept.traffic["ssd_read"] == pytest.approx(base.traffic["ssd_read"] - 2 * p16)
    assert kept.lanes_f["ssd"] == pytest.approx(base.lanes_f["ssd"] - p16 / profile.hardware.bw_s2m)
    assert kept.lanes_b["ssd"] == pytest.approx(base.lanes_b["ssd"] - p16 / profile.hardware.bw_s2m)
    assert kept.t_serial <= base.t_serial and kept.t_iter <= base.t_iter
    with pytest.raises(ValueError, match="kept_p16_params"):
        dataclasses.replace(profile, kept_p16_params=profile.param_count + 1)


def test_the_kept_share_of_p16_is_what_the_blocks_in_use_leave_of_the_pool() -> None:
    from lohan.plan.pools import kept_p16_fraction

    blocks = [100] * 10
    assert kept_p16_fraction(1000, blocks, 2) == 1.0  # every block fits: all kept
    assert kept_p16_fraction(500, blocks, 2) == pytest.approx(0.2)  # 5 buffers, 3 in use
    assert kept_p16_fraction(300, blocks, 2) == 0.0
