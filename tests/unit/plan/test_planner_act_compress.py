"""The cost model and Algorithm 1 with int8 activation records (``act_compress: int8``): records that leave the
device are priced at their compressed bytes on the links and the tiers, and their quantization (forward) and
dequantization (backward) on the ``gpu`` lane. Pure: hand-built and analytic profiles, no torch."""

from __future__ import annotations

import dataclasses
import json

import pytest

from lohan.config import get_model_config
from lohan.plan.planner import (
    HARDWARE_PRESETS,
    QUANT_TRAFFIC,
    GpuSpec,
    Hardware,
    OpProfile,
    Plan,
    Profile,
    algorithm1,
    analytic_profile,
    capacity,
    estimate,
    forced_plan,
    parse_hardware,
    walk_order,
)

PAPER_256 = "rtx4090,12xP5510,256GB"


def int8_profile(act_compress: str = "int8", quant: float = 0.0, dequant: float = 0.0,
                 mem_avail: int = 10**18) -> Profile:
    hw = Hardware("synthetic", thp_g=10.0, bw_g=2.0, bw_s2m=4.0, bw_m2s=8.0, mem_avail=mem_avail,
                  act_quant_bps=quant, act_dequant_bps=dequant)
    ops = (OpProfile("x", 100.0, 8, 3), OpProfile("y", 50.0, 4, 2), OpProfile("z", 0.0, 4))
    return Profile("synthetic", 1, 1, 5, ops, 4, 10, 2, 1000.0, hw, "analytic", input_bytes_int8=2,
                   act_compress=act_compress)


def test_int8_prices_the_compressed_bytes_and_the_quantization_on_the_gpu_lane() -> None:
    plain, packed = estimate(int8_profile("none"), ["x"]), estimate(int8_profile(quant=4.0, dequant=8.0), ["x"])
    raw, small = 4 * (4 + 8), 4 * (2 + 3)  # four of the five blocks leave the device
    assert (plain.a_g2m, plain.a_g2m_raw, plain.quant_s) == (raw, raw, 0.0)
    assert (packed.a_g2m, packed.a_g2m_raw) == (small, raw)
    assert (packed.quant_s, packed.dequant_s) == (raw / 4.0, raw / 8.0)
    assert packed.lanes_f["g2m"] == small / 2.0 and packed.lanes_b["m2g"] == (20 + small) / 2.0
    assert packed.lanes_f["gpu"] == plain.lanes_f["gpu"] + raw / 4.0
    assert packed.lanes_b["gpu"] == plain.lanes_b["gpu"] + raw / 8.0
    assert packed.traffic["g2m"] == small + 20 and packed.flop_r == plain.flop_r
    # an op whose int8 size is not known is priced as it is; without a rate the quantization is not priced
    assert estimate(int8_profile(), ["z"]).a_g2m == 4 * (2 + 4)
    assert estimate(int8_profile(dequant=0.0, quant=2.0), ["x"]).dequant_s == raw / 2.0  # dequant at quant's rate
    assert estimate(int8_profile(), ["x"]).quant_s == 0.0


def test_the_tiers_hold_compressed_records() -> None:
    """The record a plan sizes the CPU pool and the SSD volume with is the compressed one, and main memory holds
    as many more records as compression makes them smaller."""
    plain = forced_plan(int8_profile("none", mem_avail=33), "swap-all")
    packed = forced_plan(int8_profile(mem_avail=33), "swap-all")
    assert plain.block_bytes == 4 + 8 + 4 + 4 and packed.block_bytes == 2 + 3 + 2 + 4
    assert plain.block_tiers == ("ssd", "ssd", "ssd", "cpu", "keep")
    assert packed.block_tiers == ("ssd", "cpu", "cpu", "cpu", "keep")
    assert (packed.cpu_bytes, packed.ssd_bytes) == (3 * 11, 11)
    table = packed.format_table()
    assert "int8 records:" in table and "rate unknown: not priced" in table
    assert "int8 records:" not in plain.format_table()


def test_the_walk_orders_by_flops_net_of_quantization_per_compressed_byte() -> None:
    ops = (OpProfile("cheap", 40.0, 10, 3), OpProfile("dense", 100.0, 10, 9), OpProfile("free", 0.0, 4, 1))
    hw = Hardware("h", thp_g=1.0, bw_g=1.0, bw_s2m=1.0, bw_m2s=1.0, mem_avail=0)
    p = Profile("p", 1, 1, 2, ops, 0, 0, 2, 0.0, hw, "analytic")
    assert [o.name for o in walk_order(p)] == ["dense", "cheap", "free"]  # flops / raw bytes
    p8 = dataclasses.replace(p, act_compress="int8")
    assert [o.name for o in walk_order(p8)] == ["cheap", "dense", "free"]  # flops / compressed bytes
    # quantizing and dequantizing 10 bytes costs 10 + 10 s = 20 FLOPs at 1 FLOP/s: net 20 and 80
    priced = dataclasses.replace(p8, hardware=dataclasses.replace(hw, act_quant_bps=1.0))
    assert [o.name for o in walk_order(priced)] == ["dense", "cheap", "free"]


GRID = [(hw, model, batch) for hw in (PAPER_256, "rtx4090,1xP5510,256GB", "h100,4xP5510,512GB",
                                      "a100-80g,6xP5510,768GB", "rtx3090,2x980pro,64GB")
        for model in ("6b", "13b", "30b", "175b") for batch in (1, 8, 32)]


def _plans(hw: Hardware, model: str, batch: int) -> tuple[Plan, Plan]:
    p = analytic_profile(get_model_config(model), batch, 1024, hw)
    return algorithm1(p), algorithm1(dataclasses.replace(p, act_compress="int8"))


def test_with_quantization_free_int8_swaps_at_least_as_much_as_uncompressed() -> None:
    """Smaller records make every swap cheaper on the links and the SSDs: under the same budgets the plan moves at
    least the raw bytes it moved before, and strictly more somewhere."""
    more = 0
    for desc, model, batch in GRID:
        hw = dataclasses.replace(parse_hardware(desc), act_quant_bps=0.0, act_dequant_bps=0.0)
        plain, packed = _plans(hw, model, batch)
        assert packed.estimate.a_g2m_raw >= plain.estimate.a_g2m_raw, (desc, model, batch)
        assert packed.estimate.t_iter <= plain.estimate.t_iter * (1 + 1e-12), (desc, model, batch)
        more += packed.estimate.a_g2m_raw > plain.estimate.a_g2m_raw
    assert more >= len(GRID) // 3


def test_priced_quantization_swaps_more_where_the_links_bind_and_less_where_the_gpu_does() -> None:
    # an H100 box: PCIe and SSDs bind, so Algorithm 1 swaps only the block inputs (case 1); int8 halves the bytes
    # moved, and swapping the MLP's down projection now pays (case 3)
    plain, packed = _plans(parse_hardware("h100,4xP5510,512GB"), "30b", 8)
    assert (plain.case, plain.swap, packed.case, packed.swap) == (1, (), 3, ("fc_proj",))
    # about the bytes the block inputs took alone now carry them and the down projection's outputs
    assert packed.estimate.a_g2m_raw > 1.9 * plain.estimate.a_g2m_raw
    assert packed.estimate.a_g2m < 1.01 * plain.estimate.a_g2m
    # the paper's box at batch 32: the GPU binds, and quantizing the QKV projection's output (few FLOPs per byte)
    # takes longer than recomputing it: int8 swaps less, and the step is slower than uncompressed
    plain, packed = _plans(parse_hardware(PAPER_256), "30b", 32)
    assert "attn" in plain.swap and "attn" not in packed.swap
    assert packed.estimate.t_iter > plain.estimate.t_iter and packed.estimate.bottleneck_b == "gpu"


def test_described_gpus_price_the_quantization_from_their_memory_bandwidth() -> None:
    gpus = {k: v for k, v in HARDWARE_PRESETS.items() if isinstance(v, GpuSpec)}
    assert all(g.mem_bw > 0 and "memory" in g.source for g in gpus.values())
    hw = parse_hardware(PAPER_256)
    assert hw.act_quant_bps == gpus["rtx4090"].mem_bw / QUANT_TRAFFIC[0]
    assert hw.act_dequant_bps == gpus["rtx4090"].mem_bw / QUANT_TRAFFIC[1]
    assert "int8 activations" in hw.describe()


def test_capacity_plans_main_memory_and_ssds_with_compressed_records() -> None:
    """175B at batch 4 on the paper's box with 56 GB: the same plan's records overflow main memory to the SSDs
    uncompressed, and fit it int8. (64 GB before the memory plan stopped counting the stashed gradients and the
    tied embedding's gradient twice: with 8 GB more room at 64 GB, int8 now swaps a second op.)"""
    cfg, hw = get_model_config("175b"), parse_hardware("rtx4090,12xP5510,56GB")
    plain, packed = (capacity(cfg, hw, 4, 1024, act_compress=c) for c in ("none", "int8"))
    assert plain.plan.swap == packed.plan.swap == ("fc_proj",)
    assert packed.plan.block_bytes < plain.plan.block_bytes / 1.9
    assert plain.plan.ssd_bytes > 6e9 and packed.plan.ssd_bytes == 0
    assert plain.ssd_act_bytes > 6e9 and packed.ssd_act_bytes == 0
    assert packed.cpu_parts["activations"] < plain.cpu_parts["activations"]


def test_analytic_int8_bytes_and_validation() -> None:
    cfg = get_model_config("13b", n_layer=3)
    n, d = 2 * 128, cfg.d_model
    p = analytic_profile(cfg, 2, 128, parse_hardware(PAPER_256))
    ops = {o.name: o for o in p.ops}
    assert ops["fc"].bytes_int8 == n * cfg.mlp_hidden + 4 * n and ops["fc"].bytes == 2 * n * cfg.mlp_hidden
    assert ops["ln1"].bytes_int8 == n * d + 4 * n + 8 * n  # mean and rstd stay fp32
    assert p.input_bytes_int8 == n * d + 4 * n and p.act_compress == "none"
    with pytest.raises(ValueError, match="act_compress"):
        dataclasses.replace(p, act_compress="int4")
    with pytest.raises(ValueError, match="act_quant_bps"):
        dataclasses.replace(p.hardware, act_quant_bps=-1.0)


def test_profiles_round_trip_and_old_ones_load(tmp_path) -> None:
    p = dataclasses.replace(analytic_profile(get_model_config("6b", n_layer=2), 1, 256, parse_hardware(PAPER_256)),
                            act_compress="int8")
    p.save(tmp_path / "p.json")
    assert Profile.load(tmp_path / "p.json") == p
    old = json.loads((tmp_path / "p.json").read_text())
    for key in ("input_bytes_int8", "act_compress"):
        del old[key]
    for op in old["ops"]:
        del op["bytes_int8"]
    for key in ("act_quant_bps", "act_dequant_bps"):
        del old["hardware"][key]
    loaded = Profile.from_dict(old)  # saved before compression existed: records priced as they are
    assert loaded.act_compress == "none" and estimate(loaded, ["fc"]).a_g2m == estimate(p, ["fc"]).a_g2m_raw
    plan = algorithm1(p)
    assert Plan.from_dict(json.loads(json.dumps(plan.to_dict()))) == plan
