"""Write a small randomly initialized Hugging Face causal LM, with a BPE tokenizer trained on the shipped
corpus, into a local directory: something to try ``finetune.py --model DIR`` on without a download.

The directory has what a downloaded checkpoint has (config.json, model.safetensors, tokenizer.json and
its config), so everything that works on it works on a real local checkpoint of that family (``--family``: Llama,
Mistral, Qwen2, Qwen3, Gemma 2, Gemma 3 text, Phi-3, OLMo 2, GPT-2, OPT).

Usage::

    .venv/bin/python scripts/make_tiny_hf.py runs/tiny-llama                  # Llama family
    .venv/bin/python scripts/make_tiny_hf.py runs/tiny-qwen2 --family qwen2 --layers 6
    .venv/bin/python scripts/make_tiny_hf.py runs/llama-110m --size 110m      # ~110M params (benchmarks/soak.py)
    .venv/bin/python scripts/make_tiny_hf.py runs/llama-350m --size 350m      # ~341M params (benchmarks/vs_deepspeed.py)
    .venv/bin/python scripts/make_tiny_hf.py runs/llama-3b --size 3b --streamed  # ~3.0B params, 6 GB in bf16

``--streamed`` writes the weights tensor by tensor into 1 GiB safetensors shards (random normal with the config's
``initializer_range``, norms 1, biases 0) from a model built on the meta device, so a model bigger than main memory
can be made (benchmarks/results/lora_beyond_ram/cpu2-xeon.md); without it the model is built in memory by ``from_config``.

``--size`` picks a named shape (`SIZES`); explicit flags override its fields.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent

# Named shapes (flag defaults; explicit flags win). "110m": a Llama-2-style layout at GPT-2-small width,
# the model of the memory soak (benchmarks/soak.py): 12 x 7.08M per layer + 24.6M tied embedding
# = ~109.5M parameters. "350m": the same layout at GPT-2-medium width (24 layers x 12.85M + 32.8M tied
# embedding = ~341.2M parameters; MLP 2816 = 8/3 x 1024 rounded to 256, as Llama sizes its MLP), the larger
# model of benchmarks/vs_deepspeed.py. The BPE vocabulary trained on the corpus stays smaller than 32000;
# the model's vocabulary is padded to it (`model_vocab`), as real checkpoints pad theirs.
SIZES: dict[str, dict[str, int | bool]] = {
    "110m": dict(layers=12, hidden=768, heads=12, kv_heads=12, intermediate=2048, vocab=32000, model_vocab=32000,
                 tie=True),
    "350m": dict(layers=24, hidden=1024, heads=16, kv_heads=16, intermediate=2816, vocab=32000, model_vocab=32000,
                 tie=True),
    # a Llama-3.2-3B-like layout (GQA 24/8, untied): ~3.0B parameters, 6 GB of bf16 (with --streamed)
    "3b": dict(layers=28, hidden=3072, heads=24, kv_heads=8, intermediate=8192, vocab=32000, model_vocab=32000,
               tie=False),
}
SHARD_BYTES = 1 << 30  # --streamed: a safetensors shard is closed once it holds this much


def train_tokenizer(corpus: Path, vocab_size: int):
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.BPE(unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=vocab_size, special_tokens=["<unk>", "<s>", "</s>"],
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet(), show_progress=False)
    tok.train([str(corpus)], trainer)
    # a pad token of its own vocabulary: a family's tokenizer class otherwise adds its default one when the model
    # directory is loaded (Qwen2's <|endoftext|>), one token more than the model's vocabulary
    return PreTrainedTokenizerFast(tokenizer_object=tok, unk_token="<unk>", bos_token="<s>", eos_token="</s>",
                                   pad_token="<unk>", chat_template=CHAT_TEMPLATE)


# A minimal chat template, saved with the tokenizer so {"messages": [...]} data (data/chat_example.jsonl) runs on
# the tiny model: "<s>### user\n...</s>### assistant\n...</s>", each turn closed by the EOS (no new tokens).
CHAT_TEMPLATE = (
    "{{ bos_token }}{% for m in messages %}{{ '### ' + m['role'] + '\\n' + m['content'] + eos_token }}{% endfor %}"
    "{% if add_generation_prompt %}{{ '### assistant\\n' }}{% endif %}"
)


# Llama-layout families: one config signature (class name, tied by default). Gemma and Qwen3 default to a
# head_dim of their own (256, 128); it is set to hidden // heads here so that small widths work.
_LLAMA_LIKE = {"llama": ("LlamaConfig", False), "qwen2": ("Qwen2Config", True), "mistral": ("MistralConfig", False),
               "qwen3": ("Qwen3Config", True), "gemma2": ("Gemma2Config", True),
               "gemma3_text": ("Gemma3TextConfig", True), "phi3": ("Phi3Config", False),
               "olmo2": ("Olmo2Config", False)}
FAMILIES = (*_LLAMA_LIKE, "gpt2", "opt")


def model_config(family: str, vocab: int, hidden: int, layers: int, heads: int, positions: int,
                 intermediate: int | None = None, kv_heads: int | None = None, tie: bool | None = None):
    """The family's config; `intermediate` (default 4 x hidden), `kv_heads` (default heads // 2) and `tie`
    (default: the family's usual, e.g. untied Llama, tied Qwen2) apply to the Llama-layout families."""
    import transformers as tf

    # the tokenizer's ids (train_tokenizer), pad included (<unk>, which byte-level BPE never produces: an embedding
    # row frozen as padding costs nothing): Phi-3's default pad id (32000) lies past a small vocabulary
    ids = dict(bos_token_id=1, eos_token_id=2, pad_token_id=0)
    ffn = intermediate or 4 * hidden
    kv = kv_heads or max(1, heads // 2)
    if family in _LLAMA_LIKE:
        cls, tied = _LLAMA_LIKE[family]
        extra = {"head_dim": hidden // heads} if family in ("qwen3", "gemma2", "gemma3_text") else {}
        return getattr(tf, cls)(vocab_size=vocab, hidden_size=hidden, intermediate_size=ffn,
                                num_hidden_layers=layers, num_attention_heads=heads, num_key_value_heads=kv,
                                max_position_embeddings=positions, tie_word_embeddings=tied if tie is None else tie,
                                **extra, **ids)
    if family == "gpt2":
        return tf.GPT2Config(vocab_size=vocab, n_embd=hidden, n_layer=layers, n_head=heads, n_positions=positions,
                             **ids)
    if family == "opt":
        return tf.OPTConfig(vocab_size=vocab, hidden_size=hidden, ffn_dim=4 * hidden, num_hidden_layers=layers,
                            num_attention_heads=heads, max_position_embeddings=positions,
                            word_embed_proj_dim=hidden, **ids)
    raise ValueError(f"unknown family {family!r}: {', '.join(FAMILIES)}")


def make(out: str | Path, family: str = "llama", layers: int = 4, hidden: int = 128, heads: int = 4,
         positions: int = 512, vocab: int = 1024, seed: int = 0, corpus: Path = REPO / "data" / "corpus.txt",
         intermediate: int | None = None, kv_heads: int | None = None, tie: bool | None = None,
         model_vocab: int | None = None, streamed: bool = False, dtype=None) -> Path:
    """Write the model and tokenizer to `out`. `vocab` is the BPE target (the corpus may yield fewer
    tokens); `model_vocab` pads the model's vocabulary beyond the tokenizer's (default: the tokenizer's);
    `streamed`: tensor by tensor into shards (`write_streamed`); `dtype`: the weights' (default fp32)."""
    import torch
    from transformers import AutoModelForCausalLM

    dtype = dtype or torch.float32
    out = Path(out)
    if out.exists() and any(out.iterdir()):
        raise SystemExit(f"{out} exists and is not empty; choose a new directory")
    tokenizer = train_tokenizer(corpus, vocab)
    if model_vocab is not None and model_vocab < len(tokenizer):
        raise SystemExit(f"--model-vocab {model_vocab} is smaller than the tokenizer's {len(tokenizer)} tokens")
    torch.manual_seed(seed)
    cfg = model_config(family, model_vocab or len(tokenizer), hidden, layers, heads, positions, intermediate,
                       kv_heads, tie)
    if streamed:
        write_streamed(out, cfg, seed, dtype)
    else:
        model = AutoModelForCausalLM.from_config(cfg, dtype=dtype)
        model.save_pretrained(out)
    tokenizer.save_pretrained(out)
    return out


def write_streamed(out: Path, cfg, seed: int, dtype) -> None:
    """The model of `cfg` written tensor by tensor into shards of `SHARD_BYTES` with an index, as sharded checkpoints
    are: at most one shard in memory, whatever the model's size."""
    import json

    import torch
    from safetensors.torch import save_file
    from transformers import AutoModelForCausalLM

    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(cfg)
    gen = torch.Generator().manual_seed(seed)
    std = getattr(cfg, "initializer_range", 0.02)
    out.mkdir(parents=True, exist_ok=True)
    shard: dict = {}
    weight_map: dict[str, str] = {}
    total = 0

    def flush() -> None:
        name = f"model-{len(set(weight_map.values())) + 1:05d}.safetensors"
        save_file(shard, str(out / name), metadata={"format": "pt"})
        weight_map.update(dict.fromkeys(shard, name))
        shard.clear()

    for name, p in model.named_parameters():  # (a tied weight is listed once)
        if "norm" in name and name.endswith("weight"):
            t = torch.ones(p.shape, dtype=dtype)
        elif name.endswith("bias"):
            t = torch.zeros(p.shape, dtype=dtype)
        else:
            t = (torch.randn(p.shape, generator=gen) * std).to(dtype)
        shard[name] = t
        total += t.numel() * t.element_size()
        if sum(x.numel() * x.element_size() for x in shard.values()) >= SHARD_BYTES:
            flush()
    if shard:
        flush()
    (out / "model.safetensors.index.json").write_text(
        json.dumps({"metadata": {"total_size": total}, "weight_map": weight_map}, indent=1) + "\n")
    cfg.torch_dtype = dtype
    cfg.save_pretrained(out)


def _dtypes() -> dict:
    import torch

    return {"fp32": torch.float32, "bf16": torch.bfloat16}


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("out", help="directory to create")
    p.add_argument("--family", default="llama", choices=FAMILIES)
    p.add_argument("--size", choices=sorted(SIZES), help="a named shape; explicit flags override its fields")
    p.add_argument("--layers", type=int, default=4)
    p.add_argument("--hidden", type=int, default=128)
    p.add_argument("--heads", type=int, default=4)
    p.add_argument("--kv-heads", type=int, default=None, help="key/value heads (Llama-layout families; default heads // 2)")
    p.add_argument("--intermediate", type=int, default=None, help="MLP width (Llama-layout families; default 4 x hidden)")
    p.add_argument("--tie", action=argparse.BooleanOptionalAction, default=None,
                   help="tie lm_head to the embedding (Llama-layout families; default: the family's usual)")
    p.add_argument("--positions", type=int, default=512)
    p.add_argument("--vocab", type=int, default=1024, help="BPE vocabulary trained on data/corpus.txt")
    p.add_argument("--model-vocab", type=int, default=None,
                   help="the model's vocabulary, padded beyond the tokenizer's (default: the tokenizer's size)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--streamed", action="store_true",
                   help="write the weights tensor by tensor into 1 GiB shards (a model bigger than main memory)")
    p.add_argument("--dtype", choices=("fp32", "bf16"), default="fp32", help="the weights' dtype")
    if argv is None:
        argv = sys.argv[1:]
    size = p.parse_known_args(argv)[0].size
    if size:  # the named shape becomes the defaults, so flags given explicitly still win
        p.set_defaults(**SIZES[size])
    args = p.parse_args(argv)
    out = make(args.out, args.family, args.layers, args.hidden, args.heads, args.positions, args.vocab, args.seed,
               intermediate=args.intermediate, kv_heads=args.kv_heads, tie=args.tie, model_vocab=args.model_vocab,
               streamed=args.streamed, dtype=_dtypes()[args.dtype])
    print(f"wrote a {args.family} model ({args.layers} layers, hidden {args.hidden}) and its tokenizer to {out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
