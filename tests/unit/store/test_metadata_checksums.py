"""Issue 42, item 8: checksums are not optional. Every metadata record lohan reads back (the store's description,
commit record, initialization progress and group record, the run state, the activation profile, the volume's
manifests) is refused as damage, with the file named and the fix, when it carries no checksum, when its checksum
does not match, or when its keys and value types are not the record's; the profile, a cache of measurements, is
set aside and measured again instead."""

from __future__ import annotations

import json
import re
import shutil
from pathlib import Path

import pytest

from io_engine import VolumeConfigError, open_volume
from io_engine.durable import json_checksum
from lohan.app.cli import main
from lohan.plan.planner import Profile
from lohan.store.group import read_decision
from lohan.store.integrity import StoreCorruptError
from lohan.store.states import StateStore

FT = ["--compute-dtype", "fp32", "--seq-len", "64", "--batch-size", "4", "--backend", "threads"]


@pytest.fixture(scope="module")
def trained(tmp_path_factory) -> Path:
    """The NVMe directory of a tiny preset run of 2 steps (copied by each test that changes it)."""
    root = tmp_path_factory.mktemp("trained")
    assert main([*FT, "--steps", "2", "--nvme", str(root / "nvme"), "--metrics", str(root / "m.jsonl")]) == 0
    return root / "nvme"


@pytest.fixture
def nvme(trained, tmp_path) -> Path:
    return Path(shutil.copytree(trained, tmp_path / "nvme"))


def resume(nvme: Path, *extra: str) -> list[str]:
    return [*FT, "--steps", "3", "--nvme", str(nvme), "--metrics", str(nvme.parent / "m.jsonl"), "--resume", *extra]


def edit(path: Path, change, checksum: bool = False) -> None:
    """Apply `change` to the JSON record at `path`; `checksum`: give it a checksum that matches (a record that
    passes its checksum but is not what lohan writes)."""
    data = json.loads(path.read_text())
    change(data)
    if checksum:
        data["checksum"] = json_checksum(data)
    path.write_text(json.dumps(data, indent=1))


def run(argv: list[str], capsys) -> tuple[int, str]:
    code = main(argv)
    out = capsys.readouterr()
    return code, out.out + out.err


@pytest.mark.parametrize("name, what", [("lohan.commit.json", "commit record"),
                                        ("lohan.store.json", "store description"),
                                        ("lohan.run.json", r"run state \(data position, RNG\)")])
def test_a_record_without_its_checksum_is_refused_as_damage(nvme, capsys, name, what):
    edit(nvme / name, lambda d: d.pop("checksum"))
    code, out = run(resume(nvme), capsys)
    assert code == 2, out
    assert re.search(rf"error: {re.escape(str(nvme / name))} \({what}\) is damaged: it carries no 'checksum' field",
                     out), out
    assert "Traceback" not in out


def test_the_commit_record_with_a_flipped_key_name_is_refused_in_a_run_and_in_verify(nvme, capsys):
    """The issue's case: `checksum` damaged into `chdcksum` gave an unexpected TypeError from Commit.__init__."""
    path = nvme / "lohan.commit.json"
    path.write_text(path.read_text().replace('"checksum"', '"chdcksum"'))
    for argv in (resume(nvme), ["--verify", "--nvme", str(nvme)]):
        code, out = run(argv, capsys)
        assert code == 2, out
        assert f"error: {path} (commit record) is damaged: it carries no 'checksum' field" in out, out
        assert "--overwrite" in out and "TypeError" not in out


@pytest.mark.parametrize("name, change, problem", [
    ("lohan.commit.json", lambda d: d.update(stpe=d.pop("step")), r"missing 'step'; unknown 'stpe'"),
    ("lohan.commit.json", lambda d: d.update(sums=[[[1, 2, 3]]] + d["sums"][1:]),
     r"the checksums of block 0 are not a list of \[state, p16\] integer pairs"),
    ("lohan.run.json", lambda d: d.update(step="2"), r"'step' is \"2\", not int"),
    ("lohan.run.json", lambda d: d["store"].pop("volume_id"), r"missing 'volume_id'"),
])
def test_a_record_that_passes_its_checksum_but_has_foreign_fields_is_refused(nvme, capsys, name, change, problem):
    edit(nvme / name, change, checksum=True)
    code, out = run(resume(nvme), capsys)
    assert code == 2, out
    assert re.search(rf"error: {re.escape(str(nvme / name))} \(.*\) is damaged: .*{problem}", out), out
    assert "Traceback" not in out


def test_initialization_progress_and_group_record_without_checksum_are_damage(nvme):
    meta = json.loads((nvme / "lohan.store.json").read_text())
    (nvme / "lohan.commit.json").unlink()  # as if the creation had stopped: status reads the progress record
    (nvme / "lohan.init.json").write_text(json.dumps({"volume_id": meta["volume_id"], "blocks_done": 1,
                                                      "sums": [[[1, 2]]]}))
    with pytest.raises(StoreCorruptError, match=r"lohan\.init\.json \(initialization progress\) is damaged: it "
                                                r"carries no 'checksum' field.*--overwrite"):
        StateStore.status([str(nvme)])
    (nvme / "rank0").mkdir()
    (nvme / "rank0" / "lohan.dp.json").write_text(json.dumps({"world": 2, "step": 1}))
    with pytest.raises(StoreCorruptError, match=r"lohan\.dp\.json \(data-parallel commit record\) is damaged: it "
                                                r"carries no 'checksum' field"):
        read_decision([str(nvme)], "lohan")


# ------------------------------------------------------------------------------------------- the profile
def _garble(path: Path) -> None:
    text = path.read_text()
    at = text.index('":', len(text) // 2)
    path.write_text(text[:at + 1] + text[at + 2:])  # one ':' gone: "Expecting ':' delimiter"


@pytest.mark.parametrize("damage", ["garbled", "without-checksum"])
def test_a_damaged_saved_profile_is_set_aside_and_measured_again(nvme, capsys, damage):
    path = nvme / "lohan.profile.json"
    if damage == "garbled":
        _garble(path)
        problem = "it does not parse as JSON (Expecting ':' delimiter"
    else:  # what lohan wrote before profiles carried a checksum
        edit(path, lambda d: d.pop("checksum"))
        problem = "it carries no 'checksum' field"
    damaged = path.read_bytes()
    code, out = run(resume(nvme), capsys)
    assert code == 0, out
    (aside,) = nvme.glob("lohan.profile.json.damaged-*")
    assert f"note: {path} (an activation profile) is damaged: {problem}" in " ".join(out.split()), out
    assert f"set aside as {aside}" in out.replace("\n", "")
    assert aside.read_bytes() == damaged  # kept as it was, for a look
    assert Profile.load(path).source == "measured"  # measured again, and saved with its checksum


def test_a_damaged_profile_from_is_refused_naming_the_file_and_the_fix(nvme, tmp_path, capsys):
    given = tmp_path / "my.profile.json"
    shutil.copy(nvme / "lohan.profile.json", given)
    _garble(given)
    code, out = run(resume(nvme, "--set", f"engine.profile_from={given}"), capsys)
    assert code == 2, out
    flat = " ".join(out.split())
    assert f"error: engine.profile_from: {given} (an activation profile) is damaged: it does not parse" in flat, out
    assert "leave profile_from unset" in flat


# ---------------------------------------------------------------------------------------- volume.json
def _volume(d: Path) -> Path:
    open_volume([str(d)], 1 << 20, backend="threads", name="v").close()
    return d / "v.volume.json"


def test_a_volume_manifest_carries_a_checksum_and_damage_is_refused(tmp_path):
    manifest = _volume(tmp_path)
    assert json.loads(manifest.read_text())["checksum"].startswith("xxh3:")
    edit(manifest, lambda d: d.update(file_size=d["file_size"] // 2))  # no other check would see this one
    with pytest.raises(VolumeConfigError, match=rf"{re.escape(str(manifest))}: damaged volume manifest \(its "
                                                r"checksum does not match its contents\).*restore the file"):
        open_volume([str(tmp_path)], 1 << 20, backend="threads", name="v")
    edit(manifest, lambda d: d.pop("checksum"))
    with pytest.raises(VolumeConfigError, match=r"damaged volume manifest \(it carries no 'checksum' field\)"):
        open_volume([str(tmp_path)], 1 << 20, backend="threads", name="v")


def test_a_version_1_manifest_is_read_and_rewritten_with_its_checksum(tmp_path):
    """Volumes created before manifests carried a checksum (version 1) still open: every store made until now
    has one. Their fields are checked, and the manifest is rewritten as version 2 on the first open."""
    manifest = _volume(tmp_path)
    legacy = {k: v for k, v in json.loads(manifest.read_text()).items() if k != "checksum"} | {"version": 1}
    manifest.write_text(json.dumps(legacy))
    open_volume([str(tmp_path)], 1 << 20, backend="threads", name="v").close()
    now = json.loads(manifest.read_text())
    assert now["version"] == 2 and now["checksum"] == json_checksum(now) and now["volume_id"] == legacy["volume_id"]
    manifest.write_text(json.dumps(legacy | {"index": "0"}))
    with pytest.raises(VolumeConfigError, match=r"damaged volume manifest \('index' is \"0\", not int\)"):
        open_volume([str(tmp_path)], 1 << 20, backend="threads", name="v")
