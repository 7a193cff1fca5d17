"""Shapes too big to plan or to build are refused from their arithmetic, before anything is allocated (issue 42,
item 4): a preset with a typo'd ``--layers`` (a billion layers grew to 23 GB and was killed by the kernel), a
width, vocabulary or position count a million times too big, and Hugging Face config.json files whose skeleton
would allocate hundreds of GiB (also with ``--dry-run``), whose dimensions are negative, or that have 100,000
layers.

Each case runs ``finetune.py``'s entry in a child process under an address-space limit (a regression must not take
the machine's memory with it) and checks: exit code 2, one ``error:`` line that says the count, the limit and what
to do, no traceback, a refusal in seconds at a bounded peak RSS, and nothing written (the NVMe directory is never
created; the scratch folder is unchanged).
"""

from __future__ import annotations

import json
import os
import re
import resource
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path

import psutil
import pytest

REPO = Path(__file__).resolve().parents[2]
GiB = 2**30

ADDRESS_SPACE = 8 * GiB
"""The child's address-space limit: torch and transformers load within it; an unbounded build dies in it."""
MAX_SECONDS = 10.0
"""How long the refusal itself may take (the child's imports are done before the clock starts); under a loaded
test machine it takes well under a second."""
MAX_PEAK_RSS = 2 * GiB
"""The child's peak RSS: torch and transformers take about 0.5 GiB; the billion-layer plan took 23 GB."""

CHILD = r"""
import importlib, os, resource, sys, time
warm = [m for m in os.environ["LOHAN_TEST_WARM"].split(",") if m]
if warm:  # a Hugging Face case: what the CLI does first, then the imports its refusal would otherwise pay for
    from lohan.models.hf_imports import keep_torchao_out
    keep_torchao_out()
for name in warm:
    importlib.import_module(name)
from lohan.app.cli import main
start = time.monotonic()
code = main(sys.argv[1:])
peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
print(f"\nrefusal-cost {time.monotonic() - start:.3f} {peak}", file=sys.stderr)
sys.exit(code)
"""

HF_WARM = "torch,transformers.modeling_utils,transformers.models.llama.modeling_llama,transformers.models.gpt2." \
          "modeling_gpt2"

LLAMA = {"architectures": ["LlamaForCausalLM"], "model_type": "llama", "vocab_size": 150, "hidden_size": 32,
         "intermediate_size": 64, "num_hidden_layers": 2, "num_attention_heads": 4, "num_key_value_heads": 2,
         "max_position_embeddings": 64, "rms_norm_eps": 1e-6, "tie_word_embeddings": False, "bos_token_id": 1,
         "eos_token_id": 2, "pad_token_id": 0}
GPT2 = {"architectures": ["GPT2LMHeadModel"], "model_type": "gpt2", "vocab_size": 150, "n_embd": 32, "n_layer": 2,
        "n_head": 4, "n_positions": 64, "bos_token_id": 1, "eos_token_id": 2}


@dataclass(frozen=True)
class Case:
    id: str
    args: tuple[str, ...]
    """Flags after the common ones (a preset run, or `--model <the case's config-only directory>`)."""
    message: str
    """A regex the output must match: the count, the limit and the fix."""
    config: dict | None = None
    """A Hugging Face config.json for the case's model directory (None: a preset)."""


def _llama(**changes) -> dict:
    return {k: v for k, v in {**LLAMA, **changes}.items() if v is not None}


LAYERS = r"n_layer=({n}) transformer blocks are more than lohan builds \(at most 1,024; .*\): use --layers N with N <= 1,024"
TOO_MANY = r"parameters \([\d.,]+T\) are more than lohan plans for \(at most 2,000,000,000,000, 2T"
HF_TOO_MANY = r"config\.json describes [\d,]+ parameters \([\d.,]+T\), more than lohan plans for \(at most 2,000,000,000,000"

CASES = [
    Case("preset-billion-layers", ("--layers", "1000000000"), LAYERS.format(n="1,000,000,000")),
    Case("preset-100000-layers", ("--layers", "100000"), LAYERS.format(n="100,000")),
    Case("preset-n_layer-override", ("--set", "model_overrides.n_layer=100000"), LAYERS.format(n="100,000")),
    Case("preset-billion-layers-dry-run-other-box",
         ("--layers", "1000000000", "--dry-run", "--hardware", "rtx4090,12xP5510,256GB"), LAYERS.format(n="1,000,000,000")),
    Case("preset-d_model", ("--set", "model_overrides.d_model=1048576"),
         TOO_MANY + r".*not even one block of this width fits; give it a smaller d_model \(1,048,576\)"),
    Case("preset-412b-deeper", ("--model", "412b", "--layers", "1024", "--data", "synthetic"),
         TOO_MANY + r".*the 1,024 blocks of 3,221,438,464 .*use --layers N with N <= 620"),
    Case("preset-vocab_size", ("--set", "model_overrides.vocab_size=100000000000"),
         TOO_MANY + r".*the embeddings, \(vocab_size 100,000,000,000 \+ seq_len 256\) x d_model 160"),
    Case("preset-seq_len", ("--set", "model_overrides.seq_len=1000000000000"),
         TOO_MANY + r".*seq_len 1,000,000,000,000"),
    # hidden 2**20 with the head width and MLP that follow from it: 4 TiB for one projection inside from_config
    Case("hf-hidden-2e20", (), HF_TOO_MANY + r".*the largest tensor is model\.layers\.0\.mlp\.\w+_proj\.weight",
         _llama(hidden_size=2**20, intermediate_size=2**22)),
    Case("hf-hidden-2e20-dry-run", ("--dry-run",), HF_TOO_MANY, _llama(hidden_size=2**20, intermediate_size=2**22)),
    Case("hf-negative-hidden", (), r"config\.json: hidden_size=-32 must be a positive integer; fix the file",
         _llama(hidden_size=-32)),
    Case("hf-negative-vocab-dry-run", ("--dry-run",), r"config\.json: vocab_size=-5 must be a positive integer",
         _llama(vocab_size=-5)),
    Case("hf-zero-heads", (), r"config\.json: num_attention_heads=0 must be a positive integer",
         _llama(num_attention_heads=0)),
    Case("hf-gpt2-names-its-own-key", (), r"config\.json: n_embd=-8 must be a positive integer", {**GPT2, "n_embd": -8}),
    Case("hf-100000-layers", (), r"config\.json: num_hidden_layers=100,000 decoder layers are more than lohan builds "
         r"\(at most 1,024\); train a slice of its first layers with --layers N", _llama(num_hidden_layers=100000)),
    # under the parameter limit (one layer), but one tensor of 1.2 TB made real before it moves to the meta device
    Case("hf-one-tensor-beyond-ram", ("--layers", "1"),
         r"building its skeleton allocates 1,192\.1 GiB at once \(model\.layers\.0\.mlp\.\w+_proj\.weight "
         r"\[(10000000000, 32|32, 10000000000)\] in fp32.*more than this machine's [\d.,]+ GiB of RAM",
         _llama(intermediate_size=10**10)),
]


def snapshot(root: Path) -> dict[str, tuple[str, int, int]]:
    out = {}
    for dirpath, dirnames, filenames in os.walk(root):
        for name in dirnames + filenames:
            p = Path(dirpath, name)
            st = p.lstat()
            out[str(p.relative_to(root))] = ("d" if p.is_dir() else "f", st.st_size, st.st_mtime_ns)
    return out


def _limit_memory() -> None:
    resource.setrlimit(resource.RLIMIT_AS, (ADDRESS_SPACE, ADDRESS_SPACE))


def run_child(argv: list[str], warm: str, cwd: Path) -> tuple[int, str]:
    env = {**os.environ, "PYTHONPATH": str(REPO), "LOHAN_TEST_WARM": warm}
    out = subprocess.run([sys.executable, "-c", CHILD, *argv], cwd=cwd, env=env, capture_output=True, text=True,
                         timeout=240, preexec_fn=_limit_memory)
    return out.returncode, out.stdout + out.stderr


@pytest.mark.parametrize("case", CASES, ids=[c.id for c in CASES])
def test_shape_is_refused_from_its_arithmetic(case: Case, tmp_path: Path):
    if case.config is not None:
        pytest.importorskip("transformers")
        if case.id == "hf-one-tensor-beyond-ram" and psutil.virtual_memory().total > 1100 * GiB:
            pytest.skip("this machine has the RAM for the case's tensor")
        model = tmp_path / "model"
        model.mkdir()
        (model / "config.json").write_text(json.dumps(case.config))
        argv = ["--model", str(model), "--data", "synthetic"]
    else:
        argv = []
    argv += ["--nvme", str(tmp_path / "nvme"), "--metrics", str(tmp_path / "m.jsonl"), "--compute-dtype", "fp32",
             "--seq-len", "16", "--batch-size", "2", "--steps", "2", "--backend", "threads", *case.args]
    cwd = tmp_path / "cwd"
    cwd.mkdir()
    before = snapshot(tmp_path)
    code, text = run_child(argv, HF_WARM if case.config is not None else "", cwd)
    assert code == 2, text[-4000:]
    assert "Traceback" not in text, text[-4000:]
    assert re.search(r"^error: ", text, re.M), text[-4000:]
    assert re.search(case.message, text, re.S), text[-4000:]
    cost = re.search(r"^refusal-cost (\S+) (\d+)$", text, re.M)
    assert cost, text[-4000:]
    seconds, peak = float(cost.group(1)), int(cost.group(2))
    assert seconds < MAX_SECONDS, f"refused after {seconds:.1f} s"
    assert peak < MAX_PEAK_RSS, f"peak RSS {peak / GiB:.2f} GiB"
    assert not (tmp_path / "nvme").exists()
    assert snapshot(tmp_path) == before


def test_limits_admit_every_preset_and_the_largest_shapes_under_them():
    """The limits refuse typos, not models: every preset, 1,024 layers, and 2T parameters exactly are accepted."""
    from lohan.config import MAX_LAYERS, MAX_PARAMS, PRESETS, ModelConfig, get_model_config

    for name in PRESETS:
        get_model_config(name)
    get_model_config("tiny", n_layer=MAX_LAYERS)
    block = get_model_config("412b").block_param_count()
    fits = get_model_config("412b", n_layer=MAX_PARAMS // block - 1)
    assert fits.param_count() <= MAX_PARAMS
    with pytest.raises(ValueError, match="more than lohan plans for"):
        get_model_config("412b", n_layer=MAX_PARAMS // block + 1)
    with pytest.raises(ValueError, match="n_layer=1,025 transformer blocks"):
        ModelConfig(name="x", n_layer=MAX_LAYERS + 1, n_head=1, d_model=8, vocab_size=8, seq_len=8)
