"""Issue 42, items 7 and 10: the token cache is checksummed. Flipped bytes in `tokens.bin` / `mask.bin` were
trained on ("token cache reused"), or met the embedding as an IndexError after the store was created. Now every
reuse checks the folder against its manifest (sizes and XXH3-64 checksums); a damaged folder is set aside (renamed,
never removed) and built again, with a warning naming what was wrong and where it went; token ids are checked
against the model's vocabulary before anything is written; and a full disk while building names the folder, the
file and the fix, and leaves nothing a later run could take for a cache."""

from __future__ import annotations

import errno
import json
import logging
import threading
from pathlib import Path

import pytest
import xxhash

from io_engine.durable import json_checksum
from lohan.app.cli import main
from lohan.data import TokenDataset
from lohan.data import token_cache as cache_module
from tests.unit.data.test_data_formats import _assert_same, _rows, _write

WARN = logging.WARNING


def built(tmp_path: Path, n: int = 200) -> tuple[Path, Path, TokenDataset]:
    """(source, cache folder, the dataset it must give) of a freshly built cache under tmp_path/cache. The dataset
    is read in memory (`from_file`): one mapped from the cache would see the bytes a test then flips in it."""
    source = _write("jsonl", _rows(n), tmp_path)
    assert "token cache built" in TokenDataset.from_source(source, seq_len=16, cache_root=tmp_path / "cache").description
    (folder,) = [p for p in (tmp_path / "cache").iterdir() if p.is_dir()]
    return source, folder, TokenDataset.from_file(source, seq_len=16)


def flip_byte(path: Path, at: int) -> None:
    data = bytearray(path.read_bytes())
    data[at] ^= 0x01
    path.write_bytes(bytes(data))


def edit_manifest(folder: Path, change, checksum: bool = True) -> None:
    path = folder / "manifest.json"
    data = json.loads(path.read_text())
    change(data)
    if checksum:
        data["checksum"] = json_checksum(data)
    path.write_text(json.dumps(data))


def reload(source: Path, tmp_path: Path, **kw) -> TokenDataset:
    return TokenDataset.from_source(source, seq_len=16, cache_root=tmp_path / "cache", **kw)


@pytest.mark.parametrize("file, at", [("tokens.bin", 8 * 40), ("mask.bin", 41)])
def test_flipped_bytes_are_found_and_the_folder_is_set_aside_and_built_again(tmp_path, caplog, file, at):
    source, folder, first = built(tmp_path)
    flip_byte(folder / file, at)
    damaged = (folder / file).read_bytes()
    with caplog.at_level(WARN):
        again = reload(source, tmp_path)
    assert "token cache built" in again.description  # not "reused": the flipped byte is never trained on
    _assert_same(again, first)
    (aside,) = tmp_path.joinpath("cache").glob(f"{folder.name}.damaged-*")
    assert (aside / file).read_bytes() == damaged  # kept whole, for a look
    assert f"the token cache {folder} is damaged: {file} does not match the checksum in its manifest.json" in \
        caplog.text and f"set aside as {aside}; building it again" in caplog.text
    assert "token cache reused" in reload(source, tmp_path).description  # the rebuilt folder is trusted


@pytest.mark.parametrize("damage, problem", [
    ("truncated", r"tokens\.bin has \d+ bytes, its manifest says \d+"),
    ("edited", r"its manifest\.json: its checksum does not match its contents"),
    ("no-checksum", r"its manifest\.json: it carries no 'checksum' field"),
    ("foreign-field", r"its manifest\.json: missing 'files'"),
    ("not-json", r"its manifest\.json: it does not parse as JSON"),
])
def test_a_damaged_manifest_or_file_is_set_aside_too(tmp_path, caplog, damage, problem):
    source, folder, first = built(tmp_path)
    if damage == "truncated":
        (folder / "tokens.bin").write_bytes((folder / "tokens.bin").read_bytes()[:-8])
    elif damage == "edited":
        edit_manifest(folder, lambda d: d.update(n_tokens=d["n_tokens"] - 1), checksum=False)
    elif damage == "no-checksum":
        edit_manifest(folder, lambda d: d.pop("checksum"), checksum=False)
    elif damage == "foreign-field":
        edit_manifest(folder, lambda d: d.pop("files"))
    else:
        (folder / "manifest.json").write_text('{"version": 2, "key": ')
    with caplog.at_level(WARN):
        _assert_same(reload(source, tmp_path), first)
    assert len(list(tmp_path.joinpath("cache").glob(f"{folder.name}.damaged-*"))) == 1
    import re

    assert re.search(rf"the token cache {re.escape(str(folder))} is damaged: {problem}", caplog.text), caplog.text


def test_a_dry_run_neither_uses_nor_moves_a_damaged_folder(tmp_path, caplog):
    source, folder, first = built(tmp_path)
    flip_byte(folder / "tokens.bin", 8 * 3)
    with caplog.at_level(WARN):
        dry = reload(source, tmp_path, write_cache=False)
    _assert_same(dry, first)
    assert "not cached" in dry.description and "this dry run tokenizes into a temporary folder" in caplog.text
    assert [p.name for p in tmp_path.joinpath("cache").iterdir()] == [folder.name]  # nothing written


def test_processes_that_meet_one_damaged_folder_set_it_aside_once(tmp_path):
    source, folder, first = built(tmp_path, n=600)
    flip_byte(folder / "tokens.bin", 8 * 100)
    got: list[TokenDataset] = []
    threads = [threading.Thread(target=lambda: got.append(reload(source, tmp_path))) for _ in range(3)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert len(got) == 3 and sorted("reused" in ds.description for ds in got) == [False, True, True]
    for ds in got:
        _assert_same(ds, first)
    assert len(list(tmp_path.joinpath("cache").glob("*.damaged-*"))) == 1


# --------------------------------------------------------------------------------------------- vocabulary
def test_token_ids_outside_the_vocabulary_are_refused_naming_the_source(tmp_path):
    source = _write("jsonl", _rows(50), tmp_path)  # byte-level: ids up to ord("x")
    with pytest.raises(ValueError, match=rf"'{source}': the tokenizer made token id 120, outside the model's "
                                         r"vocabulary of 100 \(ids 0 to 99\)"):
        TokenDataset.from_source(source, seq_len=16, cache_root=tmp_path / "cache", vocab_size=100)
    text = tmp_path / "notes.txt"
    text.write_text("zzz " * 100)
    with pytest.raises(ValueError, match="token id 122, outside the model's vocabulary of 100"):
        TokenDataset.from_source(text, seq_len=16, vocab_size=100)
    assert len(TokenDataset.from_source(source, seq_len=16, cache_root=tmp_path / "cache", vocab_size=121)) > 0


def test_a_cache_with_an_id_beyond_the_models_vocabulary_is_refused_before_the_store_is_created(tmp_path, capsys,
                                                                                               monkeypatch):
    """The IndexError of the issue: an id the embedding does not have. Here the cache is whole (its checksums
    match) but holds id 300 (a tokenizer that does not fit the model): the run stops before writing anything."""
    monkeypatch.setenv("LOHAN_DATA_CACHE", str(tmp_path / "cache"))
    source, folder, _ = built(tmp_path)
    tokens = bytearray((folder / "tokens.bin").read_bytes())
    tokens[0:8] = (300).to_bytes(8, "little")
    (folder / "tokens.bin").write_bytes(bytes(tokens))
    edit_manifest(folder, lambda d: (d["files"].update({"tokens.bin": xxhash.xxh3_64_hexdigest(bytes(tokens))}),
                                     d.update(ids=[d["ids"][0], 300])))
    nvme = tmp_path / "nvme"
    code = main(["--data", str(source), "--nvme", str(nvme), "--compute-dtype", "fp32", "--seq-len", "16",
                 "--batch-size", "4", "--steps", "2", "--backend", "threads"])
    out = capsys.readouterr()
    assert code == 2, out
    assert f"error: '{source}': the tokenizer made token id 300, outside the model's vocabulary of 256" in \
        " ".join(out.out.split())
    assert not nvme.exists()


# ------------------------------------------------------------------------------------------------ disk full
def _enospc(filename: str | None = None) -> OSError:
    return OSError(errno.ENOSPC, "No space left on device", *([filename] if filename else []))


def _full_when_writing_tokens(monkeypatch) -> None:
    """The cache's own write of tokens.bin fails as on a full disk (f.write: no file name in the error)."""
    real = open

    class Full:
        def __init__(self, f):
            self.f = f

        def write(self, data):
            raise _enospc()

        def __getattr__(self, name):
            return getattr(self.f, name)

        def __enter__(self):
            return self

        def __exit__(self, *exc):
            self.f.close()

    def open_(path, mode="r", *a, **k):
        f = real(path, mode, *a, **k)
        return Full(f) if str(path).endswith("tokens.bin") and "w" in mode else f

    monkeypatch.setattr(cache_module, "open", open_, raising=False)


def _full_in_the_reader(monkeypatch) -> None:
    """datasets' copy of the source fails on a full disk, and the reader wraps the error in its own (as
    records.open_records does for pyarrow's), the OSError only in its context."""
    def open_records(path, kind, work_dir, *a, **k):
        try:
            raise _enospc(str(Path(work_dir) / "json" / "data-00000.arrow"))
        except OSError as e:
            raise ValueError(f"training data could not be read as JSON: OSError: {e}") from None

    monkeypatch.setattr(cache_module, "open_records", open_records)


@pytest.mark.parametrize("where", ["tokens", "reader"])
def test_a_full_disk_names_the_folder_and_the_fix_and_leaves_nothing(tmp_path, monkeypatch, where):
    source = _write("jsonl", _rows(100), tmp_path)
    (_full_when_writing_tokens if where == "tokens" else _full_in_the_reader)(monkeypatch)
    with pytest.raises(ValueError) as info:
        reload(source, tmp_path)
    msg = str(info.value)
    assert msg.startswith(f"the disk is full while building the token cache in {tmp_path / 'cache'}"), msg
    assert ".partial (writing " in msg if where == "reader" else ".partial with " in msg
    assert "MiB left. " in msg and "set LOHAN_DATA_CACHE to a folder on a disk with room" in msg
    assert [p.suffix for p in tmp_path.joinpath("cache").iterdir()] == []  # no folder, no .partial, no lock
    monkeypatch.undo()
    assert "token cache built" in reload(source, tmp_path).description


def test_a_full_disk_while_building_is_one_error_line_of_the_cli(tmp_path, monkeypatch, capsys):
    monkeypatch.setenv("LOHAN_DATA_CACHE", str(tmp_path / "cache"))
    source = _write("jsonl", _rows(100), tmp_path)
    _full_when_writing_tokens(monkeypatch)
    code = main(["--data", str(source), "--nvme", str(tmp_path / "nvme"), "--compute-dtype", "fp32", "--seq-len",
                 "16", "--batch-size", "4", "--steps", "2", "--backend", "threads"])
    out = capsys.readouterr()
    assert code == 2
    assert "error: the disk is full while building the token cache in" in out.out and "Errno" not in out.out
    assert not (tmp_path / "nvme").exists()
