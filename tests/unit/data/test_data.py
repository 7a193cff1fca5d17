"""Data pipeline: tokenizers, packing, jsonl examples and loss masks, seeded and resumable batches,
micro-batches, the shipped corpus."""

from __future__ import annotations

import itertools
import json
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F

from lohan.config import RunConfig
from lohan.data import (
    DEFAULT_CORPUS,
    IGNORE_INDEX,
    BatchIterator,
    ByteTokenizer,
    HFTokenizer,
    TokenDataset,
    Tokenizer,
    encode_examples,
    eval_batches,
    load_jsonl,
    load_text,
    pack_tokens,
    synthetic_batches,
)

DATA_DIR = Path(__file__).resolve().parents[3] / "data"


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


def test_micro_batches_cut_like_the_engine_keep_inputs_and_targets_paired():
    """The engine cuts a batch into micro-batches with ``tensor.chunk`` along the batch (Engine.step): equal
    parts, in order, each micro-batch's targets the next tokens of its own inputs."""
    idx, targets = next(BatchIterator(_windows(200, 5), batch_size=12, seed=3))
    parts = list(zip(idx.chunk(3), targets.chunk(3)))
    assert len(parts) == 3
    assert all(x.shape == y.shape == (4, 5) for x, y in parts)
    assert torch.equal(torch.cat([x for x, _ in parts]), idx)
    assert torch.equal(torch.cat([y for _, y in parts]), targets)
    assert all(torch.equal(x[:, 1:], y[:, :-1]) for x, y in parts)


def test_micro_batches_not_dividing_the_batch_refused_naming_numbers_and_valid_values():
    """The run config refuses a micro-batch count that does not divide the batch before any step runs."""
    with pytest.raises(ValueError) as e:
        RunConfig(batch_size=12, engine={"micro_batches": 5})
    msg = str(e.value)
    assert "micro_batches=5" in msg and "batch_size=12" in msg
    assert "[1, 2, 3, 4, 6, 12]" in msg and "multiple of 5" in msg
    with pytest.raises(ValueError, match=r"micro_batches=0 must be an integer >= 1"):
        RunConfig(batch_size=12, engine={"micro_batches": 0})


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


# ------------------------------------------------------------------------------ HF tokenizer (offline)

WORDS = ["[UNK]", "<s>", "</s>", "what", "is", "two", "plus", "four", "six", "the", "sky", "blue", "?", "hi"]
VOCAB = {w: i for i, w in enumerate(WORDS)}
BOS, EOS = VOCAB["<s>"], VOCAB["</s>"]


def _hf_tok(bos_token: str | None = "<s>", eos_token: str | None = "</s>"):
    """A tiny word-level fast tokenizer built in memory; its post-processor adds <s> ... </s>, so a wrapper
    that forgets add_special_tokens=False is caught."""
    from tokenizers import Tokenizer as RawTokenizer
    from tokenizers import models, pre_tokenizers, processors
    from transformers import PreTrainedTokenizerFast

    raw = RawTokenizer(models.WordLevel(VOCAB, unk_token="[UNK]"))
    raw.pre_tokenizer = pre_tokenizers.Whitespace()
    raw.post_processor = processors.TemplateProcessing(
        single="<s> $A </s>", special_tokens=[("<s>", BOS), ("</s>", EOS)]
    )
    kwargs = {k: v for k, v in (("bos_token", bos_token), ("eos_token", eos_token)) if v is not None}
    return PreTrainedTokenizerFast(tokenizer_object=raw, unk_token="[UNK]", model_max_length=4, **kwargs)


def _ids(text: str) -> list[int]:
    return [VOCAB[w] for w in text.split()]


def test_hf_tokenizer_wraps_without_special_tokens_and_satisfies_protocol():
    raw = _hf_tok()
    tok = HFTokenizer(raw)
    assert raw.encode("what is two") == [BOS, *_ids("what is two"), EOS]  # the raw one adds them...
    assert tok.encode("what is two plus four ?") == _ids("what is two plus four ?")  # ...the wrapper not
    assert tok.encode_batch(["the sky", "", "six"]) == [_ids("the sky"), [], _ids("six")]
    assert tok.encode_batch([]) == []
    assert tok.vocab_size == len(raw) == len(WORDS)
    assert (tok.eos_id, tok.bos_id) == (EOS, BOS)
    assert tok.decode(torch.tensor([BOS, *_ids("hi")])) == "<s> hi"
    assert isinstance(tok, Tokenizer) and isinstance(ByteTokenizer(), Tokenizer)
    assert ByteTokenizer().eos_id is None and ByteTokenizer().bos_id is None


def test_hf_tokenizer_without_bos_or_with_bos_equal_to_eos_prepends_nothing():
    assert HFTokenizer(_hf_tok(bos_token=None)).bos_id is None
    gpt2_like = HFTokenizer(_hf_tok(bos_token="</s>", eos_token="</s>"))  # one <|endoftext|> for both
    assert (gpt2_like.bos_id, gpt2_like.eos_id) == (None, EOS)
    ids, _ = encode_examples([{"text": "hi"}, {"text": "six"}], gpt2_like)
    assert ids.tolist() == [VOCAB["hi"], EOS, VOCAB["six"], EOS]
    no_eos = HFTokenizer(_hf_tok(eos_token=None))
    assert no_eos.eos_id is None
    ids, _ = encode_examples([{"text": "hi"}, {"text": "six"}], no_eos)
    assert ids.tolist() == [BOS, VOCAB["hi"], BOS, VOCAB["six"]]


def test_hf_tokenizer_rejects_paths_and_loads_a_saved_one(tmp_path):
    with pytest.raises(TypeError, match="from_pretrained"):
        HFTokenizer("gpt2")
    _hf_tok().save_pretrained(tmp_path)
    tok = HFTokenizer.from_pretrained(tmp_path, local_files_only=True)
    assert tok.encode("the sky is blue") == _ids("the sky is blue")
    assert (tok.bos_id, tok.eos_id, tok.vocab_size) == (BOS, EOS, len(WORDS))


# ----------------------------------------------------------------------------- jsonl and loss masks


def _write_jsonl(path: Path, rows: list[object], blank_every: int = 0) -> Path:
    lines = []
    for i, row in enumerate(rows):
        lines.append(row if isinstance(row, str) else json.dumps(row))
        if blank_every and i % blank_every == 0:
            lines.append("")
    path.write_text("\n".join(lines) + "\n", encoding="utf-8")
    return path


def _expected_pairs(stream: list[int], is_target: list[bool], seq_len: int) -> list[tuple[list[int], ...]]:
    """(input, target) of every window, computed straight from the definition."""
    n_windows = (len(stream) - 1) // seq_len
    pairs = []
    for i in range(n_windows):
        lo = i * seq_len
        inp = stream[lo : lo + seq_len]
        tgt = [stream[j] if is_target[j] else IGNORE_INDEX for j in range(lo + 1, lo + seq_len + 1)]
        pairs.append((inp, tgt))
    return pairs


def _assert_dataset(ds: TokenDataset, stream: list[int], is_target: list[bool]) -> None:
    expected = _expected_pairs(stream, is_target, ds.seq_len)
    assert len(ds) == len(expected) > 1
    for i, (inp, tgt) in enumerate(expected):
        x, y = ds[i]
        assert x.tolist() == inp, f"window {i} input"
        assert y.tolist() == tgt, f"window {i} target"


QA = [
    {"prompt": "Q: what is 2+2?\nA:", "response": " four\n"},
    {"prompt": "Q: the sky?\nA:", "response": " blue, mostly\n", "id": 7},  # extra keys are ignored
    {"prompt": "Say hi.\n", "response": "hi\n"},
] * 3


def test_jsonl_prompt_response_masks_exactly_the_prompt_bytes(tmp_path):
    path = _write_jsonl(tmp_path / "qa.jsonl", QA, blank_every=2)
    seq_len = 7  # windows cut through prompts and responses
    ds = TokenDataset.from_file(path, seq_len=seq_len)
    stream, is_target = [], []
    for ex in QA:
        p, r = ex["prompt"].encode(), ex["response"].encode()
        stream += [*p, *r]  # ByteTokenizer: no BOS/EOS
        is_target += [False] * len(p) + [True] * len(r)
    _assert_dataset(ds, stream, is_target)
    assert ds.loss_mask is not None and ds.loss_mask.dtype == torch.bool
    # The targets that count are exactly the response bytes, in order (each token is a target once).
    counted = torch.cat([ds[i][1] for i in range(len(ds))])
    kept = bytes(counted[counted != IGNORE_INDEX].tolist())
    responses = b"".join(ex["response"].encode() for ex in QA)
    covered = len(ds) * seq_len + 1  # tokens of the stream inside the windows; the tail is dropped
    assert kept == bytes(t for t, m in zip(stream[1:covered], is_target[1:covered]) if m)
    assert responses.startswith(kept) and len(kept) > len(responses) - seq_len
    assert ds.n_targets == len(kept)


def test_jsonl_prompt_response_with_hf_tokenizer_adds_bos_and_eos(tmp_path):
    rows = [
        {"prompt": "what is two plus four ?", "response": "six"},
        {"text": "the sky is blue"},
        {"prompt": "hi", "response": "hi hi"},
    ] * 4
    path = _write_jsonl(tmp_path / "mixed.jsonl", rows)
    ds = TokenDataset.from_file(path, seq_len=5, tokenizer=HFTokenizer(_hf_tok()))
    stream, is_target = [], []
    for ex in rows:
        if "text" in ex:
            ids = [BOS, *_ids(ex["text"]), EOS]
            stream += ids
            is_target += [True] * len(ids)  # plain text: nothing masked
        else:
            head, tail = [BOS, *_ids(ex["prompt"])], [*_ids(ex["response"]), EOS]
            stream += head + tail
            is_target += [False] * len(head) + [True] * len(tail)  # EOS is a target: learn to stop
    _assert_dataset(ds, stream, is_target)
    targets = torch.stack([ds[i][1] for i in range(len(ds))])
    # An EOS closes every example: count them among the windows' tokens.
    assert int((ds.windows[:, 1:] == EOS).sum()) == sum(1 for t in stream[1 : len(ds) * 5 + 1] if t == EOS)
    assert int((targets == IGNORE_INDEX).sum()) == sum(1 for m in is_target[1 : len(ds) * 5 + 1] if not m) > 0


def test_jsonl_text_only_is_unmasked_and_concatenated(tmp_path):
    texts = ["first line of text. ", "second, with a ünicode char. ", "third."] * 3
    path = _write_jsonl(tmp_path / "text.jsonl", [{"text": t} for t in texts])
    ds = TokenDataset.from_file(path, seq_len=16)
    assert ds.loss_mask is None
    assert not any((ds[i][1] == IGNORE_INDEX).any() for i in range(len(ds)))
    stream = list("".join(texts).encode())  # ByteTokenizer: examples abut, no separator
    _assert_dataset(ds, stream, [True] * len(stream))
    # With an EOS, one EOS follows every example.
    hf = HFTokenizer(_hf_tok())
    ids, mask = encode_examples([{"text": "the sky"}, {"text": "is blue"}], hf)
    assert ids.tolist() == [BOS, *_ids("the sky"), EOS, BOS, *_ids("is blue"), EOS]
    assert mask.all()


def test_from_file_dispatches_on_extension(tmp_path):
    rows = [{"prompt": "p" * 5, "response": "r" * 5}] * 4
    as_jsonl = _write_jsonl(tmp_path / "d.JSONL", rows)
    as_txt = _write_jsonl(tmp_path / "d.txt", rows)
    masked = TokenDataset.from_file(as_jsonl, seq_len=4)
    plain = TokenDataset.from_file(as_txt, seq_len=4)
    assert masked.loss_mask is not None and plain.loss_mask is None
    assert bytes(plain.windows[0].tolist()) == b'{"pro'  # a .txt is text, even when it holds JSON
    assert bytes(masked.windows[0].tolist()) == b"ppppp"


def test_from_text_with_hf_tokenizer_is_one_document():
    ds = TokenDataset.from_text("the sky is blue", seq_len=5, tokenizer=HFTokenizer(_hf_tok()))
    assert ds.windows.tolist() == [[BOS, *_ids("the sky is blue"), EOS]] and ds.loss_mask is None


def test_load_jsonl_accepts_bom_crlf_blank_lines_and_drops_extra_keys(tmp_path):
    path = tmp_path / "x.jsonl"
    path.write_bytes(
        b'\xef\xbb\xbf{"text": "a", "meta": 1}\r\n\r\n   \n{"prompt": "b", "response": "c", "lang": "en"}\r\n'
    )
    assert load_jsonl(path) == [{"text": "a"}, {"prompt": "b", "response": "c"}]


@pytest.mark.parametrize(
    ("bad_line", "problem"),
    [
        ('{"text": "unterminated}', "invalid JSON"),
        ('["text", "a list"]', "expected a JSON object, got list"),
        ('"just a string"', "expected a JSON object, got str"),
        ('{"prompt": "only a prompt"}', 'has a "prompt" key but no "response" key'),
        ('{"response": "only a response"}', 'has a "response" key but no "prompt" key'),
        ('{"input": "x", "output": "y"}', 'needs a "text" key or "prompt" and "response" keys (or a "messages" list); it has keys'),
        ('{"text": "t", "prompt": "p", "response": "r"}', "has both"),
        ('{"text": 42}', 'the "text" value must be a string, got int 42'),
        ('{"prompt": "p", "response": null}', 'the "response" value must be a string, got NoneType null'),
        # chat examples: checked line by line before any tokenizer sees them
        ('{"messages": []}', 'the "messages" value must be a non-empty list'),
        ('{"messages": "hi"}', 'the "messages" value must be a non-empty list'),
        ('{"text": "t", "messages": [{"role": "user", "content": "q"}]}', 'has "messages" and'),
        ('{"messages": [{"role": "tool", "content": "x"}, {"role": "assistant", "content": "a"}]}',
         'message 1: the role "tool" is not one of "system", "user", "assistant"'),
        ('{"messages": [{"content": "x"}]}', "message 1: the role null is not one of"),
        ('{"messages": [{"role": "user", "content": " "}, {"role": "assistant", "content": "a"}]}',
         "message 1 (user): the content is empty"),
        ('{"messages": [{"role": "user", "content": "q"}, {"role": "assistant", "content": 3}]}',
         'message 2 (assistant): the "content" must be a string, got int 3'),
        ('{"messages": [{"role": "system", "content": "s"}, {"role": "user", "content": "q"}]}',
         "has no assistant message"),
        ('{"messages": [{"role": "system", "content": "s"}, {"role": "assistant", "content": "a"}]}',
         "message 2 is an assistant turn before any user message"),
        ('{"messages": [["user", "q"]]}', 'message 1: expected a {"role", "content"} object, got list'),
    ],
)
def test_bad_jsonl_line_names_file_line_and_problem(tmp_path, bad_line, problem):
    path = tmp_path / "bad.jsonl"
    # Line 4 is bad; the blank line 2 still counts.
    path.write_text(f'{{"text": "ok"}}\n\n{{"prompt": "a", "response": "b"}}\n{bad_line}\n{{"text": "ok"}}\n')
    with pytest.raises(ValueError) as e:
        TokenDataset.from_file(path, seq_len=2)
    msg = str(e.value)
    assert "bad.jsonl" in msg and "line 4:" in msg and problem in msg, msg


def test_jsonl_invalid_utf8_names_the_line_and_missing_file_errors(tmp_path):
    path = tmp_path / "latin.jsonl"
    path.write_bytes(b'{"text": "ok"}\n{"text": "caf\xe9"}\n')
    with pytest.raises(ValueError, match="line 2: not valid UTF-8"):
        load_jsonl(path)
    with pytest.raises(FileNotFoundError, match="does not exist"):
        TokenDataset.from_file(tmp_path / "missing.jsonl", seq_len=4)
    (tmp_path / "dir.jsonl").mkdir()
    with pytest.raises(IsADirectoryError):
        load_jsonl(tmp_path / "dir.jsonl")


def test_in_memory_examples_are_checked_by_index():
    with pytest.raises(ValueError, match='example 1: has a "prompt" key but no "response" key'):
        encode_examples([{"text": "a"}, {"prompt": "b"}])
    with pytest.raises(ValueError, match="example 0: expected a JSON object, got tuple"):
        encode_examples([("text", "a")])  # type: ignore[list-item]


def test_empty_and_too_short_jsonl_errors_give_token_counts(tmp_path):
    empty = tmp_path / "empty.jsonl"
    empty.write_text("\n  \n\n")
    with pytest.raises(ValueError) as e:
        TokenDataset.from_file(empty, seq_len=8)
    msg = str(e.value)
    assert "empty.jsonl" in msg and "no examples (0 tokens" in msg and "needs at least 9 tokens" in msg, msg

    short = _write_jsonl(tmp_path / "short.jsonl", [{"prompt": "abc", "response": "de"}, {"text": "fghijkl"}])
    with pytest.raises(ValueError) as e:
        TokenDataset.from_file(short, seq_len=64)
    msg = str(e.value)
    assert "2 example(s) tokenize to 12 tokens" in msg and "seq_len=64 needs at least 65 tokens" in msg, msg
    assert "--seq-len 11" in msg
    assert len(TokenDataset.from_file(short, seq_len=11)) == 1  # exactly one window is enough


def test_jsonl_with_no_target_token_is_rejected(tmp_path):
    rows = [{"prompt": "only prompts here", "response": ""}] * 3
    with pytest.raises(ValueError, match="no token of the .* windows is a prediction target"):
        TokenDataset.from_examples(rows, seq_len=8)
    path = _write_jsonl(tmp_path / "prompts.jsonl", rows)  # in a file, the first empty response is named
    with pytest.raises(ValueError, match='line 1: the "response" is empty'):
        TokenDataset.from_file(path, seq_len=8)


def test_token_dataset_validates_loss_mask():
    w = _windows(n_tokens=41, seq_len=4)
    with pytest.raises(ValueError, match="loss_mask must be a bool tensor shaped like windows"):
        TokenDataset(w, torch.ones(w.shape[0], 4, dtype=torch.bool))
    with pytest.raises(ValueError, match="loss_mask must be a bool tensor"):
        TokenDataset(w, torch.ones_like(w))
    mask = torch.ones_like(w, dtype=torch.bool)
    mask[0, 2] = False
    ds = TokenDataset(w, mask)
    assert ds[0][1].tolist() == [1, IGNORE_INDEX, 3, 4]  # target j is masked by mask[:, j + 1]
    assert ds.n_targets == w.shape[0] * 4 - 1


# ----------------------------------------------------------------------- batches over masked data


def _masked_dataset(tmp_path: Path, seq_len: int = 6) -> TokenDataset:
    rows = [{"prompt": f"question {i}? ", "response": f"answer {i}.\n"} for i in range(40)]
    return TokenDataset.from_file(_write_jsonl(tmp_path / "qa.jsonl", rows), seq_len=seq_len)


def test_batch_iterator_carries_the_mask(tmp_path):
    ds = _masked_dataset(tmp_path)
    it = BatchIterator(ds, batch_size=4, shuffle=False, epochs=1)
    batches = list(it)
    assert len(batches) == it.batches_per_epoch == len(ds) // 4
    for b, (idx, tgt) in enumerate(batches):
        rows = [ds[b * 4 + k] for k in range(4)]
        assert torch.equal(idx, torch.stack([x for x, _ in rows]))
        assert torch.equal(tgt, torch.stack([y for _, y in rows]))
    all_targets = torch.cat([t for _, t in batches])
    assert (all_targets == IGNORE_INDEX).any() and (all_targets != IGNORE_INDEX).any()
    # Unmasked targets are still the inputs shifted by one.
    idx, tgt = batches[0]
    keep = tgt[:, :-1] != IGNORE_INDEX
    assert torch.equal(tgt[:, :-1][keep], idx[:, 1:][keep])
    # A plain windows tensor (no dataset) has no mask.
    assert not (next(BatchIterator(ds.windows, batch_size=4))[1] == IGNORE_INDEX).any()


def test_masked_batches_resume_exactly(tmp_path):
    ds = _masked_dataset(tmp_path)
    n = BatchIterator(ds, batch_size=4, seed=5).batches_per_epoch
    k = n + 3  # past an epoch boundary
    expected = _take(BatchIterator(ds, batch_size=4, seed=5), k + 8)[k:]
    first = BatchIterator(ds, batch_size=4, seed=5)
    _take(first, k)
    state = json.loads(json.dumps(first.state_dict()))  # survives a JSON checkpoint
    resumed = BatchIterator(ds, batch_size=4, seed=5)
    resumed.load_state_dict(state)
    got = _take(resumed, 8)
    assert any((t == IGNORE_INDEX).any() for _, t in got)
    # Shuffled rows keep their own mask: each row's targets are those of the window it came from.
    inputs = ds.windows[:, :-1]
    for x, y in got:
        for row_x, row_y in zip(x, y):
            same_input = (inputs == row_x).all(dim=1).nonzero()[:, 0].tolist()
            assert any(torch.equal(row_y, ds[i][1]) for i in same_input)
    for (x, y), (ex, ey) in zip(got, expected):
        assert torch.equal(x, ex) and torch.equal(y, ey)
    # N epochs: N * batches_per_epoch batches, less those with no target that counts (skipped), then it stops.
    two = BatchIterator(ds, batch_size=4, seed=5, epochs=2)
    assert len(list(two)) == 2 * n - two.untrained_skipped and two.untrained_skipped > 0


def test_masked_cross_entropy_equals_loss_over_response_tokens_only():
    g = torch.Generator().manual_seed(0)
    vocab, b, t = 11, 3, 9
    logits = torch.randn(b, t, vocab, generator=g)
    tokens = torch.randint(0, vocab, (b, t), generator=g)
    is_response = torch.zeros(b, t, dtype=torch.bool)
    is_response[0, 5:] = True
    is_response[1, 2:7] = True
    is_response[2, :] = True
    targets = tokens.masked_fill(~is_response, IGNORE_INDEX)
    loss = F.cross_entropy(logits.reshape(-1, vocab), targets.reshape(-1), ignore_index=IGNORE_INDEX)
    logp = torch.log_softmax(logits, dim=-1).gather(-1, tokens.unsqueeze(-1)).squeeze(-1)
    expected = -logp[is_response].mean()
    torch.testing.assert_close(loss, expected)
    assert not torch.allclose(loss, -logp.mean())  # the mask changes the loss


# ------------------------------------------------------------------------------------------ chat data

CHAT_WORDS = [*WORDS, "user", "assistant", "system", ":", "|", "be", "brief"]
CHAT_VOCAB = {w: i for i, w in enumerate(CHAT_WORDS)}
# The end-of-turn token right after the content, a BOS from the template, a generation prompt.
EOT_TEMPLATE = (
    "{{ bos_token }}{% for m in messages %}{{ m['role'] + ' : ' + m['content'] + eos_token }}{% endfor %}"
    "{% if add_generation_prompt %}{{ 'assistant : ' }}{% endif %}"
)
# ChatML-like: a header, the turn closed by EOS plus a newline, no BOS.
CHATML_TEMPLATE = (
    "{% for m in messages %}{{ '| ' + m['role'] + '\\n' + m['content'] + eos_token + '\\n' }}{% endfor %}"
    "{% if add_generation_prompt %}{{ '| assistant\\n' }}{% endif %}"
)
# No generation prompt (as some older templates): the assistant header is then part of the turn.
NO_PROMPT_TEMPLATE = "{% for m in messages %}{{ '| ' + m['role'] + ' ' + m['content'] + eos_token }}{% endfor %}"

CONVERSATION = [
    {"role": "system", "content": "be brief"},
    {"role": "user", "content": "what is two plus four ?"},
    {"role": "assistant", "content": "six"},
    {"role": "user", "content": "the sky ?"},
    {"role": "assistant", "content": "blue blue"},
]


def _chat_tok(template: str | None = EOT_TEMPLATE) -> HFTokenizer:
    from tokenizers import Tokenizer as RawTokenizer
    from tokenizers import models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    raw = RawTokenizer(models.WordLevel(CHAT_VOCAB, unk_token="[UNK]"))
    raw.pre_tokenizer = pre_tokenizers.Whitespace()
    tok = PreTrainedTokenizerFast(tokenizer_object=raw, unk_token="[UNK]", bos_token="<s>", eos_token="</s>",
                                  name_or_path="models/word-chat")
    tok.chat_template = template
    return HFTokenizer(tok)


def _chat_expected(messages: list[dict], template: str) -> tuple[list[int], list[bool]]:
    """The stream and target flags of one conversation, written out per template."""
    v = CHAT_VOCAB
    ids, is_target = ([v["<s>"]], [False]) if template == EOT_TEMPLATE else ([], [])
    for m in messages:
        head = [v[m["role"]], v[":"]] if template == EOT_TEMPLATE else [v["|"], v[m["role"]]]
        turn = [v[w] for w in m["content"].split()] + [v["</s>"]]  # the end-of-turn token is a target
        ids += head + turn
        mine = m["role"] == "assistant"
        is_target += [mine and template == NO_PROMPT_TEMPLATE] * len(head) + [mine] * len(turn)
    return ids, is_target


@pytest.mark.parametrize("template", [EOT_TEMPLATE, CHATML_TEMPLATE, NO_PROMPT_TEMPLATE],
                         ids=["eot", "chatml", "no-generation-prompt"])
def test_chat_targets_are_exactly_the_assistant_turns(tmp_path, template):
    tok = _chat_tok(template)
    (ids, is_target), = tok.encode_chats([CONVERSATION])
    assert (ids, is_target) == _chat_expected(CONVERSATION, template)
    short = CONVERSATION[1:3]
    rows = [{"messages": CONVERSATION}, {"messages": short}, {"text": "hi"}] * 3  # forms mix, in file order
    ds = TokenDataset.from_file(_write_jsonl(tmp_path / "chat.jsonl", rows, blank_every=2), seq_len=6, tokenizer=tok)
    stream, targets = [], []
    for row in rows:
        if "text" in row:  # text keeps its BOS/EOS from the pipeline; a conversation's come from its template
            part = ([BOS, VOCAB["hi"], EOS], [True] * 3)
        else:
            part = _chat_expected(row["messages"], template)
        stream += part[0]
        targets += part[1]
    _assert_dataset(ds, stream, targets)
    # batches and resume positions work as for any masked dataset
    it = BatchIterator(ds, batch_size=2, seed=3)
    next(it)
    resumed = BatchIterator(ds, batch_size=2, seed=3)
    resumed.load_state_dict(it.state_dict())
    assert all(torch.equal(a, b) for a, b in zip(next(it), next(resumed)))


def test_chat_data_without_a_template_or_with_bytes_names_the_fix(tmp_path):
    path = _write_jsonl(tmp_path / "chat.jsonl", [{"messages": CONVERSATION}] * 4)
    with pytest.raises(ValueError) as e:
        TokenDataset.from_file(path, seq_len=4, tokenizer=_chat_tok(None))
    msg = str(e.value)
    assert "the tokenizer of models/word-chat has no chat template" in msg
    assert "tokenizer_config.json" in msg and "{prompt, response}" in msg
    with pytest.raises(ValueError, match="byte-level tokenizer of the presets has no chat template.*--model DIR"):
        TokenDataset.from_file(path, seq_len=4)


def test_chat_template_failures_and_unstable_templates_name_the_line(tmp_path):
    rows = [{"messages": CONVERSATION[1:3]}, {"messages": CONVERSATION}]  # line 2 has a system message
    path = _write_jsonl(tmp_path / "chat.jsonl", rows)
    strict = "{% if messages[0]['role'] == 'system' %}{{ raise_exception('no system role here') }}{% endif %}"
    with pytest.raises(ValueError) as e:
        TokenDataset.from_file(path, seq_len=4, tokenizer=_chat_tok(strict + EOT_TEMPLATE))
    assert "chat.jsonl' line 2: the chat template of models/word-chat failed" in str(e.value)
    assert "no system role here" in str(e.value)
    # closes only the conversation's last turn: a turn rendered alone is not the start of the whole
    last_only = ("{% for m in messages %}{{ m['role'] + ' ' + m['content'] }}{% if loop.last %}{{ eos_token }}"
                 "{% endif %}{% endfor %}")
    with pytest.raises(ValueError, match="line 1: .* does not render this conversation prefix by prefix"):
        TokenDataset.from_file(path, seq_len=4, tokenizer=_chat_tok(last_only))
    silent = "{% for m in messages %}{% if m['role'] != 'assistant' %}{{ m['content'] }}{% endif %}{% endfor %}"
    with pytest.raises(ValueError, match="line 1: .* does not write the content of message 2"):
        TokenDataset.from_file(path, seq_len=4, tokenizer=_chat_tok(silent))


def test_shipped_chat_example_trains_on_its_assistant_turns_with_the_tiny_hf_template():
    import importlib.util

    spec = importlib.util.spec_from_file_location("make_tiny_hf", DATA_DIR.parent / "scripts" / "make_tiny_hf.py")
    make_tiny_hf = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(make_tiny_hf)
    tok = HFTokenizer(make_tiny_hf.train_tokenizer(DEFAULT_CORPUS, 512))
    rows = load_jsonl(DATA_DIR / "chat_example.jsonl")
    assert len(rows) >= 200 and all(len(r["messages"]) >= 4 for r in rows)  # multi-turn
    for row, (ids, is_target) in zip(rows[:40], tok.encode_chats([r["messages"] for r in rows[:40]])):
        answers = [m["content"] for m in row["messages"] if m["role"] == "assistant"]
        # the targets, turn by turn, decode to each answer followed by the end-of-turn EOS
        runs = [list(g) for k, g in itertools.groupby(zip(ids, is_target), key=lambda t: t[1]) if k]
        assert [tok.decode([i for i, _ in run]) for run in runs] == [a + "</s>" for a in answers]
    ds = TokenDataset.from_file(DATA_DIR / "chat_example.jsonl", seq_len=128, tokenizer=tok)
    assert len(ds) > 100 and 0 < ds.n_targets < len(ds) * 128


# ------------------------------------------------------------------------------- held-out split


def test_split_holds_out_seeded_whole_windows_and_eval_batches_cover_them_in_order():
    ds = TokenDataset(_windows(1000, 8), torch.rand(124, 9) > 0.3)
    train, held = ds.split(0.1, seed=4)
    assert (len(train), len(held)) == (112, 12)
    again_train, again_held = ds.split(0.1, seed=4)
    assert torch.equal(held.windows, again_held.windows) and torch.equal(train.loss_mask, again_train.loss_mask)
    assert not torch.equal(held.windows, ds.split(0.1, seed=5)[1].windows)
    # whole windows, disjoint, each part in the original order (window i starts at token 8 * i)
    starts = sorted(train.windows[:, 0].tolist() + held.windows[:, 0].tolist())
    assert starts == ds.windows[:, 0].tolist()
    assert held.windows[:, 0].tolist() == sorted(held.windows[:, 0].tolist())
    rows = {w[0] // 8 for w in held.windows.tolist()}
    assert torch.equal(held.loss_mask, ds.loss_mask[sorted(rows)])
    batches = list(eval_batches(held, batch_size=5))
    assert [b[0].shape[0] for b in batches] == [5, 5, 2]
    xs, ys = torch.cat([b[0] for b in batches]), torch.cat([b[1] for b in batches])
    assert all(torch.equal(xs[i], held[i][0]) and torch.equal(ys[i], held[i][1]) for i in range(len(held)))
    assert [b[0].shape[0] for b in eval_batches(held, batch_size=8, multiple=4)] == [8, 4]
    assert [b[0].shape[0] for b in eval_batches(held, batch_size=10, multiple=5)] == [10]  # the last 2 are cut
    with pytest.raises(ValueError, match="leaves none to train on"):
        TokenDataset(_windows(10, 8)).split(0.5)  # one window
    with pytest.raises(ValueError, match=r"fraction=1.5 must be a number in \(0, 1\)"):
        ds.split(1.5)


def test_one_row_batches_keep_their_inputs_and_the_dataset_intact(tmp_path):
    """A one-row batch's inputs and targets are slices of one window: masking the targets must not write -100
    into the inputs (training batches) or into the dataset's windows (evaluation batches slice them)."""
    ds = TokenDataset.from_file(_write_jsonl(tmp_path / "qa.jsonl", QA), seq_len=7)
    before = ds.windows.clone()
    masked = 0
    for idx, targets in itertools.islice(BatchIterator(ds, batch_size=1, seed=0), len(ds)):
        assert (idx >= 0).all(), idx
        masked += int((targets == IGNORE_INDEX).sum())
    for idx, _ in eval_batches(ds, batch_size=1):
        assert (idx >= 0).all(), idx
    assert masked > 0 and torch.equal(ds.windows, before)


def test_batches_without_a_trained_token_are_skipped_counted_and_resumable():
    """A batch whose every target is masked (chat windows without an assistant token) trains nothing: the iterator
    skips it and counts it, a resumed iterator lands on the same batches, and data with no target at all is refused
    instead of looping forever."""
    w = _windows(n_tokens=81, seq_len=4)  # 20 windows; window j starts with token 4j
    mask = torch.zeros_like(w, dtype=torch.bool)
    mask[::3, 2] = True  # one target in windows 0, 3, 6, 9, ...: batches {4,5}, {10,11}, {16,17} have none
    it = BatchIterator(TokenDataset(w, mask), batch_size=2, shuffle=False)
    got = [next(it) for _ in range(4)]
    assert [int(x[0, 0]) // 4 for x, _ in got] == [0, 2, 6, 8]  # batch {4, 5} was skipped
    assert all((t != IGNORE_INDEX).any() for _, t in got) and it.untrained_skipped == 1
    again = BatchIterator(TokenDataset(w, mask), batch_size=2, shuffle=False)
    again.load_state_dict(it.state_dict())
    assert torch.equal(next(again)[0], next(it)[0])  # both skip {10, 11} and yield {12, 13}
    assert it.untrained_skipped == again.untrained_skipped + 1 == 2
    with pytest.raises(ValueError, match="no target that counts"):
        next(BatchIterator(TokenDataset(w, torch.zeros_like(mask)), batch_size=2))
