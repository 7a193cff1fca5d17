"""Data pipeline: local file -> tokens (+ loss mask) -> packed windows -> seeded, resumable batches.

Deliberately small: LoHan's subject is where model states live, not tokenization. The default pipeline
is a byte-level tokenizer over a local ``.txt`` file (``data/corpus.txt`` ships with the repository)
with fixed-length packing, like nanoGPT's ``shakespeare_char``. A Hugging Face tokenizer can be used
instead through :class:`HFTokenizer`, and a ``.jsonl`` file of ``{"text": ...}`` or
``{"prompt": ..., "response": ...}`` examples gives instruction tuning with the loss on the responses
only (see :meth:`TokenDataset.from_jsonl`); ``{"messages": [...]}`` conversations are rendered with the
model's chat template and trained on the assistant turns only (:meth:`HFTokenizer.encode_chats`). Alpaca and
ShareGPT records map onto these (:mod:`~lohan.data.formats`), and :meth:`TokenDataset.from_source` reads them from
``.jsonl``, ``.json``, Parquet, Arrow and CSV files and ``save_to_disk`` folders with the ``datasets`` library,
tokenized once into an on-disk token cache that later runs memory-map (:mod:`~lohan.data.token_cache`).
Everything here is deterministic given a seed, and :class:`BatchIterator` can save and restore its
position so a resumed run sees exactly the batches an uninterrupted run would have seen.
:meth:`TokenDataset.split` holds out a seeded share of the windows for evaluation, and
:func:`eval_batches` walks a dataset once, in order.

Shapes: a *window* is ``seq_len + 1`` consecutive tokens; the model input is ``window[:-1]`` and the
target is ``window[1:]`` (next-token prediction). Batches are ``(idx, targets)``, both ``int64`` of shape
``[batch_size, seq_len]``, on the CPU; the engine moves them to the device. A target of
:data:`IGNORE_INDEX` (``-100``) is not a prediction target: ``F.cross_entropy(..., ignore_index=-100)``
skips it (prompt tokens of a prompt/response example).

Modules, lowest first: :mod:`~lohan.data.tokenizers` (the :class:`Tokenizer` protocol, :class:`ByteTokenizer`,
:class:`HFTokenizer`), :mod:`~lohan.data.formats` (record formats and their checks), :mod:`~lohan.data.sources`
(reading text and ``.jsonl`` files, encoding examples, packing), :mod:`~lohan.data.records` (what a path is; tables
of records through ``datasets``), :mod:`~lohan.data.token_cache` (tokenize once, memory-map after),
:mod:`~lohan.data.dataset` (:class:`TokenDataset`) and :mod:`~lohan.data.batches` (:class:`BatchIterator`,
:func:`eval_batches`, :func:`synthetic_batches`). Import from the package: ``from lohan.data import ...``.
"""

from .batches import BatchIterator, eval_batches, synthetic_batches
from .dataset import Batch, TokenDataset
from .formats import ALPACA_PROMPT, ALPACA_PROMPT_NO_INPUT, to_example
from .sources import (
    DEFAULT_CORPUS,
    IGNORE_INDEX,
    encode_examples,
    load_jsonl,
    load_text,
    pack_tokens,
)
from .token_cache import load_stream
from .tokenizers import ByteTokenizer, HFTokenizer, Tokenizer

__all__ = [
    "ALPACA_PROMPT",
    "ALPACA_PROMPT_NO_INPUT",
    "Batch",
    "BatchIterator",
    "ByteTokenizer",
    "DEFAULT_CORPUS",
    "HFTokenizer",
    "IGNORE_INDEX",
    "TokenDataset",
    "Tokenizer",
    "encode_examples",
    "eval_batches",
    "load_jsonl",
    "load_stream",
    "load_text",
    "pack_tokens",
    "synthetic_batches",
    "to_example",
]
