"""What a run trains: its model (a preset or a Hugging Face directory) and its data, the eval set held out or read
beside it, and the batch stream positioned at a step."""

from __future__ import annotations

import dataclasses
import os
from collections.abc import Iterator
from typing import Any

from lohan.config import ModelConfig, RunConfig
from lohan.data import Batch, BatchIterator, ByteTokenizer, TokenDataset, synthetic_batches
from lohan.runtime.engine import preset_program


# ------------------------------------------------------------------------------------------ model
@dataclasses.dataclass
class Model:
    """What the loop needs to know of the model, preset or Hugging Face."""

    config: ModelConfig          # for presets the real one; for HF models a GPT-shaped stand-in for planning
    tokenizer: Any
    hf_program: Any = None       # lohan.models.hf.HFBlocks for Hugging Face models

    @property
    def max_seq_len(self) -> int:
        return self.hf_program.max_seq_len if self.hf_program is not None else self.config.seq_len

    def program(self) -> Any:
        """The block program the engine trains, with its parameters on the meta device: what the run is planned
        from (`_run_plan`)."""
        return self.hf_program if self.hf_program is not None else preset_program(self.config)


def load_model(run: RunConfig, dry_run: bool = False) -> Model:
    """The run's model. A Hugging Face directory's weights are checked for a real run only: a dry run plans
    from config.json alone (a real model's shape, no download), and without a tokenizer reads no data."""
    if not run.is_hf:
        return Model(run.model_config(), ByteTokenizer())
    from lohan.data import HFTokenizer
    from lohan.models.hf import check_weights, has_tokenizer, load_hf_skeleton, load_tokenizer

    program = load_hf_skeleton(run.model, run.model_overrides.get("n_layer"))  # --layers N: the first N layers
    if not dry_run:
        check_weights(program, run.model)  # a damaged checkpoint is refused here, not halfway into the store
    tokenizer = (HFTokenizer(load_tokenizer(run.model)) if not dry_run or has_tokenizer(run.model) else None)
    return Model(program.planning_config(os.path.basename(os.path.normpath(run.model))), tokenizer, program)


# ------------------------------------------------------------------------------------------- data
def load_dataset(run: RunConfig, model: Model, seq_len: int, dry_run: bool = False) -> TokenDataset | None:
    """The training data (None for synthetic tokens). Records go through the token cache; a dry run writes none
    (it uses a cached stream if there is one)."""
    if run.data == "synthetic":
        return None
    if model.config.vocab_size < getattr(model.tokenizer, "vocab_size", 0):
        raise ValueError(f"the tokenizer has {model.tokenizer.vocab_size} tokens but the model's vocabulary is "
                         f"{model.config.vocab_size} (for presets set model_overrides.vocab_size >= 256)")
    return TokenDataset.from_source(run.data, seq_len, model.tokenizer, data_format=run.data_format,
                                    text_field=run.text_field, split=run.split, write_cache=not dry_run,
                                    vocab_size=model.config.vocab_size)


def load_eval_set(run: RunConfig, model: Model, dataset: TokenDataset | None, seq_len: int,
                  dry_run: bool = False) -> tuple[TokenDataset | None, TokenDataset | None]:
    """(training data, eval set): `eval_fraction` holds whole packed sequences out of the training data
    (seeded by engine.seed), `eval_data` is read like the training data; without either, no eval set."""
    if run.eval_fraction is not None and dataset is not None:
        dataset, held = dataset.split(run.eval_fraction, run.engine.execution.seed)
        what = f"{run.eval_fraction:g} of {run.data}"
    elif run.eval_data is not None:
        held = TokenDataset.from_source(run.eval_data, seq_len, model.tokenizer, data_format=run.data_format,
                                        text_field=run.text_field, split=run.eval_split, write_cache=not dry_run,
                                        vocab_size=model.config.vocab_size)
        what = run.eval_data
    else:
        return dataset, None
    m = run.engine.execution.micro_batches
    used = len(held) // m * m  # eval_batches evaluates whole micro-batches
    more = "use a larger --eval-fraction, a longer --eval-data file or a shorter --seq-len"
    if used == 0:
        raise ValueError(f"the eval set ({what}) packs into {len(held)} sequence(s) of {seq_len} tokens, fewer than "
                         f"the {m} micro-batches an evaluation runs; {more}")
    if held.loss_mask is not None and not held.loss_mask[:used, 1:].any():
        raise ValueError(f"no token of the eval set ({what}: {len(held)} sequence(s) of {seq_len} tokens) is a "
                         f"prediction target, so there is no loss to evaluate; {more}")
    return dataset, held


def make_batches(run: RunConfig, model: Model, dataset: TokenDataset | None, seq_len: int, start_step: int,
                 data_state: dict | None) -> Iterator[Batch]:
    """The run's batch stream positioned at optimizer step `start_step` (from the saved data state when
    there is one; batches are deterministic, so counting from the start gives the same position)."""
    seed = run.engine.execution.seed
    if dataset is None:
        return synthetic_batches(model.config.vocab_size, run.batch_size, seq_len, seed=seed, start=start_step)
    it = BatchIterator(dataset, run.batch_size, seed=seed)
    state = it.state_dict()
    if data_state is not None:
        it.load_state_dict(data_state["iterator"])
        for _ in range(start_step - data_state["step"]):  # the step committed after the state was saved
            next(it)
    elif start_step and dataset.loss_mask is not None:  # batches without a trained token are skipped: count
        for _ in range(start_step):
            next(it)
    elif start_step:
        state["epoch"], state["position"] = divmod(start_step, it.batches_per_epoch)
        it.load_state_dict(state)
    return it
