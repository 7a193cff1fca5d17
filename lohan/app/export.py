"""The run's weights as Hugging Face checkpoints: the export at the end (``--export DIR``) and the periodic
checkpoints (``--save-every N``: ``DIR/step-N``, the last ``--save-total-limit K`` kept).

Both are the same files (`write_export`: sharded safetensors, config.json, generation config, tokenizer and
chat template; `lohan.models.hf.export_hf` or, for presets, `lohan.models.gpt_export.export_gpt2`), written into
a staging folder, made durable, then renamed in: a kill (SIGKILL, a power cut) leaves the previous export and
checkpoints whole, and never a half-written one where a reader looks. Every folder lohan writes holds
`EXPORT_MARKER` from its first moment to its last (`remove_owned` deletes it last), so the next run knows a
leftover for its own and cleans it (`tidy`), and nothing else is ever removed (`lohan.app.layout`).

A save blocks training between two steps: it reads the committed weights back from the store, which the next
step's writes would race (with one slot they overwrite them in place) on the SSDs that step needs. Its seconds are
measured and reported (a log line, ``save_s`` in the step's metrics record, the summary): the 110M Llama's fp32
checkpoint (0.44 GB) took 1.5-2.5 s on a shared 2-core box, about 1.1 s of it reading the fp32 masters back.

Resume: a checkpoint is written after its step is durable (`Engine.whole` flushes a staged commit), so a
resumed run never recomputes a step whose checkpoint exists. One that a kill cut short (the leftover
``step-N.partial``) is written at the start of the resumed run, from the same committed weights. A checkpoint
found at a step the run saves (a store started over with --overwrite into the same export directory) is
lohan's, and is replaced atomically (renamed to ``step-N.old``, the new one renamed in, the old one removed).
"""

from __future__ import annotations

import json
import os
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from rich.console import Console

from io_engine.base import fsync_dir
from lohan.app.layout import EXPORT_MARKER, RunLayout, checkpoint_step, is_leftover, partial_dir
from lohan.config import RunConfig
from lohan.crashpoints import crashpoint


def write_export(out: Path, run: RunConfig, model: Any, whole: Any, dtype: str | None, marker: dict) -> str:
    """Write the weights `whole` (`Engine.whole`) as a Hugging Face checkpoint into `out`, a new folder: the
    marker first, then the model's files, each fsynced. Returns the dtype written."""
    out.mkdir(parents=True)
    (out / EXPORT_MARKER).write_text(json.dumps(marker) + "\n")
    if model.hf_program is not None:
        from lohan.models.hf import export_hf

        dtype = export_hf(whole, model.hf_program, run.model, out, dtype)
    else:
        from lohan.models.gpt_export import export_gpt2

        export_gpt2(whole, model.config, out)
        dtype = "float32"
    for f in out.iterdir():  # durable before it replaces anything
        with open(f, "rb") as fh:
            os.fsync(fh.fileno())
    return dtype


def remove_owned(path: Path) -> None:
    """Remove a folder lohan wrote (checked by the caller), its marker last: a kill midway leaves a folder that
    still says it is lohan's, or an empty one, never one the next run would take for a stranger's."""
    entries = [e for e in path.iterdir() if e.name != EXPORT_MARKER]
    folders = [e for e in entries if e.is_dir() and not e.is_symlink()]
    for entry in folders:
        # exports are flat: a folder in one is a checkpoint (one a killed final export moved, see tidy), or a
        # stranger's that appeared since the run's checks, which is not lohan's to remove
        if checkpoint_step(entry) is None and not is_leftover(entry):
            raise ValueError(f"{entry} appeared in a folder of lohan's while it was being replaced; it is not "
                             f"lohan's, so {path} is left as it is: move {entry} away and run again")
    for entry in entries:
        if entry in folders:
            remove_owned(entry)
        else:
            entry.unlink()
    (path / EXPORT_MARKER).unlink(missing_ok=True)
    path.rmdir()



def tidy(layout: RunLayout, console: Console) -> None:
    """Before the run writes to its export directory: put back the checkpoints a killed final export had moved
    into its staging folder, and remove what killed saves left (each checked to be lohan's: `is_leftover`)."""
    final = layout.export
    if final is None:
        return
    staging = partial_dir(final)
    if staging.is_dir():  # lohan's (the run's layout checked it): a killed final export
        for entry in staging.iterdir():
            if checkpoint_step(entry) is not None and not (final / entry.name).exists():
                final.mkdir(exist_ok=True)
                os.replace(entry, final / entry.name)
                console.print(f"restored the checkpoint {final / entry.name} from a killed export's staging folder")
        remove_owned(staging)
    if final.is_dir():
        for entry in final.iterdir():
            if is_leftover(entry):
                remove_owned(entry)
                console.print(f"removed {entry}, left by a save that was killed")


def export_final(console: Console, run: RunConfig, model: Any, engine: Any, layout: RunLayout,
                 dtype: str | None = None) -> None:
    """Export into the sibling ``<out>.partial``, then swap it in, the checkpoints moved along: a kill before the
    swap leaves the previous export at `out`, and the same command redoes it. Checked again first (the run may
    have taken hours): nothing but lohan's is ever removed."""
    layout.check_export()
    final = layout.export
    tmp = partial_dir(final)
    tidy(layout, console)
    dtype = write_export(tmp, run, model, engine.whole, dtype, {"step": engine.step_count, "model": run.model})
    crashpoint("export.written")
    if final.exists():
        for entry in final.iterdir():  # the checkpoints go with the new export (a kill: tidy moves them back)
            if checkpoint_step(entry) is not None:
                os.replace(entry, tmp / entry.name)
                crashpoint("export.checkpoint_moved")
        remove_owned(final)  # now the previous export's files only (checked above)
    os.replace(tmp, final)
    fsync_dir(final.parent)
    console.print(f"exported the step-{engine.step_count} weights to {final} in {dtype} (loads with transformers "
                  "AutoModelForCausalLM.from_pretrained)")


@dataclass(frozen=True)
class Saved:
    """A checkpoint written: where, of which step, in which dtype, the seconds training waited for it (the
    weights' reads, a staged commit's completion, the files and their fsyncs, the pruning), what was pruned."""

    path: Path
    step: int
    dtype: str
    seconds: float
    removed: list[Path]

    def describe(self, limit: int | None) -> str:
        gone = f"; removed {', '.join(p.name for p in self.removed)} (--save-total-limit {limit})" if self.removed \
            else ""
        return f"checkpoint {self.path} (step {self.step}, {self.dtype}) written in {self.seconds:.2f} s{gone}"


class Checkpoints:
    """The periodic checkpoints of a run: `save` every `every` steps into ``<export>/step-N``, keeping the last
    `limit` (None: all)."""

    def __init__(self, layout: RunLayout, run: RunConfig, model: Any, every: int, limit: int | None,
                 dtype: str | None) -> None:
        assert layout.export is not None, "checkpoints go into the export directory (--export)"
        self.layout, self.run, self.model = layout, run, model
        self.every, self.limit, self.dtype = every, limit, dtype

    def due(self, step: int) -> bool:
        return step > 0 and step % self.every == 0

    def has(self, step: int) -> bool:
        return checkpoint_step(self.layout.checkpoint(step)) is not None

    def save(self, engine: Any) -> Saved:
        """Write the checkpoint of the engine's committed step, then prune (`limit`)."""
        t0 = time.perf_counter()
        step = engine.step_count
        self.layout.check_export()  # a folder that appeared since the start is not written over
        final = self.layout.checkpoint(step)
        tmp, old = final.with_name(final.name + ".partial"), final.with_name(final.name + ".old")
        for leftover in (tmp, old):
            if leftover.exists():
                remove_owned(leftover)  # a killed save's or removal's (checked: layout.is_leftover)
        try:
            dtype = write_export(tmp, self.run, self.model, engine.whole, self.dtype,
                                 {"step": step, "model": self.run.model, "kind": "checkpoint"})
            crashpoint("checkpoint.written")
            if final.exists():  # lohan's (checked): a store started over reaches a step saved before
                os.replace(final, old)
                os.replace(tmp, final)
                remove_owned(old)
            else:
                os.replace(tmp, final)
            fsync_dir(final.parent)
        except BaseException:
            if old.exists() and not final.exists():  # failed between the two renames: the old one back
                os.replace(old, final)
            if tmp.exists():
                remove_owned(tmp)
            raise
        return Saved(final, step, dtype, time.perf_counter() - t0, self.prune(step))

    def prune(self, step: int) -> list[Path]:
        """Remove all but the last `limit` checkpoints of lohan's up to `step` (later ones are another run's,
        left until this run saves their step), each renamed to ``step-N.old`` first: a kill never leaves a
        half-removed ``step-N`` that looks whole."""
        if self.limit is None or not self.layout.export.is_dir():
            return []
        ours = sorted((s, p) for p in self.layout.export.iterdir()
                      if (s := checkpoint_step(p)) is not None and s <= step)
        removed = []
        for _, path in ours[:-self.limit]:
            old = path.with_name(path.name + ".old")
            os.replace(path, old)
            remove_owned(old)
            removed.append(path)
        return removed
