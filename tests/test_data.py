"""Data pipeline: tokenizer, packing, seeded and resumable batches, micro-batches, the shipped corpus."""

from __future__ import annotations

import itertools
from pathlib import Path

import pytest
import torch

from lohan.data import (
    DEFAULT_CORPUS,
    BatchIterator,
    ByteTokenizer,
    TokenDataset,
    load_text,
    pack_tokens,
    split_micro_batches,
    synthetic_batches,
)

DATA_DIR = Path(__file__).resolve().parent.parent / "data"


def _windows(n_tokens: int = 1000, seq_len: int = 8) -> torch.Tensor:
    return pack_tokens(list(range(n_tokens)), seq_len)


# ------------------------------------------------------------------------------------- tokenizer


def test_tokenizer_round_trip_including_non_ascii():
    tok = ByteTokenizer()
    text = "Hello, wörld! ∑ naïve 日本語 🚀\n\ttabs"
    ids = tok.encode(text)
    assert tok.vocab_size == 256
    assert all(0 <= i < 256 for i in ids)
    assert len(ids) == len(text.encode("utf-8")) > len(text)  # multi-byte characters take several ids
    assert tok.decode(ids) == text
    assert tok.decode(torch.tensor(ids)) == text


def test_tokenizer_decodes_cut_characters_with_replacement_and_rejects_non_bytes():
    tok = ByteTokenizer()
    ids = tok.encode("é")  # two bytes
    assert tok.decode(ids[:1]) == "\ufffd"
    with pytest.raises(ValueError, match="token id 300 is not a byte"):
        tok.decode([65, 300])


# --------------------------------------------------------------------------------------- packing


def test_pack_shapes_and_targets_are_inputs_shifted_by_one():
    ids = list(range(103))
    seq_len = 10
    w = pack_tokens(ids, seq_len)
    assert w.dtype == torch.long
    assert w.shape == ((103 - 1) // seq_len, seq_len + 1) == (10, 11)
    ds = TokenDataset(w)
    assert len(ds) == 10 and ds.seq_len == 10
    for i in range(len(ds)):
        x, y = ds[i]
        assert torch.equal(x, torch.arange(i * seq_len, i * seq_len + seq_len))
        assert torch.equal(y[:-1], x[1:]) and y[-1] == x[-1] + 1
    # Stride seq_len: the last target of a window is the first input of the next one.
    assert torch.equal(w[:-1, -1], w[1:, 0])


def test_pack_short_corpus_error_names_lengths_and_fix():
    with pytest.raises(ValueError) as e:
        pack_tokens(list(range(50)), 64)
    msg = str(e.value)
    assert "50 tokens" in msg and "seq_len=64" in msg and "65 tokens" in msg and "--seq-len 49" in msg
    pack_tokens(list(range(65)), 64)  # exactly one window is enough


def test_dataset_from_text_uses_bytes():
    ds = TokenDataset.from_text("abcdefghij", seq_len=3)
    assert ds.windows.shape == (3, 4)
    assert ByteTokenizer().decode(ds.windows[0]) == "abcd"


def test_load_text_errors(tmp_path):
    with pytest.raises(FileNotFoundError, match="does not exist"):
        load_text(tmp_path / "missing.txt")
    with pytest.raises(IsADirectoryError, match="is a directory"):
        load_text(tmp_path)
    empty = tmp_path / "empty.txt"
    empty.write_text("\n \n")
    with pytest.raises(ValueError, match="is empty"):
        load_text(empty)
    latin1 = tmp_path / "latin1.txt"
    latin1.write_bytes("caf\xe9".encode("latin-1"))
    with pytest.raises(ValueError, match="not valid UTF-8 .byte 3"):
        load_text(latin1)
    ok = tmp_path / "ok.txt"
    ok.write_text("naïve text\n", encoding="utf-8")
    assert load_text(ok) == "naïve text\n"


# --------------------------------------------------------------------------------------- batches


def _take(it, k):
    return list(itertools.islice(it, k))


def test_batch_shapes_and_shift():
    it = BatchIterator(_windows(), batch_size=4, seed=0)
    idx, tgt = next(it)
    assert idx.shape == tgt.shape == (4, 8) and idx.dtype == tgt.dtype == torch.long
    # Token ids are positions in the stream here, so the shift is exact.
    assert torch.equal(tgt, idx + 1)


def test_seeded_shuffle_is_reproducible_and_epochs_differ():
    w = _windows()  # 124 windows, batch 4 -> 31 batches per epoch
    a = BatchIterator(w, batch_size=4, seed=7)
    b = BatchIterator(w, batch_size=4, seed=7)
    n = a.batches_per_epoch
    assert n == 31
    ea, eb = _take(a, 2 * n), _take(b, 2 * n)
    assert all(torch.equal(x[0], y[0]) for x, y in zip(ea, eb))
    epoch0 = torch.cat([x[0][:, 0] for x in ea[:n]])
    epoch1 = torch.cat([x[0][:, 0] for x in ea[n:]])
    assert not torch.equal(epoch0, epoch1)  # a new order each epoch
    assert len(set(epoch0.tolist())) == n * 4  # no window repeats within an epoch
    other_seed = torch.cat([x[0][:, 0] for x in _take(BatchIterator(w, batch_size=4, seed=8), n)])
    assert not torch.equal(epoch0, other_seed)


def test_unshuffled_follows_text_order_and_epochs_bound_iteration():
    w = _windows(n_tokens=81, seq_len=8)  # 10 windows
    it = BatchIterator(w, batch_size=3, seed=0, shuffle=False, epochs=2)
    batches = list(it)
    assert len(batches) == 2 * 3  # 10 // 3 = 3 batches per epoch, the 10th window is dropped
    assert torch.equal(batches[0][0][:, 0], torch.tensor([0, 8, 16]))
    assert torch.equal(batches[3][0], batches[0][0])
    assert (it.epoch, it.position) == (2, 0)


def test_resume_continues_exactly():
    w = _windows()
    k = 45  # past the first epoch boundary (31 batches)
    reference = BatchIterator(w, batch_size=4, seed=3)
    expected = _take(reference, k + 10)[k:]

    first = BatchIterator(w, batch_size=4, seed=3)
    _take(first, k)
    state = first.state_dict()
    assert (state["epoch"], state["position"]) == (1, k - 31)

    resumed = BatchIterator(w, batch_size=4, seed=3)
    resumed.load_state_dict(state)
    got = _take(resumed, 10)
    assert all(torch.equal(x[0], y[0]) and torch.equal(x[1], y[1]) for x, y in zip(got, expected))


def test_resume_with_different_settings_lists_every_mismatch():
    state = BatchIterator(_windows(), batch_size=4, seed=3).state_dict()
    other = BatchIterator(_windows(), batch_size=2, seed=5)
    with pytest.raises(ValueError) as e:
        other.load_state_dict(state)
    assert "seed: checkpoint has 3, this run has 5" in str(e.value)
    assert "batch_size: checkpoint has 4, this run has 2" in str(e.value)


def test_batch_iterator_rejects_batch_larger_than_data():
    with pytest.raises(ValueError, match="fewer than batch_size=20; use --batch-size 10 or less"):
        BatchIterator(_windows(n_tokens=81, seq_len=8), batch_size=20)


def test_synthetic_batches_deterministic_and_resumable():
    a = _take(synthetic_batches(vocab_size=50, batch_size=2, seq_len=16, seed=1), 5)
    b = _take(synthetic_batches(vocab_size=50, batch_size=2, seq_len=16, seed=1), 5)
    c = _take(synthetic_batches(vocab_size=50, batch_size=2, seq_len=16, seed=2), 1)
    late = _take(synthetic_batches(vocab_size=50, batch_size=2, seq_len=16, seed=1, start=3), 2)
    assert all(torch.equal(x[0], y[0]) for x, y in zip(a, b))
    assert not torch.equal(a[0][0], a[1][0]) and not torch.equal(a[0][0], c[0][0])
    assert torch.equal(late[0][0], a[3][0]) and torch.equal(late[1][1], a[4][1])
    idx, tgt = a[0]
    assert idx.shape == (2, 16) and int(idx.max()) < 50 and torch.equal(idx[:, 1:], tgt[:, :-1])


# --------------------------------------------------------------------------------- micro-batches


def test_split_micro_batches():
    idx = torch.arange(12 * 5).reshape(12, 5)
    parts = split_micro_batches(idx, idx + 1, 3)
    assert len(parts) == 3
    assert all(x.shape == y.shape == (4, 5) for x, y in parts)
    assert torch.equal(torch.cat([x for x, _ in parts]), idx)
    assert torch.equal(torch.cat([y for _, y in parts]), idx + 1)


def test_split_micro_batches_error_names_numbers_and_valid_values():
    idx = torch.zeros(12, 5, dtype=torch.long)
    with pytest.raises(ValueError) as e:
        split_micro_batches(idx, idx, 5)
    msg = str(e.value)
    assert "micro_batches=5" in msg and "batch_size=12" in msg
    assert "[1, 2, 3, 4, 6, 12]" in msg and "e.g. 10 or 15" in msg
    with pytest.raises(ValueError, match="positive integer"):
        split_micro_batches(idx, idx, 0)


# -------------------------------------------------------------------------------- shipped corpus


def test_shipped_corpus_is_small_utf8_and_licensed():
    corpus = DATA_DIR / "corpus.txt"
    assert corpus == DEFAULT_CORPUS
    size = corpus.stat().st_size
    assert 300_000 <= size <= 1_000_000
    text = corpus.read_bytes().decode("utf-8")  # strict: raises if not UTF-8
    assert not any(line.lstrip().startswith(">>>") for line in text.splitlines())  # no doctests
    license_text = (DATA_DIR / "LICENSE-PSF.txt").read_text(encoding="utf-8")
    assert "PYTHON SOFTWARE FOUNDATION LICENSE" in license_text
    assert "corpus.txt" in (DATA_DIR / "README.md").read_text(encoding="utf-8")
    # Enough for a real run: the default seq_len packs into hundreds of windows.
    assert len(TokenDataset.from_file(corpus, seq_len=1024)) > 290
