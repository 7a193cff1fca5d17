"""The run's own outputs failing (issue 42, item 10): a full disk while a checkpoint or a metrics record is written
says which file, which disk and what to do, with no traceback, and the resumed run ends with every step once; and
`--verify --export` reads an export and its checkpoints back against the checksums of their manifests."""

from __future__ import annotations

import errno
import json
from pathlib import Path

import pytest

from lohan.app.cli import main
from tests.integration.test_cli import args


def steps(path: Path) -> list[int]:
    return [json.loads(line)["step"] for line in path.read_text().splitlines()]


def test_a_full_disk_while_a_checkpoint_is_written_names_it_and_the_resume_goes_on(tmp_path, monkeypatch, capsys):
    from safetensors import SafetensorError

    import lohan.models.gpt_export as gpt_export

    real = gpt_export.save_file

    def full(*a, **k):  # what safetensors raises when the disk is full
        raise SafetensorError("Error while serializing: IoError(Os { code: 28, kind: StorageFull, message: \"No "
                              "space left on device\" })")

    out = tmp_path / "out"
    monkeypatch.setattr(gpt_export, "save_file", full)
    assert main(args(tmp_path, "--steps", "3", "--save-every", "2", "--export", str(out))) == 2
    text = "".join(capsys.readouterr())
    assert f"No space left on device while writing the checkpoint ({out / 'step-2.partial'}): the disk is full" \
        in text, text
    assert "Traceback" not in text and "unexpected" not in text and "committed at step 2 is intact" in text
    assert not (out / "step-2.partial").exists()  # the half-written checkpoint (lohan's, proven) is gone
    monkeypatch.setattr(gpt_export, "save_file", real)
    assert main(args(tmp_path, "--steps", "3", "--save-every", "2", "--export", str(out), "--resume")) == 0
    assert steps(tmp_path / "m.jsonl") == [1, 2, 3] and (out / "step-2").is_dir()
    records = [json.loads(line) for line in (tmp_path / "m.jsonl").read_text().splitlines()]
    assert "save_s" in records[1]  # step 2's checkpoint, saved by the resumed run, is in its record


def test_a_full_disk_while_a_metrics_record_is_written_names_it_and_loses_no_step(tmp_path, monkeypatch, capsys):
    import lohan.app.metrics as metrics

    real = metrics._append

    class Full:
        def __init__(self, f):
            self.f = f

        def write(self, text):
            self.f.write(text[: len(text) // 2])  # part of the line reaches the disk
            self.f.flush()
            raise OSError(errno.ENOSPC, "No space left on device")

        def __getattr__(self, name):
            return getattr(self.f, name)

    monkeypatch.setattr(metrics, "_append", lambda path: Full(real(path)))
    assert main(args(tmp_path, "--steps", "4")) == 2
    text = "".join(capsys.readouterr())
    assert f"No space left on device while writing the metrics ({tmp_path / 'm.jsonl'}): the disk is full" in text
    assert "Traceback" not in text and "JSONDecodeError" not in text
    monkeypatch.setattr(metrics, "_append", real)
    assert main(args(tmp_path, "--steps", "4", "--resume")) == 0
    assert steps(tmp_path / "m.jsonl") == [1, 2, 3, 4]  # the cut line dropped, no step lost or repeated


def test_verify_export_reads_every_file_back_against_its_manifest(tmp_path, capsys):
    out = tmp_path / "out"
    assert main(args(tmp_path, "--steps", "2", "--save-every", "1", "--export", str(out))) == 0
    capsys.readouterr()
    assert main(["--verify", "--export", str(out)]) == 0
    assert "3 folder(s) (the export and its checkpoints), all" in capsys.readouterr().out
    weights = sorted((out / "step-1").glob("*.safetensors"))[0]
    data = bytearray(weights.read_bytes())
    data[-1] ^= 0x01  # one flipped bit, size and name unchanged
    weights.write_bytes(bytes(data))
    assert main(["--verify", "--export", str(out)]) == 1
    text = capsys.readouterr().out
    assert f"damaged: {weights}: its bytes do not match the checksum lohan recorded" in text
    (tmp_path / "empty").mkdir()
    assert main(["--verify", "--export", str(tmp_path / "empty")]) == 2


@pytest.mark.parametrize("bad", ["../x", "a/b", "", "lohan-act"])
def test_the_python_api_refuses_a_store_name_that_is_not_a_file_name(tmp_path, bad):
    import lohan

    with pytest.raises(ValueError, match="name="):
        lohan.init("tiny", {"nvme": [str(tmp_path / "nvme")], "name": bad, "backend": "threads"})
    assert not (tmp_path / "nvme").exists() or not any((tmp_path / "nvme").iterdir())


@pytest.mark.parametrize("damaged", ["lohan.commit.json", "lohan.store.json"])
def test_a_store_whose_metadata_is_damaged_can_be_started_over(tmp_path, capsys, damaged):
    """The damage's message says: restore, or start over with --overwrite; the overwrite must then work (it
    discards the store by its files' names), and it still takes the run's own metrics only where it can tell
    they are its own (the store's description names it)."""
    assert main(args(tmp_path, "--steps", "1")) == 0
    (tmp_path / "nvme" / damaged).write_text('{"x":')
    assert main(args(tmp_path, "--steps", "1")) == 2
    text = "".join(capsys.readouterr())
    assert "is damaged" in text and ("start over with --overwrite" in text or "cannot tell whether" in text), text
    code = main(args(tmp_path, "--steps", "1", "--overwrite"))
    text = "".join(capsys.readouterr())
    if damaged == "lohan.commit.json":  # the description still says whose the metrics are
        assert code == 0, text
        assert steps(tmp_path / "m.jsonl") == [1]
    else:  # it cannot tell: the metrics file is left alone, and the message says what to do
        assert code == 2 and "m.jsonl holds the metrics of a lohan run" in text, text
        assert "cannot tell whether it is its own: " in text and "store.json (store description) is damaged" in text
        (tmp_path / "m.jsonl").unlink()
        (tmp_path / "m.png").unlink()
        assert main(args(tmp_path, "--steps", "1", "--overwrite")) == 0
