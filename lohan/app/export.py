"""The run's weights as Hugging Face checkpoints: the export at the end (``--export DIR``) and the periodic
checkpoints (``--save-every N``: ``DIR/step-N``, the last ``--save-total-limit K`` kept).

Both are the same files (`write_export`: sharded safetensors, config.json, generation config, tokenizer and
chat template; `lohan.models.hf.export_hf` or, for presets, `lohan.models.gpt_export.export_gpt2`), written into
a staging folder, made durable, then renamed in: a kill (SIGKILL, a power cut) leaves the previous export and
checkpoints whole, and never a half-written one where a reader looks. Every folder lohan writes holds its
manifest (`EXPORT_MARKER`, `lohan.app.ownership`) from its first moment to its last: the run that wrote it, and once
complete each file with its size, checksum and inode. The next run knows a leftover of its own and cleans it
(`tidy`); it removes only files the manifest proves it wrote and that are unchanged since (`ownership.remove_folder`),
so a file a user added to an export or a checkpoint stops the removal, and pruning keeps that checkpoint whole.

A save blocks training between two steps: it reads the committed weights back from the store, which the next
step's writes would race (with one slot they overwrite them in place) on the SSDs that step needs. Its seconds are
measured and reported (a log line, ``save_s`` in the step's metrics record, the summary): the 110M Llama's fp32
checkpoint (0.44 GB) took 1.5-2.5 s on a shared 2-core box, about 1.1 s of it reading the fp32 masters back.

Resume: a checkpoint is written after its step is durable (`Engine.whole` flushes a staged commit), so a
resumed run never recomputes a step whose checkpoint exists. One that a kill cut short (the leftover
``step-N.partial``) is written at the start of the resumed run, from the same committed weights. A checkpoint
found at a step the run saves (a store started over with --overwrite into the same export directory) is
this run's (the store it replaced wrote it), and is replaced atomically (renamed to ``step-N.old``, the new one renamed in, the old one removed).
"""

from __future__ import annotations

import errno
import os
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from rich.console import Console

from io_engine import IOEngineError
from io_engine.base import fsync_dir
from lohan.app.layout import OutputError, RunLayout, checkpoint_step, is_leftover, partial_dir
from lohan.app.ownership import (
    ForeignFileError,
    begin_folder,
    folder_problem,
    read_manifest,
    remove_folder,
    seal_folder,
    verify_folder,
)
from lohan.config import RunConfig
from lohan.crashpoints import crashpoint


def write_export(out: Path, run: RunConfig, model: Any, whole: Any, dtype: str | None, info: dict,
                 run_id: str) -> str:
    """Write the weights `whole` (`Engine.whole`) as a Hugging Face checkpoint into `out`, a new folder: its manifest
    first (``writing``, `ownership.begin_folder`), then the model's files, then the manifest listing each of them with
    its checksum, all durable (`ownership.seal_folder`). Returns the dtype written. A LoRA run (`LoraEngine`) writes a
    PEFT adapter folder (fp32 adapters), or with ``info["merged"]`` the base with its adapters merged in."""
    try:
        begin_folder(out, run_id, info)
        lora = getattr(whole, "lora", None)
        if lora is not None and not info.get("merged"):
            from lohan.models.lora import write_peft_adapter

            write_peft_adapter(lora, whole.program.model, os.path.abspath(run.model) if model.hf_program is not None
                               else run.model, out, whole.cfg.lora.lora_dropout)
            dtype = "float32"
        elif model.hf_program is not None:
            from lohan.models.hf import export_hf

            dtype = export_hf(whole.merged() if lora is not None else whole, model.hf_program, run.model, out, dtype)
        else:
            from lohan.models.gpt_export import export_gpt2

            export_gpt2(whole.merged() if lora is not None else whole, model.config, out)
            dtype = "float32"
        seal_folder(out, run_id, {**info, "dtype": dtype})
    except IOEngineError:  # reading the weights from the store: its own message says where
        raise
    except OSError as err:  # safetensors and json say neither which file nor what was being done
        raise OutputError(err, f"writing the {info.get('kind', 'export')}", err.filename or out) from err
    except Exception as err:
        if "No space left" not in str(err) and "os error 28" not in str(err):
            raise
        # safetensors raises its own error type for a full disk (SafetensorError: "... os error 28")
        raise OutputError(OSError(errno.ENOSPC, os.strerror(errno.ENOSPC)), f"writing the "
                          f"{info.get('kind', 'export')}", out) from err
    return dtype


def tidy(layout: RunLayout, console: Console) -> None:
    """Before the run writes to its export directory: put back the checkpoints a killed final export had moved
    into its staging folder, and remove what killed saves left (each proven this run's, `ownership.remove_folder`)."""
    final = layout.export
    if final is None:
        return
    staging = partial_dir(final)
    if staging.is_dir() and not staging.is_symlink():  # this run's (checked): a killed final export
        for entry in staging.iterdir():
            if checkpoint_step(entry) is not None and not (final / entry.name).exists():
                final.mkdir(exist_ok=True)
                os.replace(entry, final / entry.name)
                console.print(f"restored the checkpoint {final / entry.name} from a killed export's staging folder")
        remove_folder(staging, layout.owner, "the export's staging")
    if final.is_dir() and not final.is_symlink():
        for entry in final.iterdir():
            if is_leftover(entry):
                remove_folder(entry, layout.owner, "the checkpoint")
                console.print(f"removed {entry}, left by a save that was killed")


def export_final(console: Console, run: RunConfig, model: Any, engine: Any, layout: RunLayout,
                 dtype: str | None = None, merged: bool = False) -> None:
    """Export into the sibling ``<out>.partial``, then swap it in, the checkpoints moved along: a kill before the
    swap leaves the previous export at `out`, and the same command redoes it. Checked again first (the run may
    have taken hours): nothing but this run's is ever removed. `merged`: a LoRA run's base with its adapters merged
    in (``--export-merged``), instead of its PEFT adapter folder."""
    layout.check_export()
    final = layout.export
    tmp = partial_dir(final)
    tidy(layout, console)
    info = {"step": engine.step_count, "model": run.model, "kind": "export", **({"merged": True} if merged else {})}
    dtype = write_export(tmp, run, model, engine.whole, dtype, info, layout.owner.current)
    crashpoint("export.written")
    if final.exists():
        layout.check_export()  # nothing appeared in it while the export was written
        for entry in final.iterdir():  # the checkpoints go with the new export (a kill: tidy moves them back)
            if checkpoint_step(entry) is not None:
                os.replace(entry, tmp / entry.name)
                crashpoint("export.checkpoint_moved")
        remove_folder(final, layout.owner)  # now the previous export's files only (proven)
    os.replace(tmp, final)
    fsync_dir(final.parent)
    if getattr(engine, "lora", None) is not None and not merged:
        console.print(f"exported the step-{engine.step_count} LoRA adapters to {final} (loads with "
                      "peft.PeftModel.from_pretrained(base, DIR); --export-merged DIR writes the merged weights)")
        return
    console.print(f"exported the step-{engine.step_count} weights to {final} in {dtype} (loads with transformers "
                  "AutoModelForCausalLM.from_pretrained)")


@dataclass(frozen=True)
class Saved:
    """A checkpoint written: where, of which step, in which dtype, the seconds training waited for it (the
    weights' reads, a staged commit's completion, the files and their fsyncs, the pruning), what was pruned, and
    what pruning left because it holds files lohan cannot prove it wrote."""

    path: Path
    step: int
    dtype: str
    seconds: float
    removed: list[Path]
    kept: list[str] = field(default_factory=list)

    def describe(self, limit: int | None) -> str:
        gone = f"; removed {', '.join(p.name for p in self.removed)} (--save-total-limit {limit})" if self.removed \
            else ""
        kept = "".join(f"\n  note: {k}" for k in self.kept)
        return f"checkpoint {self.path} (step {self.step}, {self.dtype}) written in {self.seconds:.2f} s{gone}{kept}"


class Checkpoints:
    """The periodic checkpoints of a run: `save` every `every` steps into ``<export>/step-N``, keeping the last
    `limit` (None: all)."""

    def __init__(self, layout: RunLayout, run: RunConfig, model: Any, every: int, limit: int | None,
                 dtype: str | None, merged: bool = False) -> None:
        assert layout.export is not None, "checkpoints go into the export directory (--export)"
        self.layout, self.run, self.model = layout, run, model
        self.every, self.limit, self.dtype = every, limit, dtype
        self.merged = merged  # a LoRA run's: merged weights (--export-merged), else its PEFT adapter folders

    def due(self, step: int) -> bool:
        return step > 0 and step % self.every == 0

    def has(self, step: int) -> bool:
        return checkpoint_step(self.layout.checkpoint(step)) is not None

    def save(self, engine: Any) -> Saved:
        """Write the checkpoint of the engine's committed step, then prune (`limit`). What it replaces (a
        checkpoint of the same step, leftovers of a killed save) is proven this run's first (ForeignFileError)."""
        t0 = time.perf_counter()
        step = engine.step_count
        owner = self.layout.owner
        final = self.layout.checkpoint(step)
        tmp, old = final.with_name(final.name + ".partial"), final.with_name(final.name + ".old")
        problem = next((p for p in (folder_problem(f, owner, None, "the checkpoint") for f in (final, tmp, old))
                        if p), None)
        if problem:
            raise ForeignFileError(problem)
        for leftover in (tmp, old):
            if leftover.exists():
                remove_folder(leftover, owner, "the checkpoint")  # a killed save's or removal's
        try:
            dtype = write_export(tmp, self.run, self.model, engine.whole, self.dtype,
                                 {"step": step, "model": self.run.model, "kind": "checkpoint",
                                  **({"merged": True} if self.merged else {})}, owner.current)
            crashpoint("checkpoint.written")
            if final.exists():  # this run's (proven): a store started over reaches a step saved before
                os.replace(final, old)
                os.replace(tmp, final)
                remove_folder(old, owner, "the checkpoint")
            else:
                os.replace(tmp, final)
            fsync_dir(final.parent)
        except BaseException:
            if old.exists() and not final.exists():  # failed between the two renames: the old one back
                os.replace(old, final)
            if tmp.exists() and not folder_problem(tmp, owner, None, "the checkpoint"):
                remove_folder(tmp, owner, "the checkpoint")
            raise
        removed, kept = self.prune(step)
        return Saved(final, step, dtype, time.perf_counter() - t0, removed, kept)

    def prune(self, step: int) -> tuple[list[Path], list[str]]:
        """Remove all but the last `limit` of this run's checkpoints up to `step` (later ones are left until this
        run saves their step), each renamed to ``step-N.old`` first: a kill never leaves a half-removed ``step-N``
        that looks whole. One that holds a file lohan cannot prove it wrote is kept whole, and said so."""
        if self.limit is None or not self.layout.export.is_dir():
            return [], []
        owner = self.layout.owner
        ours = sorted((s, p) for p in self.layout.export.iterdir()
                      if (s := checkpoint_step(p)) is not None and s <= step
                      and owner.owns(read_manifest(p)[0].run_id))
        removed, kept = [], []
        for _, path in ours[:-self.limit]:
            problem = folder_problem(path, owner, None, "the checkpoint")
            if problem:
                kept.append(f"{path} is kept: {problem.split(': ', 1)[-1]}")
                continue
            old = path.with_name(path.name + ".old")
            os.replace(path, old)
            remove_folder(old, owner, "the checkpoint")
            removed.append(path)
        return removed, kept


def verify_export(out: Path, console: Console) -> int:
    """`finetune.py --verify --export DIR`: read every file of the export and of each of its checkpoints back
    against the checksums its manifest recorded when lohan wrote it. Exit code 0: intact; 1: damaged (each file
    listed); 2: not an export lohan completed."""
    if not out.is_dir() or out.is_symlink():
        console.print(f"error: {out} is not a directory: nothing to verify")
        return 2
    folders = [out] if read_manifest(out)[0] is not None else []
    folders += sorted((p for p in out.iterdir() if checkpoint_step(p) is not None), key=checkpoint_step)
    if not folders:
        console.print(f"error: {out} holds no export or checkpoint of lohan's ({read_manifest(out)[1]})")
        return 2
    problems = [p for folder in folders for p in verify_folder(folder)]
    for p in problems:
        console.print(f"damaged: {p}")
    files = sum(len(m.files) for f in folders if (m := read_manifest(f)[0]) is not None)
    if problems:
        console.print(f"{len(problems)} problem(s) in {out}: export again from the store (--resume --steps N "
                      "--export DIR, N the committed step), or restore the folder from a backup")
        return 1
    console.print(f"{out}: {len(folders)} folder(s) (the export and its checkpoints), all {files} files match the "
                  "checksums lohan recorded when it wrote them")
    return 0
