"""Record formats and sources: Alpaca and ShareGPT records mapped onto lohan's examples, every file type read through
``datasets`` into the token cache with windows and masks bit-identical to the in-memory ``.jsonl`` path, the cache's
reuse and kill safety, and finetune.py on each shipped example file."""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest
import torch

from lohan.data import (
    ALPACA_PROMPT,
    ALPACA_PROMPT_NO_INPUT,
    TokenDataset,
    load_jsonl,
    load_stream,
    to_example,
)
from lohan.data import token_cache as cache_module
from lohan.data.formats import check_columns
from tests.unit.data.test_data import CONVERSATION, EOT_TEMPLATE, _chat_tok

DATA_DIR = Path(__file__).resolve().parents[3] / "data"
KEYS = ("text", "prompt", "response", "messages")


# ------------------------------------------------------------------------------------------ formats
def test_alpaca_is_a_prompt_response_in_the_alpaca_template():
    with_input = to_example({"instruction": "Add.", "input": "2 and 3", "output": "5", "id": 1})
    assert with_input == {"prompt": ALPACA_PROMPT.format(instruction="Add.", input="2 and 3"), "response": "5"}
    assert with_input["prompt"].endswith("### Input:\n2 and 3\n\n### Response:\n")
    for blank in ({}, {"input": ""}, {"input": "  "}, {"input": None}):
        ex = to_example({"instruction": "Say hi.", "output": "hi", **blank}, "alpaca")
        assert ex == {"prompt": ALPACA_PROMPT_NO_INPUT.format(instruction="Say hi."), "response": "hi"}
    with pytest.raises(ValueError, match='the "output" is empty; fill it in or drop the record'):
        to_example({"instruction": "x", "output": ""}, unit="record")
    with pytest.raises(ValueError, match='an Alpaca record needs "instruction" and "output" keys'):
        to_example({"instruction": "x"}, "alpaca")
    with pytest.raises(ValueError, match='the "input" value must be a string, got int 3'):
        to_example({"instruction": "x", "input": 3, "output": "y"})


def test_sharegpt_turns_become_chat_messages():
    turns = [{"from": "system", "value": "be brief"}, {"from": "human", "value": "q"}, {"from": "gpt", "value": "a"}]
    assert to_example({"conversations": turns, "id": "x"}) == {"messages": [
        {"role": "system", "content": "be brief"}, {"role": "user", "content": "q"},
        {"role": "assistant", "content": "a"}]}
    for bad, problem in [
        ([], 'the "conversations" value must be a non-empty list'),
        ([{"from": "human", "value": "q"}, {"from": "bing", "value": "a"}], 'turn 2: the "from" value "bing" is not'),
        ([{"from": "human", "value": 3}], 'turn 1 (human): the "value" must be a string, got int 3'),
        ([{"from": "human", "value": "q"}], "has no assistant message"),
        (["hi"], 'turn 1: expected a {"from", "value"} object'),
    ]:
        with pytest.raises(ValueError, match=None) as e:
            to_example({"conversations": bad}, "sharegpt")
        assert problem in str(e.value), (bad, str(e.value))


def test_auto_reads_each_record_by_its_keys_and_a_named_format_ignores_the_others():
    alpaca = {"instruction": "i", "output": "o", "text": "the rendered record"}  # HF Alpaca sets carry such a text
    assert "response" in to_example(alpaca)
    chat = {"messages": [{"role": "user", "content": "q"}, {"role": "assistant", "content": "a"}],
            "conversations": [{"from": "human", "value": "other"}]}
    assert to_example(chat)["messages"][0]["content"] == "q"  # messages first
    assert to_example({"body": "words", "text": "not this"}, text_field="body") == {"text": "words"}
    assert to_example({"prompt": "p", "response": "r", "text": "t"}, "prompt-response") == {"prompt": "p",
                                                                                             "response": "r"}
    with pytest.raises(ValueError, match='has both "text" and "prompt"/"response" keys'):
        to_example({"prompt": "p", "response": "r", "text": "t"})
    with pytest.raises(ValueError, match=r"--data-format messages needs the key\(s\) 'messages'; it has keys"):
        to_example({"text": "t"}, "messages")
    with pytest.raises(ValueError, match="needs a \"text\" key .* it has keys \\['a'\\]; Alpaca .* --text-field"):
        to_example({"a": 1})


def test_columns_are_checked_up_front_naming_them_and_the_fix():
    assert check_columns(["instruction", "input", "output", "text"]) == (
        "alpaca (instruction, input, output; records without them: text)")  # HF Alpaca sets carry a text column
    assert check_columns(["id", "body"], text_field="body") == "text (column 'body')"
    assert check_columns(["text", "prompt", "response"]) == "prompt-response (prompt, response; records without them: text)"
    with pytest.raises(ValueError, match=r"no column says what its records are; its columns are 'q', 'a'\. .*"
                                         r"--data-format FORMAT .*--text-field NAME"):
        check_columns(["q", "a"], source="'qa.csv'")
    with pytest.raises(ValueError, match=r"--data-format sharegpt needs the column\(s\) 'conversations'"):
        check_columns(["messages"], "sharegpt")
    with pytest.raises(ValueError, match=r"has no column 'content' to read the text from; its columns are 'body'"):
        check_columns(["body"], "text", "content")


# -------------------------------------------------------------------------------- the same windows
def _rows(n: int) -> list[dict]:
    """Text and prompt/response records of varied lengths (byte-level: every character is a token)."""
    rows: list[dict] = []
    for i in range(n):
        if i % 3 == 2:
            rows.append({"text": f"Plain text number {i}, {'long ' * (i % 7)}and done.\n"})
        else:
            rows.append({"prompt": f"Q{i}: what is {i} + {i % 11}? ", "response": f"A: {i + i % 11}.\n"})
    return rows


def _columns(rows: list[dict]) -> dict[str, list]:
    keys = [k for k in KEYS if any(k in r for r in rows)]
    return {k: [r.get(k) for r in rows] for k in keys}


def _write(kind: str, rows: list[dict], folder: Path) -> Path:
    """The records as a source of `kind`; a missing key is a null in a table."""
    import datasets
    import pyarrow as pa
    import pyarrow.parquet as pq

    path = folder / f"records.{kind}"
    if kind == "jsonl":
        path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    elif kind == "json":
        path.write_text(json.dumps(rows))
    elif kind == "parquet":
        pq.write_table(pa.table(_columns(rows)), path)
    elif kind == "arrow":
        table = pa.table(_columns(rows))
        with pa.OSFile(str(path), "wb") as f, pa.ipc.new_file(f, table.schema) as w:
            w.write_table(table)
    elif kind == "csv":
        import csv

        with open(path, "w", newline="") as f:
            w = csv.DictWriter(f, fieldnames=list(_columns(rows)))
            w.writeheader()
            w.writerows(rows)
    elif kind == "saved":
        path = folder / "saved"
        datasets.Dataset.from_dict(_columns(rows)).save_to_disk(str(path))
    elif kind == "saved-dict":
        path = folder / "saved-dict"
        other = datasets.Dataset.from_dict(_columns(rows[:5]))
        datasets.DatasetDict({"test": other, "train": datasets.Dataset.from_dict(_columns(rows))}).save_to_disk(
            str(path))
    return path


def _assert_same(got: TokenDataset, want: TokenDataset) -> None:
    assert torch.equal(got.windows, want.windows)
    assert (got.loss_mask is None) == (want.loss_mask is None)
    if want.loss_mask is not None:
        assert torch.equal(got.loss_mask, want.loss_mask)


@pytest.mark.parametrize("kind", ["jsonl", "json", "parquet", "arrow", "saved", "saved-dict"])
def test_every_source_gives_the_windows_and_masks_of_the_in_memory_jsonl_path(tmp_path, kind):
    rows = _rows(2_500)  # more than one map batch (1,000 records): the batches' streams must join exactly
    want = TokenDataset.from_file(_write("jsonl", rows, tmp_path), seq_len=37)
    (tmp_path / kind).mkdir()
    got = TokenDataset.from_source(_write(kind, rows, tmp_path / kind), seq_len=37)
    _assert_same(got, want)
    assert not got.windows.is_contiguous()  # views of the one mapped stream, not a copy per window
    assert got.windows.untyped_storage().nbytes() == 8 * (len("".join(  # the whole stream, byte-level
        r.get("text", "") + r.get("prompt", "") + r.get("response", "") for r in rows).encode()))
    assert "; 833 text, 1,667 prompt/response examples, " in got.description


def test_csv_alpaca_sharegpt_and_chat_sources_match_their_jsonl_equivalents(tmp_path):
    qa = [r for r in _rows(60) if "prompt" in r]
    (tmp_path / "csv").mkdir()
    _assert_same(TokenDataset.from_source(_write("csv", qa, tmp_path / "csv"), seq_len=16),
                 TokenDataset.from_file(_write("jsonl", qa, tmp_path), seq_len=16))

    alpaca = [{"instruction": f"Add {i} and {i}.", "input": "" if i % 2 else f"{i}, {i}", "output": str(2 * i)}
              for i in range(40)]
    (tmp_path / "alpaca.json").write_text(json.dumps(alpaca))
    as_pr = tmp_path / "as_pr.jsonl"
    as_pr.write_text("".join(json.dumps(to_example(r)) + "\n" for r in alpaca))
    _assert_same(TokenDataset.from_source(tmp_path / "alpaca.json", seq_len=16, data_format="alpaca"),
                 TokenDataset.from_file(as_pr, seq_len=16))

    tok = _chat_tok(EOT_TEMPLATE)  # BOS, EOS and a chat template: the mixed forms of a real HF run
    mixed = [{"messages": CONVERSATION}, {"prompt": "what is two plus four ?", "response": "six"},
             {"text": "the sky is blue"}] * 30
    ref = TokenDataset.from_file(_write("jsonl", mixed, tmp_path), seq_len=9, tokenizer=tok)
    assert ref.loss_mask is not None
    (tmp_path / "mixed").mkdir()
    _assert_same(TokenDataset.from_source(_write("parquet", mixed, tmp_path / "mixed"), seq_len=9, tokenizer=tok), ref)
    roles = {"system": "system", "user": "human", "assistant": "gpt"}
    sharegpt = [{"conversations": [{"from": roles[m["role"]], "value": m["content"]} for m in CONVERSATION]}] * 30
    (tmp_path / "sg.jsonl").write_text("".join(json.dumps(r) + "\n" for r in sharegpt))
    chats = [{"messages": CONVERSATION}] * 30
    _assert_same(TokenDataset.from_source(tmp_path / "sg.jsonl", seq_len=9, tokenizer=tok),
                 TokenDataset.from_file(_write("jsonl", chats, tmp_path), seq_len=9, tokenizer=tok))


def test_bad_records_are_named_by_line_or_record_number(tmp_path):
    lines = ['{"text": "fine"}', "", '{"instruction": "x", "output": "  "}']
    (tmp_path / "bad.jsonl").write_text("\n".join(lines) + "\n")
    with pytest.raises(ValueError, match=r"bad\.jsonl' line 3: the \"output\" is empty; fill it in or drop the line"):
        TokenDataset.from_source(tmp_path / "bad.jsonl", seq_len=4)
    (tmp_path / "bad.json").write_text(json.dumps([{"prompt": "p", "response": "r"}, {"prompt": "p", "response": 5}]))
    with pytest.raises(ValueError, match=r"bad\.json' record 2: the \"response\" value must be a string, got int 5"):
        TokenDataset.from_source(tmp_path / "bad.json", seq_len=4)
    (tmp_path / "broken.parquet").write_bytes(b"PAR1 not really")
    with pytest.raises(ValueError, match=r"broken\.parquet' could not be read as PARQUET: "):
        TokenDataset.from_source(tmp_path / "broken.parquet", seq_len=4)
    assert not any(p.name.startswith(("bad", "broken")) for p in Path(os.environ["LOHAN_DATA_CACHE"]).iterdir())


# -------------------------------------------------------------------------------------- the cache
def _count_encodes(monkeypatch) -> dict[str, int]:
    calls = {"n": 0}
    real = cache_module.encode_examples

    def counting(*a, **k):
        calls["n"] += 1
        return real(*a, **k)

    monkeypatch.setattr(cache_module, "encode_examples", counting)
    return calls


def test_a_cached_stream_is_reused_for_any_seq_len_and_rebuilt_when_the_source_changes(tmp_path, monkeypatch):
    root = tmp_path / "cache"
    path = _write("jsonl", _rows(300), tmp_path)
    calls = _count_encodes(monkeypatch)
    first = TokenDataset.from_source(path, seq_len=16, cache_root=root)
    assert calls["n"] == 1 and "token cache built" in first.description
    again = TokenDataset.from_source(path, seq_len=16, cache_root=root)
    longer = TokenDataset.from_source(path, seq_len=64, cache_root=root)
    assert calls["n"] == 1 and "token cache reused" in again.description  # no tokenizing on a resume
    _assert_same(again, first)
    assert longer.seq_len == 64 and len([p for p in root.iterdir() if p.is_dir()]) == 1
    assert sorted(p.name for p in next(root.iterdir()).iterdir()) == ["manifest.json", "mask.bin", "tokens.bin"]
    path.write_text(path.read_text() + json.dumps({"text": "one more record"}) + "\n")
    TokenDataset.from_source(path, seq_len=16, cache_root=root)
    assert calls["n"] == 2 and len([p for p in root.iterdir() if p.is_dir()]) == 2
    assert not list(root.glob("*.lock")) and not list(root.glob("*.partial"))


def test_a_dry_run_writes_no_cache_but_uses_a_built_one(tmp_path, monkeypatch):
    root = tmp_path / "cache"
    path = _write("jsonl", _rows(100), tmp_path)
    dry = TokenDataset.from_source(path, seq_len=16, cache_root=root, write_cache=False)
    assert not root.exists() and "not cached" in dry.description
    built = TokenDataset.from_source(path, seq_len=16, cache_root=root)
    _assert_same(dry, built)
    calls = _count_encodes(monkeypatch)
    assert "reused" in TokenDataset.from_source(path, seq_len=16, cache_root=root, write_cache=False).description
    assert calls["n"] == 0


def test_a_build_killed_before_its_manifest_is_not_trusted_and_resumes_from_the_map_output(tmp_path, monkeypatch):
    root = tmp_path / "cache"
    path = _write("parquet", _rows(300), tmp_path)

    def killed(*a, **k):
        raise KeyboardInterrupt

    monkeypatch.setattr(cache_module, "_write_manifest", killed)
    with pytest.raises(KeyboardInterrupt):
        TokenDataset.from_source(path, seq_len=16, cache_root=root)
    monkeypatch.undo()
    (partial,) = root.glob("*.partial")
    assert not [p for p in root.iterdir() if p.is_dir() and p != partial]  # nothing a later run would trust
    (partial / "tmpkilledmap").write_bytes(b"half of a map's output")  # what a map killed midway leaves
    calls = _count_encodes(monkeypatch)
    ds = TokenDataset.from_source(path, seq_len=16, cache_root=root)
    assert calls["n"] == 0  # the map's finished Arrow file was reused: no second tokenization
    _assert_same(ds, TokenDataset.from_file(_write("jsonl", _rows(300), tmp_path), seq_len=16))
    assert not list(root.glob("*.partial")) and not list(root.glob("*/tmp*"))


def test_concurrent_builders_of_one_source_tokenize_it_once(tmp_path, monkeypatch):
    """Data-parallel ranks start together: the lock makes one build the cache and the others map it."""
    import threading

    root = tmp_path / "cache"
    path = _write("parquet", _rows(600), tmp_path)
    calls = _count_encodes(monkeypatch)
    got: list[TokenDataset] = []
    threads = [threading.Thread(target=lambda: got.append(TokenDataset.from_source(path, seq_len=16, cache_root=root)))
               for _ in range(3)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert len(got) == 3 and calls["n"] == 1
    assert sorted("reused" in ds.description for ds in got) == [False, True, True]
    for ds in got[1:]:
        _assert_same(ds, got[0])
    assert len(list(root.iterdir())) == 1  # the folder; no lock file or .partial left


def test_the_cache_is_never_written_inside_a_saved_dataset(tmp_path):
    saved = _write("saved", _rows(50), tmp_path)
    with pytest.raises(ValueError, match="lies inside the data folder .*never writes into its inputs"):
        load_stream(saved, cache_root=saved / "cache")
    assert not (saved / "cache").exists()


def test_split_picks_a_split_of_a_saved_dataset_dict(tmp_path):
    path = _write("saved-dict", _rows(50), tmp_path)
    assert len(TokenDataset.from_source(path, seq_len=8, split="test")) < len(TokenDataset.from_source(path, seq_len=8))
    with pytest.raises(ValueError, match=r"has no split 'dev'; its splits are 'test', 'train'"):
        TokenDataset.from_source(path, seq_len=8, split="dev")


# --------------------------------------------------------------------- finetune.py on each example
@pytest.fixture(scope="module")
def chat_model(tmp_path_factory) -> str:
    """A tiny Llama whose tokenizer (trained on the corpus) has a chat template, for the chat examples."""
    pytest.importorskip("transformers")
    import importlib.util

    spec = importlib.util.spec_from_file_location("make_tiny_hf", DATA_DIR.parent / "scripts" / "make_tiny_hf.py")
    make_tiny_hf = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(make_tiny_hf)
    return str(make_tiny_hf.make(tmp_path_factory.mktemp("chat") / "llama", "llama", layers=1, hidden=32, heads=2,
                                 vocab=300))


EXAMPLES = [
    ("alpaca_example.json", ["--data-format", "alpaca"], "alpaca (instruction, input, output); 40 prompt/response"),
    ("prompt_response_example.parquet", [], "prompt-response (prompt, response); 40 prompt/response"),
    ("text_example.csv", ["--text-field", "body"], "text (column 'body'); 40 text"),
    ("sharegpt_example.jsonl", ["--data-format", "sharegpt"], "sharegpt, line by line; 30 chat"),
    ("messages_example.arrow", [], "messages (messages); 30 chat"),
    ("saved", ["--split", "train"], "alpaca (instruction, input, output); 40 prompt/response"),
]


@pytest.mark.parametrize(("name", "flags", "read"), EXAMPLES, ids=[e[0] for e in EXAMPLES])
def test_finetune_trains_on_each_example_file(tmp_path, capsys, request, name, flags, read):
    from lohan.app.cli import main

    if name == "saved":  # a save_to_disk folder, made here from the Alpaca example (binary: not committed)
        import datasets

        records = json.loads((DATA_DIR / "alpaca_example.json").read_text())
        data = tmp_path / "saved"
        datasets.DatasetDict({"train": datasets.Dataset.from_list(records)}).save_to_disk(str(data))
    else:
        data = DATA_DIR / name
    assert data.stat().st_size < 20_000 or data.is_dir()
    chat = "chat" in read
    model = ["--model", request.getfixturevalue("chat_model"), "--lr", "1e-3"] if chat else [
        "--set", "model_overrides.n_layer=2"]
    argv = ["--data", str(data), *flags, *model, "--nvme", str(tmp_path / "nvme"), "--metrics", str(tmp_path / "m.jsonl"),
            "--batch-size", "2", "--seq-len", "32", "--steps", "2", "--backend", "threads"]
    assert main(argv) == 0
    out = capsys.readouterr().out
    assert f"data: {data}: {read}" in out, out
    records = [json.loads(line) for line in (tmp_path / "m.jsonl").read_text().splitlines()]
    assert [r["step"] for r in records] == [1, 2] and all(r["loss"] > 0 for r in records)


def test_the_example_files_are_what_their_script_makes_and_the_readme_lists(tmp_path):
    import importlib.util

    import pyarrow.feather
    import pyarrow.parquet as pq

    spec = importlib.util.spec_from_file_location("mfe", DATA_DIR.parent / "scripts" / "make_format_examples.py")
    script = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(script)
    assert script.main(["--out", str(tmp_path)]) == 0
    readme = (DATA_DIR / "README.md").read_text()
    for name in ("alpaca_example.json", "sharegpt_example.jsonl", "text_example.csv"):
        assert (tmp_path / name).read_bytes() == (DATA_DIR / name).read_bytes(), name
    assert pq.read_table(tmp_path / "prompt_response_example.parquet").equals(
        pq.read_table(DATA_DIR / "prompt_response_example.parquet"))
    assert pyarrow.feather.read_table(tmp_path / "messages_example.arrow").equals(
        pyarrow.feather.read_table(DATA_DIR / "messages_example.arrow"))
    for name, *_ in EXAMPLES[:-1]:
        assert f"`{name}`" in readme, name
    rows = [json.loads(line) for line in (DATA_DIR / "sharegpt_example.jsonl").read_text().splitlines()]
    assert len(rows) == 30 and {t["from"] for r in rows for t in r["conversations"]} == {"system", "human", "gpt"}
    assert load_jsonl(DATA_DIR / "sharegpt_example.jsonl")[0]["messages"][0]["role"] in ("system", "user")


def test_eval_data_takes_a_split_of_a_saved_dataset_and_a_dry_run_writes_no_cache(tmp_path, monkeypatch, capsys):
    from lohan.app.cli import main

    monkeypatch.setenv("LOHAN_DATA_CACHE", str(tmp_path / "cache"))
    data = _write("saved-dict", _rows(400), tmp_path)
    run = ["--data", str(data), "--nvme", str(tmp_path / "nvme"), "--metrics", str(tmp_path / "m.jsonl"),
           "--batch-size", "2", "--seq-len", "32", "--steps", "2", "--backend", "threads",
           "--set", "model_overrides.n_layer=2"]
    assert main([*run, "--eval-data", str(data), "--dry-run"]) == 0
    assert "tokenized for this dry run, not cached" in capsys.readouterr().out
    assert not (tmp_path / "cache").exists()
    assert main([*run, "--eval-data", str(data), "--eval-split", "test"]) == 0
    out = capsys.readouterr().out
    assert f"sequences from {data}, at the end" in out and "token cache built" in out and "eval after step" in out
    assert [json.loads(line)["step"] for line in (tmp_path / "m.jsonl").read_text().splitlines()] == [1, 2]
    assert main([*run, "--eval-split", "test"]) == 2
    assert "eval_split picks a split of eval_data" in capsys.readouterr().err
