"""Every tested Hugging Face decoder family through the engine, real model shapes without weights,
`--layers N` on HF directories, and the export's dtype and shards.

Each family is a tiny random model saved by transformers (2 layers, hidden 32, every weight perturbed);
sequences (16-20 tokens) are longer than the sliding windows (8), so sliding-window masks are exercised.
References are the HF models loaded with `from_pretrained` (tests/unit/models/test_hf.py's `reference_run`).
"""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest
import torch

from lohan.app.cli import main
from lohan.models import hf
from lohan.runtime.hf_engine import init_from_hf

transformers = pytest.importorskip("transformers")
import transformers as tf  # noqa: E402
from transformers import AutoModelForCausalLM  # noqa: E402

from tests.unit.models.test_hf import (  # noqa: E402
    VOCAB,
    batches,
    engine_config,
    engine_hf_state,
    materialize,
    reference_model,
    reference_run,
    save_tokenizer,
)

REPO = Path(__file__).resolve().parents[2]
_COMMON = dict(vocab_size=VOCAB, hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
               num_key_value_heads=2, max_position_embeddings=64, bos_token_id=1, eos_token_id=2, pad_token_id=0)
_LLAMA3_ROPE = dict(rope_type="llama3", rope_theta=500000.0, factor=8.0, low_freq_factor=1.0, high_freq_factor=4.0,
                    original_max_position_embeddings=16)


def family_config(family: str):
    """A tiny config of each tested family, with the feature that family is known for."""
    if family == "llama":  # Llama 3.x: GQA, llama3 rope scaling, tied (3.2-style)
        return tf.LlamaConfig(**_COMMON, tie_word_embeddings=True, rope_parameters=_LLAMA3_ROPE)
    if family == "mistral":  # sliding window shorter than the sequence
        return tf.MistralConfig(**_COMMON, sliding_window=8, tie_word_embeddings=False)
    if family == "qwen2":  # Qwen2.5 = qwen2: q/k/v biases; here with sliding layers past max_window_layers
        return tf.Qwen2Config(**_COMMON, tie_word_embeddings=True, use_sliding_window=True, sliding_window=8,
                              max_window_layers=1)
    if family == "qwen3":  # q/k norms, head_dim independent of hidden_size
        return tf.Qwen3Config(**_COMMON, head_dim=16, tie_word_embeddings=True)
    if family == "gemma2":  # eager attention with soft-capping, final logit soft-capping, +1 norms, sliding
        return tf.Gemma2Config(**_COMMON, head_dim=8, sliding_window=8, final_logit_softcapping=30.0,
                               attn_logit_softcapping=50.0)
    if family == "gemma3_text":  # scaled embeddings, sliding/global pattern with two rope bases, soft-capping
        return tf.Gemma3TextConfig(**_COMMON, head_dim=8, sliding_window=8, final_logit_softcapping=30.0,
                                   layer_types=["sliding_attention", "full_attention"])
    if family == "phi3":  # fused qkv and gate_up projections, sliding window
        return tf.Phi3Config(**_COMMON, sliding_window=8, tie_word_embeddings=False)
    if family == "olmo2":  # post-norm layers, q/k norms
        return tf.Olmo2Config(**_COMMON, tie_word_embeddings=False)
    if family == "gpt2":  # learned positions, Conv1D
        return tf.GPT2Config(vocab_size=VOCAB, n_embd=32, n_layer=2, n_head=4, n_positions=64, bos_token_id=1,
                             eos_token_id=2)
    if family == "opt":  # post-LN, project_in / project_out, positions offset 2
        return tf.OPTConfig(vocab_size=VOCAB, hidden_size=32, ffn_dim=64, num_hidden_layers=2, num_attention_heads=4,
                            max_position_embeddings=64, word_embed_proj_dim=16, do_layer_norm_before=False,
                            pad_token_id=1, bos_token_id=1, eos_token_id=2)
    if family == "gpt_neox":  # Pythia: parallel attention + MLP, partial rotary, a head saved as embed_out
        return tf.GPTNeoXConfig(vocab_size=VOCAB, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                                num_attention_heads=4, max_position_embeddings=64, rotary_pct=0.25,
                                use_parallel_residual=True, tie_word_embeddings=False, bos_token_id=1, eos_token_id=2)
    if family == "granite":  # untested family, standard layout: embedding and residual multipliers
        return tf.GraniteConfig(**_COMMON, embedding_multiplier=3.0, residual_multiplier=0.5,
                                attention_multiplier=0.3, logits_scaling=1.0)
    raise ValueError(family)


def save_model(path, config, dtype: torch.dtype = torch.float32, **save_kw) -> str:
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    with torch.no_grad():
        for p in model.parameters():
            p.add_(torch.randn_like(p) * 0.05)
    model.to(dtype).save_pretrained(path, **save_kw)
    save_tokenizer(path)
    return str(path)


_DIRS: dict[str, str] = {}


@pytest.fixture(scope="module")
def family_dir(tmp_path_factory):
    def get(family: str) -> str:
        if family not in _DIRS:
            _DIRS[family] = save_model(tmp_path_factory.mktemp(family), family_config(family))
        return _DIRS[family]

    yield get
    _DIRS.clear()


def loaded_program(path: str) -> hf.HFBlocks:
    program = hf.load_hf_skeleton(path)
    init_block = hf.make_init_block(program, path)
    materialize(program, [init_block(i) for i in range(len(program.modules))])
    return program


# ---------------------------------------------------------------------------------------------- families
@pytest.mark.parametrize("family", [*hf.SUPPORTED, "granite"])
def test_blocks_equal_the_hf_forward(family_dir, family):
    """Bit-identical logits and loss, sequence 20 > sliding window 8: the per-layer masks and position
    embeddings the blocks get are the ones HF's forward builds."""
    path = family_dir(family)
    ref = reference_model(path)
    program = loaded_program(path)
    assert program.family == family and program.names == ["embed", "layer0", "layer1", "head"]
    ids = torch.randint(0, VOCAB, (3, 20), generator=torch.Generator().manual_seed(1))
    targets = torch.cat([ids[:, 1:], torch.full((3, 1), -100)], dim=1)
    with torch.no_grad():
        want = ref(input_ids=ids, labels=ids)
        assert torch.equal(program.forward(ids), want.logits)
        x = ids
        for i in range(len(program.modules)):
            x = program.run(i, x, targets if i == len(program.modules) - 1 else None)
    assert torch.equal(x, want.loss)


@pytest.mark.parametrize("family", hf.SUPPORTED)
def test_family_trains_bit_exact_exports_and_generates(family_dir, make_dirs, tmp_path, family):
    """3 engine steps == 3 steps of torch AdamW on the HF model (losses and weights, bit for bit); the export
    loads with from_pretrained, gives the engine's logits exactly, and generates."""
    path = family_dir(family)
    policy = "swap-all" if family in ("mistral", "gemma3_text") else "interblock"  # replayed masked attention
    ecfg = engine_config(make_dirs(1), act_policy=policy, total_steps=3)
    ref_losses, ref_params = reference_run(path, ecfg, batches(3))
    out = tmp_path / "export"
    with init_from_hf(path, ecfg) as engine:
        program = engine.program
        losses = [engine.step(b) for b in batches(3)]
        params = engine_hf_state(engine, program)
        assert hf.export_hf(engine, program, path, out) == "float32"  # the source's dtype
        blocks = [engine.store.read_params(i) for i in range(len(program.modules))]
    assert losses == ref_losses and losses[-1] != losses[0]
    assert set(params) == set(ref_params)
    for name, t in params.items():
        assert torch.equal(t, ref_params[name]), name

    loaded = AutoModelForCausalLM.from_pretrained(out).eval()
    materialize(program, blocks)
    ids = torch.randint(0, VOCAB, (2, 20), generator=torch.Generator().manual_seed(3))
    with torch.no_grad():
        assert torch.equal(loaded(input_ids=ids).logits, program.forward(ids))
    generated = loaded.generate(input_ids=ids[:1, :5], max_new_tokens=3, do_sample=False)
    assert generated.shape == (1, 8) and torch.equal(generated[:, :5], ids[:1, :5])


# ---------------------------------------------------------------------------------------------- refusals
@pytest.mark.parametrize("config,match", [
    (tf.BertConfig(vocab_size=VOCAB, hidden_size=32, num_hidden_layers=2, num_attention_heads=4,
                   intermediate_size=64), "'bert' is not supported: it is an encoder"),
    (tf.MixtralConfig(**_COMMON, num_local_experts=4), "mixture-of-experts.*num_local_experts=4"),
    (tf.Qwen3MoeConfig(**_COMMON, num_experts=4), "mixture-of-experts.*experts=4"),
    (tf.Gemma3Config(text_config=dict(vocab_size=VOCAB, hidden_size=32, num_hidden_layers=2)),
     "multimodal.*Gemma3ForCausalLM with a Gemma3TextConfig"),
    (tf.T5Config(vocab_size=VOCAB, d_model=32, num_layers=2), "encoder-decoder"),
])
def test_unsupported_kinds_are_refused_up_front(tmp_path, make_dirs, config, match):
    config.save_pretrained(tmp_path)
    with pytest.raises(ValueError, match=match) as err:
        hf.load_hf_skeleton(tmp_path)
    assert "tested: llama, mistral, qwen2, qwen3, gemma2, gemma3_text, phi3, olmo2, gpt2, opt" in str(err.value)
    dirs = make_dirs(1)
    with pytest.raises(ValueError, match=match):
        init_from_hf(tmp_path, engine_config(dirs))
    assert os.listdir(dirs[0]) == []


def test_a_forward_the_blocks_do_not_reproduce_is_refused(tmp_path):
    """Granite divides its logits by logits_scaling in its *ForCausalLM forward: the probe run at load sees
    logits that differ from the head block's and refuses, naming the stage."""
    config = family_config("granite")
    config.logits_scaling = 8.0
    config.save_pretrained(tmp_path)
    with pytest.raises(NotImplementedError, match="granite: the HF forward does more.*logits after the lm_head"):
        hf.load_hf_skeleton(tmp_path)


# ---------------------------------------------------------------------------------------------- real shapes
def cli_args(tmp_path, *extra: str) -> list[str]:
    return ["--nvme", str(tmp_path / "nvme"), "--metrics", str(tmp_path / "m.jsonl"), "--backend", "threads",
            *extra]


@pytest.mark.parametrize("name,layers,hidden,kv", [("llama-3.1-8b", 32, 4096, 8), ("qwen2.5-14b", 48, 5120, 8),
                                                   ("llama-3.1-70b", 80, 8192, 8)])
def test_shipped_real_configs_dry_run_without_weights(tmp_path, capsys, name, layers, hidden, kv):
    path = REPO / "configs" / "hf" / name
    assert os.listdir(path) == ["config.json"]  # the shape only: no weights, no tokenizer
    program = hf.load_hf_skeleton(path)
    cfg = program.config
    assert (program.n_layer, program.hidden_size, cfg.num_key_value_heads) == (layers, hidden, kv)
    assert program.family == json.loads((path / "config.json").read_text())["model_type"]
    assert main(cli_args(tmp_path, "--model", str(path), "--dry-run", "--batch-size", "1", "--seq-len", "1024",
                         "--hardware", "rtx4090,12xP5510,256GB")) == 0
    text = capsys.readouterr().out
    assert "has no tokenizer" in text and "dry run:" in text and "nothing was written" in text
    assert not (tmp_path / "nvme").exists() or os.listdir(tmp_path / "nvme") == []

    assert main(cli_args(tmp_path, "--model", str(path), "--dry-run", "--layers", "1", "--batch-size", "1",
                         "--seq-len", "1024", "--hardware", "rtx4090,12xP5510,256GB")) == 0
    assert "dry run:" in capsys.readouterr().out
    # a real run needs the weights, and says so before anything is written
    assert main(cli_args(tmp_path, "--model", str(path), "--layers", "1", "--data", "synthetic", "--steps",
                         "1", "--batch-size", "1", "--seq-len", "16")) == 2
    assert "holds no weights, only the model's config: --dry-run plans it" in capsys.readouterr().out
    assert not (tmp_path / "nvme").exists() or os.listdir(tmp_path / "nvme") == []


def test_llama31_config_reads_its_rope_scaling():
    program = hf.load_hf_skeleton(REPO / "configs" / "hf" / "llama-3.1-8b")
    rope = program.config.rope_parameters
    assert rope["rope_type"] == "llama3" and rope["factor"] == 8.0 and rope["rope_theta"] == 500000.0
    assert program.vocab_size == 128256 and not program.tied and program.max_seq_len == 131072
    per_layer = sum(p.numel() for p in program.modules[1].parameters())
    assert per_layer == 4096 * (4096 + 2 * 1024 + 4096) + 3 * 4096 * 14336 + 2 * 4096  # q, k, v, o; mlp; norms


def test_layers_slice_of_a_saved_model(family_dir, make_dirs, tmp_path, capsys):
    """--layers 1: the first layer's weights are imported (what transformers loads for num_hidden_layers=1), the
    layer-type pattern is cut to match; the CLI trains it and exports a 1-layer model."""
    path = family_dir("gemma3_text")
    ecfg = engine_config(make_dirs(1), total_steps=2)
    ref = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32, num_hidden_layers=1)
    with init_from_hf(path, ecfg, n_layer=1) as engine:
        assert engine.program.names == ["embed", "layer0", "head"]
        assert engine.program.config.layer_types == ["sliding_attention"]
        state = engine_hf_state(engine, engine.program)
    want = dict(ref.named_parameters())  # a tied lm_head once, as the embedding
    assert set(state) == set(want)
    assert all(torch.equal(t, want[n]) for n, t in state.items())
    with pytest.raises(ValueError, match="--layers 3: .* has 2 decoder layers; choose 1 to 2"):
        hf.load_hf_skeleton(path, 3)

    out = tmp_path / "export"
    assert main(cli_args(tmp_path, "--model", path, "--layers", "1", "--data", "synthetic", "--steps", "1",
                         "--batch-size", "2", "--seq-len", "16", "--compute-dtype", "fp32", "--export",
                         str(out))) == 0
    assert "exported the step-1 weights" in capsys.readouterr().out
    config = json.loads((out / "config.json").read_text())
    assert config["num_hidden_layers"] == 1 and config["layer_types"] == ["sliding_attention"]
    assert AutoModelForCausalLM.from_pretrained(out).config.num_hidden_layers == 1
    assert main(cli_args(tmp_path, "--model", path, "--set", "model_overrides.d_model=64", "--dry-run")) == 2
    assert "model_overrides d_model apply to presets" in capsys.readouterr().err


# ---------------------------------------------------------------------------------------------- export
def test_export_dtype_default_shards_and_bf16_logits(tmp_path, make_dirs):
    """A bf16 checkpoint exports bf16 by default, in bounded shards with an index; from_pretrained gives the
    logits of the engine's weights cast to bf16, exactly."""
    path = save_model(tmp_path / "src", family_config("qwen3"), dtype=torch.bfloat16)
    (tmp_path / "src" / "chat_template.jinja").write_text("{{ messages }}")
    assert json.loads((tmp_path / "src" / "config.json").read_text())["dtype"] == "bfloat16"
    out = tmp_path / "export"
    bound = 6000
    with init_from_hf(path, engine_config(make_dirs(1), act_policy="interblock")) as engine:
        engine.step(next(batches(1)))
        assert hf.export_hf(engine, engine.program, path, out, max_shard_bytes=bound) == "bfloat16"
        state = engine_hf_state(engine, engine.program)
    files = sorted(os.listdir(out))
    shards = [n for n in files if n.endswith(".safetensors")]
    assert len(shards) > 3 and shards[0] == f"model-00001-of-{len(shards):05d}.safetensors"
    assert {"model.safetensors.index.json", "config.json", "generation_config.json", "tokenizer.json",
            "chat_template.jinja"} <= set(files)
    index = json.loads((out / "model.safetensors.index.json").read_text())
    assert set(index["weight_map"]) == set(state) and set(index["weight_map"].values()) == set(shards)
    from safetensors import safe_open

    for n in shards:  # bounded, unless one tensor alone is larger
        with safe_open(out / n, framework="pt") as f:
            sizes = [f.get_slice(k).get_shape() for k in f.keys()]
        nbytes = sum(2 * torch.Size(s).numel() for s in sizes)
        assert nbytes <= bound or len(sizes) == 1, (n, nbytes)
    assert json.loads((out / "config.json").read_text())["dtype"] == "bfloat16"

    loaded = AutoModelForCausalLM.from_pretrained(out, dtype=torch.bfloat16).eval()
    want = AutoModelForCausalLM.from_config(loaded.config, dtype=torch.bfloat16).eval()
    want.load_state_dict({n: t.to(torch.bfloat16) for n, t in state.items()}, strict=False)
    want.tie_weights()
    ids = torch.randint(0, VOCAB, (2, 12), generator=torch.Generator().manual_seed(2))
    with torch.no_grad():
        assert torch.equal(loaded(input_ids=ids).logits, want(input_ids=ids).logits)
    for name, p in loaded.named_parameters():
        assert torch.equal(p.detach(), state[name].to(torch.bfloat16)), name


def test_export_dtype_flag(family_dir, tmp_path, capsys):
    path = family_dir("llama")
    out = tmp_path / "export"
    assert main(cli_args(tmp_path, "--model", path, "--data", "synthetic", "--steps", "1", "--batch-size", "2",
                         "--seq-len", "8", "--export", str(out), "--export-dtype", "fp16")) == 0
    assert "in float16" in capsys.readouterr().out
    assert json.loads((out / "config.json").read_text())["dtype"] == "float16"
    assert AutoModelForCausalLM.from_pretrained(out).dtype == torch.float16
    assert main(cli_args(tmp_path, "--model", path, "--export-dtype", "bf16", "--dry-run")) == 2
    assert "pass --export too" in capsys.readouterr().err


@pytest.mark.parametrize("family", ["llama", "qwen2", "mistral", "qwen3", "gemma2", "gemma3_text", "phi3", "olmo2",
                                    "gpt2", "opt"])
def test_make_tiny_hf_writes_a_model_lohan_takes(tmp_path, family, capsys):
    """scripts/make_tiny_hf.py, for every family it offers: its tokenizer, loaded as the family loads it, fits the
    model's vocabulary, and finetune.py plans a run on it."""
    import importlib.util

    from transformers import AutoConfig, AutoTokenizer

    from lohan.app.cli import main

    spec = importlib.util.spec_from_file_location("make_tiny_hf", Path(__file__).parents[2] / "scripts" / "make_tiny_hf.py")
    make_tiny_hf = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(make_tiny_hf)
    assert family in make_tiny_hf.FAMILIES
    out = make_tiny_hf.make(tmp_path / family, family, layers=1, hidden=32, heads=2, vocab=300)
    assert len(AutoTokenizer.from_pretrained(out)) <= AutoConfig.from_pretrained(out).vocab_size
    assert main(["--model", str(out), "--steps", "1", "--batch-size", "1", "--seq-len", "16", "--nvme",
                 str(tmp_path / "nvme"), "--dry-run"]) == 0, capsys.readouterr()
