"""The bad-input catalogue of `finetune.py`: every mistake a user can make with the data, the model, the
numbers, the NVMe directories, the memory budgets, the config file, the export target and the hardware
description ends the same way: exit code 2, one `error: ...` message naming the cause (and the fix), no
Python traceback, and nothing on disk touched (no NVMe directory created, no file written or removed).

Every case runs `lohan.app.cli.main` in-process from a scratch working directory under `tmp_path`, so a stray
relative write would show up in the before/after snapshot of `tmp_path` too. The files a case prepares
(a damaged model directory, a broken YAML, ...) are made before the snapshot is taken.
"""

from __future__ import annotations

import errno
import json
import os
import random
import re
import shutil
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

import pytest
import torch

from lohan.app.cli import main

MakeModel = Callable[[], Path]
"""Copies the module's tiny Llama directory into the case's tmp_path and returns the copy."""


@dataclass(frozen=True)
class Case:
    id: str
    setup: Callable[[Path, MakeModel], list[str]]
    """Prepares the case's files under tmp_path and returns the argv."""
    message: str
    """A regex the output must match: the cause (and, where there is one, the fix)."""
    marks: tuple = field(default=())


def preset(t: Path, *extra: str) -> list[str]:
    """A tiny 2-layer preset run whose every path is under `t` (the flags a case adds come last and win)."""
    return ["--nvme", str(t / "nvme"), "--metrics", str(t / "m.jsonl"), "--batch-size", "2", "--seq-len", "32",
            "--steps", "1", "--set", "model_overrides.n_layer=2", "--backend", "threads", *extra]


def without_steps(args: list[str]) -> list[str]:
    """`args` less the preset's `--steps N` (for cases that say how long to train another way)."""
    at = args.index("--steps")
    return args[:at] + args[at + 2:]


def hf_args(model: Path, t: Path, *extra: str) -> list[str]:
    return ["--model", str(model), "--data", "synthetic", "--nvme", str(t / "nvme"), "--metrics",
            str(t / "m.jsonl"), "--batch-size", "2", "--seq-len", "16", "--steps", "1", "--backend", "threads",
            *extra]


def saved_dict(path: Path) -> Path:
    """A DatasetDict.save_to_disk folder with the splits train and test."""
    import datasets

    rows = [{"text": f"record {i} " * 20} for i in range(8)]
    datasets.DatasetDict({"train": datasets.Dataset.from_list(rows),
                          "test": datasets.Dataset.from_list(rows[:2])}).save_to_disk(str(path))
    return path


def write(path: Path, content: str | bytes) -> Path:
    if isinstance(content, bytes):
        path.write_bytes(content)
    else:
        path.write_text(content)
    return path


def mkdir(path: Path) -> Path:
    path.mkdir()
    return path


def yaml_config(t: Path, text: str) -> list[str]:
    return ["--config", str(write(t / "run.yaml", text)), "--nvme", str(t / "nvme"), "--metrics", str(t / "m.jsonl")]


def jsonl(t: Path, lines: list[str]) -> list[str]:
    return preset(t, "--data", str(write(t / "d.jsonl", "\n".join(lines) + "\n")))


def damaged(make: MakeModel, damage: Callable[[Path], object]) -> Path:
    model = make()
    damage(model)
    return model


def set_model_type(model: Path, family: str) -> None:
    config = json.loads((model / "config.json").read_text())
    (model / "config.json").write_text(json.dumps({**config, "model_type": family}))


def truncate(path: Path) -> None:
    data = path.read_bytes()
    path.write_bytes(data[: len(data) // 2])


def remove_tokenizer(model: Path) -> None:
    for name in ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json"):
        (model / name).unlink(missing_ok=True)


def store_run(t: Path, *extra: str) -> list[str]:
    """A real 1-step run leaves a store in t/nvme (setup of the resume cases)."""
    assert main(preset(t, *extra)) == 0
    return preset(t, *extra)


CASES = [
    # ------------------------------------------------------------------ data
    Case("data-missing", lambda t, m: preset(t, "--data", str(t / "missing.txt")), r"missing\.txt' does not exist"),
    Case("data-directory", lambda t, m: preset(t, "--data", str(t)), r"is a directory; pass one"),
    Case("data-empty-txt", lambda t, m: preset(t, "--data", str(write(t / "e.txt", "\n  \n"))), r"is empty"),
    Case("data-binary-txt", lambda t, m: preset(t, "--data", str(write(t / "b.txt", random.Random(0).randbytes(4096)))),
         r"is not valid UTF-8 .*convert it"),
    Case("data-nul-bytes-txt", lambda t, m: preset(t, "--data", str(write(t / "z.txt", b"\0" * 4096))),
         r"contains NUL bytes .*binary file"),
    Case("data-jsonl-malformed-line", lambda t, m: jsonl(t, ['{"text": "a"}', '{"text": "b"}', '{"text": "c"', '{}']),
         r"d\.jsonl' line 3: invalid JSON"),
    Case("data-jsonl-wrong-keys", lambda t, m: jsonl(t, ['{"question": "a", "answer": "b"}']),
         r'line 1: needs a "text" key or "prompt" and "response" keys'),
    Case("data-jsonl-empty-response", lambda t, m: jsonl(t, ['{"prompt": "q", "response": "a"}',
                                                             '{"prompt": "q", "response": ""}']),
         r'line 2: the "response" is empty; fill it in or drop the line'),
    Case("data-unknown-extension", lambda t, m: preset(t, "--data", str(write(t / "d.xlsx", "a,b\n1,2\n"))),
         r"extension '\.xlsx'; lohan reads plain text .*\.jsonl.*\.parquet.*save_to_disk"),
    Case("data-csv-unknown-columns", lambda t, m: preset(t, "--data", str(write(t / "d.csv", "a,b\n1,2\n"))),
         r"d\.csv': no column says what its records are; its columns are 'a', 'b'.*--data-format FORMAT.*"
         r"--text-field NAME"),
    Case("data-text-field-missing", lambda t, m: preset(t, "--data", str(write(t / "d.csv", "body\nhello\n")),
                                                        "--text-field", "content"),
         r"d\.csv' has no column 'content' to read the text from; its columns are 'body'"),
    Case("data-alpaca-empty-output", lambda t, m: preset(t, "--data", str(write(t / "a.json", json.dumps(
        [{"instruction": "say hi", "input": "", "output": "hi"}, {"instruction": "say no", "output": " "}])))),
         r"a\.json' record 2: the \"output\" is empty; fill it in or drop the record"),
    Case("data-sharegpt-unknown-role", lambda t, m: jsonl(t, [json.dumps({"conversations": [
        {"from": "human", "value": "q"}, {"from": "bing", "value": "a"}]})]),
         r"d\.jsonl' line 1: turn 2: the \"from\" value \"bing\" is not a ShareGPT role"),
    Case("data-split-missing", lambda t, m: preset(t, "--data", str(saved_dict(t / "dd")), "--split", "validation"),
         r"dd' has no split 'validation'; its splits are 'train', 'test': pick one with --split NAME"),
    Case("data-split-of-a-file", lambda t, m: preset(t, "--data", str(write(t / "d.csv", "text\nhello\n")),
                                                     "--split", "test"),
         r"--split test: .*d\.csv' is one file, read as the single split 'train'"),
    Case("data-format-of-plain-text", lambda t, m: preset(t, "--data", str(write(t / "d.txt", "text " * 400)),
                                                          "--data-format", "alpaca"),
         r"d\.txt' is plain text, trained on as one document: --data-format alpaca applies to files of records"),
    Case("data-text-field-with-another-format", lambda t, m: preset(t, "--data-format", "alpaca", "--text-field", "x"),
         r"text_field='x' names the column of text records, but data_format is 'alpaca'"),
    # ------------------------------------------------------------------ model
    Case("model-unknown-preset", lambda t, m: preset(t, "--model", "gpt5"), r"choose a preset \(tiny, 125m, .*175b"),
    Case("model-dir-without-config", lambda t, m: hf_args(damaged(m, lambda d: (d / "config.json").unlink()), t),
         r"is a directory without config\.json"),
    Case("model-without-weights", lambda t, m: hf_args(damaged(m, lambda d: (d / "model.safetensors").unlink()), t),
         r"model holds no weights, only the model's config: --dry-run plans it, but training needs its "
         r"\*\.safetensors files"),
    Case("model-truncated-safetensors",
         lambda t, m: hf_args(damaged(m, lambda d: truncate(d / "model.safetensors")), t),
         r"weights in .* cannot be read: .*Save the model again"),
    Case("model-garbage-safetensors",
         lambda t, m: hf_args(damaged(m, lambda d: write(d / "model.safetensors", random.Random(1).randbytes(999))), t),
         r"weights in .* cannot be read: .*Save the model again"),
    Case("model-config-not-json", lambda t, m: hf_args(damaged(m, lambda d: write(d / "config.json", "{oops")), t),
         r"config\.json is not valid JSON"),
    Case("model-bert", lambda t, m: hf_args(damaged(m, lambda d: set_model_type(d, "bert")), t),
         r"model_type 'bert' is not supported: it is an encoder .*tested: llama, mistral, qwen2"),
    Case("model-made-up-architecture", lambda t, m: hf_args(damaged(m, lambda d: set_model_type(d, "frobnik")), t),
         r"model_type 'frobnik' is not supported: transformers has no causal-LM class .*tested: llama, mistral"),
    Case("model-missing-tokenizer", lambda t, m: hf_args(damaged(m, remove_tokenizer), t),
         r"has no tokenizer .*pass a directory that has one"),
    Case("model-bloom", lambda t, m: hf_args(damaged(m, lambda d: set_model_type(d, "bloom")), t),
         r"model_type 'bloom' is not supported: its positions are ALiBi attention biases"),
    # ------------------------------------------------------------------ numbers
    Case("steps-zero", lambda t, m: preset(t, "--steps", "0"), r"steps=0 must be an integer >= 1"),
    Case("steps-negative", lambda t, m: preset(t, "--steps", "-3"), r"steps=-3 must be an integer >= 1"),
    Case("steps-huge", lambda t, m: preset(t, "--steps", str(10**12)), r"steps=1,000,000,000,000 is more than"),
    Case("steps-not-a-number", lambda t, m: preset(t, "--steps", "1e3"), r"^error: argument --steps: invalid int"),
    Case("epochs-huge", lambda t, m: without_steps(preset(t, "--epochs", str(10**9))), r"steps, more than lohan counts"),
    Case("batch-size-zero", lambda t, m: preset(t, "--batch-size", "0"), r"batch_size=0 must be an integer >= 1"),
    Case("batch-size-negative", lambda t, m: preset(t, "--batch-size", "-2"), r"batch_size=-2 must be an integer"),
    Case("seq-len-zero", lambda t, m: preset(t, "--seq-len", "0"), r"seq_len=0 must be a positive integer"),
    Case("seq-len-above-positions", lambda t, m: preset(t, "--seq-len", "4096"),
         r"seq_len 4096 exceeds the model's 256 positions; use --seq-len 256 or less"),
    Case("seq-len-above-hf-positions", lambda t, m: hf_args(m(), t, "--seq-len", "65"),
         r"seq_len 65 exceeds the model's 64 positions; use --seq-len 64 or less"),
    Case("lr-nan", lambda t, m: preset(t, "--lr", "nan"), r"lr=nan must be a finite positive number"),
    Case("lr-negative", lambda t, m: preset(t, "--lr", "-0.001"), r"lr=-0\.001 must be a finite positive number"),
    Case("lr-inf", lambda t, m: preset(t, "--lr", "inf"), r"lr=inf must be a finite positive number"),
    Case("micro-batches-not-dividing", lambda t, m: preset(t, "--batch-size", "4", "--micro-batches", "3"),
         r"batch_size=4 is not divisible by micro_batches=3: pick micro_batches from \[1, 2, 4\]"),
    # ------------------------------------------------------------------ NVMe
    Case("nvme-is-a-file", lambda t, m: preset(t, "--nvme", str(write(t / "states", "x"))),
         r"--nvme .*states is a file, not a directory: pass a directory"),
    Case("nvme-under-a-file", lambda t, m: preset(t, "--nvme", str(write(t / "file.txt", "x")) + "/sub"),
         r"file\.txt/sub cannot be created: .*file\.txt is a file"),
    Case("nvme-on-sysfs", lambda t, m: preset(t, "--nvme", "/sys/lohan-states"),
         r"--nvme /sys/lohan-states is on a filesystem without storage .*pass a directory on an SSD",
         marks=(pytest.mark.skipif(not os.path.isdir("/sys") or shutil.disk_usage("/sys").total != 0,
                                   reason="needs a sysfs at /sys"),)),
    Case("nvme-on-procfs", lambda t, m: preset(t, "--nvme", "/proc/lohan-states"),
         r"--nvme /proc/lohan-states is on a filesystem without storage",
         marks=(pytest.mark.skipif(not os.path.isdir("/proc") or shutil.disk_usage("/proc").total != 0,
                                   reason="needs a procfs at /proc"),)),
    Case("nvme-listed-twice", lambda t, m: preset(t, "--nvme", str(t / "a"), str(t / "a")),
         r"--nvme names .*a twice: list each SSD directory once"),
    Case("nvme-listed-twice-other-spelling", lambda t, m: preset(t, "--nvme", str(t / "a"), f"{t}/b/../a"),
         r"names .*/b/\.\./a twice \(also as .*a\)"),
    # ------------------------------------------------------------------ device
    Case("device-cuda-without-cuda", lambda t, m: preset(t, "--device", "cuda"),
         r"device 'cuda' was asked for but torch sees no CUDA device .*use --device cpu or auto",
         marks=(pytest.mark.skipif(torch.cuda.is_available(), reason="needs a machine without CUDA"),)),
    # ------------------------------------------------------------------ budgets
    Case("cpu-mem-below-one-block", lambda t, m: preset(t, "--cpu-mem", "1KiB"),
         r"cpu_mem=1\.00 KiB is too small .*Raise cpu_mem to at least \d+\.\d\d MiB"),
    Case("cpu-mem-without-unit", lambda t, m: preset(t, "--cpu-mem", "4"),
         r"cpu_mem='4': a size needs a unit; write e\.g\. 4GiB, 4MiB or 4B"),
    Case("size-without-unit-in-set", lambda t, m: preset(t, "--set", "engine.act_mem=512"),
         r"act_mem=512: a size needs a unit"),
    Case("boolean-that-is-not-one", lambda t, m: preset(t, "--set", "engine.checksums=maybe"),
         r"checksums='maybe' must be true or false"),
    Case("cpu-mem-above-ram", lambda t, m: preset(t, "--cpu-mem", "64TiB"),
         r"--cpu-mem 65536\.00 GiB is more than this machine's RAM \(\d+\.\d\d GiB\)"),
    Case("cpu-mem-malformed", lambda t, m: preset(t, "--cpu-mem", "lots"), r"cpu_mem: cannot read 'lots' as a size"),
    Case("gpu-mem-malformed", lambda t, m: preset(t, "--gpu-mem", "12XB"),
         r"gpu_mem: cannot read '12XB' as a size; write e\.g\. 8GiB"),
    Case("act-mem-malformed", lambda t, m: preset(t, "--act-mem", "12XB"), r"act_mem: cannot read '12XB' as a size"),
    # ------------------------------------------------------------------ config
    Case("yaml-malformed", lambda t, m: yaml_config(t, "model: [unclosed\nsteps: 3\n"),
         r"run\.yaml is not valid YAML \(line \d+, column \d+\)"),
    Case("yaml-is-a-list", lambda t, m: yaml_config(t, "- model\n- tiny\n"), r"a run config is a mapping of fields"),
    Case("yaml-unknown-key", lambda t, m: yaml_config(t, "model: tiny\nstepz: 3\n"),
         r"unknown run setting 'stepz' \(valid: .*steps"),
    Case("yaml-unknown-engine-key", lambda t, m: yaml_config(t, "model: tiny\nengine:\n  prefetch: 3\n"),
         r"unknown engine setting 'prefetch' \(valid: .*prefetch_depth"),
    Case("set-renamed-engine-key", lambda t, m: preset(t, "--set", "engine.chunk_bytes=2MiB"),
         r"engine setting 'chunk_bytes' is now 'stripe_bytes"),
    Case("config-missing", lambda t, m: ["--config", str(t / "nope.yaml")],
         r"config file .*nope\.yaml does not exist; pass a YAML file"),
    Case("config-is-a-directory", lambda t, m: ["--config", str(t)], r"is a directory; pass a YAML file"),
    Case("set-unknown-key", lambda t, m: preset(t, "--set", "bogus=1"), r"unknown run setting 'bogus'"),
    Case("set-unknown-section", lambda t, m: preset(t, "--set", "optim.lr=1"), r"--set optim\.lr: unknown key"),
    Case("set-without-equals", lambda t, m: preset(t, "--set", "engine.lr"), r"write KEY=VALUE"),
    Case("set-lr-wrong-type", lambda t, m: preset(t, "--set", "engine.lr=abc"),
         r"lr='abc' must be a finite positive number"),
    Case("set-nvme-wrong-type", lambda t, m: preset(t, "--set", "engine.nvme=5"), r"nvme=5: give one directory path"),
    Case("set-unreadable-value", lambda t, m: preset(t, "--set", "engine.betas=[0.9"),
         r"--set 'engine\.betas=\[0\.9': cannot read the value"),
    # ------------------------------------------------------------------ export
    Case("export-into-non-empty-dir", lambda t, m: preset(t, "--export", str(write(mkdir(t / "out") / "notes.txt",
                                                                                  "keep me").parent)),
         r"export directory .*out holds what lohan cannot prove it wrote: notes.txt .*choose another --export"),
    Case("export-onto-a-file", lambda t, m: preset(t, "--export", str(write(t / "out.bin", "x"))),
         r"export path .*out\.bin is a file; give a directory"),
    # ------------------------------------------------------------------ paths: the run layout owns every output
    Case("export-holds-the-store", lambda t, m: preset(t, "--nvme", str(t / "run" / "nvme"), "--export", str(t / "run")),
         r"--nvme .*run/nvme lies inside --export .*run, which lohan replaces whole"),
    Case("export-is-the-store", lambda t, m: preset(t, "--nvme", str(t / "x"), "--export", str(t / "x")),
         r"--nvme and --export are the same path"),
    Case("export-inside-is-fine-but-metrics-inside-export",
         lambda t, m: preset(t, "--export", str(t / "out"), "--metrics", str(t / "out" / "m.jsonl")),
         r"--metrics .*out/m\.jsonl lies inside --export"),
    Case("metrics-is-the-data", lambda t, m: preset(t, "--data", str(write(t / "d.txt", "text " * 400)),
                                                    "--metrics", str(t / "d.txt")),
         r"--metrics and --data are the same path"),
    Case("metrics-is-the-config", lambda t, m: [*yaml_config(t, "model: tiny\nsteps: 1\ndata: synthetic\n"), "--metrics",
                                                str(t / "run.yaml")],
         r"--metrics and --config are the same path"),
    Case("metrics-inside-the-model", lambda t, m: hf_args(model := m(), t, "--metrics", str(model / "config.json")),
         r"--metrics .*model/config\.json lies inside --model .*: lohan never writes into its inputs"),
    Case("metrics-a-foreign-file", lambda t, m: preset(t, "--metrics", str(write(t / "notes.txt", "mine"))),
         r"--metrics .*notes\.txt holds a file lohan did not write"),
    Case("metrics-a-directory", lambda t, m: preset(t, "--metrics", str(mkdir(t / "mdir"))),
         r"--metrics .*mdir is a directory: give the path of a file"),
    Case("metrics-plot-a-foreign-file", lambda t, m: [*preset(t), "--metrics",
                                                     str(write(t / "p.png", b"\x89PNG mine").with_suffix(".jsonl"))],
         r"the metrics plot goes to .*p\.png, which holds a file lohan did not write"),
    Case("metrics-a-store-file", lambda t, m: preset(t, "--metrics", str(t / "nvme" / "lohan.commit.json")),
         r"--metrics .*lohan\.commit\.json is the name of one of the store's own files"),
    Case("nvme-inside-the-model", lambda t, m: hf_args(model := m(), t, "--nvme", str(model / "states")),
         r"--nvme .*model/states lies inside --model"),
    Case("data-inside-the-store", lambda t, m: preset(t, "--nvme", str(t / "n"),
                                                      "--data", str(write(mkdir(t / "n") / "d.txt", "text " * 400))),
         r"--data .*n/d\.txt lies inside the store directory"),
    Case("export-is-the-model", lambda t, m: hf_args(model := m(), t, "--export", str(model)),
         r"--export and --model are the same path"),
    Case("config-inside-the-export", lambda t, m: [*yaml_config(mkdir(t / "out"), "model: tiny\nsteps: 1\ndata: synthetic\n"),
                                                   "--export", str(t / "out")],
         r"--config .*out/run\.yaml lies inside --export"),
    Case("eval-data-inside-the-store", lambda t, m: preset(t, "--nvme", str(t / "n"), "--data",
                                                           str(write(t / "d.txt", "text " * 400)), "--eval-data",
                                                           str(write(mkdir(t / "n") / "e.txt", "text " * 100))),
         r"--eval-data .*n/e\.txt lies inside the store directory"),
    Case("config-inside-the-store", lambda t, m: [*yaml_config(mkdir(t / "n"), "model: tiny\nsteps: 1\ndata: synthetic\n"),
                                                  "--nvme", str(t / "n")],
         r"--config .*n/run\.yaml lies inside the store directory"),
    Case("data-inside-the-export", lambda t, m: preset(t, "--export", str(t / "out"), "--data",
                                                       str(write(mkdir(t / "out") / "d.txt", "text " * 400))),
         r"--data .*out/d\.txt lies inside --export .*which lohan replaces whole"),
    Case("eval-data-inside-the-export", lambda t, m: preset(t, "--export", str(t / "out"), "--data",
                                                            str(write(t / "d.txt", "text " * 400)), "--eval-data",
                                                            str(write(mkdir(t / "out") / "e.txt", "text " * 100))),
         r"--eval-data .*out/e\.txt lies inside --export"),
    Case("metrics-is-the-eval-data", lambda t, m: preset(t, "--data", str(write(t / "d.txt", "text " * 400)),
                                                         "--eval-data", str(write(t / "e.txt", "text " * 100)),
                                                         "--metrics", str(t / "e.txt")),
         r"--metrics and --eval-data are the same path"),
    Case("export-staging-directory-foreign",
         lambda t, m: (write(mkdir(t / "out.partial") / "x", "mine"), preset(t, "--export", str(t / "out")))[1],
         r"export's staging directory .*out\.partial holds what lohan cannot prove it wrote"),
    # ------------------------------------------------------------------ hardware
    Case("hardware-without-dry-run", lambda t, m: preset(t, "--hardware", "rtx4090,12xP5510,256GB"),
         r"--hardware describes another machine: use it with --dry-run"),
    Case("hardware-malformed", lambda t, m: preset(t, "--dry-run", "--hardware", "rtx4090,12xQ9,lots"),
         r"cannot read hardware .*unknown SSD 'q9'"),
    # ------------------------------------------------------------------ resume
    Case("resume-nothing-to-resume", lambda t, m: preset(t, "--resume"), r"nothing to resume in .*nvme"),
    Case("existing-store-without-resume", lambda t, m: store_run(t), r"--resume.*--overwrite|--overwrite.*--resume"),
    Case("resume-other-batch-size", lambda t, m: [*store_run(t), "--resume", "--batch-size", "4"],
         r"batch_size"),
    Case("resume-other-model", lambda t, m: [*store_run(t), "--resume", "--set", "model_overrides.n_layer=3"],
         r"n_layer"),
    Case("resume-below-the-committed-step", lambda t, m: [*store_run(t, "--steps", "2"), "--resume", "--steps", "1"],
         r"committed at step 2, past the 1 steps asked for .*pass --steps above 2"),
    Case("steps-and-epochs", lambda t, m: preset(t, "--data", str(write(t / "d.txt", "some text " * 200)),
                                                 "--epochs", "1"),
         r"--steps 1 and --epochs 1 both say how long to train: pass one"),
    Case("hardware-empty", lambda t, m: preset(t, "--dry-run", "--hardware", ""), r"--hardware is empty"),
]


def snapshot(root: Path) -> dict[str, tuple[str, int, int]]:
    """Every file and directory under root: kind, size, mtime (ns)."""
    out = {}
    for dirpath, dirnames, filenames in os.walk(root):
        for name in dirnames + filenames:
            p = Path(dirpath, name)
            st = p.lstat()
            out[str(p.relative_to(root))] = ("d" if p.is_dir() else "f", 0 if p.is_dir() else st.st_size,
                                             st.st_mtime_ns)
    return out


@pytest.fixture(scope="module")
def tiny_llama(tmp_path_factory) -> Path:
    """A valid tiny Llama directory (built once: a few seconds); cases damage copies of it."""
    pytest.importorskip("transformers")
    from tests.unit.models.test_hf import make_hf_dir

    return Path(make_hf_dir(tmp_path_factory.mktemp("tiny-llama"), "llama"))


@pytest.fixture
def workdir(tmp_path, monkeypatch) -> Path:
    """tmp_path/cwd as the working directory, so relative writes would land in the snapshot too."""
    cwd = tmp_path / "cwd"
    cwd.mkdir()
    monkeypatch.chdir(cwd)
    return tmp_path


def _make_model(request: pytest.FixtureRequest, t: Path) -> MakeModel:
    def make() -> Path:
        return Path(shutil.copytree(request.getfixturevalue("tiny_llama"), t / "model"))

    return make


@pytest.mark.parametrize("case", [pytest.param(c, id=c.id, marks=c.marks) for c in CASES])
def test_bad_input_exits_2_with_one_error_and_touches_nothing(case: Case, workdir: Path, capsys, request):
    argv = case.setup(workdir, _make_model(request, workdir))
    capsys.readouterr()  # what a setup run printed
    before = snapshot(workdir)
    code = main(argv)
    out, err = capsys.readouterr()
    text = out + err
    assert code == 2, text
    assert "Traceback" not in text, text
    assert re.search(r"^error: ", text, re.M), text
    assert re.search(case.message, text, re.M | re.S), text
    assert snapshot(workdir) == before


def test_catalogue_has_at_least_30_cases():
    assert len(CASES) >= 30


# ---------------------------------------------------------------------------------- NVMe permissions
@pytest.mark.skipif(os.geteuid() == 0, reason="root writes through permission bits (the simulated case below runs)")
def test_unwritable_nvme_directory_is_refused(workdir, capsys):
    locked = workdir / "locked"
    locked.mkdir(mode=0o500)
    before = snapshot(workdir)
    assert main(preset(workdir, "--nvme", str(locked / "nvme"))) == 2
    assert re.search(r"cannot be created: .*locked is not writable by this user; fix the permissions",
                     capsys.readouterr().out)
    assert snapshot(workdir) == before


def test_unwritable_nvme_directory_is_refused_simulated(workdir, capsys, monkeypatch):
    """As root, permission bits do not stop writes; a read-only mount does, and os.access says so. Simulate it."""
    target = workdir / "readonly"
    target.mkdir()
    real_access = os.access

    def access(path, mode, *a, **k):
        return False if os.path.abspath(path) == str(target) else real_access(path, mode, *a, **k)

    monkeypatch.setattr(os, "access", access)
    before = snapshot(workdir)
    assert main(preset(workdir, "--nvme", str(target))) == 2
    text = capsys.readouterr().out
    assert re.search(r"^error: --nvme .*readonly is not writable by this user; fix the permissions", text, re.M), text
    assert snapshot(workdir) == before


# ---------------------------------------------------------------------------------- O_DIRECT
def _refuses_o_direct(directory: str) -> bool:
    probe = os.path.join(directory, f".lohan-odirect-probe-{os.getpid()}")
    try:
        os.close(os.open(probe, os.O_RDWR | os.O_CREAT | os.O_DIRECT, 0o600))
        return False
    except OSError:
        return True
    finally:
        if os.path.exists(probe):
            os.unlink(probe)


@pytest.mark.skipif(not os.path.isdir("/dev/shm") or not _refuses_o_direct("/dev/shm"),
                    reason="needs /dev/shm on a tmpfs that refuses O_DIRECT (Linux < 6.6; simulated below)")
def test_nvme_without_o_direct_is_handled_with_a_warning(workdir, caplog):
    """Not a refusal: tmpfs (and other filesystems without O_DIRECT) train through the page cache, and the
    fallback is said in a warning, because tests and laptops use such directories on purpose."""
    root = Path(f"/dev/shm/lohan-bad-inputs-{os.getpid()}")
    try:
        argv = preset(workdir, "--nvme", str(root / "nvme"), "--metrics", str(root / "m.jsonl"))
        with caplog.at_level("WARNING"):
            assert main(argv) == 0
        assert re.search(r"refuses O_DIRECT; using buffered I/O", caplog.text), caplog.text
    finally:
        shutil.rmtree(root, ignore_errors=True)


class _NoDirectOs:
    """`os` as io_engine.threads sees it on a filesystem that refuses O_DIRECT (EINVAL), like older tmpfs."""

    def __getattr__(self, name: str):
        return getattr(os, name)

    @staticmethod
    def open(path, flags, *args, **kwargs):
        if flags & os.O_DIRECT:
            raise OSError(errno.EINVAL, "Invalid argument", path)
        return os.open(path, flags, *args, **kwargs)


def test_nvme_without_o_direct_is_handled_with_a_warning_simulated(workdir, caplog, monkeypatch):
    """tmpfs accepts O_DIRECT since Linux 6.6, so the refusal is simulated where the real one cannot be had."""
    from io_engine import threads

    monkeypatch.setattr(threads, "os", _NoDirectOs())
    with caplog.at_level("WARNING"):
        assert main(preset(workdir)) == 0
    assert re.search(r"refuses O_DIRECT; using buffered I/O", caplog.text), caplog.text


# ---------------------------------------------------------------------------------- safety net
def _crash(*args, **kwargs):
    raise RuntimeError("boom in the loop")


def test_unexpected_exception_is_one_error_line_with_a_hint(workdir, capsys, monkeypatch):
    import lohan.app.train

    monkeypatch.delenv("LOHAN_DEBUG", raising=False)
    monkeypatch.setattr(lohan.app.train, "train", _crash)
    assert main(preset(workdir)) == 2
    out, err = capsys.readouterr()
    assert "error: unexpected RuntimeError: boom in the loop; run with -v for the traceback" in err
    assert "Traceback" not in out + err


def test_unexpected_exception_with_verbose_prints_the_traceback(workdir, capsys, monkeypatch):
    import lohan.app.train

    monkeypatch.delenv("LOHAN_DEBUG", raising=False)
    monkeypatch.setattr(lohan.app.train, "train", _crash)
    assert main(preset(workdir, "-v")) == 2
    err = capsys.readouterr().err
    assert "Traceback" in err and "error: unexpected RuntimeError: boom in the loop" in err


def test_unexpected_exception_propagates_under_lohan_debug(workdir, monkeypatch):
    import lohan.app.train

    monkeypatch.setenv("LOHAN_DEBUG", "1")
    monkeypatch.setattr(lohan.app.train, "train", _crash)
    with pytest.raises(RuntimeError, match="boom in the loop"):
        main(preset(workdir))


# ---------------------------------------------------------------------------------- relative paths
def test_default_config_finds_its_corpus_from_another_directory(tmp_path, monkeypatch, capsys):
    """`python /path/to/finetune.py` from elsewhere: the config's data/corpus.txt is found next to the
    repository's configs/, while the outputs stay relative to the working directory."""
    monkeypatch.chdir(tmp_path)
    assert main(["--steps", "1", "--seq-len", "32", "--batch-size", "2", "--nvme", str(tmp_path / "nvme"),
                 "--set", "model_overrides.n_layer=2", "--backend", "threads"]) == 0, capsys.readouterr()
    assert (tmp_path / "nvme" / "lohan.metrics.jsonl").exists()  # default metrics: with the store
    assert not (tmp_path / "runs").exists()


def test_relative_output_paths_of_a_config_stay_in_the_working_directory(tmp_path, monkeypatch):
    from lohan.app.cli import build_parser, load_run_config

    conf = tmp_path / "conf"
    (conf / "data").mkdir(parents=True)
    write(conf / "data" / "mine.txt", "some text " * 100)
    write(conf / "run.yaml", "model: tiny\ndata: data/mine.txt\nmetrics: out/m.jsonl\nengine:\n  nvme: [./out/nvme]\n")
    work = tmp_path / "work"
    work.mkdir()
    monkeypatch.chdir(work)
    run = load_run_config(build_parser().parse_args(["--config", str(conf / "run.yaml")]))
    assert run.data == str(conf / "data" / "mine.txt")
    assert run.metrics == "out/m.jsonl" and run.engine.nvme == ("./out/nvme",)
    write(mkdir(work / "data") / "mine.txt", "local text " * 100)
    run = load_run_config(build_parser().parse_args(["--config", str(conf / "run.yaml")]))
    assert run.data == "data/mine.txt"  # a file in the working directory wins, and keeps its spelling
    run = load_run_config(build_parser().parse_args(["--config", str(conf / "run.yaml"), "--data", "x.txt"]))
    assert run.data == "x.txt"  # command-line paths are never rewritten
