"""finetune.py as users meet it: plans and refusals, export, interruption and resume, jsonl data."""

from __future__ import annotations

import json

import pytest
import torch

from lohan.app.cli import main
from tests.integration.test_cli import args, losses


def test_175b_is_refused_with_the_missing_resources_and_nothing_written(tmp_path, capsys):
    nvme = tmp_path / "nvme"
    assert main(["--model", "175b", "--nvme", str(nvme), "--data", "synthetic", "--batch-size", "1"]) == 2
    out = capsys.readouterr().out
    assert "175b does not fit this machine" in out and "Nothing was written" in out
    assert "SSD: needs" in out and "the SSDs hold" in out  # 4.9 TB of states vs this disk
    assert "policy plan" in out and "predicted step" in out  # the plan is shown, not a traceback
    assert not nvme.exists()


def test_dry_run_plans_175b_for_the_papers_box(tmp_path, capsys):
    """The paper's box with an H100 for its 4090: a 175B block's GPU working set (planner.gpu_need) is more
    than 24 GiB, and the dry run of the paper's own box says so."""
    nvme = tmp_path / "nvme"
    assert main(["--model", "175b", "--nvme", str(nvme), "--data", "synthetic", "--batch-size", "1",
                 "--seq-len", "1024", "--dry-run", "--hardware", "rtx4090,12xP5510,256GB"]) == 0
    assert "GPU memory: needs" in capsys.readouterr().out
    # (tiny.yaml's cpu_mem, 2 GiB, cannot hold 175B's pools: the engine would refuse it, and so does the plan)
    assert main(["--model", "175b", "--nvme", str(nvme), "--data", "synthetic", "--batch-size", "1",
                 "--seq-len", "1024", "--dry-run", "--hardware", "h100,12xP5510,256GB", "--cpu-mem", "200GiB"]) == 0
    out = capsys.readouterr().out
    assert "=> fits" in out and "predicted step" in out and "TFLOPS" in out and "nothing was written" in out
    assert "gpu" in out and "cpu" in out and "ssd" in out
    assert not nvme.exists()
    assert main(["--model", "175b", "--hardware", "rtx4090,12xP5510,256GB"]) == 2  # --hardware needs --dry-run
    assert "use it with --dry-run" in capsys.readouterr().err


def test_layers_slices_a_preset_shape(tmp_path, capsys):
    assert main(["--model", "125m", "--layers", "1", "--nvme", str(tmp_path / "nvme"), "--data", "synthetic",
                 "--batch-size", "1", "--seq-len", "32", "--dry-run"]) == 0
    out = capsys.readouterr().out
    assert "125m, batch 1 x seq 32" in out


def interrupt_at(monkeypatch, call: int) -> None:
    """Ctrl-C in the middle of a step: during backward, when the optimizer pipeline gets its `call`-th block."""
    from lohan.runtime import offload
    original = offload.GradOffloader.submit
    count = {"n": 0}

    def submit(self, *a, **k):
        count["n"] += 1
        if count["n"] == call:
            raise KeyboardInterrupt
        return original(self, *a, **k)

    monkeypatch.setattr(offload.GradOffloader, "submit", submit)


@pytest.mark.parametrize("data", ["corpus", "jsonl", "parquet"])
def test_interrupt_then_resume_equals_an_uninterrupted_run(tmp_path, monkeypatch, capsys, data):
    rows = [{"prompt": f"Q{i}: what is {i} + {i}? ", "response": f"A: {2 * i}."} for i in range(300)]
    if data == "jsonl":
        path = tmp_path / "sft.jsonl"
        path.write_text("\n".join(json.dumps(r) for r in rows))
        extra = ["--data", str(path)]
    elif data == "parquet":  # through the token cache: the resumed run maps the stream the first run tokenized
        import pyarrow as pa
        import pyarrow.parquet as pq

        path = tmp_path / "sft.parquet"
        pq.write_table(pa.Table.from_pylist(rows), path)
        extra = ["--data", str(path), "--data-format", "prompt-response"]
    else:
        extra = []
    a, b = tmp_path / "a", tmp_path / "b"
    assert main(args(a, "--steps", "5", *extra)) == 0
    interrupt_at(monkeypatch, 3 * 4 + 2)  # 4 blocks per step: step 4, mid-backward
    assert main(args(b, "--steps", "5", *extra)) == 130
    monkeypatch.undo()
    assert len(losses(b / "m.jsonl")) == 3
    state = json.loads((b / "nvme" / "lohan.run.json").read_text())
    assert state["step"] == 3
    capsys.readouterr()
    assert main(args(b, "--steps", "5", "--resume", *extra)) == 0
    assert losses(b / "m.jsonl") == losses(a / "m.jsonl")
    if data != "corpus":
        assert "token cache reused" in capsys.readouterr().out


def test_resume_with_other_settings_is_refused(tmp_path, capsys):
    assert main(args(tmp_path, "--steps", "2")) == 0
    assert main(args(tmp_path, "--steps", "3", "--resume", "--batch-size", "4")) == 2
    assert "other settings" in capsys.readouterr().out
    assert main(args(tmp_path, "--steps", "3", "--resume", "--data-format", "text")) == 2  # how records are read
    assert "'data_format': (None, 'text')" in capsys.readouterr().out


def test_epochs_metrics_and_plot(tmp_path):
    text = tmp_path / "small.txt"
    text.write_text("the quick brown fox jumps over the lazy dog. " * 40)  # 1800 bytes: 54 windows of 33
    assert main(args(tmp_path, "--data", str(text), "--epochs", "2", "--batch-size", "9")) == 0
    records = [json.loads(line) for line in (tmp_path / "m.jsonl").read_text().splitlines()]
    assert len(records) == 2 * (1800 // 33 // 9)
    assert (tmp_path / "m.png").stat().st_size > 1000


def test_export_preset_loads_in_transformers_with_identical_logits(tmp_path, capsys):
    transformers = pytest.importorskip("transformers")
    from lohan.config import EngineConfig, get_model_config
    from lohan.models.gpt import build_model
    from lohan.runtime.engine import init
    from tests.integration.test_engine_equivalence import ref_name

    out = tmp_path / "hf"
    assert main(args(tmp_path, "--steps", "2", "--compute-dtype", "fp32", "--export", str(out))) == 0
    hf = transformers.AutoModelForCausalLM.from_pretrained(out).eval()
    mcfg = get_model_config("tiny", vocab_size=256, seq_len=256, n_layer=2)
    cfg = EngineConfig(nvme=(str(tmp_path / "nvme"),), backend="threads", compute_dtype="fp32")
    with init(mcfg, cfg, resume=True) as engine:
        assert engine.step_count == 2
        weights = {ref_name(k): v for k, v in engine.state_dict_fp32().items()}
    ours = build_model(mcfg, device="cpu")
    ours.load_state_dict(weights)
    ids = torch.randint(0, 256, (2, 32), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        want, got = ours(ids), hf(ids).logits
    assert torch.allclose(got, want, atol=1e-5, rtol=0), (got - want).abs().max()

    foreign = tmp_path / "foreign"
    foreign.mkdir()
    (foreign / "notes.txt").write_text("keep me")
    assert main(args(tmp_path, "--steps", "3", "--resume", "--compute-dtype", "fp32", "--export", str(foreign))) == 2
    assert "holds what lohan cannot prove it wrote: notes.txt" in capsys.readouterr().out
    assert (foreign / "notes.txt").read_text() == "keep me"


def test_hf_directory_finetune_on_jsonl_then_export_and_reload(tmp_path, capsys):
    """The user flow: a local Hugging Face directory, prompt/response data, --export, from_pretrained."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from lohan import init_from_hf
    from tests.unit.models.test_hf import engine_hf_state, make_hf_dir, reference_model

    model_dir = make_hf_dir(tmp_path / "llama", "llama")
    data = tmp_path / "sft.jsonl"
    words = [f"w{i}" for i in range(3, 40)]
    data.write_text("\n".join(json.dumps({"prompt": " ".join(words[i % 30:i % 30 + 5]),
                                          "response": " ".join(words[(i + 7) % 30:(i + 7) % 30 + 3])})
                              for i in range(120)))
    out = tmp_path / "export"
    argv = ["--model", model_dir, "--data", str(data), "--nvme", str(tmp_path / "nvme"), "--metrics",
            str(tmp_path / "m.jsonl"), "--batch-size", "4", "--seq-len", "16", "--steps", "4", "--lr", "1e-2",
            "--compute-dtype", "fp32", "--backend", "threads", "--export", str(out)]
    assert main(argv) == 0
    text = capsys.readouterr().out
    assert "lohan llama" in text and "exported the step-4 weights" in text
    assert len(losses(tmp_path / "m.jsonl")) == 4

    from lohan.config import EngineConfig

    cfg = EngineConfig(nvme=(str(tmp_path / "nvme"),), compute_dtype="fp32", backend="threads")
    with init_from_hf(model_dir, cfg, resume=True) as engine:
        state = engine_hf_state(engine, engine.program)
    trained = reference_model(model_dir)
    trained.load_state_dict(state, strict=False)
    loaded = AutoModelForCausalLM.from_pretrained(out).eval()
    ids = torch.randint(0, 150, (2, 12), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        assert torch.equal(loaded(input_ids=ids).logits, trained(input_ids=ids).logits)
        assert not torch.equal(loaded(input_ids=ids).logits, reference_model(model_dir)(input_ids=ids).logits)
    assert AutoTokenizer.from_pretrained(out)("w3 w4")["input_ids"] == [3, 4]


def test_cpu_only_plan_counts_the_device_working_set_in_main_memory():
    """With the CPU as the device, activations, gradients and the process share RAM with the pools."""
    from lohan.app.fit import Machine, fit_report
    from lohan.config import get_model_config
    from lohan.plan.planner import parse_hardware

    hw = parse_hardware("h100,1xP5510,18GB")  # a 24 GiB card does not hold a 175b layer's GPU working set
    mcfg = get_model_config("175b").with_overrides(n_layer=1)
    gpu = fit_report(mcfg, Machine(hw, ()), 1, 64)
    host = fit_report(mcfg, Machine(hw, (), device_is_host=True), 1, 64)
    assert host.capacity.cpu_bytes > gpu.capacity.cpu_bytes + 3e9  # + a 175b layer's bf16 gradients
    assert "device block gradients" in host.capacity.cpu_parts and host.capacity.gpu_bytes == 0
    assert gpu.fits and not host.fits
    assert any("the device is the CPU" in r for r in host.capacity.reasons)


def test_a_store_that_fills_its_disk_resumes(tmp_path, monkeypatch, capsys):
    """The pre-flight counts the store already on the disk as the run's: with no byte free beside it, the store
    is resumed (and overwritten), where a new run is refused; a fresh run also needs room for the speed probe."""
    import shutil
    from types import SimpleNamespace

    import lohan.app.fit as fit

    assert main(args(tmp_path, "--steps", "2")) == 0
    held = fit.store_bytes((str(tmp_path / "nvme"),), "lohan")
    assert held > 0
    # the pre-flight sees a full disk (io_engine's own check, when a volume is created, sees the real one: an
    # overwrite removes the old store first)
    monkeypatch.setattr(fit, "shutil", SimpleNamespace(disk_usage=lambda p: shutil.disk_usage(p)._replace(free=0)))
    assert main(args(tmp_path, "--steps", "3", "--resume")) == 0
    assert main(args(tmp_path, "--steps", "1", "--overwrite")) == 0
    capsys.readouterr()
    assert main(args(tmp_path / "other", "--steps", "1")) == 2
    assert "SSD" in capsys.readouterr().out


def test_a_resume_with_another_lr_says_so(tmp_path, capsys):
    assert main(args(tmp_path, "--steps", "2")) == 0
    capsys.readouterr()
    assert main(args(tmp_path, "--steps", "3", "--resume", "--lr", "1e-4")) == 0
    out = capsys.readouterr().out
    assert "the optimizer's settings differ from the run being resumed (lr 0.002 -> 0.0001)" in out
    assert main(args(tmp_path, "--steps", "4", "--resume", "--lr", "1e-4")) == 0
    assert "differ from the run being resumed" not in capsys.readouterr().out


def test_an_absurd_lr_is_warned_about(tmp_path, capsys):
    assert main(args(tmp_path, "--steps", "1", "--lr", "1e6")) == 0
    assert "warning: lr 1e+06 is far above what AdamW training uses" in capsys.readouterr().out


def test_store_creation_reports_progress_in_a_log_file(tmp_path, capsys):
    """Output that is not a terminal gets plain progress lines while the store is created (the bar is only drawn
    on a terminal): a long creation is not silent in a log file."""
    assert main(args(tmp_path, "--steps", "1")) == 0
    lines = [ln for ln in capsys.readouterr().out.splitlines() if ln.startswith("initializing states on NVMe")]
    assert lines and lines[-1].startswith("initializing states on NVMe: 4 of 4 blocks"), lines
    assert "GiB) in" in lines[-1]


@pytest.mark.parametrize("extra", [(), ("--lora", "4"), ("--state-format", "8bit-moments")])
def test_store_creations_progress_counts_what_it_writes(tmp_path, monkeypatch, extra):
    """The progress line's total is one slot of the run's state format (a LoRA run: its frozen base, 2 bytes a
    parameter in bf16), not a full fine-tuning record: a 13b LoRA said 167 GiB for a 26 GB store."""
    from lohan.app import train

    totals = []
    real = train._InitLog.__init__
    monkeypatch.setattr(train._InitLog, "__init__",
                        lambda self, console, state_bytes, every=5.0: (totals.append(state_bytes),
                                                                       real(self, console, state_bytes, every))[1])
    assert main(args(tmp_path, "--steps", "1", "--compute-dtype", "bf16", *extra)) == 0
    slab = sum(p.stat().st_size for p in (tmp_path / "nvme").glob("*.slab"))
    slots = 1 if extra[:1] == ("--lora",) else 2
    # (the tiny model's blocks are a few KiB, so the slab's 4 KiB alignment pads them by up to a third)
    assert totals and 0.6 < totals[0] * slots / slab < 1.1, (totals, slab)


def test_a_full_disk_during_training_says_so_and_what_stands(tmp_path, monkeypatch, capsys):
    import errno

    import lohan.runtime.engine

    assert main(args(tmp_path, "--steps", "2")) == 0
    real = lohan.runtime.engine.Engine.step

    def step(self, *a, **kw):
        if self.step_count >= 3:
            raise OSError(errno.ENOSPC, "No space left on device")
        return real(self, *a, **kw)

    monkeypatch.setattr(lohan.runtime.engine.Engine, "step", step)
    capsys.readouterr()
    assert main(args(tmp_path, "--steps", "5", "--resume")) == 2
    out = capsys.readouterr().out
    assert "the disk is full" in out and "is intact. Fix the cause, then continue with --resume" in out
