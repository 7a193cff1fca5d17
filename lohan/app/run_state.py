"""A run's state beside its store: what a resume needs that the store does not keep (the data position, the RNG,
the settings a resume may change), written atomically for each committed step and checked when read back."""

from __future__ import annotations

import base64
import dataclasses
import io
from pathlib import Path
from typing import Any

import torch

from lohan.app.inputs import Model
from lohan.config import SCHEDULE_FIELDS, EngineConfig, RunConfig
from lohan.runtime.engine import Engine
from lohan.store.integrity import check_record, read_json_checked, write_json_atomic

RUN_STATE_VERSION = 2


def run_state_path(run: RunConfig) -> Path:
    return Path(run.engine.store.nvme[0]) / f"{run.engine.store.name}.run.json"


def _fingerprint(run: RunConfig, seq_len: int) -> dict[str, Any]:
    fp = {"model": run.model, "data": run.data, "batch_size": run.batch_size, "seq_len": seq_len,
          "seed": run.engine.execution.seed}
    if run.eval_fraction is not None:  # it takes sequences out of the training data (eval_data does not)
        fp["eval_fraction"] = run.eval_fraction
    # how the records are read; only when set, so that a run saved before these settings existed still resumes
    for key, default in (("data_format", "auto"), ("text_field", None), ("split", None)):
        if getattr(run, key) != default:
            fp[key] = getattr(run, key)
    return fp


def save_run_state(run: RunConfig, seq_len: int, engine: Engine, iterator: dict | None,
                   prev: dict | None = None) -> dict:
    """Atomically record what a resume needs beyond the store, for its committed version: the data
    position (`iterator`: the batch iterator's state just after the committed step's batch; None for a
    stream that is positioned by the step count) and the RNG states. `prev`, the state this call returned
    for the step before, is kept beside it: with write-behind the store's durable commit can trail the
    step count by one (`Engine.committed_step`), and with a durability interval (`engine.persist_every`) by up to
    the interval: `prev` is then the state of that durable step, which a resume takes."""
    buf = io.BytesIO()
    torch.save(torch.get_rng_state(), buf)
    step = engine.step_count
    state = {"version": RUN_STATE_VERSION, "step": step, "run": _fingerprint(run, seq_len),
             "schedule": schedule_settings(engine.cfg), "activations": {"act_compress": engine.cfg.activations.act_compress},
             "store": {"step": step, "slot": engine.store.slot, "volume_id": engine.store.volume.volume_id},
             "iterator": iterator,
             "torch_rng": base64.b64encode(buf.getvalue()).decode()}
    keep = _durable_state(prev, engine.committed_step) if engine.committed_step < step else None
    write_json_atomic(run_state_path(run), {**state, "prev": keep})
    return state


def _durable_state(prev: dict | None, durable: int) -> dict | None:
    """The run state of step `durable` (the last durable one) among `prev` and the state kept beside it."""
    for state in (prev, (prev or {}).get("prev")):
        if state is not None and state["step"] == durable:
            return {k: v for k, v in state.items() if k != "prev"}
    return None


RESUMABLE_SETTINGS = (*SCHEDULE_FIELDS, "max_grad_norm")
"""The settings a resume may change, saved with the run state by their flat names (as before the config had
sections, so every saved state compares): the schedule section and the clipping norm."""


def schedule_settings(e: EngineConfig) -> dict[str, Any]:
    """The optimizer settings a resume may change (saved with the run state; a change is said, not refused)."""
    settings = e.settings()
    return {k: list(v) if isinstance(v, tuple) else v for k, v in ((k, settings[k]) for k in RESUMABLE_SETTINGS)}


def schedule_changes(saved: dict | None, e: EngineConfig) -> str:
    """``lr 0.001 -> 0.0002, ...``: what differs from the saved settings ('' when nothing, or nothing saved)."""
    if not saved:
        return ""
    now = schedule_settings(e)
    return ", ".join(f"{k} {saved[k]} -> {now[k]}" for k in RESUMABLE_SETTINGS if k in saved and saved[k] != now[k])


def check_resumable(run: RunConfig, seq_len: int, model: Model, stored_model: dict | None) -> None:
    """Before the store is opened (and so before anything in it is touched): a resume must be of the same
    model and the same data settings. ValueError lists what differs (stored, now)."""
    if model.hf_program is not None:
        from lohan.models.hf import model_meta

        now = model_meta(model.hf_program)
    else:
        now = {"kind": "gpt", "config": dataclasses.asdict(model.config), "seed": run.engine.execution.seed}
    if stored_model is not None and stored_model != now:
        old, new = stored_model.get("config", {}), now.get("config", {})
        diff = {k: (old.get(k), new.get(k)) for k in sorted(set(old) | set(new)) if old.get(k) != new.get(k)}
        if stored_model.get("seed") != now.get("seed"):
            diff["seed"] = (stored_model.get("seed"), now.get("seed"))
        raise ValueError(f"--resume with another model than the stored one: {diff or stored_model.get('kind')} "
                         "(stored, now); resume with the settings it was created with, or start over with --overwrite")
    path = run_state_path(run)
    if path.exists():
        state = _read_run_state(path, f"Delete {path} to resume from the step count instead")
        if state.get("version") == RUN_STATE_VERSION and state["run"] != _fingerprint(run, seq_len):
            diff = {k: (state["run"].get(k), v) for k, v in _fingerprint(run, seq_len).items()
                    if state["run"].get(k) != v}
            raise ValueError(f"--resume with other settings than the run being resumed: {diff} (saved, now); "
                             "pass the same settings, or start over with --overwrite")


_RUN_STATE_FIELDS = {"version": int, "step": int, "run": dict, "store": dict, "iterator": (dict, type(None)),
                     "torch_rng": str}
_RUN_STATE_LATER = {"schedule": dict, "activations": dict}  # (states saved before these settings lack them)


def _read_run_state(path: Path, fix: str) -> dict:
    """The run state at `path`, checked (integrity.read_json_checked); a state of this version also has its
    fields checked, and the one before kept in it (`prev`) too, so damage is refused with the file named."""
    what = "run state (data position, RNG)"
    state = read_json_checked(path, what, fix)
    if state.get("version") == RUN_STATE_VERSION:
        prev = {**_RUN_STATE_LATER, "prev": (dict, type(None))}  # the state of the step before, without its own
        for record, later in ((state, prev), (state.get("prev"), _RUN_STATE_LATER)):
            if record is not None:
                check_record(path, record, what, fix, _RUN_STATE_FIELDS, later)
                check_record(path, record["store"], what, fix, {"step": int, "slot": int, "volume_id": str})
    return state


def load_run_state(run: RunConfig, seq_len: int, engine: Engine) -> dict | None:
    """The saved run state if it belongs to this run, to this store and to its committed step (or the
    one before: a Ctrl-C between a commit and the state's write; or the state kept for the step before
    when the last step's commit never became durable)."""
    path = run_state_path(run)
    if not path.exists():
        return None
    state = _read_run_state(path, f"Delete {path} to resume from the step count instead (the data position is "
                                  "then recomputed, the RNG state is not restored)")
    if state.get("version") != RUN_STATE_VERSION:
        return None
    if state["store"]["volume_id"] != engine.store.volume.volume_id:
        return None  # written for a store that has since been replaced
    store_step = engine.step_count
    if state["run"] != _fingerprint(run, seq_len):
        diff = {k: (state["run"].get(k), v) for k, v in _fingerprint(run, seq_len).items() if state["run"].get(k) != v}
        raise ValueError(f"--resume with other settings than the run being resumed: {diff} (saved, now)")
    if state["step"] > store_step and (state.get("prev") or {}).get("step") == store_step:
        state = state["prev"]  # the steps after the durable one were not (write-behind, the durability interval)
    if not 0 <= store_step - state["step"] <= 1:
        return None  # a state from another point in time: position from the step count instead
    torch.set_rng_state(torch.load(io.BytesIO(base64.b64decode(state["torch_rng"]))))
    return state if state["iterator"] is not None else None


class RunStateWriter:
    """The run state of each committed step, written by rank 0 (or the one process) once `Engine.step` returns,
    with the state of the step before kept beside it (`save_run_state`'s `prev`)."""

    def __init__(self, run: RunConfig, seq_len: int, main_rank: bool, last: dict | None = None) -> None:
        self.run, self.seq_len, self.main_rank = run, seq_len, main_rank
        self.last = last
        """The state saved for the step before (a resume: the one it read, if it is of the step it resumes at)."""

    def save(self, engine: Engine, position: dict | None) -> None:
        """The state of the step `engine` has just committed; `position`: the data position after its batch."""
        if self.main_rank:
            self.last = save_run_state(self.run, self.seq_len, engine, position, self.last)
