"""The pretraining data pipeline: vectorised batch encoding against the tokenizer, batches from DataLoader workers in
the stream's order with the position of each, and corpora that hold no word."""

import signal
from contextlib import contextmanager

import pytest
import torch

from hf_elmo import ElmoTokenizer
from hf_elmo.cli import pretrain_main
from hf_elmo.pretraining_data import (
    BatchEncoder,
    CorpusError,
    PretrainingBatches,
    SentenceBatchStream,
    WordSplitter,
    make_batch,
    resolve_shards,
)
from hf_elmo.testing_utils import english_text_sample
from hf_elmo.tokenization_elmo import write_vocab


pytestmark = pytest.mark.usefixtures("fresh_accelerate_state")  # conftest.py


def tokenizer_batch(tokenizer, sentences):
    """The specification: the tokenizer's char ids and `words_to_indices` labels, one Python row at a time."""
    encoded = tokenizer(sentences, is_split_into_words=True, padding=True, return_tensors="pt")
    labels = torch.full(encoded["attention_mask"].shape, -100, dtype=torch.long)
    for row, words in enumerate(sentences):
        labels[row, : len(words)] = torch.tensor(tokenizer.words_to_indices(words), dtype=torch.long)
    return {"input_ids": encoded["input_ids"], "attention_mask": encoded["attention_mask"], "labels": labels}


def test_batch_encoder_equals_the_tokenizer(tmp_path):
    # Boundary words, a word past the 48-byte cut, a 3-byte character cut in the middle, a lone surrogate (dropped),
    # a word that repeats, unknown words, and a vocabulary with a duplicated line (the first one wins).
    odd = [["<S>", "the", "</S>", "x" * 60, "日本語" * 6, "a\ud800b", "the", "zebra"], ["naïve", "café"], ["the"]]
    lines = english_text_sample().read_text(encoding="utf-8").splitlines()[:300]
    splitter = WordSplitter("ptb")
    real = [splitter(line) for line in lines]
    vocab = ["<S>", "</S>", "<UNK>", "the", "café", "the", *sorted({w for s in real[:150] for w in s} - {"the"})]
    tokenizer = ElmoTokenizer(vocab_file=write_vocab(vocab, str(tmp_path / "vocab.txt")), max_characters_per_token=50)
    encoder = BatchEncoder.from_tokenizer(tokenizer)
    for sentences in [odd, real[:64], real[64:300]]:
        expected = tokenizer_batch(tokenizer, sentences)
        batch = encoder(sentences)
        assert batch.pop("num_tokens") == sum(len(s) + 1 for s in sentences)
        assert sorted(batch) == sorted(expected)
        for key in expected:
            assert batch[key].dtype == expected[key].dtype and torch.equal(batch[key], expected[key]), key
    batch = make_batch(tokenizer, odd)
    assert batch["labels"].tolist()[1:] == [[2, 4, -100, -100, -100, -100, -100, -100], [3] + [-100] * 7]
    assert batch["input_ids"][0, 0, :4].tolist() == [259, 257, 260, 261]  # <S>: the sentence-begin row
    # Lengths bucketed: 8 words padded to a multiple of 5, the same batch otherwise.
    bucketed = BatchEncoder.from_tokenizer(tokenizer, pad_to_multiple_of=5)(odd)
    plain = encoder(odd)
    assert bucketed["input_ids"].shape == (3, 10, 50) and bucketed["num_tokens"] == plain["num_tokens"]
    for key in ("input_ids", "attention_mask", "labels"):
        assert torch.equal(bucketed[key][:, :8], plain[key]), key
    assert not bucketed["input_ids"][:, 8:].any() and not bucketed["attention_mask"][:, 8:].any()
    assert (bucketed["labels"][:, 8:] == -100).all()
    with pytest.raises(ValueError, match="pad_to_multiple_of must be a positive integer, got 0"):
        BatchEncoder.from_tokenizer(tokenizer, pad_to_multiple_of=0)
    with pytest.raises(ValueError, match="pad_rows_to must be a non-negative integer, got -1"):
        BatchEncoder.from_tokenizer(tokenizer, pad_rows_to=-1)
    # Another row width (a model with max_characters_per_token 12).
    narrow = ElmoTokenizer(vocab_file=str(tmp_path / "vocab.txt"), max_characters_per_token=12)
    assert torch.equal(BatchEncoder.from_tokenizer(narrow)(odd)["input_ids"], tokenizer_batch(narrow, odd)["input_ids"])


def _shards(tmp_path, n_shards=3, per_shard=30):
    files = []
    for s in range(n_shards):
        lines = [" ".join(f"s{s}.{i}.{k}" for k in range(1 + i % 6)) for i in range(per_shard)]
        path = tmp_path / f"shard-{s}.txt"
        path.write_text("\n".join(lines) + "\n", encoding="utf-8")
        files.append(str(path))
    return files


def _loader(dataset, num_workers):
    return torch.utils.data.DataLoader(dataset, batch_size=None, num_workers=num_workers,
                                       prefetch_factor=3 if num_workers else None, generator=torch.Generator())


def test_workers_give_the_streams_batches_in_order_and_resume_at_the_used_batch(tmp_path):
    files = _shards(tmp_path)
    settings = dict(shards=files, split_words=str.split, batch_size=4, seed=5, rank=1, world_size=2, shuffle_window=16,
                    max_words=4)
    vocab = write_vocab(["<S>", "</S>", "<UNK>", "s0.1.0", "s1.2.1"], str(tmp_path / "vocab.txt"))
    encoder = BatchEncoder.from_tokenizer(ElmoTokenizer(vocab_file=vocab))
    # The specification: the stream read in this process, one batch after another (across two epochs: 90 lines each).
    stream = SentenceBatchStream(**settings)
    expected, positions = [], []
    for _ in range(30):
        expected.append(encoder(stream.next_batch()))
        positions.append(stream.position())
    assert stream.epoch == 2

    # Drawing from the loader leaves the global generator alone (a resumed run draws the same negatives).
    torch.manual_seed(0)
    before = torch.get_rng_state()
    for num_workers in (0, 2):
        batches = iter(_loader(PretrainingBatches(settings, encoder), num_workers))
        got = [next(batches) for _ in range(30)]
        del batches
        assert [b.pop("stream_position") for b in got] == positions
        for mine, reference in zip(got, expected):
            assert mine["num_tokens"] == reference["num_tokens"]
            assert all(torch.equal(mine[k], reference[k]) for k in ("input_ids", "attention_mask", "labels"))
    assert torch.equal(torch.get_rng_state(), before)

    # A stream moved to the position of the 11th batch (the last one the model used) and a loader started from
    # it continue with the 12th, although the first loader had read further ahead.
    restored = SentenceBatchStream(**settings)
    restored.set_position(positions[10])
    batches = iter(_loader(PretrainingBatches(settings, encoder, start=restored.state_dict()), 2))
    for reference in expected[11:20]:
        assert torch.equal(next(batches)["input_ids"], reference["input_ids"])
    del batches


def test_a_corpus_error_in_a_worker_arrives_as_one_line_in_its_place(tmp_path):
    (tmp_path / "a.txt").write_bytes(b"one two\nthree four five\n" * 4 + "caf\xe9\n".encode("latin-1"))
    settings = dict(shards=[str(tmp_path / "a.txt")], split_words=str.split, batch_size=2, seed=0, shuffle_window=2)
    vocab = write_vocab(["<S>", "</S>", "<UNK>"], str(tmp_path / "vocab.txt"))
    batches = iter(_loader(PretrainingBatches(settings, BatchEncoder.from_tokenizer(ElmoTokenizer(vocab_file=vocab))), 2))
    items = [next(batches) for _ in range(5)]
    del batches
    # Windows of 2 sentences, one batch each: 4 batches, then the window with line 9.
    assert ["error" in item for item in items] == [False] * 4 + [True]
    assert items[4] == {"error": f"{tmp_path / 'a.txt'}:9: not UTF-8 text (byte 3: b'\\xe9\\n'); expected UTF-8. "
                                 "Convert the file, e.g. iconv -f LATIN1 -t UTF-8 for Latin-1."}


@contextmanager
def _fails_instead_of_hanging(seconds=60):
    """Turns a hang (the defect under test) into a failure; a correct run ends long before."""

    def stop(signum, frame):
        raise AssertionError(f"still running after {seconds} s: the reader loops")

    previous = signal.signal(signal.SIGALRM, stop)
    signal.alarm(seconds)
    try:
        yield
    finally:
        signal.alarm(0)
        signal.signal(signal.SIGALRM, previous)


def test_a_corpus_of_unicode_whitespace_stops_at_once(tmp_path, capsys):
    blank = tmp_path / "nbsp.txt"
    blank.write_text("\u00a0\n\u3000 \u00a0\n\u2003\n", encoding="utf-8")
    with _fails_instead_of_hanging():
        with pytest.raises(CorpusError, match=r"nbsp\.txt is empty \(no non-blank line\)"):
            resolve_shards([str(blank)], split_words=WordSplitter("ptb"))
        # A stream on such files (not checked first) ends after one epoch without a sentence.
        stream = SentenceBatchStream([str(blank)], str.split, batch_size=2, seed=0)
        with pytest.raises(CorpusError, match=r"^no sentence in a whole epoch of .*nbsp\.txt: every line is empty"):
            stream.next_batch()
        code = pretrain_main(["--train-files", str(blank), "--build-vocab", "--config", "small", "--max-steps", "1",
                              "--output-dir", str(tmp_path / "out"), "--report-to", "none"])
    assert code == 1
    errors = [line for line in capsys.readouterr().err.splitlines() if line.startswith("error: ")]
    assert errors == [f"error: --train-files: {blank} is empty (no non-blank line). Every shard must hold sentences, one per "
                      "line; remove the file or fix the pattern."]
