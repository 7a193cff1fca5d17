"""Write a small randomly initialized Hugging Face causal LM, with a BPE tokenizer trained on the shipped
corpus, into a local directory: something to try ``finetune.py --model DIR`` on without a download.

The directory has what a downloaded checkpoint has (config.json, model.safetensors, tokenizer.json and
its config), so everything that works on it works on a real local Llama, GPT-2, OPT or Qwen2 checkpoint.

Usage::

    .venv/bin/python scripts/make_tiny_hf.py runs/tiny-llama                  # Llama family
    .venv/bin/python scripts/make_tiny_hf.py runs/tiny-qwen2 --family qwen2 --layers 6
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent


def train_tokenizer(corpus: Path, vocab_size: int):
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.BPE(unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=vocab_size, special_tokens=["<unk>", "<s>", "</s>"],
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet(), show_progress=False)
    tok.train([str(corpus)], trainer)
    return PreTrainedTokenizerFast(tokenizer_object=tok, unk_token="<unk>", bos_token="<s>", eos_token="</s>")


def model_config(family: str, vocab: int, hidden: int, layers: int, heads: int, positions: int):
    import transformers as tf

    ids = dict(bos_token_id=1, eos_token_id=2)
    if family == "llama":
        return tf.LlamaConfig(vocab_size=vocab, hidden_size=hidden, intermediate_size=4 * hidden,
                              num_hidden_layers=layers, num_attention_heads=heads,
                              num_key_value_heads=max(1, heads // 2), max_position_embeddings=positions,
                              tie_word_embeddings=False, **ids)
    if family == "qwen2":
        return tf.Qwen2Config(vocab_size=vocab, hidden_size=hidden, intermediate_size=4 * hidden,
                              num_hidden_layers=layers, num_attention_heads=heads,
                              num_key_value_heads=max(1, heads // 2), max_position_embeddings=positions,
                              tie_word_embeddings=True, **ids)
    if family == "gpt2":
        return tf.GPT2Config(vocab_size=vocab, n_embd=hidden, n_layer=layers, n_head=heads, n_positions=positions,
                             **ids)
    if family == "opt":
        return tf.OPTConfig(vocab_size=vocab, hidden_size=hidden, ffn_dim=4 * hidden, num_hidden_layers=layers,
                            num_attention_heads=heads, max_position_embeddings=positions,
                            word_embed_proj_dim=hidden, pad_token_id=0, **ids)
    raise ValueError(f"unknown family {family!r}: llama, qwen2, gpt2 or opt")


def make(out: str | Path, family: str = "llama", layers: int = 4, hidden: int = 128, heads: int = 4,
         positions: int = 512, vocab: int = 1024, seed: int = 0, corpus: Path = REPO / "data" / "corpus.txt") -> Path:
    import torch
    from transformers import AutoModelForCausalLM

    out = Path(out)
    if out.exists() and any(out.iterdir()):
        raise SystemExit(f"{out} exists and is not empty; choose a new directory")
    tokenizer = train_tokenizer(corpus, vocab)
    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(model_config(family, len(tokenizer), hidden, layers, heads, positions),
                                             dtype=torch.float32)
    model.save_pretrained(out)
    tokenizer.save_pretrained(out)
    return out


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("out", help="directory to create")
    p.add_argument("--family", default="llama", choices=["llama", "qwen2", "gpt2", "opt"])
    p.add_argument("--layers", type=int, default=4)
    p.add_argument("--hidden", type=int, default=128)
    p.add_argument("--heads", type=int, default=4)
    p.add_argument("--positions", type=int, default=512)
    p.add_argument("--vocab", type=int, default=1024, help="BPE vocabulary trained on data/corpus.txt")
    p.add_argument("--seed", type=int, default=0)
    args = p.parse_args(argv)
    out = make(args.out, args.family, args.layers, args.hidden, args.heads, args.positions, args.vocab, args.seed)
    print(f"wrote a {args.family} model ({args.layers} layers, hidden {args.hidden}) and its tokenizer to {out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
