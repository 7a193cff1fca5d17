"""`python -m lohan.capacity`: the paper's headline capacity statement, from the command line."""

from __future__ import annotations

import pytest

from lohan.capacity import main, report


def test_175b_with_256gb(capsys):
    """The paper's headline machine, but for the GPU: 256 GB of RAM hold 175B with LoHan and not with
    activations in main memory. A 4090 (24 GiB) holds the engine's working set of a 175B block (planner.gpu_need)
    only at prefetch depth 1 and batch 1, so the fit is shown on an H100 and the 4090's refusal at the default
    depth names the GPU."""
    assert main(["--model", "175b", "--hardware", "h100,12xP5510,256GB", "--seq", "1024"]) == 0
    out = capsys.readouterr().out
    ours, _, zero = out.partition("activations in main memory (ZeRO-Infinity style)")
    assert "=> fits" in ours and "largest batch for 175b at seq 1024:" in ours
    assert "=> does NOT fit" in zero and "main memory: needs" in zero
    assert main(["--model", "175b", "--hardware", "rtx4090,12xP5510,256GB", "--no-compare"]) == 0
    out = capsys.readouterr().out
    assert "=> does NOT fit" in out and "GPU memory: needs" in out and "block gradients" in out


def test_too_small_machine_says_why():
    text = report("412b", "rtx4080,1xP5510,16GB", seq=1024, compare=False)
    assert "does NOT fit" in text
    assert "does not fit at any batch size" in text


def test_bad_hardware_is_a_usage_error(capsys):
    with pytest.raises(SystemExit) as e:
        main(["--hardware", "gtx9999,1xP5510,64GB"])
    assert e.value.code == 2
    assert "gtx9999" in capsys.readouterr().err


def test_a_hugging_face_folder_with_only_its_config_is_planned(tmp_path, capsys):
    """Llama-2-7B's config.json alone (no weights, no tokenizer): planned as the run's own plan does."""
    import json

    from lohan.capacity import model_config

    folder = tmp_path / "llama-2-7b"
    folder.mkdir()
    (folder / "config.json").write_text(json.dumps({
        "architectures": ["LlamaForCausalLM"], "model_type": "llama", "hidden_size": 4096, "intermediate_size": 11008,
        "num_attention_heads": 32, "num_key_value_heads": 32, "num_hidden_layers": 32, "vocab_size": 32000,
        "max_position_embeddings": 4096, "rms_norm_eps": 1e-5, "tie_word_embeddings": False,
        "torch_dtype": "float16"}))
    cfg = model_config(str(folder))
    assert (cfg.name, cfg.n_layer, cfg.d_model, cfg.vocab_size) == ("llama-2-7b", 32, 4096, 32000)
    assert abs(cfg.param_count() - 6.74e9) / 6.74e9 < 0.05  # Llama-2-7B has 6.74B parameters
    assert main(["--model", str(folder), "--hardware", "h100,4xP5510,128GB", "--no-compare"]) == 0
    out = capsys.readouterr().out
    assert "llama-2-7b, batch 1 x seq 1024 on h100,4xP5510,128GB" in out and "=> fits" in out
    assert "largest batch for llama-2-7b at seq 1024:" in out
    (tmp_path / "empty").mkdir()
    with pytest.raises(SystemExit) as e:
        main(["--model", str(tmp_path / "empty")])
    assert e.value.code == 2
    assert "is a folder without config.json" in capsys.readouterr().err


def test_the_report_gives_the_ssd_need_of_each_state_format():
    from lohan.config import get_model_config
    from lohan.plan.formats import FORMATS, state_format
    from lohan.plan.planner import capacity, parse_hardware

    text = report("175b", "rtx4090,12xP5510,256GB", compare=False)
    rows = [line.split() for line in text.split("SSD need per state format")[1].splitlines()[3:7]]
    assert [r[0] for r in rows] == list(FORMATS)
    states = [float(r[2]) for r in rows]
    assert states == sorted(states, reverse=True)
    cfg, hw = get_model_config("175b"), parse_hardware("rtx4090,12xP5510,256GB")
    exact = capacity(cfg, hw, 1, 1024).ssd_states_bytes
    assert states[0] == round(exact / 1e9, 1)
    assert states[-1] == pytest.approx(states[0] * state_format("bf16-master").at_rest() / 14, rel=1e-3)
    moved = [float(r[4]) for r in rows]
    assert moved == sorted(moved, reverse=True)  # fewer bytes at rest, fewer bytes moved per step


def test_lora_is_priced_on_the_models_own_projections(capsys):
    """--lora R: the plan of a LoRA run (the base read-only: SSD reads, memory, predicted step); the adapters priced
    on the model's own projections: Llama-3.1-70B's k and v are 8192 -> 1024 (grouped-query attention), so rank 16
    over every projection is PEFT's 207,093,760 parameters, not the 4 d x d attention of a GPT block."""
    from pathlib import Path

    folder = str(Path(__file__).resolve().parents[3] / "configs" / "hf" / "llama-3.1-70b")
    assert main(["--model", folder, "--hardware", "rtx4090,1xP5510,64GB", "--lora", "16"]) == 0
    out = capsys.readouterr().out
    assert "LoRA rank 16: 207.09M adapter parameters" in out
    assert "predicted step" in out and "SSD reads" in out and "B/param" in out and "parameter pool" in out
    assert main(["--model", folder, "--hardware", "rtx4090,1xP5510,64GB", "--lora", "16",
                 "--lora-targets", "q_proj,v_proj"]) == 0
    assert f"{80 * 16 * (2 * 8192 + 8192 + 1024) / 1e6:,.2f}M adapter parameters" in capsys.readouterr().out
    with pytest.raises(SystemExit) as e:
        main(["--model", folder, "--lora", "16", "--lora-targets", "nope"])
    assert e.value.code == 2 and "matches no linear projection" in capsys.readouterr().err


def test_lora_on_a_preset_prices_its_own_adapters():
    """A preset's adapters are those of its GPT blocks (q, k, v fused), counted exactly."""
    from lohan.capacity import lora_report
    from lohan.config import get_model_config
    from lohan.models.gpt import build_model
    from lohan.models.lora import LoraAdapters

    real = LoraAdapters(build_model(get_model_config("350m"), device="meta").block_modules(), 8, 16.0).numel
    assert f"LoRA rank 8: {real / 1e6:,.2f}M adapter parameters" in lora_report("350m", "rtx4090,1xP5510,64GB", 8)
