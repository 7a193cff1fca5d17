"""`RunConfig`: a fine-tuning run (which model, which data, how long, the trackers) around its `EngineConfig`."""

from __future__ import annotations

import dataclasses
import os
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Literal, get_args

from lohan.config.choices import setting
from lohan.config.engine_config import EngineConfig
from lohan.config.model import PRESETS, ModelConfig, get_model_config
from lohan.config.units import is_int

DataFormat = Literal["auto", "text", "prompt-response", "messages", "alpaca", "sharegpt"]
DATA_FORMATS: tuple[str, ...] = get_args(DataFormat)
"""How the records of ``data`` are read (``RunConfig.data_format``; lohan.data.formats maps each onto the examples
lohan trains)."""

MAX_STEPS = 2**24
"""The most optimizer steps a run may ask for: AdamW's step counter is a float32 tensor (exact to 2**24)."""


TRACKERS = ("tensorboard", "wandb", "mlflow")
"""What ``report_to`` takes (the names HF Trainer uses), besides ``none`` and ``all``."""


def parse_report_to(value: str | Sequence[str] | None) -> tuple[str, ...]:
    """``"tensorboard,wandb"`` / ``["mlflow"]`` / ``"all"`` / ``"none"`` -> the trackers, in the given order.

    Raises:
        ValueError: An unknown name (the message lists the known ones).
    """
    if value is None:
        return ()
    items = value.split(",") if isinstance(value, str) else [s for v in value for s in str(v).split(",")]
    names = [s.strip().lower() for s in items if s.strip()]
    if names in (["none"], []):
        return ()
    if names == ["all"]:
        return TRACKERS
    unknown = [n for n in names if n not in TRACKERS]
    if unknown:
        raise ValueError(f"report_to: unknown tracker(s) {', '.join(unknown)}: choose from {', '.join(TRACKERS)} "
                         "(comma-separated), 'all' or 'none'")
    return tuple(dict.fromkeys(names))


@dataclass(frozen=True)
class RunConfig:
    """A fine-tuning run: which model, which data, how long, and the engine settings.

    Loaded from YAML (``configs/*.yaml``) and command-line overrides by :mod:`lohan.app.cli`.
    """

    model: str = setting(
        "tiny", group="model",
        help=f"preset ({', '.join(PRESETS)}) or a local Hugging Face model directory")
    """A preset name (see :data:`PRESETS`), or a local Hugging Face model directory (config.json +
    safetensors; any decoder-only ``*ForCausalLM`` of the standard layout, see :mod:`lohan.models.hf`)."""

    model_overrides: dict = dataclasses.field(default_factory=dict)
    """Fields of the preset to replace, e.g. ``{vocab_size: 256, seq_len: 256}``."""

    data: str = setting(
        "data/corpus.txt", group="data", metavar="PATH",
        help="training data: a .txt file (plain text), a file of records (.jsonl, .json, .parquet, .arrow, "
             ".csv: text, prompt/response, chat messages, Alpaca or ShareGPT records), a folder written by "
             "datasets' save_to_disk, or 'synthetic'; records are tokenized once into the token cache "
             "($LOHAN_DATA_CACHE, default: the datasets cache)")
    """A local ``.txt`` file (plain text), a file of records (``.jsonl``, ``.json``, ``.parquet``, ``.arrow``,
    ``.csv``: text, prompt/response with the loss on the response, chat ``messages`` rendered with the model's chat
    template with the loss on the assistant turns, Alpaca or ShareGPT records; see ``data_format``), a folder
    written by ``datasets``' ``save_to_disk``, or ``synthetic`` for random tokens. Presets use byte-level tokens; a
    Hugging Face model uses its own tokenizer. Records are tokenized once into the token cache
    (``$LOHAN_DATA_CACHE``; lohan/data/token_cache.py)."""

    data_format: DataFormat = setting(
        "auto", group="data",
        help="how records are read (auto: by their columns: messages, conversations -> sharegpt, "
             "instruction+output -> alpaca, prompt+response, text); also for --eval-data")
    """How records are read: ``auto`` (by each record's keys), ``text``, ``prompt-response``, ``messages``,
    ``alpaca`` (instruction + input as the prompt, in Stanford Alpaca's template; output as the response) or
    ``sharegpt`` (``conversations`` of human/gpt/system turns, read as chat messages). Also for ``eval_data``."""

    text_field: str | None = setting(
        None, group="data", metavar="NAME",
        help="the column holding the text of text records, if not 'text'")
    """The column (key) holding the text of ``text`` records, when it is not ``text``. Also for ``eval_data``."""

    split: str | None = setting(
        None, group="data", metavar="NAME",
        help="the split of a saved DatasetDict folder given as --data (default train)")
    """The split of ``data`` when it is a ``DatasetDict.save_to_disk`` folder (default ``train``)."""

    steps: int = setting(
        200, group="optimization",
        help="optimizer steps to run (in total, when resuming)")
    """Optimizer steps to run (the total, counting steps of the run being resumed)."""

    epochs: int | None = setting(
        None, group="optimization",
        help="passes over the data (instead of --steps)")
    """If set, run this many passes over the data instead of ``steps``."""

    batch_size: int = setting(
        8, group="data",
        help="sequences per optimizer step")
    """Sequences per optimizer step (split into ``engine.micro_batches``)."""

    seq_len: int | None = setting(
        None, group="model",
        help="tokens per sequence (default: the model's)")
    """Tokens per sequence; defaults to the model's ``seq_len``."""

    metrics: str | None = setting(
        None, group="output",
        help="JSONL metrics file, one record per step (default: <nvme>/<name>.metrics.jsonl)")
    """JSONL file receiving one record per step (default: ``<first nvme dir>/<engine.name>.metrics.jsonl``)."""

    log_every: int | None = setting(
        None, group="output", metavar="N",
        help="a log line every N steps (and the first, the last and evaluating ones); default: every step "
             "on a terminal, about 200 lines over the run in a log file")
    """Steps between log lines (the first, the last and evaluating steps always get one); None: every step on a
    terminal, about 200 lines over the run in a log file."""

    report_to: tuple[str, ...] | str = setting(
        (), group="output", metavar="TRACKERS",
        help="also send each step's metrics and the run's settings to tensorboard, wandb and/or mlflow "
             "(comma-separated; 'all'; default none). wandb runs offline unless WANDB_MODE says otherwise; "
             "mlflow writes a local store unless MLFLOW_TRACKING_URI is set")
    """Experiment trackers that receive each step's record and the run's settings: ``tensorboard``, ``wandb``,
    ``mlflow`` (comma-separated in a string), ``all`` or ``none`` (the default). See :mod:`lohan.app.tracking`."""

    logging_dir: str | None = setting(
        None, group="output", metavar="DIR",
        help="where the trackers write (default: <metrics dir>/<run name>.logs)")
    """Where the trackers write (``tensorboard/``, ``wandb/``, ``mlflow/`` inside it); default
    ``<the metrics file's directory>/<engine.name>.logs``."""

    eval_data: str | None = setting(
        None, group="data", metavar="PATH",
        help="evaluate on this data (forward only): anything --data takes")
    """A file or saved dataset to evaluate on (anything ``data`` takes, read the same way, with the model's
    tokenizer)."""

    eval_split: str | None = setting(
        None, group="data", metavar="NAME",
        help="the split of a saved DatasetDict folder given as --eval-data (default train)")
    """The split of ``eval_data`` when it is a ``DatasetDict.save_to_disk`` folder (default ``train``)."""

    eval_fraction: float | None = setting(
        None, group="data", metavar="F",
        help="hold out this share of the data's sequences, in (0, 0.5], for evaluation (seeded)")
    """Hold out this share of the data's packed sequences, in (0, 0.5], for evaluation (seeded by
    ``engine.seed``; the held-out sequences are not trained on). Exclusive with ``eval_data``."""

    eval_every: int | None = setting(
        None, group="data", metavar="N",
        help="evaluate every N steps and at the end (default: only at the end)")
    """Evaluate every this many steps, and at the end; None: only at the end (with an eval set)."""

    save_every: int | None = setting(
        None, group="output", metavar="N",
        help="every N steps, also write a Hugging Face checkpoint to DIR/step-N (needs --export DIR)")
    """Every this many optimizer steps, write the weights as a Hugging Face checkpoint into ``<export>/step-N``
    (the same files as the export at the end, `lohan.app.export`); needs an export directory (``--export``)."""

    save_total_limit: int | None = setting(
        None, group="output", metavar="K",
        help="keep only the last K DIR/step-N checkpoints (default: all)")
    """Keep only the last this many ``step-N`` checkpoints (lohan's own; older ones are deleted after each save);
    None keeps them all. Needs ``save_every``."""

    engine: EngineConfig = dataclasses.field(default_factory=EngineConfig)
    """Engine settings (NVMe directories, memory budget, offloading mode, optimizer)."""

    def __post_init__(self) -> None:
        problems: list[str] = []
        if not isinstance(self.model, str) or (self.model not in PRESETS and not is_model_dir(self.model)):
            # say which of the two readings failed: a directory without config.json is the usual mistake
            found = (f" ({self.model} is a directory without config.json: point at the folder that "
                     "save_pretrained wrote)" if isinstance(self.model, str) and os.path.isdir(self.model) else "")
            problems.append(f"model={self.model!r}: choose a preset ({', '.join(PRESETS)}) or a local Hugging Face "
                            f"model directory (with config.json){found}")
        if not isinstance(self.model_overrides, dict):
            problems.append("model_overrides must be a mapping of ModelConfig fields")
        if not isinstance(self.data, str) or not self.data:
            problems.append(f"data={self.data!r}: give a file (.txt, .jsonl, .json, .parquet, .arrow, .csv), a folder "
                            "written by datasets' save_to_disk, or 'synthetic'")
        problems += self._format_problems()
        if self.log_every is not None and (not is_int(self.log_every) or self.log_every < 1):
            problems.append(f"log_every={self.log_every!r}: give a number of steps >= 1, or leave it unset")
        try:
            object.__setattr__(self, "report_to", parse_report_to(self.report_to))
        except ValueError as err:
            problems.append(str(err))
        if self.logging_dir is not None and (not isinstance(self.logging_dir, str) or not self.logging_dir):
            problems.append(f"logging_dir={self.logging_dir!r}: give a directory path or leave it unset")
        if self.metrics is not None and not isinstance(self.metrics, str):
            problems.append(f"metrics={self.metrics!r}: give a file path (JSONL) or leave it unset")
        for name in ("steps", "batch_size"):
            value = getattr(self, name)
            if not is_int(value) or value < 1:
                problems.append(f"{name}={value!r} must be an integer >= 1")
        if is_int(self.steps) and self.steps > MAX_STEPS:
            problems.append(f"steps={self.steps:,} is more than lohan counts ({MAX_STEPS:,}: the optimizer's step "
                            "counter is float32, exact up to 2**24); a typo? Ask for fewer steps")
        if self.epochs is not None and (not is_int(self.epochs) or self.epochs < 1):
            problems.append(f"epochs={self.epochs!r} must be an integer >= 1")
        if self.epochs is not None and self.data == "synthetic":
            problems.append("epochs needs a dataset; synthetic data has no epochs (use steps)")
        if self.seq_len is not None and (not is_int(self.seq_len) or self.seq_len < 1):
            problems.append(f"seq_len={self.seq_len!r} must be a positive integer")
        problems += self._eval_problems() + self._save_problems()
        if isinstance(self.engine, dict):
            try:
                object.__setattr__(self, "engine", EngineConfig(**self.engine))
            except (TypeError, ValueError) as e:
                problems.append(f"engine: {e}")
        m = self.engine.execution.micro_batches if isinstance(self.engine, EngineConfig) else None
        if is_int(self.batch_size) and self.batch_size >= 1 and is_int(m) and m >= 1 and self.batch_size % m:
            # every micro-batch has the same shape; refusing here beats a failure at the first step
            fits = [d for d in range(1, self.batch_size + 1) if self.batch_size % d == 0]
            problems.append(f"batch_size={self.batch_size} is not divisible by micro_batches={m}: pick micro_batches "
                            f"from {fits} or a batch size that is a multiple of {m}")
        if problems:
            raise ValueError("invalid run config:\n  - " + "\n  - ".join(problems))

    def _format_problems(self) -> list[str]:
        problems = []
        if self.data_format not in DATA_FORMATS:
            problems.append(f"data_format={self.data_format!r} must be one of {', '.join(DATA_FORMATS)}")
        for name in ("text_field", "split", "eval_split"):
            value = getattr(self, name)
            if value is not None and (not isinstance(value, str) or not value.strip()):
                problems.append(f"{name}={value!r}: give a column name, or leave it unset" if name == "text_field" else
                                f"{name}={value!r}: give a split name (e.g. train), or leave it unset")
        if self.text_field is not None and self.data_format not in ("auto", "text"):
            problems.append(f"text_field={self.text_field!r} names the column of text records, but data_format is "
                            f"{self.data_format!r}: drop text_field (--text-field), or use data_format text")
        if self.eval_split is not None and self.eval_data is None:
            problems.append("eval_split picks a split of eval_data: add eval_data (--eval-data DIR), or drop it")
        return problems

    def _eval_problems(self) -> list[str]:
        problems = []
        if self.eval_data is not None and self.eval_fraction is not None:
            problems.append("eval_data and eval_fraction are two ways to get an eval set: pass one of them")
        if self.eval_data is not None:
            if not isinstance(self.eval_data, str) or not self.eval_data:
                problems.append(f"eval_data={self.eval_data!r}: give a file or a folder written by save_to_disk")
            elif not os.path.exists(self.eval_data):
                problems.append(f"eval_data={self.eval_data!r} does not exist; pass an existing file (.txt, .jsonl, "
                                ".json, .parquet, .arrow, .csv) or a folder written by datasets' save_to_disk")
        if self.eval_fraction is not None:
            f = self.eval_fraction
            if isinstance(f, bool) or not isinstance(f, (int, float)) or not 0 < f <= 0.5:
                problems.append(f"eval_fraction={f!r} must be a number in (0, 0.5], e.g. 0.05 to hold out 5% of the "
                                "data")
            elif self.data == "synthetic":
                problems.append("eval_fraction needs a dataset to hold sequences out of; synthetic data has none "
                                "(use eval_data)")
        if self.eval_every is not None:
            if not is_int(self.eval_every) or self.eval_every < 1:
                problems.append(f"eval_every={self.eval_every!r} must be an integer >= 1")
            elif self.eval_data is None and self.eval_fraction is None:
                problems.append("eval_every needs an eval set: add eval_data (--eval-data FILE) or eval_fraction "
                                "(--eval-fraction F)")
        return problems

    def _save_problems(self) -> list[str]:
        problems = []
        for name in ("save_every", "save_total_limit"):
            value = getattr(self, name)
            if value is not None and (not is_int(value) or value < 1):
                problems.append(f"{name}={value!r} must be an integer >= 1 (or unset)")
        if self.save_total_limit is not None and self.save_every is None:
            problems.append("save_total_limit limits the checkpoints save_every writes: add save_every "
                            "(--save-every N) or drop it")
        return problems

    @property
    def evaluates(self) -> bool:
        """Whether the run has an eval set."""
        return self.eval_data is not None or self.eval_fraction is not None

    @property
    def is_hf(self) -> bool:
        return self.model not in PRESETS and is_model_dir(self.model)

    def model_config(self) -> ModelConfig:
        """The preset's config (with overrides); a Hugging Face model's is read from its directory."""
        if self.is_hf:
            raise ValueError(f"{self.model} is a Hugging Face model directory, not a preset")
        return get_model_config(self.model, **self.model_overrides)


def is_model_dir(path: str) -> bool:
    """A directory holding a Hugging Face config.json (checked further when the model is loaded)."""
    return os.path.isfile(os.path.join(path, "config.json"))
