"""Hugging Face causal LMs (Llama, GPT-2, OPT, Qwen2) through the engine: import, training, export.

(tests/integration/test_hf_families.py runs every tested family, Gemma, Mistral, Qwen3, Phi-3 and OLMo 2 included.)

Every model and tokenizer is created here (tiny configs, fixed seeds, every weight perturbed so that
no two parameters of one shape are alike and a mix-up of names or order shows). The references are
the HF models themselves, loaded from the same directories with `from_pretrained` in fp32.
"""

from __future__ import annotations

import json
import os

import pytest
import torch

from lohan.config import EngineConfig
from lohan.models import hf, hf_checkpoint
from lohan.models.gpt import lm_loss
from lohan.runtime.hf_engine import init_from_hf
from lohan.runtime.optim import lr_factor, param_groups

transformers = pytest.importorskip("transformers")
from tokenizers import Tokenizer, models, pre_tokenizers  # noqa: E402
from transformers import (  # noqa: E402
    AutoModelForCausalLM,
    AutoTokenizer,
    GPT2Config,
    LlamaConfig,
    OPTConfig,
    PreTrainedTokenizerFast,
    Qwen2Config,
)

VOCAB = 150
STEPS = 4


def tiny_config(family: str):
    ids = dict(bos_token_id=1, eos_token_id=2)
    if family == "llama":  # untied, grouped-query attention (2 KV heads for 4 query heads)
        return LlamaConfig(vocab_size=VOCAB, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                           num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64,
                           pad_token_id=0, tie_word_embeddings=False, **ids)
    if family == "qwen2":  # q/k/v biases, GQA, tied embeddings
        return Qwen2Config(vocab_size=VOCAB, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                           num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64,
                           tie_word_embeddings=True, **ids)
    if family == "gpt2":  # learned positions, Conv1D, tied, dropout in the config (off in eval)
        return GPT2Config(vocab_size=VOCAB, n_embd=32, n_layer=2, n_head=4, n_positions=64, **ids)
    if family == "opt":  # learned positions with offset 2, padding_idx, pre-LN, final LN, tied
        return OPTConfig(vocab_size=VOCAB, hidden_size=32, ffn_dim=64, num_hidden_layers=2, num_attention_heads=4,
                         max_position_embeddings=64, word_embed_proj_dim=32, pad_token_id=1, **ids)
    if family == "opt-350m":  # post-LN, no final LN, project_in / project_out
        return OPTConfig(vocab_size=VOCAB, hidden_size=32, ffn_dim=64, num_hidden_layers=2, num_attention_heads=4,
                         max_position_embeddings=64, word_embed_proj_dim=16, do_layer_norm_before=False,
                         pad_token_id=1, **ids)
    raise ValueError(family)


def save_tokenizer(path) -> None:
    vocab = {"<unk>": 0, "<s>": 1, "</s>": 2, **{f"w{i}": i for i in range(3, 40)}}
    tok = Tokenizer(models.WordLevel(vocab, unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    PreTrainedTokenizerFast(tokenizer_object=tok, unk_token="<unk>", bos_token="<s>",
                            eos_token="</s>").save_pretrained(path)


def make_hf_dir(path, family: str, max_shard_size: str | None = None) -> str:
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(tiny_config(family), dtype=torch.float32)
    with torch.no_grad():
        for p in model.parameters():
            p.add_(torch.randn_like(p) * 0.05)
    kw = {"max_shard_size": max_shard_size} if max_shard_size else {}
    model.save_pretrained(path, **kw)
    save_tokenizer(path)
    return str(path)


_DIRS: dict[tuple[str, str | None], str] = {}


@pytest.fixture(scope="module")
def hf_dir(tmp_path_factory):
    """hf_dir(family, shard=None) -> a (cached, read-only) model directory."""

    def get(family: str, shard: str | None = None) -> str:
        key = (family, shard)
        if key not in _DIRS:
            _DIRS[key] = make_hf_dir(tmp_path_factory.mktemp(family), family, shard)
        return _DIRS[key]

    yield get
    _DIRS.clear()


def reference_model(path: str):
    """The model as transformers loads it (its default attention: SDPA, or eager where the family has no SDPA)."""
    return AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()


def materialize(program: hf.HFBlocks, tensors: list[list[torch.Tensor]]) -> None:
    """Give the skeleton's blocks real weights the way the streamer does (module._parameters entries)."""
    for block, ts in zip(program.modules, tensors):
        for (name, _), t in zip(list(block.named_parameters()), ts):
            owner, _, leaf = name.rpartition(".")
            block.get_submodule(owner)._parameters[leaf] = torch.nn.Parameter(t)


def batches(steps: int, batch: int = 4, seq: int = 16, seed: int = 7):
    g = torch.Generator().manual_seed(seed)
    for _ in range(steps):
        x = torch.randint(0, VOCAB, (batch, seq + 1), generator=g)
        yield x[:, :-1], x[:, 1:]


def engine_config(dirs, **kw) -> EngineConfig:
    base = dict(nvme=tuple(dirs), compute_dtype="fp32", backend="threads", lr=1e-2, weight_decay=0.1,
                betas=(0.9, 0.95), eps=1e-8, cpu_mem="512MiB", warmup_steps=2, total_steps=STEPS)
    base.update(kw)
    return EngineConfig(**base)


def engine_hf_state(engine, program: hf.HFBlocks) -> dict[str, torch.Tensor]:
    """The engine's fp32 master weights under their HF state-dict names."""
    out = {}
    for b in engine.store.layout.blocks:
        for name, t in zip(program.param_names(b.index), engine.store.read_params(b.index), strict=True):
            out[name] = t
    return out


# ---------------------------------------------------------------------------------------------- directory
def test_unsupported_model_type_is_refused(tmp_path):
    d = tmp_path / "bert"
    d.mkdir()
    (d / "config.json").write_text(json.dumps({"model_type": "bert", "hidden_size": 32, "type_vocab_size": 2}))
    assert hf.is_hf_dir(d)  # a model directory: refused when loaded, with the reason
    assert not hf.is_hf_dir(tmp_path / "missing")
    with pytest.raises(ValueError, match="model_type 'bert' is not supported: it is an encoder.*tested: llama, "
                                         "mistral, qwen2"):
        hf.load_hf_skeleton(d)
    with pytest.raises(ValueError, match="'bert' is not supported"):
        init_from_hf(d, engine_config([str(tmp_path / "nvme")]))
    assert not os.path.exists(tmp_path / "nvme" / "lohan.store.json")


@pytest.mark.parametrize("config,match", [
    (OPTConfig(vocab_size=VOCAB, hidden_size=32, ffn_dim=64, num_hidden_layers=2, num_attention_heads=4,
               word_embed_proj_dim=32, do_layer_norm_before=False), "head block would own no parameters"),
    (GPT2Config(vocab_size=VOCAB, n_embd=32, n_layer=2, n_head=4, add_cross_attention=True), "cross_attention"),
])
def test_unsupported_variants_are_refused(tmp_path, config, match):
    config.save_pretrained(tmp_path)
    assert hf.is_hf_dir(tmp_path)  # a supported family ...
    with pytest.raises(NotImplementedError, match=match):  # ... in a variant the blocks do not cover
        hf.load_hf_skeleton(tmp_path)


def test_is_hf_dir(hf_dir):
    for family in ("llama", "gpt2"):
        assert hf.is_hf_dir(hf_dir(family))
    assert {"llama", "gpt2", "opt", "qwen2", "mistral", "qwen3", "gemma2", "gemma3_text", "phi3",
            "olmo2", "gpt_neox"} == set(hf.SUPPORTED)


def test_skeleton_has_meta_parameters_and_real_buffers(hf_dir):
    program = hf.load_hf_skeleton(hf_dir("llama"))
    model = program.model
    assert all(p.is_meta for p in model.parameters())
    rope = model.model.rotary_emb
    assert not rope.inv_freq.is_meta and rope.inv_freq.dtype == torch.float32
    head_dim = 32 // 4
    theta = model.config.rope_parameters["rope_theta"]
    expect = 1.0 / (theta ** (torch.arange(0, head_dim, 2, dtype=torch.float) / head_dim))
    assert torch.equal(rope.inv_freq, expect)
    assert not model.training  # dropout off
    assert program.family == "llama" and program.n_layer == 2 and program.vocab_size == VOCAB
    assert program.max_seq_len == 64
    assert program.names == ["embed", "layer0", "layer1", "head"]
    # untied: the head owns lm_head.weight and borrows nothing
    assert program.param_names(3) == ["model.norm.weight", "lm_head.weight"]
    assert program.external_params(3) == []
    # every op the activation runtime tracks is a child of the HF layer
    assert [n for n, _ in program.modules[1].named_children()] == [
        "self_attn", "mlp", "input_layernorm", "post_attention_layernorm"]


@pytest.mark.parametrize("family", ["gpt2", "qwen2", "opt"])
def test_tied_embedding_is_owned_by_the_embed_block(hf_dir, family):
    program = hf.load_hf_skeleton(hf_dir(family))
    last = len(program.modules) - 1
    embed_names = program.param_names(0)
    tok = next(n for n in embed_names if "embed_tokens" in n or n.endswith("wte.weight"))
    assert program.external_params(last) == [(0, embed_names.index(tok))]
    assert not any("lm_head" in n for i in range(last + 1) for n in program.param_names(i))
    all_names = [n for i in range(last + 1) for n in program.param_names(i)]
    assert len(all_names) == len(set(all_names))
    assert set(all_names) == {n for n, _ in program.model.named_parameters()}


# ---------------------------------------------------------------------------------------------- forward
@pytest.mark.parametrize("family", ["llama", "qwen2", "gpt2", "opt", "opt-350m"])
def test_blocks_in_sequence_equal_the_hf_forward(hf_dir, family):
    """Bit-identical: the blocks call HF's own modules with what HF's model forward passes them."""
    path = hf_dir(family)
    ref = reference_model(path)
    program = hf.load_hf_skeleton(path)
    init_block = hf.make_init_block(program, path)
    materialize(program, [init_block(i) for i in range(len(program.modules))])
    ids = torch.randint(0, VOCAB, (3, 17), generator=torch.Generator().manual_seed(1))
    targets = torch.cat([ids[:, 1:], torch.full((3, 1), -100)], dim=1)  # HF's labels=ids shifted
    with torch.no_grad():
        want = ref(input_ids=ids, labels=ids)
        x = ids
        for i in range(len(program.modules)):
            x = program.run(i, x, targets if i == len(program.modules) - 1 else None)
        logits = program.forward(ids)
    assert torch.equal(x, want.loss), f"{x.item()} vs {want.loss.item()}"
    assert torch.equal(logits, want.logits)


# ---------------------------------------------------------------------------------------------- engine
def reference_run(path: str, ecfg: EngineConfig, data):
    model = reference_model(path)
    opt = torch.optim.AdamW(param_groups(model, ecfg.weight_decay, ecfg.no_decay), lr=ecfg.lr, betas=ecfg.betas,
                            eps=ecfg.eps, fused=True)
    sched = torch.optim.lr_scheduler.LambdaLR(
        opt, lambda s: lr_factor(s, ecfg.warmup_steps, ecfg.total_steps, ecfg.min_lr_ratio))
    losses = []
    m = ecfg.micro_batches
    for idx, tgt in data:
        total = 0.0
        for x, y in zip(idx.chunk(m), tgt.chunk(m)):
            loss = lm_loss(model(input_ids=x).logits, y) / m
            loss.backward()
            total += float(loss.detach())
        if ecfg.max_grad_norm > 0:
            torch.nn.utils.clip_grad_norm_(model.parameters(), ecfg.max_grad_norm)
        opt.step()
        sched.step()
        opt.zero_grad(set_to_none=True)
        losses.append(total)
    return losses, {n: p.detach() for n, p in model.named_parameters()}


@pytest.mark.parametrize("family,policy", [("llama", "interblock"), ("llama", "swap-all"), ("gpt2", "plan"),
                                           ("opt", "plan"), ("qwen2", "plan"), ("gpt2", "swap-all"),
                                           ("opt", "swap-all"), ("qwen2", "swap-all")])
def test_engine_is_bit_exact_with_pytorch(hf_dir, make_dirs, family, policy):
    """Losses and final fp32 weights equal a plain PyTorch loop over the HF model, bit for bit. GPT-2 runs 2
    micro-batches: the tied embedding accumulates its head and embedding contributions per micro-batch."""
    path = hf_dir(family)
    ecfg = engine_config(make_dirs(2), act_policy=policy, micro_batches=2 if family == "gpt2" else 1)
    ref_losses, ref_params = reference_run(path, ecfg, batches(STEPS))
    losses = []
    with init_from_hf(path, ecfg) as engine:
        program = engine.program
        assert isinstance(program, hf.HFBlocks)
        for batch in batches(STEPS):
            losses.append(engine.step(batch))
        assert engine.last_stats.activations["policy"] == policy
        if policy == "swap-all":  # every op of every layer was recorded in forward and replayed in backward
            ops = {n for n, _ in program.modules[1].named_children()}
            assert len(ops) >= 4 and set(engine.last_stats.activations["swap"]) == ops
        params = engine_hf_state(engine, program)
    assert losses == ref_losses
    assert losses[-1] != losses[0]
    assert set(params) == set(ref_params)
    for name, t in params.items():
        assert torch.equal(t, ref_params[name]), f"{name}: max |diff| {(t - ref_params[name]).abs().max():.3e}"


class _Recorder:
    """Wraps safetensors.safe_open: records every tensor read (keys() reads only the header)."""

    def __init__(self, real) -> None:
        self.real = real
        self.reads: list[str] = []

    def __call__(self, filename, framework, device="cpu"):
        inner = self.real(filename, framework=framework, device=device)
        rec = self

        class Handle:
            def __enter__(self):
                inner.__enter__()
                return self

            def __exit__(self, *exc):
                return inner.__exit__(*exc)

            def keys(self):
                return inner.keys()

            def get_tensor(self, key):
                rec.reads.append(key)
                return inner.get_tensor(key)

            def get_slice(self, key):
                rec.reads.append(key)
                return inner.get_slice(key)

        return Handle()


def test_import_reads_one_block_at_a_time_from_shards(hf_dir, make_dirs, monkeypatch):
    path = hf_dir("llama", "20KB")
    with open(os.path.join(path, hf.WEIGHTS_INDEX)) as f:
        weight_map = json.load(f)["weight_map"]
    assert len(set(weight_map.values())) > 2  # really sharded
    rec = _Recorder(hf_checkpoint.safe_open)
    monkeypatch.setattr(hf_checkpoint, "safe_open", rec)
    per_block: list[list[str]] = []

    def progress(done: int, total: int) -> None:
        per_block.append(list(rec.reads))
        rec.reads.clear()

    with init_from_hf(path, engine_config(make_dirs(1)), progress=progress) as engine:
        program = engine.program
        assert len(per_block) == len(program.modules)
        for i, keys in enumerate(per_block):
            assert sorted(keys) == sorted(program.param_names(i)), f"block {i} read {keys}"
        state = engine_hf_state(engine, program)
    ref = reference_model(path).state_dict()
    assert set(state) == set(ref)
    for name, t in state.items():
        assert torch.equal(t, ref[name]), name


def test_import_without_base_model_prefix(hf_dir, make_dirs, tmp_path):
    """Hub GPT-2 checkpoints name tensors 'h.0.attn...' (no 'transformer.'), and may be fp16."""
    from safetensors.torch import load_file, save_file

    src = hf_dir("gpt2")
    d = tmp_path / "gpt2-hub"
    d.mkdir()
    for n in os.listdir(src):
        if n != hf.WEIGHTS_NAME:
            with open(os.path.join(src, n), "rb") as f_in, open(d / n, "wb") as f_out:
                f_out.write(f_in.read())
    sd = load_file(os.path.join(src, hf.WEIGHTS_NAME))
    save_file({k.removeprefix("transformer."): v.half() for k, v in sd.items()}, str(d / hf.WEIGHTS_NAME),
              metadata={"format": "pt"})
    with init_from_hf(d, engine_config(make_dirs(1))) as engine:
        state = engine_hf_state(engine, engine.program)
    assert set(state) == {k for k in sd if k != "lm_head.weight"}
    for name, t in state.items():
        assert t.dtype == torch.float32
        assert torch.equal(t, sd[name].half().float()), name


def test_resume_checks_the_model(hf_dir, make_dirs):
    dirs = make_dirs(1)
    path = hf_dir("gpt2")
    with init_from_hf(path, engine_config(dirs, act_policy="interblock")) as engine:
        engine.step(next(batches(1)))
        meta = engine.store.status(dirs).model
        before = engine_hf_state(engine, engine.program)
    assert meta["kind"] == "hf" and meta["family"] == "gpt2" and meta["config"]["n_embd"] == 32
    assert json.loads(json.dumps(meta)) == meta
    assert not any(isinstance(v, str) and os.sep in v for v in meta["config"].values())
    with init_from_hf(path, engine_config(dirs, act_policy="interblock"), resume=True) as engine:
        assert engine.step_count == 1
        assert all(torch.equal(t, before[n]) for n, t in engine_hf_state(engine, engine.program).items())
    with pytest.raises(ValueError, match="holds another model"):
        init_from_hf(hf_dir("opt"), engine_config(dirs), resume=True)


def test_flops_per_token(hf_dir):
    program = hf.load_hf_skeleton(hf_dir("llama"))
    h, ffn, kv, layers = 32, 64, 2 * 8, 2
    per_layer = h * h + 2 * h * kv + h * h + 3 * h * ffn  # q, k, v, o; gate, up, down
    matmul = layers * per_layer + VOCAB * h  # + lm_head
    assert program.flops_per_token(16) == 2 * matmul + 4 * layers * 16 * h


# ---------------------------------------------------------------------------------------------- export
@pytest.mark.parametrize("family,shard_bytes", [("llama", 20_000), ("gpt2", 5 * 10**9)])
def test_export_loads_in_transformers_with_identical_logits(hf_dir, make_dirs, tmp_path, family, shard_bytes):
    path = hf_dir(family)
    out = str(tmp_path / "export")
    with init_from_hf(path, engine_config(make_dirs(1), act_policy="interblock")) as engine:
        program = engine.program
        for batch in batches(2):
            engine.step(batch)
        hf.export_hf(engine, program, path, out, max_shard_bytes=shard_bytes)
        state = engine_hf_state(engine, program)
        blocks = [engine.store.read_params(i) for i in range(len(program.modules))]
    files = set(os.listdir(out))
    assert {"config.json", "generation_config.json", "tokenizer.json", "tokenizer_config.json"} <= files
    if shard_bytes < 10**6:
        assert hf.WEIGHTS_INDEX in files and sum(n.endswith(".safetensors") for n in files) > 2
    else:
        assert hf.WEIGHTS_NAME in files and hf.WEIGHTS_INDEX not in files
    from safetensors import safe_open

    written = set()
    for n in files:
        if n.endswith(".safetensors"):
            with safe_open(os.path.join(out, n), framework="pt") as f:
                written |= set(f.keys())
    assert written == set(state)
    assert ("lm_head.weight" in written) == (family == "llama")  # a tied head is written once, as the embedding

    loaded = AutoModelForCausalLM.from_pretrained(out).eval()
    assert loaded.config.dtype == torch.float32
    trained = reference_model(path)
    missing, unexpected = trained.load_state_dict(state, strict=False)
    assert unexpected == [] and set(missing) <= {"lm_head.weight"}
    materialize(program, blocks)
    ids = torch.randint(0, VOCAB, (2, 20), generator=torch.Generator().manual_seed(3))
    with torch.no_grad():
        got = loaded(input_ids=ids).logits
        assert torch.equal(got, trained(input_ids=ids).logits)
        assert torch.equal(got, program.forward(ids))
        assert not torch.equal(got, reference_model(path)(input_ids=ids).logits)  # training changed them
    tok = AutoTokenizer.from_pretrained(out)
    assert tok("w3 w4 zz")["input_ids"] == [3, 4, 0]
    assert hf.load_tokenizer(out)("w5")["input_ids"] == [5]


def test_export_bf16_and_reexport(hf_dir, make_dirs, tmp_path):
    path = hf_dir("qwen2")
    out = tmp_path / "export"
    with init_from_hf(path, engine_config(make_dirs(1), act_policy="interblock")) as engine:
        engine.step(next(batches(1)))
        hf.export_hf(engine, engine.program, path, out, max_shard_bytes=20_000)
        n_shards = sum(n.endswith(".safetensors") for n in os.listdir(out))
        assert n_shards > 2
        with pytest.raises(ValueError, match="refusing to export into .*: it is not empty"):
            hf.export_hf(engine, engine.program, path, out)  # over anything: a run replaces exports (app.export)
        out = tmp_path / "export-bf16"
        hf.export_hf(engine, engine.program, path, out, dtype="bfloat16")
        state = engine_hf_state(engine, engine.program)
    assert sorted(n for n in os.listdir(out) if "safetensors" in n) == [hf.WEIGHTS_NAME]
    config = json.loads((out / "config.json").read_text())
    assert config["dtype"] == "bfloat16" and config["hidden_size"] == 32
    loaded = AutoModelForCausalLM.from_pretrained(out, dtype=torch.bfloat16)
    for name, p in loaded.named_parameters():
        assert torch.equal(p.detach(), state[name].to(torch.bfloat16)), name


def test_export_refuses_a_foreign_directory(hf_dir, make_dirs, tmp_path):
    path = hf_dir("gpt2")
    foreign = tmp_path / "foreign"
    foreign.mkdir()
    (foreign / "notes.txt").write_text("mine")
    with init_from_hf(path, engine_config(make_dirs(1))) as engine:
        with pytest.raises(ValueError, match="refusing to export into .*notes.txt"):
            hf.export_hf(engine, engine.program, path, foreign)
        with pytest.raises(ValueError, match="is the source directory"):
            hf.export_hf(engine, engine.program, path, path)
        with pytest.raises(ValueError, match="export dtype"):
            hf.export_hf(engine, engine.program, path, tmp_path / "new", dtype="int8")
    assert os.listdir(foreign) == ["notes.txt"]


def test_load_tokenizer_errors(tmp_path, hf_dir):
    assert hf.load_tokenizer(hf_dir("llama"))("w7 w8")["input_ids"] == [7, 8]
    empty = tmp_path / "empty"
    empty.mkdir()
    (empty / "config.json").write_text(json.dumps({"model_type": "llama"}))
    with pytest.raises(ValueError, match="has no tokenizer"):
        hf.load_tokenizer(empty)


def test_interrupted_import_continues_where_it_stopped(hf_dir, make_dirs, monkeypatch):
    """A weight import killed halfway (here: an error at the 3rd block) continues with resume=True from the
    first block not yet durable, and the store ends equal to the checkpoint."""
    path = hf_dir("llama")
    real = hf_checkpoint.make_init_block
    reads: list[int] = []

    def dying(program, src):
        init_block = real(program, src)

        def wrapped(i: int):
            reads.append(i)
            if len(reads) == 3:
                raise OSError("simulated kill during the import")
            return init_block(i)

        return wrapped

    monkeypatch.setattr(hf_checkpoint, "make_init_block", dying)
    dirs = make_dirs(1)
    with pytest.raises(OSError, match="simulated kill"):
        init_from_hf(path, engine_config(dirs))
    monkeypatch.setattr(hf_checkpoint, "make_init_block", real)
    reads.clear()
    monkeypatch.setattr(hf_checkpoint, "make_init_block", lambda program, src: (lambda i: reads.append(i) or real(program, src)(i)))
    with init_from_hf(path, engine_config(dirs), resume=True) as engine:
        assert reads[0] == 2  # blocks 0 and 1 were not imported again
        state = engine_hf_state(engine, engine.program)
    ref = reference_model(path).state_dict()
    assert all(torch.equal(t, ref[name]) for name, t in state.items())
