"""``compute_dtype: auto`` (the default): which dtype each machine gets and why (lohan/plan/compute_dtype.py), the
run header and the dry run saying so, bf16-master keeping bf16, and stores and configs with an explicit dtype."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

import lohan
from lohan.app import fit, preflight
from lohan.app.cli import main
from lohan.capacity import main as capacity_main
from lohan.config import EngineConfig, get_model_config
from lohan.plan.compute_dtype import SLOW_BF16, choose
from lohan.runtime import device as device_mod

AVX2 = frozenset({"sse4_2", "avx", "avx2", "fma", "avx512f"})  # AVX-512 without its bf16 extension: still slow
AMX = AVX2 | {"amx_tile", "amx_bf16"}
AVX512_BF16 = AVX2 | {"avx512_bf16"}


# ------------------------------------------------------------------------------------------------ the choice
@pytest.mark.parametrize("device", ["cpu", "sim"])  # the simulated device computes on the CPU
def test_auto_on_a_cpu_without_native_bf16_is_fp32_and_says_why(device):
    c = choose("auto", device, AVX2)
    assert c.dtype == "fp32"
    assert c.describe() == (f"compute fp32 (auto: this CPU has no native bf16 (AMX or AVX-512 bf16): {SLOW_BF16}; "
                            "--compute-dtype bf16 forces it)")


@pytest.mark.parametrize("flags,native", [(AMX, "AMX bf16"), (AVX512_BF16, "AVX-512 bf16"),
                                          (AMX | AVX512_BF16, "AMX bf16 and AVX-512 bf16")])
def test_auto_on_a_cpu_with_native_bf16_is_bf16(flags, native):
    assert choose("auto", "cpu", flags).describe() == f"compute bf16 (auto: this CPU has {native})"


def test_auto_on_cuda_is_bf16_whatever_the_cpu_and_fp32_on_a_gpu_without_bf16():
    assert choose("auto", "cuda", AVX2).describe() == "compute bf16 (auto: the GPU computes bf16)"
    old = choose("auto", "cuda", AMX, gpu_bf16=False)
    assert old.dtype == "fp32" and "compute capability below 8.0" in old.reason and "fp16" in old.reason


def test_an_explicit_dtype_is_kept_and_bf16_on_a_slow_cpu_says_what_it_costs():
    for dtype in ("bf16", "fp16", "fp32"):
        assert choose(dtype, "cuda", ()).dtype == choose(dtype, "cpu", AMX).dtype == dtype
    assert choose("fp32", "cpu", AMX).reason == "as set"
    slow = choose("bf16", "cpu", AVX2)
    assert slow.dtype == "bf16" and SLOW_BF16 in slow.reason and "--compute-dtype auto picks fp32 here" in slow.reason
    with pytest.raises(ValueError, match=r"compute_dtype='bf8': choose one of auto, bf16, fp16, fp32"):
        choose("bf8", "cpu", AMX)


def test_bf16_master_keeps_bf16_under_auto_and_says_what_it_costs_on_a_slow_cpu():
    assert EngineConfig(state_format="bf16-master").compute_dtype == "auto"  # valid: auto picks bf16 for it
    slow = choose("auto", "cpu", AVX2, state_format="bf16-master")
    assert slow.dtype == "bf16" and SLOW_BF16 in slow.reason and "bf16-master" in slow.reason
    assert "the other state formats compute in fp32 here" in slow.reason
    fast = choose("auto", "cpu", AMX, state_format="bf16-master")
    assert fast.dtype == "bf16" and SLOW_BF16 not in fast.reason
    with pytest.raises(ValueError, match=r"needs compute_dtype bf16, not fp32 \(--compute-dtype bf16\)"):
        EngineConfig(state_format="bf16-master", compute_dtype="fp32")


def test_a_resume_under_auto_keeps_the_stored_dtype_and_says_what_auto_would_pick():
    kept = choose("auto", "cpu", AMX, stored="fp32")
    assert kept.dtype == "fp32"
    assert kept.reason == "auto: the store was created with fp32, which a resume keeps; a new run here would pick bf16"
    slow = choose("auto", "cpu", AVX2, stored="bf16")
    assert slow.dtype == "bf16" and "a new run here would pick fp32" in slow.reason and SLOW_BF16 in slow.reason
    assert choose("auto", "cpu", AMX, stored="bf16") == choose("auto", "cpu", AMX)  # the same: nothing to say
    assert choose("fp32", "cpu", AMX, stored="bf16").dtype == "fp32"  # explicit: the store's opening refuses it


def test_cpu_flags_are_read_from_cpuinfo(tmp_path: Path):
    info = tmp_path / "cpuinfo"
    info.write_text("processor\t: 0\nflags\t\t: fpu sse avx2 amx_bf16 avx512_bf16\n\nprocessor\t: 1\n")
    assert device_mod.cpu_flags(str(info)) == {"fpu", "sse", "avx2", "amx_bf16", "avx512_bf16"}
    arm = tmp_path / "arm"
    arm.write_text("processor\t: 0\nFeatures\t: fp asimd bf16\n")
    assert device_mod.cpu_flags(str(arm)) == {"fp", "asimd", "bf16"}


def test_the_config_default_is_auto():
    assert EngineConfig().compute_dtype == "auto"


# ------------------------------------------------------------------------------------ the run, the dry run
def args(tmp_path: Path, *extra: str) -> list[str]:
    return ["--nvme", str(tmp_path / "nvme"), "--metrics", str(tmp_path / "m.jsonl"), "--model", "tiny",
            "--batch-size", "2", "--seq-len", "32", "--set", "model_overrides.n_layer=2", "--backend", "threads",
            *extra]


@pytest.fixture
def flags(monkeypatch):
    """flags(set): this CPU reports those feature flags (lohan.runtime.device.cpu_flags)."""
    def use(these: frozenset[str]) -> None:
        monkeypatch.setattr(device_mod, "cpu_flags", lambda cpuinfo="/proc/cpuinfo": these)
    return use


def test_the_header_says_fp32_and_why_on_an_avx2_cpu(tmp_path, capsys, flags):
    flags(AVX2)
    assert main(args(tmp_path, "--steps", "1")) == 0
    out = capsys.readouterr().out
    assert "device cpu, fp32, mode" in out, out
    assert "  compute fp32 (auto: this CPU has no native bf16 (AMX or AVX-512 bf16): bf16 would run ~10x slower" in out


def test_the_dry_run_prices_the_resolved_dtype(tmp_path, capsys, flags, monkeypatch):
    seen = []

    def detect(nvme, device="auto", compute_dtype="bf16", *a, **kw):
        seen.append(compute_dtype)
        return real(nvme, device, compute_dtype, *a, **kw)

    real = preflight.detect_hardware
    monkeypatch.setattr(preflight, "detect_hardware", detect)
    for these, dtype, why in ((AVX2, "fp32", "this CPU has no native bf16"), (AMX, "bf16", "this CPU has AMX bf16")):
        flags(these)
        assert main(args(tmp_path, "--dry-run")) == 0
        out = capsys.readouterr().out
        assert seen[-1] == dtype and f"compute {dtype} (auto: {why}" in out, out
    # a described machine computes on its GPU: bf16, whatever this CPU has
    assert main(args(tmp_path, "--dry-run", "--hardware", "rtx4090,1xP5510,64GB")) == 0
    assert "compute bf16 (auto: the GPU computes bf16)" in capsys.readouterr().out
    assert not (tmp_path / "nvme").exists()


def test_bf16_master_under_auto_runs_bf16_and_the_dry_run_says_what_it_costs(tmp_path, capsys, flags):
    flags(AVX2)
    assert main(args(tmp_path, "--dry-run", "--state-format", "bf16-master")) == 0
    out = capsys.readouterr().out
    assert "compute bf16 (auto: state format bf16-master computes on its bf16 master; this CPU has no native " \
           f"bf16 (AMX or AVX-512 bf16): {SLOW_BF16}" in out, out


def test_the_cpu_matmul_rate_is_measured_in_the_compute_dtype(tmp_path, monkeypatch):
    seen = []
    monkeypatch.setattr(fit, "_matmul_flops", lambda device, dtype, *a, **kw: seen.append(dtype) or 1e12)
    fit.detect_hardware((str(tmp_path),), "cpu", "bf16")
    fit.detect_hardware((str(tmp_path),), "cpu", "fp32")
    assert seen == [torch.bfloat16, torch.float32]


def test_the_capacity_cli_prices_auto_as_the_described_gpu_does(capsys):
    assert capacity_main(["--model", "1b", "--no-compare"]) == 0
    assert capsys.readouterr().out.startswith("compute bf16 (auto: the GPU computes bf16)\n")


# ------------------------------------------------------------------------- explicit dtypes: stores and configs
def test_a_store_made_with_an_explicit_dtype_resumes_under_auto_on_another_cpu(tmp_path, capsys, flags):
    flags(AVX2)
    assert main(args(tmp_path, "--steps", "1", "--compute-dtype", "fp32")) == 0
    flags(AMX)  # auto picks bf16 here, but the store's P16 copy is fp32
    assert main(args(tmp_path, "--steps", "2", "--resume")) == 0
    out = capsys.readouterr().out
    assert "compute fp32 (auto: the store was created with fp32, which a resume keeps; a new run here would pick " \
           "bf16)" in out, out
    # an explicit dtype other than the store's: refused, naming both and the flags that resume it
    assert main(args(tmp_path, "--steps", "3", "--resume", "--compute-dtype", "bf16")) == 2
    out = capsys.readouterr().out
    assert "was created with compute_dtype fp32 and this run asks for bf16" in out, out
    assert "Resume with --compute-dtype fp32, or auto" in out, out


def test_a_config_with_an_explicit_dtype_keeps_it(tmp_path, capsys, flags):
    config = tmp_path / "old.yaml"
    config.write_text("model: tiny\nsteps: 1\nengine:\n  compute_dtype: bf16\n")
    flags(AVX2)
    assert main(["--config", str(config), *args(tmp_path, "--dry-run")]) == 0
    out = capsys.readouterr().out
    assert "compute bf16 (as set; this CPU has no native bf16" in out, out


def test_the_api_resolves_auto_too(tmp_path, flags):
    flags(AVX2)
    engine = lohan.init(get_model_config("tiny", n_layer=2, seq_len=32), {"nvme": [str(tmp_path)], "cpu_mem": "1GiB",
                                                                         "backend": "threads"})
    try:
        assert engine.cfg.compute_dtype == "fp32" and engine.compute_dtype == torch.float32
        assert engine.dtype_choice.reason.startswith("auto: this CPU has no native bf16")
    finally:
        engine.close()
