"""ELMo pretraining: the LM objective, the vocabulary and corpus stream, and real Accelerate runs on real English text
(a 2-process CPU run, a run killed with SIGKILL and resumed, held-out perplexity, export to bilm-tf and back)."""

import hashlib
import json
import logging
import math
import os
import platform
import re
import pickle
import shutil
import signal
import subprocess
import sys
import time
from collections import Counter
from concurrent.futures import ThreadPoolExecutor
from dataclasses import asdict
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file
from transformers import AutoModel, AutoModelForPreTraining, AutoTokenizer

from hf_elmo import ElmoConfig, ElmoForPreTraining, ElmoModel, ElmoTokenizer
from hf_elmo import run_record, sampled_softmax
from hf_elmo.cli import pretrain_main
from hf_elmo.log_uniform_sampler import log_uniform_expected_count, sample_log_uniform_candidates
from hf_elmo.pretraining import COMPILED_LENGTH_BUCKET, latest_checkpoint, padding_multiple, warn_of_cut_words
from hf_elmo.pretraining_data import (
    BatchEncoder,
    CorpusError,
    SentenceBatchStream,
    count_words,
    make_batch,
    read_eval_sentences,
    resolve_shards,
)
from hf_elmo.testing_utils import free_port, launch_failure_report
from hf_elmo.pretraining_data import build_vocab
from hf_elmo.tokenization_elmo import write_vocab


REPO_ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
TINY = {
    "char_filters": [[1, 8], [2, 8], [3, 16]],
    "n_highway": 1,
    "char_embedding_dim": 8,
    "lstm_dim": 64,
    "projection_dim": 16,
    "num_lstm_layers": 2,
}


def error_lines(capsys) -> list[str]:
    """The `error: ...` lines printed on stderr since the last read, without the prefix."""
    return [line[len("error: "):] for line in capsys.readouterr().err.splitlines() if line.startswith("error: ")]


def tiny_config(**overrides) -> ElmoConfig:
    return ElmoConfig(**{**TINY, "vocab_size": 40, **overrides})


pytestmark = pytest.mark.usefixtures("fresh_accelerate_state")  # conftest.py


# ------------------------------------------------------------------------------------------------ the objective
def test_lm_targets_put_boundaries_where_bilm_tf_predicts_them():
    model = ElmoForPreTraining(tiny_config(bos_word_id=5, eos_word_id=3))
    labels = torch.tensor([[10, 11, 12], [20, -100, -100]])
    word_mask = torch.tensor([[1, 1, 1, 1, 1], [1, 1, 1, 0, 0]], dtype=torch.bool)  # <S> words </S>
    forward_targets, backward_targets = model.lm_targets(labels, word_mask)
    # Forward: <S> -> w0, w_i -> w_{i+1}, last word -> </S>. Backward: </S> -> last word, w_i -> w_{i-1}, w0 -> <S>.
    assert forward_targets.tolist() == [[10, 11, 12, 3, -100], [20, 3, -100, -100, -100]]
    assert backward_targets.tolist() == [[-100, 5, 10, 11, 12], [-100, 5, 20, -100, -100]]
    # A row without words (padding up to a fixed row count) predicts nothing, not even </S> or <S>.
    empty = model.lm_targets(torch.full((1, 3), -100), torch.tensor([[1, 1, 0, 0, 0]], dtype=torch.bool))
    assert [t.tolist() for t in empty] == [[[-100] * 5], [[-100] * 5]]


def test_rows_without_words_change_neither_the_losses_nor_the_gradients():
    words = [f"w{i}" for i in range(37)]
    sentences = [["w1", "w2", "w3", "w4", "w5"], ["w6", "w7", "w8"], ["w9"]]
    vocab = ["<S>", "</S>", "<UNK>", *words]
    batch, padded = BatchEncoder(vocab)(sentences), BatchEncoder(vocab, pad_rows_to=5)(sentences)
    assert padded["input_ids"].shape == (5, 5, 50) and padded["labels"][3:].eq(-100).all()
    assert padded["attention_mask"][3:].eq(0).all() and padded["input_ids"][3:].eq(0).all()
    assert batch.pop("num_tokens") == padded.pop("num_tokens") == 12  # the padding rows predict nothing
    torch.manual_seed(0)
    model = ElmoForPreTraining(tiny_config(lm_dropout=0.0)).train()  # vocabulary 40: the full softmax
    results = []
    for inputs in (batch, padded):
        model.zero_grad()
        out = model(**inputs)
        out.loss.backward()
        results.append((out, [p.grad.clone() for p in model.parameters()]))
    (plain, plain_grads), (with_padding, padded_grads) = results
    assert int(plain.num_predictions) == int(with_padding.num_predictions) == (5 + 1) + (3 + 1) + (1 + 1)  # words + </S> per row
    for name in ("loss", "forward_loss", "backward_loss"):
        assert torch.allclose(getattr(plain, name), getattr(with_padding, name), rtol=1e-6, atol=0)
    assert max(float((a - b).abs().max()) for a, b in zip(plain_grads, padded_grads)) < 1e-6
    # Padding rows alone: no prediction, loss 0 (not 0 / 0).
    alone = model(**{key: value[3:] for key, value in padded.items()})
    assert float(alone.loss) == 0.0 and int(alone.num_predictions) == 0


def _batch(seed=0, vocab_size=40):
    generator = torch.Generator().manual_seed(seed)
    input_ids = torch.randint(1, 262, (3, 5, 50), generator=generator)
    input_ids[1, 3:] = 0
    input_ids[2, 1:] = 0
    labels = torch.randint(0, vocab_size, (3, 5), generator=generator)
    labels[1, 3:] = -100
    labels[2, 1:] = -100
    return input_ids, labels


def test_full_softmax_losses_match_a_hand_computation():
    torch.manual_seed(0)
    model = ElmoForPreTraining(tiny_config()).eval()
    input_ids, labels = _batch()
    with torch.no_grad():
        output = model(input_ids, labels=labels)
        top = model.elmo(input_ids, keep_sentence_boundaries=True).last_hidden_state
    p, forward_nll, backward_nll = model.config.projection_dim, [], []
    for row, n in enumerate((5, 3, 1)):
        words = labels[row, :n].tolist()
        for position, target in enumerate(words + [1]):  # eos_word_id = 1
            forward_nll.append(-torch.log_softmax(model.softmax(top[row, position, :p]), -1)[target])
        for position, target in enumerate([0] + words):  # bos_word_id = 0
            backward_nll.append(-torch.log_softmax(model.softmax(top[row, position + 1, p:]), -1)[target])
    assert int(output.num_predictions) == 6 + 4 + 2
    torch.testing.assert_close(output.forward_loss, torch.stack(forward_nll).mean(), rtol=0, atol=1e-6)
    torch.testing.assert_close(output.backward_loss, torch.stack(backward_nll).mean(), rtol=0, atol=1e-6)
    torch.testing.assert_close(output.loss, (output.forward_loss + output.backward_loss) / 2, rtol=0, atol=0)
    # Without labels: full-softmax scores at every position, the same numbers.
    with torch.no_grad():
        scores = model(input_ids)
    assert scores.forward_logits.shape == (3, 7, 40) and scores.loss is None
    first = -torch.log_softmax(scores.forward_logits[0, 0], -1)[labels[0, 0]]
    torch.testing.assert_close(first, forward_nll[0], rtol=0, atol=1e-6)


def test_sampled_softmax_is_the_tensorflow_recipe():
    config = tiny_config(vocab_size=1000, num_softmax_samples=50, lm_dropout=0.0)
    torch.manual_seed(0)
    model = ElmoForPreTraining(config).train()
    input_ids, labels = _batch(vocab_size=1000)
    torch.manual_seed(7)
    output = model(input_ids, labels=labels)
    output.loss.backward()

    # Replay the same draw and compute the loss by hand: true logit and sampled logits, each minus log(expected
    # count), accidental hits removed, softmax cross-entropy with the true word as class 0.
    torch.manual_seed(7)
    candidates, tries = sample_log_uniform_candidates(50, 1000)
    assert len(set(candidates.tolist())) == 50 and tries >= 50
    with torch.no_grad():
        top = model.elmo(input_ids, keep_sentence_boundaries=True).last_hidden_state
        word_mask = torch.arange(7) < torch.tensor([7, 5, 3])[:, None]  # <S> + words + </S> per row
        forward_targets, backward_targets = model.lm_targets(labels, word_mask)
        w, b, p = model.softmax.weight, model.softmax.bias, config.projection_dim
        nll = []
        for hidden, targets in ((top[..., :p], forward_targets), (top[..., p:], backward_targets)):
            keep = targets != -100
            h, t = hidden[keep], targets[keep]
            q_true = log_uniform_expected_count(t, 1000, 50, tries).log().float()
            q_sampled = log_uniform_expected_count(candidates, 1000, 50, tries).log().float()
            true_logit = (h * w[t]).sum(-1) + b[t] - q_true
            sampled = h @ w[candidates].t() + b[candidates] - q_sampled
            sampled[candidates[None] == t[:, None]] = float("-inf")
            logits = torch.cat([true_logit[:, None], sampled], 1)
            nll.append(-torch.log_softmax(logits, -1)[:, 0].mean())
    torch.testing.assert_close(output.forward_loss.detach(), nll[0], rtol=0, atol=1e-5)
    torch.testing.assert_close(output.backward_loss.detach(), nll[1], rtol=0, atol=1e-5)
    # Only the rows of targets and negatives receive a gradient.
    touched = set(model.softmax.weight.grad.abs().sum(1).nonzero().flatten().tolist())
    assert touched == set(candidates.tolist()) | set(labels[labels != -100].tolist()) | {0, 1}


def test_sparse_softmax_gradients_give_the_weights_of_the_dense_update():
    # Four steps of the pretraining update (forward, gradient x 20, global-norm clipping that bites, Adagrad), once
    # with dense softmax gradients and once with sparse ones: the same weights, to rounding.
    from hf_elmo.pretraining import clip_gradient_norm

    config = tiny_config(vocab_size=5000, num_softmax_samples=64, lm_dropout=0.0)
    torch.manual_seed(0)
    initial = ElmoForPreTraining(config).state_dict()
    runs = {}
    for sparse in (False, True):
        model = ElmoForPreTraining(config).train()
        model.load_state_dict(initial)
        model.softmax.sparse = sparse
        optimizer = torch.optim.Adagrad(model.parameters(), lr=0.2, initial_accumulator_value=1.0)
        norms = []
        for step in range(4):
            input_ids, labels = _batch(vocab_size=5000, seed=step)
            torch.manual_seed(100 + step)  # the same negatives on both sides
            (model(input_ids, labels=labels).loss * 20).backward()
            assert model.softmax.weight.grad.is_sparse is sparse and model.softmax.bias.grad.is_sparse is sparse
            norms.append(float(clip_gradient_norm(model.parameters(), 5.0)))
            optimizer.step()
            optimizer.zero_grad()
        runs[sparse] = norms, model.state_dict()
    (dense_norms, dense), (sparse_norms, sparse) = runs[False], runs[True]
    assert sparse_norms == pytest.approx(dense_norms, rel=1e-5) and min(dense_norms) > 5.0  # clipping bit
    for name, value in dense.items():
        torch.testing.assert_close(sparse[name], value, rtol=1e-5, atol=1e-6, msg=name)
    # The update moved the softmax rows it used and no other.
    moved = (dense["softmax.weight"] != initial["softmax.weight"]).any(1)
    assert 64 < int(moved.sum()) < 5000 // 4


@pytest.mark.parametrize("products", ["blas", "onednn"])
def test_sampled_softmax_loss_and_gradients_are_the_plain_formulas(products, request, monkeypatch):
    # 300 positions, 1024 negatives: on oneDNN the scores get 320 rows (`padded_rows`), zeros past the positions,
    # computed in blocks of rows; no padding row may reach the loss or a gradient.
    from hf_elmo import cpu_tuning
    from hf_elmo.sampled_softmax import SampledSoftmaxLoss

    if products == "onednn":
        onednn = request.getfixturevalue("onednn_products")
        monkeypatch.setattr(sampled_softmax, "SCORE_BLOCK_ROWS", 128)
    else:
        monkeypatch.setenv(cpu_tuning.TUNING_VARIABLE, "fixed")
    generator = torch.Generator().manual_seed(5)
    hidden, weight = torch.randn(300, 64, generator=generator), torch.randn(1024, 64, generator=generator) * 0.3
    shift, true_logits = torch.randn(1024, generator=generator), torch.randn(300, generator=generator)
    hit_columns = torch.randint(0, 1024, (300,), generator=generator)
    hit_values = torch.where(torch.arange(300) % 7 == 0, float("-inf"), 0.0)  # every 7th target is a negative too
    leaves = [t.clone().double().requires_grad_() for t in (hidden, weight, shift, true_logits)]
    scores = leaves[0] @ leaves[1].t() + leaves[2]
    scores = scores.index_put((torch.arange(300), hit_columns), hit_values.double(), accumulate=True)
    expected = -torch.log_softmax(torch.cat([leaves[3][:, None], scores], dim=1), dim=1)[:, 0]
    upstream = torch.rand(300, generator=generator)
    expected_gradients = torch.autograd.grad(expected, leaves, upstream.double())

    ours = [t.clone().requires_grad_() for t in (hidden, weight, shift, true_logits)]
    losses = SampledSoftmaxLoss.apply(*ours, hit_columns, hit_values)
    gradients = torch.autograd.grad(losses, ours, upstream)
    torch.testing.assert_close(losses.double(), expected.detach(), rtol=1e-5, atol=1e-5)
    for name, got, wanted in zip(("hidden", "weight", "shift", "true logits"), gradients, expected_gradients):
        assert got.shape == wanted.shape, name
        torch.testing.assert_close(got.double(), wanted, rtol=1e-5, atol=1e-6, msg=name)
    if products == "onednn":
        # The scores in 3 blocks of rows (128, 128 and 64), then the backward's two products on 320 rows.
        assert [tuple(x) for x, _ in onednn] == [(128, 64), (128, 64), (64, 64), (320, 1024), (64, 320)]


def test_clip_gradient_norm_is_torchs_rule_with_the_exact_norm():
    from hf_elmo.pretraining import clip_gradient_norm

    generator = torch.Generator().manual_seed(0)
    ours, torchs = ([torch.nn.Parameter(torch.zeros(n)) for n in (3, 7, 1)] for _ in range(2))
    for a, b in zip(ours, torchs):
        a.grad = torch.randn(a.shape, generator=generator) * 4
        b.grad = a.grad.clone()
    torchs[2].grad = ours[2].grad = None
    for max_norm in (1.0, float("inf")):
        expected = torch.nn.utils.clip_grad_norm_(torchs, max_norm)
        assert float(clip_gradient_norm(ours, max_norm)) == pytest.approx(float(expected), rel=1e-6)
        assert all(torch.allclose(a.grad, b.grad, rtol=1e-6, atol=0) for a, b in zip(ours[:2], torchs[:2]))
    assert float(clip_gradient_norm([], 1.0)) == 0.0
    # One of `original`'s LSTM matrices and a bias (4096 x 2048 and 5 values: rows of 4096, and a remainder), and a
    # sparse gradient: the norm is float64's to rounding, where torch's own came out 2.5e-4 too small on the CPU.
    big = [torch.nn.Parameter(torch.zeros(4096, 2048)), torch.nn.Parameter(torch.zeros(5)),
           torch.nn.Parameter(torch.zeros(10, 3))]
    big[0].grad = torch.randn(big[0].shape, generator=generator) * 1e-3
    big[1].grad = torch.randn(5, generator=generator)
    big[2].grad = torch.sparse_coo_tensor(torch.tensor([[2, 7, 2]]), torch.ones(3, 3), (10, 3))
    exact = math.sqrt(sum(float(g.to_dense().double().square().sum()) for g in (p.grad for p in big)))
    assert float(clip_gradient_norm(big, float("inf"))) == pytest.approx(exact, rel=1e-6)


def test_log_uniform_sampler_follows_zipf():
    torch.manual_seed(0)
    draws = torch.stack([sample_log_uniform_candidates(1, 100)[0] for _ in range(20000)]).flatten()
    frequency = torch.bincount(draws, minlength=100).double() / draws.numel()
    expected = (torch.log(torch.arange(100.0) + 2) - torch.log(torch.arange(100.0) + 1)) / math.log(101)
    assert torch.allclose(frequency[:5], expected[:5].double(), atol=0.01)
    # One draw per sample when nothing repeats: expected count = probability x samples (TensorFlow's shortcut).
    assert log_uniform_expected_count(torch.tensor([0]), 100, 1, 1).item() == pytest.approx(expected[0].item())


def test_softmax_is_saved_once_and_reloads(tmp_path):
    torch.manual_seed(0)
    model = ElmoForPreTraining(tiny_config()).eval()
    model.save_pretrained(tmp_path)
    stored = load_file(tmp_path / "model.safetensors")
    assert [k for k in stored if "softmax" in k] == ["softmax.bias", "softmax.weight"]
    reloaded = AutoModelForPreTraining.from_pretrained(tmp_path).eval()
    assert isinstance(reloaded, ElmoForPreTraining)
    for name, tensor in model.state_dict().items():
        assert torch.equal(tensor, reloaded.state_dict()[name]), name
    input_ids, labels = _batch()
    with torch.no_grad():
        assert torch.equal(model(input_ids, labels=labels).loss, reloaded(input_ids, labels=labels).loss)
    encoder = AutoModel.from_pretrained(tmp_path)
    assert type(encoder) is ElmoModel
    assert torch.equal(encoder.bilstm.forward_layers[1].input_proj.weight,
                       model.elmo.bilstm.forward_layers[1].input_proj.weight)


def test_bad_labels_and_configs_are_clear_errors():
    model = ElmoForPreTraining(tiny_config())
    input_ids, labels = _batch()
    with pytest.raises(ValueError, match=r"labels must have shape \(3, 5\)"):
        model(input_ids, labels=labels[:, :4])
    labels[0, 2] = 40
    with pytest.raises(ValueError, match=r"labels\[0, 2\] = 40 is not a word id in \[0, 40\)"):
        model(input_ids, labels=labels)
    with pytest.raises(ValueError, match="needs config.vocab_size"):
        ElmoForPreTraining(ElmoConfig(**TINY))
    with pytest.raises(ValueError, match="bos_word_id and eos_word_id must differ"):
        tiny_config(bos_word_id=1)
    with pytest.raises(ValueError, match=r"eos_word_id \(40\) must be an index"):
        tiny_config(eos_word_id=40)
    with pytest.raises(ValueError, match="lm_dropout must be a probability"):
        tiny_config(lm_dropout=1.0)


# ------------------------------------------------------------------------------------------------ vocabulary, data
def test_a_vocabulary_of_words_longer_than_a_char_row_is_one_warning(caplog):
    caplog.set_level("WARNING", logger="hf_elmo.pretraining")
    unsegmented = ["我爱北京天安门" * 6, "天安门" * 6, "北京" * 9, "门" * 17]  # 126 (42 characters), 54, 54, 51 bytes
    words = ["<S>", "</S>", "<UNK>", "the", *unsegmented, "我爱北京天安门我爱北京天安门我爱"]  # the last: 48 bytes
    warn_of_cut_words(words, "vocab.txt", max_characters_per_token=50)
    assert [r.getMessage() for r in caplog.records] == [
        "vocab.txt: 4 of its 9 words are longer than 48 UTF-8 bytes, and the model reads each as its first 48 bytes "
        f"(the most frequent: {unsegmented[0][:40] + '...'!r}, {unsegmented[1]!r}, {unsegmented[2]!r}). For text "
        "written without spaces, segment it first (--pre-tokenizer)"]
    warn_of_cut_words(words[:4] + ["abcdefghij"], "vocab.txt", max_characters_per_token=12)  # rows of 10 bytes
    warn_of_cut_words(words[:4] + ["abcdefghijk"], "vocab.txt", max_characters_per_token=12)
    assert len(caplog.records) == 2 and caplog.records[1].getMessage().startswith(
        "vocab.txt: 1 of its 5 words are longer than 10 UTF-8 bytes")


def test_vocabulary_is_frequency_sorted_in_bilm_tf_format(tmp_path, elmo_fixture):
    corpus = tmp_path / "a.txt"
    corpus.write_text("the cat sat .\nthe dog sat .\n\nthe <S> cat\n", encoding="utf-8")
    counts, sentences = count_words([str(corpus)], str.split)
    assert sentences == 3 and build_vocab(counts) == ["<S>", "</S>", "<UNK>", "the", ".", "cat", "sat", "dog"]
    # --vocab-sentences: the first sentences only (the empty line is no sentence).
    first, sentences = count_words([str(corpus)], str.split, max_sentences=2)
    assert sentences == 2 and first == {"the": 2, "cat": 1, "sat": 2, ".": 2, "dog": 1}
    assert build_vocab(counts, min_count=2) == ["<S>", "</S>", "<UNK>", "the", ".", "cat", "sat"]
    assert build_vocab(counts, max_size=5) == ["<S>", "</S>", "<UNK>", "the", "."]
    path = write_vocab(build_vocab(counts, min_count=2), str(tmp_path / "vocab.txt"))
    assert open(path, encoding="utf-8").read() == "<S>\n</S>\n<UNK>\nthe\n.\ncat\nsat\n"
    tokenizer = ElmoTokenizer(vocab_file=path)
    assert tokenizer.words_to_indices(["the", "dog"]) == [3, 2]
    # bilm-tf's own vocabulary file (its specials are not first) reads, and writes back line for line (the original
    # lacks a final newline).
    original = elmo_fixture / "vocab_test.txt"
    tokenizer = ElmoTokenizer(vocab_file=str(original))
    assert (tokenizer.bos_word_index, tokenizer.eos_word_index) == (20, 224)
    tokenizer.save_pretrained(tmp_path / "saved")
    assert (tmp_path / "saved" / "vocab.txt").read_bytes() == original.read_bytes() + b"\n"


def _write_shards(tmp_path, n_shards=3, per_shard=25):
    files = []
    for s in range(n_shards):
        lines = [" ".join(f"s{s}.{i}.{k}" for k in range(2 + i % 7)) for i in range(per_shard)]
        lines.insert(3, "")
        lines.insert(9, "   ")
        path = tmp_path / f"shard-{s}.txt"
        path.write_text("\n".join(lines) + "\n", encoding="utf-8")
        files.append(str(path))
    return files


def _as_dataset_folder(files: list[str], folder: Path) -> Path:
    """The shards as a `datasets` folder of JSON lines, a file per shard, each record two lines of its shard (so a
    window may end inside a record); a blank line is a record whose text is empty."""
    folder.mkdir()
    for index, path in enumerate(files):
        lines = Path(path).read_text(encoding="utf-8").splitlines()
        records, pending = [], []
        for line in lines:
            if not line.strip():
                records.append({"text": line})
                continue
            pending.append(line)
            if len(pending) == 2:
                records.append({"text": "\n".join(pending)})
                pending = []
        records += [{"text": line} for line in pending]
        (folder / f"train-{index}.jsonl").write_text("".join(json.dumps(r) + "\n" for r in records), encoding="utf-8")
    return folder


def _streamed(folder: Path, **options):
    from types import SimpleNamespace

    from hf_elmo.pretraining_datasets import open_streamed_dataset

    args = SimpleNamespace(dataset_name=str(folder), dataset_config=None, dataset_revision=None, dataset_split="train",
                           text_column=None, eval_split=None, eval_file=None, eval_max_sentences=None,
                           **options)
    return open_streamed_dataset(args)


def test_a_streamed_format_without_types_finds_its_text_column_in_its_first_record(tmp_path):
    from hf_elmo.pretraining_datasets import DatasetCorpusError

    # datasets streams csv (and plain text) without column types: the first record tells the text column.
    folder = tmp_path / "csv"
    folder.mkdir()
    (folder / "train.csv").write_text("id,text\n1,the cat sat .\n2,a dog ran .\n", encoding="utf-8")
    shards = _streamed(folder)
    assert shards.column == "text" and len(shards) == 1
    assert list(shards.read(0, 0, 0)) == [("the cat sat .", 1, 0), ("a dog ran .", 2, 0)]
    (folder / "train.csv").write_text("title,text\nCats,the cat sat .\n", encoding="utf-8")
    with pytest.raises(DatasetCorpusError, match=r"csv\[train\]: give --text-column, one of its string columns "
                                                 r"\(title, text\)"):
        _streamed(folder)


@pytest.mark.parametrize("source", ["text files", "a streamed dataset"])
def test_stream_deals_every_sentence_once_per_epoch_and_resumes_exactly(source, tmp_path):
    files = _write_shards(tmp_path)
    shards = files if source == "text files" else _streamed(_as_dataset_folder(files, tmp_path / "data"))
    streams = [SentenceBatchStream(shards, str.split, batch_size=4, seed=3, rank=r, world_size=2, shuffle_window=20,
                                   max_words=5) for r in range(2)]
    seen = Counter()
    while all(s.epoch == 0 for s in streams):
        for stream in streams:
            batch = stream.next_batch()
            assert 1 <= len(batch) <= 5
            seen.update(" ".join(sentence) for sentence in batch)
    # Every non-empty line is dealt to exactly one rank, once; lines of more than 5 words come as pieces of <= 5.
    lines = [line.split() for path in files for line in open(path, encoding="utf-8") if line.strip()]
    assert len(lines) == 75
    assert seen == Counter(" ".join(words[i : i + 5]) for words in lines for i in range(0, len(words), 5))
    # A dataset's blank lines are records without text: counted as such.
    skipped = {"empty_lines_skipped": 6, "records_without_text": 0} if source == "text files" else {
        "empty_lines_skipped": 0, "records_without_text": 6}
    assert asdict(streams[0].stats) == {"sentences": 75 + 3 * 9, "words": sum(map(len, lines)), **skipped,
                                        "long_lines_split": 3 * 9}
    assert streams[0].stats == streams[1].stats

    # A stream restored from a state continues exactly like the original, across the epoch boundary, from any
    # batch (inside a window, and so inside a dataset's record).
    for _ in range(3):
        streams[0].next_batch()
        state = streams[0].state_dict()
        expected = [streams[0].next_batch() for _ in range(12)]
        restored = SentenceBatchStream(shards, str.split, 4, 3, rank=0, world_size=2, shuffle_window=20, max_words=5)
        restored.load_state_dict(json.loads(json.dumps(state)))  # as a checkpoint keeps it
        assert [restored.next_batch() for _ in range(12)] == expected
    other = SentenceBatchStream(shards, str.split, 8, 3, rank=0, world_size=2, shuffle_window=20, max_words=5)
    with pytest.raises(ValueError, match="made with batch_size=4, this run has 8"):
        other.load_state_dict(state)


def test_a_streamed_dataset_holds_one_window_in_memory_whatever_the_corpus_size(tmp_path):
    import pyarrow
    import tracemalloc

    # A generated corpus ten shuffle windows long, in 4 JSON-lines shards; read window by window, the memory held
    # (Python objects, and Arrow's buffers, which tracemalloc does not see) is the same at the tenth window as at the
    # second: what was read before is not kept.
    window, words = 1000, [f"w{i}" for i in range(500)]
    folder = tmp_path / "generated"
    folder.mkdir()
    for shard in range(4):
        with open(folder / f"train-{shard}.jsonl", "w", encoding="utf-8") as handle:
            for record in range(window * 10 // 4):
                n = record + shard * 7
                sentence = " ".join(words[(n * k) % 500] for k in range(1, 16 + n % 9))
                handle.write(json.dumps({"text": sentence}) + "\n")
    stream = SentenceBatchStream(_streamed(folder), str.split, batch_size=50, seed=0, shuffle_window=window)
    tracemalloc.start()
    try:
        python_peaks, arrow_bytes = [], []
        for _ in range(10):
            tracemalloc.reset_peak()
            for _ in range(window // 50):
                stream.next_batch()
            python_peaks.append(tracemalloc.get_traced_memory()[1])
            arrow_bytes.append(pyarrow.total_allocated_bytes())
    finally:
        tracemalloc.stop()
    assert stream.stats.sentences == 10 * window
    # The first window also opens the dataset; from the second on, one window's sentences at a time.
    assert max(python_peaks[2:]) < 1.25 * python_peaks[1], python_peaks
    assert max(arrow_bytes[2:]) <= max(arrow_bytes[1], 1 << 20), arrow_bytes


def test_corpus_problems_are_clear_errors(tmp_path):
    with pytest.raises(CorpusError, match=r"'.*nothing-\*\.txt' matches no file"):
        resolve_shards([str(tmp_path / "nothing-*.txt")])
    (tmp_path / "blank.txt").write_text("\n  \n\n", encoding="utf-8")
    with pytest.raises(CorpusError, match=r"blank\.txt is empty \(no non-blank line\)"):
        resolve_shards([str(tmp_path / "*.txt")])
    (tmp_path / "blank.txt").unlink()
    (tmp_path / "latin1.txt").write_bytes("fine\ncaf\xe9\n".encode("latin-1"))
    stream = SentenceBatchStream(resolve_shards([str(tmp_path / "*.txt")]), str.split, 2, 0)
    with pytest.raises(CorpusError, match=r"latin1\.txt:2: not UTF-8 text \(byte 3: b'\\xe9\\n'\); expected UTF-8"):
        stream.next_batch()
    (tmp_path / "latin1.txt").unlink()
    (tmp_path / "utf16.txt").write_text("fine\nline\n", encoding="utf-16")  # found when the shard is first read
    with pytest.raises(CorpusError, match=r"^\S*utf16\.txt: the file is UTF-16 \(it starts with a UTF-16 byte-order"):
        resolve_shards([str(tmp_path / "*.txt")])


def test_make_batch_labels_words_and_pads_with_minus_100(tmp_path):
    vocab = write_vocab(["<S>", "</S>", "<UNK>", "the", "cat"], str(tmp_path / "vocab.txt"))
    batch = make_batch(ElmoTokenizer(vocab_file=vocab), [["the", "cat", "ran"], ["cat"]])
    assert batch["labels"].tolist() == [[3, 4, 2], [4, -100, -100]]
    assert batch["input_ids"].shape == (2, 3, 50) and batch["attention_mask"].tolist() == [[1, 1, 1], [1, 0, 0]]


# ------------------------------------------------------------------------------------------------ real runs
@pytest.fixture(scope="module")
def corpus(english_corpus):
    """The shared Wikipedia corpus (conftest.py), with this file's tiny config beside it."""
    (english_corpus / "tiny.json").write_text(json.dumps(TINY), encoding="utf-8")
    return english_corpus


def common_args(corpus, output_dir, *extra):
    return [
        "--train-files", str(corpus / "train.txt"), "--config", str(corpus / "tiny.json"),
        "--output-dir", str(output_dir), "--max-sentence-words", "30", "--seed", "1", *extra,
    ]


@pytest.fixture(scope="module")
def trained(corpus, tmp_path_factory):
    """An in-process run: build the vocabulary, 30 AdamW steps, perplexity at steps 0, 15 and 30, TensorBoard."""
    from accelerate.state import AcceleratorState, GradientState

    output = tmp_path_factory.mktemp("trained") / "run"
    messages = []
    handler = logging.Handler(logging.INFO)
    handler.emit = lambda record: messages.append(record.getMessage())
    logger = logging.getLogger("hf_elmo.pretraining")
    logger.addHandler(handler)
    logger.setLevel(logging.INFO)
    code = pretrain_main(common_args(
        corpus, output, "--build-vocab", "--min-count", "2", "--eval-file", str(corpus / "heldout.txt"),
        "--eval-max-sentences", "200", "--num-softmax-samples", "512", "--batch-size", "16",
        "--optimizer", "adamw", "--learning-rate", "2e-2", "--max-steps", "30", "--eval-steps", "15",
        "--logging-steps", "10", "--save-steps", "15",
    ))
    logger.removeHandler(handler)
    logger.setLevel(logging.NOTSET)
    AcceleratorState._reset_state(True)
    GradientState._reset_state()
    assert code == 0
    (output / "test_log.txt").write_text("\n".join(messages), encoding="utf-8")
    return output


def test_training_on_english_lowers_heldout_perplexity(trained, corpus, caplog):
    results = json.loads((trained / "eval_results.json").read_text())
    vocab = (trained / "vocab.txt").read_text(encoding="utf-8").splitlines()
    assert vocab[:3] == ["<S>", "</S>", "<UNK>"] and 3000 < len(vocab) < 10000
    log = (trained / "test_log.txt").read_text(encoding="utf-8")
    perplexities = [tuple(map(float, m)) for m in re.findall(r"perplexity forward ([\d.]+), backward ([\d.]+)", log)]
    assert [int(s) for s in re.findall(r"step (\d+): held-out", log)] == [0, 15, 30]
    # On a CPU with glibc, the run keeps freed memory for reuse (host_memory; its effect is tested there).
    if platform.libc_ver()[0] == "glibc":
        assert "Freed memory is kept for reuse (glibc malloc: large blocks from the heap, never trimmed)" in log
    # Untrained, the model is close to uniform over the vocabulary (bilm-tf's softmax init, N(0, 1/sqrt(dim)), on
    # layers of RMS ~0.1 gives logits of std ~0.1); 30 steps take it far below that, step by step.
    assert perplexities[0][0] == pytest.approx(len(vocab), rel=0.02)
    assert perplexities[0] > perplexities[1] > perplexities[2]
    assert perplexities[2][0] < 0.15 * perplexities[0][0] and perplexities[2][1] < 0.15 * perplexities[0][1]
    assert results["step"] == 30
    assert results["eval/forward_perplexity"] == pytest.approx(perplexities[2][0], abs=0.01)

    # The folder loads with the Auto classes, and recomputing the held-out perplexity gives the logged number.
    tokenizer = AutoTokenizer.from_pretrained(trained)
    model = AutoModelForPreTraining.from_pretrained(trained).eval()
    assert type(model) is ElmoForPreTraining and type(AutoModel.from_pretrained(trained)) is ElmoModel
    # The same 200 held-out sentences (lines cut at --max-sentence-words 30), in other batches: same perplexity.
    sentences, _ = read_eval_sentences(str(corpus / "heldout.txt"), tokenizer.tokenize, 30, 200)
    total, count = 0.0, 0
    with torch.no_grad():
        for i in range(0, len(sentences), 50):
            output = model(**make_batch(tokenizer, sentences[i : i + 50]))
            total += float(output.forward_loss) * int(output.num_predictions)
            count += int(output.num_predictions)
    assert math.exp(total / count) == pytest.approx(results["eval/forward_perplexity"], rel=1e-4)

    events = [f for _, _, files in os.walk(trained / "logs") for f in files if f.startswith("events.out.tfevents")]
    assert events, "no TensorBoard event file under logs/"
    # Every metric is also in metrics.jsonl, readable without any tracker.
    records = [json.loads(line) for line in (trained / "metrics.jsonl").read_text(encoding="utf-8").splitlines()]
    evaluations = [r for r in records if "eval/forward_perplexity" in r]
    assert [r["step"] for r in evaluations] == [0, 15, 30]
    assert [round(r["eval/forward_perplexity"], 2) for r in evaluations] == [p[0] for p in perplexities]
    assert [r["step"] for r in records if "train/loss" in r] == [10, 15, 20, 30]
    walls = [r["wall_s"] for r in records]  # seconds since the process started, for the card's wall time
    assert walls == sorted(walls) and walls[0] > 0
    assert os.path.isfile(trained / "checkpoint-15" / "optimizer.bin")
    assert not [name for name in os.listdir(trained) if name.endswith(".partial")]


def test_a_checkpoint_is_a_whole_model_folder_and_publishes_without_its_training_state(trained, tmp_path):
    from hf_elmo.publish import prepare_folder

    # The run's word vocabulary travels with each checkpoint: its tokenizer and softmax rows mean the same words.
    checkpoint = trained / "checkpoint-15"
    words = (trained / "vocab.txt").read_text(encoding="utf-8").splitlines()
    assert AutoTokenizer.from_pretrained(checkpoint).word_vocab == words
    model = AutoModelForPreTraining.from_pretrained(checkpoint)
    assert model.config.vocab_size == len(words) == model.softmax.weight.shape[0]
    # Published, it is the model and its tokenizer; what resuming reads stays home.
    prepared = prepare_folder(str(checkpoint), str(tmp_path / "up"), repo_id="someone/elmo-step-15")
    assert sorted(prepared.left_out) == ["optimizer.bin", "rng_state_0.json", "training_state.json"]
    assert "vocab.txt" in prepared.files and not [name for name in prepared.files if "state" in name]
    assert ElmoTokenizer.from_pretrained(tmp_path / "up").word_vocab == words
    # Its card is the run's record up to step 15, as the final folder's is up to the end.
    from hf_elmo.publish import read_pretraining

    record = read_pretraining(str(checkpoint))
    state = json.loads((checkpoint / "training_state.json").read_text())["progress"]
    evaluations = [r for r in map(json.loads, (trained / "metrics.jsonl").read_text().splitlines())
                   if "eval/forward_perplexity" in r]
    assert [point["step"] for point in record["curve"]] == [0, 15] and record["step"] == 15
    assert record["tokens_seen"] == state["tokens"] > 0 and record["train_files"] == ["train.txt"]
    at_15 = evaluations[1]
    assert record["heldout_perplexity"] == {"forward": at_15["eval/forward_perplexity"],
                                            "backward": at_15["eval/backward_perplexity"]}
    card = (tmp_path / "up" / "README.md").read_text(encoding="utf-8")
    assert (f"on `train.txt` for 15 steps, {state['sentences']:,} sentences and {state['tokens']:,} tokens seen"
            in card)
    assert (f"Held-out perplexity on `heldout.txt` at step 15: forward {at_15['eval/forward_perplexity']:.2f}, "
            in card)


def test_report_to_defaults_to_what_is_installed(monkeypatch, capsys):
    import accelerate.utils

    from hf_elmo.pretraining_args import build_parser, check_args

    parser = build_parser()
    required = ["--train-files", "x", "--config", "small", "--output-dir", "o", "--max-steps", "1"]
    for installed, expected in ((True, "tensorboard"), (False, "none")):
        monkeypatch.setattr(accelerate.utils, "is_tensorboard_available", lambda: installed)
        args = parser.parse_args(required)
        assert args.report_to == "auto"
        check_args(args, parser)
        assert args.report_to == expected
    # A tracker Accelerate does not know, or one whose package is missing: a usage error (it was a traceback).
    monkeypatch.setattr(accelerate.utils, "is_wandb_available", lambda: False)
    for tracker, message in (("bogus", "--report-to 'bogus' is not a tracker Accelerate knows: choose one of aim, "),
                             ("wandb", "--report-to wandb needs the wandb package: pip install wandb; or pass "
                                       "--report-to none")):
        with pytest.raises(SystemExit) as exit_info:
            pretrain_main([*required, "--report-to", tracker])
        assert exit_info.value.code == 2 and message in capsys.readouterr().err


def test_export_to_bilm_tf_and_back_is_bit_exact(trained, tmp_path):
    from hf_elmo.convert import convert_bilm_tf_to_hf

    script = os.path.join(REPO_ROOT, "conversion", "convert_hf_to_bilm_tf.py")
    result = subprocess.run([sys.executable, script, str(trained), "--output", str(tmp_path / "bilm")],
                            capture_output=True, text=True, env=_env())
    assert result.returncode == 0, result.stderr
    assert sorted(os.listdir(tmp_path / "bilm")) == ["options.json", "vocab.txt", "weights.hdf5"]
    assert (tmp_path / "bilm" / "vocab.txt").read_bytes() == (trained / "vocab.txt").read_bytes()
    back = convert_bilm_tf_to_hf(str(tmp_path / "bilm" / "options.json"), str(tmp_path / "bilm" / "weights.hdf5"),
                                 str(tmp_path / "back"), progress=False)
    original = {k.removeprefix("elmo."): v for k, v in load_file(trained / "model.safetensors").items()
                if k.startswith("elmo.")}
    returned = load_file(os.path.join(back, "model.safetensors"))
    assert sorted(returned) == sorted(original)
    for name, tensor in original.items():
        assert torch.equal(returned[name], tensor), name


def test_init_from_converted_bilm_tf_keeps_the_encoder(converted_dir, elmo_fixture, corpus, tmp_path):
    # Learning rate 0: the run must end with exactly the converted biLM, plus a fresh softmax over its vocabulary.
    code = pretrain_main([
        "--train-files", str(corpus / "heldout.txt"), "--init-from", str(converted_dir), "--output-dir",
        str(tmp_path / "adapted"), "--max-steps", "2", "--batch-size", "4", "--learning-rate", "0",
        "--max-sentence-words", "20", "--report-to", "none",
    ])
    assert code == 0
    adapted = load_file(tmp_path / "adapted" / "model.safetensors")
    for name, tensor in load_file(converted_dir / "model.safetensors").items():
        assert torch.equal(adapted["elmo." + name], tensor), name
    assert adapted["softmax.weight"].shape == (458, 16)  # vocab_test.txt: 458 words
    config = json.loads((tmp_path / "adapted" / "config.json").read_text())
    assert (config["vocab_size"], config["bos_word_id"], config["eos_word_id"]) == (458, 20, 224)


def test_nan_loss_stops_with_a_checkpoint(corpus, tmp_path, caplog, capsys):
    caplog.set_level(logging.INFO, logger="hf_elmo")
    output = tmp_path / "diverged"
    code = pretrain_main(common_args(
        corpus, output, "--build-vocab", "--optimizer", "adamw", "--learning-rate", "1e30", "--max-steps", "5",
        "--batch-size", "4", "--report-to", "none",
    ))
    assert code == 1
    message = error_lines(capsys)[-1]
    assert re.search(r"step 2: the gradient norm is (nan|inf) .*training stopped", message)
    assert "checkpoint-1 holds the model and optimizer from before this step" in message
    assert os.path.isfile(output / "checkpoint-1" / "model.safetensors")
    assert not os.path.exists(output / "model.safetensors")
    weights = load_file(output / "checkpoint-1" / "model.safetensors")
    assert all(torch.isfinite(t).all() for t in weights.values())

    # It is a normal checkpoint: --resume takes it, with a new learning rate. (Step 1 at lr 1e30 already threw the
    # weights to +-1e30, so step 2 fails again: the state before the failing step is not always a healthy one.)
    from accelerate.state import AcceleratorState, GradientState

    AcceleratorState._reset_state(True)
    GradientState._reset_state()
    caplog.clear()
    code = pretrain_main(common_args(
        corpus, output, "--build-vocab", "--optimizer", "adamw", "--learning-rate", "1e-3", "--max-steps", "5",
        "--batch-size", "4", "--report-to", "none", "--resume",
    ))
    assert code == 1
    assert f"Resumed from {output / 'checkpoint-1'}: step 1" in caplog.text
    assert "--learning-rate 0.001 replaces the checkpoint's 1e+30" in caplog.text
    assert "step 2: the gradient norm is" in error_lines(capsys)[-1]


def test_run_errors_and_empty_lines(corpus, tmp_path, caplog, capsys):
    caplog.set_level(logging.INFO, logger="hf_elmo")
    args = ["--config", str(corpus / "tiny.json"), "--max-steps", "3", "--report-to", "none"]
    assert pretrain_main(["--train-files", str(corpus / "train.txt"), "--output-dir", str(tmp_path / "a"), *args]) == 1
    assert "no word vocabulary: pass --vocab FILE" in error_lines(capsys)[0]
    assert pretrain_main(["--train-files", str(corpus / "train.txt"), "--vocab", str(tmp_path / "missing.txt"),
                          "--output-dir", str(tmp_path / "b"), *args]) == 1
    assert error_lines(capsys) == [f"--vocab: {tmp_path / 'missing.txt'}: vocabulary file not found."]
    # A vocabulary that cannot be used is one line naming the user's file, not a traceback naming the run's copy of it.
    (tmp_path / "no-specials.txt").write_text("the\nof\n", encoding="utf-8")
    (tmp_path / "utf16.txt").write_text("<S>\n</S>\n<UNK>\nthe\n", encoding="utf-16")
    for vocab, message in (("no-specials.txt", "vocabulary lacks <S>, </S>, <UNK>"),
                           ("utf16.txt", "the file is UTF-16 (it starts with a UTF-16 byte-order mark)")):
        assert pretrain_main(["--train-files", str(corpus / "train.txt"), "--vocab", str(tmp_path / vocab),
                              "--output-dir", str(tmp_path / "b"), *args]) == 1
        lines = error_lines(capsys)
        assert len(lines) == 1 and lines[0].startswith("--vocab: ") and message in lines[0], lines
        assert str(tmp_path / vocab) in lines[0] and not (tmp_path / "b").exists()
    (tmp_path / "empty.txt").write_text("", encoding="utf-8")
    assert pretrain_main(["--train-files", str(tmp_path / "empty.txt"), "--build-vocab",
                          "--output-dir", str(tmp_path / "c"), *args]) == 1
    assert "empty.txt is empty (no non-blank line)" in error_lines(capsys)[0]
    # As held-out text: no advice about shards and patterns, which --eval-file does not have.
    assert pretrain_main(["--train-files", str(corpus / "train.txt"), "--build-vocab", "--eval-file",
                          str(tmp_path / "empty.txt"), "--output-dir", str(tmp_path / "c"), *args]) == 1
    assert error_lines(capsys) == [f"--eval-file: {tmp_path / 'empty.txt'} is empty (no non-blank line). Expected "
                                   "sentences, one per line."]
    assert pretrain_main(["--train-files", str(corpus / "train.txt"), "--build-vocab", "--init-from",
                          str(tmp_path / "nope"), "--output-dir", str(tmp_path / "c"), *args[2:]]) == 1
    assert error_lines(capsys) == [f"--init-from: {tmp_path / 'nope'}: no such folder; expected a model folder "
                                   "written by hf-elmo convert or save_pretrained."]
    # A run that fails before its first checkpoint leaves nothing behind (no stray vocab.txt).
    assert not [name for name in os.listdir(tmp_path) if name in "abc"]

    # Empty lines are skipped and counted; an epoch here is 9 sentences, so 3 steps of 4 cover one.
    (tmp_path / "gappy.txt").write_text("a b\n\nc d e\n\n\nf\n" + "g h\n" * 6, encoding="utf-8")
    caplog.clear()
    assert pretrain_main(["--train-files", str(tmp_path / "gappy.txt"), "--build-vocab", "--batch-size", "4",
                          "--output-dir", str(tmp_path / "d"), *args]) == 0
    assert "Finished epoch 0: 9 sentences so far; skipped 3 empty line(s)" in caplog.text
    # A finished run is not silently overwritten.
    assert pretrain_main(["--train-files", str(tmp_path / "gappy.txt"), "--build-vocab",
                          "--output-dir", str(tmp_path / "d"), *args]) == 1
    assert "already holds a run (checkpoint-3); pass --resume" in error_lines(capsys)[0]

    # A finished run can be extended with --resume and a larger --max-steps; a new --learning-rate takes effect.
    extend = ["--train-files", str(tmp_path / "gappy.txt"), "--build-vocab", "--batch-size", "4",
              "--output-dir", str(tmp_path / "e"), "--save-steps", "2", "--logging-steps", "1",
              "--config", str(corpus / "tiny.json"), "--report-to", "none"]
    assert pretrain_main([*extend, "--max-steps", "2"]) == 0
    from accelerate.state import AcceleratorState, GradientState

    AcceleratorState._reset_state(True)
    GradientState._reset_state()
    assert pretrain_main([*extend, "--max-steps", "4", "--learning-rate", "0.05", "--resume"]) == 0
    assert "step 2: loss" in caplog.text and ", lr 0.2, " in caplog.text
    assert f"Resumed from {tmp_path / 'e' / 'checkpoint-2'}: step 2" in caplog.text
    assert "step 3: loss" in caplog.text and re.search(r"step 4: loss .*, lr 0\.05, ", caplog.text)
    # Resumed with a --max-steps it has reached, it says so instead of looking like a run that trained.
    AcceleratorState._reset_state(True)
    GradientState._reset_state()
    caplog.clear()
    assert pretrain_main([*extend, "--max-steps", "4", "--resume"]) == 0
    assert ("The run is already at step 4 and --max-steps is 4: nothing is left to train, and the final model is "
            "saved again. A larger --max-steps extends the run") in caplog.text
    assert "step 5: loss" not in caplog.text


class Payload:
    """A pickle that runs code when loaded: it creates the folder `path` (and its parents)."""

    def __init__(self, path: str):
        self.path = path

    def __reduce__(self):
        return (os.makedirs, (self.path,))


def _reset_accelerate():
    from accelerate.state import AcceleratorState, GradientState

    AcceleratorState._reset_state(True)
    GradientState._reset_state()


def test_resume_refuses_another_model_vocabulary_or_optimizer(trained, corpus, tmp_path, caplog, capsys):
    output = tmp_path / "run"
    shutil.copytree(trained, output)
    (tmp_path / "skip.json").write_text(json.dumps({**TINY, "use_skip_connections": False}), encoding="utf-8")
    (tmp_path / "wide.json").write_text(json.dumps({**TINY, "lstm_dim": 32}), encoding="utf-8")
    write_vocab(["<S>", "</S>", "<UNK>", "the", "of"], str(tmp_path / "other-vocab.txt"))
    same = ["--num-softmax-samples", "512", "--batch-size", "16", "--learning-rate", "2e-2", "--max-steps", "31",
            "--report-to", "none", "--num-workers", "0", "--resume"]

    def refused(*changed) -> str:
        caplog.clear()
        options = common_args(corpus, output, *same, *changed)
        if "--vocab" not in changed:
            options += ["--build-vocab", "--min-count", "2"]
        if "--optimizer" not in changed:
            options += ["--optimizer", "adamw"]
        capsys.readouterr()
        assert pretrain_main(options) == 1
        _reset_accelerate()
        errors = error_lines(capsys)
        assert len(errors) == 1, errors
        return errors[0]

    checkpoint = output / "checkpoint-30"
    message = refused("--config", str(tmp_path / "skip.json"))
    assert message == (
        f"--resume: {checkpoint} holds a model with use_skip_connections=True; this run would build one with "
        "use_skip_connections=False. Resume with the options of the original run (--config or --init-from, --vocab, "
        "--dropout, --num-softmax-samples)."
    )
    assert "holds a model with lstm_dim=64; this run would build one with lstm_dim=32." in refused(
        "--config", str(tmp_path / "wide.json"))
    assert refused("--optimizer", "adagrad") == (
        f"--resume: {checkpoint} was trained with --optimizer adamw, this run asks for adagrad; its optimizer state "
        "cannot be used. Resume with --optimizer adamw."
    )
    assert refused("--vocab", str(tmp_path / "other-vocab.txt")).startswith(
        f"--resume: --vocab {tmp_path / 'other-vocab.txt'} is not the vocabulary of the run being resumed")
    # The run's own vocabulary passed again is the same vocabulary.
    assert "holds a model with" in refused("--vocab", str(trained / "vocab.txt"), "--config", str(tmp_path / "skip.json"))

    # Other text under the same file name: the size and SHA-256 say so, before anything of the checkpoint is used.
    edited = tmp_path / "edited"
    edited.mkdir()
    text = (corpus / "train.txt").read_bytes()
    (edited / "train.txt").write_bytes(text.replace(b" the ", b" a ", 1))
    message = refused("--train-files", str(edited / "train.txt"))
    digests = [hashlib.sha256(data).hexdigest()[:12] for data in (text, (edited / "train.txt").read_bytes())]
    assert message == (
        f"--resume: {checkpoint} was trained on other text than this run would read (train_files.0.bytes: "
        f"{len(text)} then, {len(text) - 2} now; train_files.0.sha256: {digests[0]}… then, {digests[1]}… now): its "
        "position in the data would point into other lines. Resume with the original --train-files (or "
        "--dataset-name) and --pre-tokenizer, or start afresh in another --output-dir."
    )
    assert "(pre_tokenizer: 'ptb' then, 'whitespace' now)" in refused("--pre-tokenizer", "whitespace")
    state = json.loads((checkpoint / "training_state.json").read_text())
    (checkpoint / "training_state.json").write_text(json.dumps({k: v for k, v in state.items() if k != "data"}))
    assert refused().startswith(f"--resume: {checkpoint / 'training_state.json'} does not record the training files")
    (checkpoint / "training_state.json").write_text(json.dumps(state))

    # A tampered optimizer file is refused, not run; a checkpoint of the earlier, pickled format is refused unread.
    planted = tmp_path / "payload-ran"
    (checkpoint / "optimizer.bin").write_bytes(pickle.dumps(Payload(str(planted)), protocol=2))
    assert refused().startswith(f"--resume: {checkpoint / 'optimizer.bin'} is not a plain tensor file (")
    (checkpoint / "training_state.json").unlink()
    (checkpoint / "custom_checkpoint_0.pkl").write_bytes(pickle.dumps(Payload(str(planted))))
    assert refused().startswith(f"--resume: {checkpoint} was written by an earlier hf_elmo (Accelerate's pickle")
    assert not planted.exists()


# Runs pretraining; when the final model's config.json is opened for writing (not a checkpoint's), it caps the size
# of files it writes: the kernel then kills it with SIGXFSZ in the middle of writing the weights.
KILLED_IN_FINAL_SAVE = """
import os, resource, signal, sys

def arm(event, args):
    if event == "open" and os.path.basename(str(args[0])) == "config.json" and str(args[1]).startswith("w"):
        if "checkpoint-" not in str(args[0]):
            resource.setrlimit(resource.RLIMIT_CORE, (0, 0))
            signal.signal(signal.SIGXFSZ, signal.SIG_DFL)  # Python ignores it: a write would only fail
            resource.setrlimit(resource.RLIMIT_FSIZE, (65536, 65536))

sys.addaudithook(arm)
from hf_elmo.cli import pretrain_main as main
sys.exit(main(sys.argv[1:]))
"""


def test_a_kill_during_the_final_save_leaves_no_partial_model(corpus, tmp_path):
    output = tmp_path / "run"
    options = common_args(corpus, output, "--build-vocab", "--max-steps", "2", "--batch-size", "4",
                          "--num-workers", "0", "--report-to", "none")
    result = subprocess.run([sys.executable, "-c", KILLED_IN_FINAL_SAVE, *options], capture_output=True, text=True,
                            env=_env())
    assert result.returncode == -signal.SIGXFSZ, result.stderr[-3000:]
    assert (output / "checkpoint-2" / "model.safetensors").stat().st_size > 65536  # the weights are larger
    # Nothing of the final model: saved in place, a kill left config.json, the code and tokenizer files without
    # weights (and, with safetensors < 0.8, a truncated model.safetensors; with 0.8, a hidden temporary file beside
    # it that no run removed).
    visible = sorted(name for name in os.listdir(output) if not name.startswith("."))
    assert visible == ["checkpoint-2", "metrics.jsonl", "training_args.json", "vocab.txt"]

    # --resume finds the run finished, writes the final model, and removes what the killed save left.
    assert pretrain_main([*options, "--resume"]) == 0
    assert not [name for name in os.listdir(output) if name.startswith(".")]
    assert torch.equal(load_file(output / "model.safetensors")["softmax.weight"],
                       load_file(output / "checkpoint-2" / "model.safetensors")["softmax.weight"])


# ------------------------------------------------------------------------------------------------ multi-process
WORKERS_CANNOT_SHARE_MEMORY = """
import resource, sys
# Big enough for vocab.txt and training_args.json, too small for a batch handed over through shared memory.
resource.setrlimit(resource.RLIMIT_FSIZE, (100_000, 100_000))
from hf_elmo.cli import pretrain_main as main
sys.exit(main(sys.argv[1:]))
"""


FULL_DISK_AT_SECOND_CHECKPOINT = """
import os, resource, sys

def arm(event, args):
    # From the second checkpoint on, files may not grow past 64 KiB: the disk is "full" (Python ignores SIGXFSZ, so
    # a write fails with EFBIG, as on a full disk with ENOSPC).
    if event == "open" and "checkpoint-4" in str(args[0]):
        resource.setrlimit(resource.RLIMIT_FSIZE, (65536, 65536))

sys.addaudithook(arm)
from hf_elmo.cli import pretrain_main as main
sys.exit(main(sys.argv[1:]))
"""


def test_a_full_disk_at_a_checkpoint_is_one_line_naming_the_intact_one(corpus, tmp_path):
    output = tmp_path / "run"
    options = common_args(corpus, output, "--build-vocab", "--max-steps", "6", "--save-steps", "2",
                          "--batch-size", "4", "--num-workers", "0", "--report-to", "none")
    result = subprocess.run([sys.executable, "-c", FULL_DISK_AT_SECOND_CHECKPOINT, *options], capture_output=True,
                            text=True, env=_env(), timeout=300)
    assert result.returncode == 1, result.stderr[-3000:]
    errors = [line for line in result.stderr.splitlines() if line.startswith("error: ")]
    assert len(errors) == 1 and "Traceback" not in result.stderr
    assert re.search(
        rf"^error: cannot write {re.escape(str(output))}/checkpoint-4: the disk is full or a "
        r"file-size limit was reached \([\d,]+ MiB free on its disk, file-size limit 65,536 bytes \(ulimit -f\)\); "
        rf"nothing half-written was left\. Free some space, or write elsewhere\. {re.escape(str(output))}/checkpoint-2 "
        r"is intact: --resume continues from it\.$",
        errors[0],
    ), errors[0]
    assert sorted(name for name in os.listdir(output) if name.startswith("checkpoint")) == ["checkpoint-2"]
    # With room again, --resume continues from it and finishes.
    assert pretrain_main([*options, "--resume"]) == 0
    assert json.loads((output / "eval_results.json").read_text())["step"] == 6


def test_workers_that_cannot_deliver_a_batch_stop_the_run_instead_of_hanging(corpus, tmp_path):
    # A worker whose shared-memory hand-over fails (small /dev/shm, a file-size limit) neither delivers nor dies:
    # without a DataLoader timeout the training process waited forever.
    options = common_args(corpus, tmp_path / "run", "--build-vocab", "--max-vocab-size", "2000", "--max-steps", "3",
                          "--batch-size", "64", "--num-workers", "1", "--report-to", "none", "--data-timeout", "5")
    result = subprocess.run([sys.executable, "-c", WORKERS_CANNOT_SHARE_MEMORY, *options], capture_output=True,
                            text=True, env=_env(), timeout=300)
    assert result.returncode == 1, result.stderr[-3000:]
    assert ("\nerror: the 1 DataLoader worker(s) delivered no batch in 5 s: a worker cannot hand "
            "its batches over through shared memory (a small /dev/shm, such as Docker's 64 MB default, or a "
            "file-size limit) or is stuck. Rerun with --num-workers 0, or give the process more shared memory "
            "(docker run --shm-size 2g). No checkpoint was written yet.") in result.stderr


def _env():
    env = {**os.environ, "PYTHONPATH": REPO_ROOT, "HF_HUB_OFFLINE": "1", "TQDM_DISABLE": "1", "OMP_NUM_THREADS": "1",
           "ACCELERATE_USE_CPU": "1", "CUDA_VISIBLE_DEVICES": ""}  # CPU processes, also on a machine with a GPU
    env.pop("ACCELERATE_MIXED_PRECISION", None)
    return env


def _launch(corpus, vocab, output, *extra):
    """`accelerate launch` with 2 CPU processes (gloo), bf16: the command the README gives."""
    return [
        sys.executable, "-m", "accelerate.commands.accelerate_cli", "launch", "--multi_gpu", "--num_processes", "2",
        "--num_machines", "1", "--main_process_port", str(free_port()), "--mixed_precision", "bf16",
        "--dynamo_backend", "no", "-m", "hf_elmo.cli", "pretrain",
        *common_args(corpus, output, "--vocab", str(vocab), "--num-softmax-samples", "256", "--batch-size", "8",
                     "--max-steps", "12", "--save-steps", "4", "--logging-steps", "4", "--eval-steps", "4",
                     "--eval-file", str(corpus / "heldout.txt"), "--eval-max-sentences", "32",
                     "--gradient-accumulation-steps", "2", "--report-to", "none", *extra),
    ]


def test_a_failed_launch_report_shows_the_crashed_worker_before_the_end_of_the_log():
    crash = "Fatal Python error: Aborted\n\nThread 0x7f (most recent call first):\n  File \"train.py\", line 9\n"
    # What aborted the process is printed just before faulthandler's stacks; the lines before it are context.
    cause = "step 4: loss 6.1\n" * 400 + "free(): corrupted unsorted chunks\n"
    log = cause + crash + "rank 0: Traceback (most recent call last): ...\n" * 200
    report = launch_failure_report(log)
    head, tail = report.split("\n...\n")
    before, after = head.split(crash)
    assert before.endswith("loss 6.1\nfree(): corrupted unsorted chunks\n") and before.startswith("step 4: loss 6.1\n")
    assert 3000 <= len(before) <= 3100 and after.startswith("rank 0: Traceback") and tail == log[-6000:]
    assert launch_failure_report("a short log") == "a short log"  # nothing pushed out: the log as it is


def _run_launch(command, timeout=300) -> tuple[int, str]:
    """
    Run `accelerate launch`; on a timeout or an interrupt, kill the workers too (they have sessions of their own).
    A run that hangs fails with the end of its log and every process's Python stacks: SIGABRT makes faulthandler
    (PYTHONFAULTHANDLER=1) print them before the process dies.
    """
    process = subprocess.Popen(command, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                               env={**_env(), "PYTHONFAULTHANDLER": "1"})
    try:
        output, _ = process.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        for hung in [*_descendants(process.pid), process.pid]:
            try:
                os.kill(hung, signal.SIGABRT)
            except ProcessLookupError:
                pass
        try:
            output, _ = process.communicate(timeout=15)
        except subprocess.TimeoutExpired:
            output = "(no output after SIGABRT)"
        pytest.fail(f"accelerate launch ran over {timeout} s; its log, ending with the stacks:\n{output[-12000:]}")
    finally:
        if process.poll() is None:
            _kill_tree(process.pid)
            process.wait()
    return process.returncode, output


@pytest.fixture(scope="module")
def two_process_run(trained, corpus, tmp_path_factory):
    output = tmp_path_factory.mktemp("ddp") / "reference"
    code, log = _run_launch(_launch(corpus, trained / "vocab.txt", output))
    assert code == 0, launch_failure_report(log)
    return output, log


def test_two_cpu_processes_train_one_model(two_process_run):
    output, log = two_process_run
    assert "World size 2 (MULTI_CPU), device cpu" in log and "mixed precision bf16" in log
    assert "Weights identical on all 2 process(es)" in log  # each rank hashed its own weights, gathered, compared
    # Adagrad with the sampled softmax over gloo: DDP sums the softmax's sparse gradients across processes.
    assert "sampled (256 negatives) softmax in training (sparse gradient)" in log
    assert os.path.isfile(output / "model.safetensors")
    assert json.loads((output / "eval_results.json").read_text())["step"] == 12


def _descendants(pid: int) -> list[int]:
    """Every process below `pid` (torchrun starts each worker in a session of its own, so killpg misses them)."""
    children = {}
    for entry in os.listdir("/proc") if os.path.isdir("/proc") else []:
        if entry.isdigit():
            try:
                with open(f"/proc/{entry}/stat") as handle:
                    parent = int(handle.read().rsplit(")", 1)[1].split()[1])
            except (OSError, IndexError, ValueError):
                continue
            children.setdefault(parent, []).append(int(entry))
    found, todo = [], [pid]
    while todo:
        for child in children.get(todo.pop(), []):
            found.append(child)
            todo.append(child)
    return found


def _parent(pid: int) -> int | None:
    try:
        with open(f"/proc/{pid}/stat") as handle:
            return int(handle.read().rsplit(")", 1)[1].split()[1])
    except (OSError, IndexError, ValueError):
        return None


def _cmdline(pid: int) -> str:
    try:
        with open(f"/proc/{pid}/cmdline", "rb") as handle:
            return handle.read().replace(b"\0", b" ").decode()
    except OSError:
        return ""


def _alive(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/stat") as handle:
            return handle.read().rsplit(")", 1)[1].split()[0] != "Z"
    except OSError:
        return False


def _kill_tree(pid: int) -> None:
    for process in [pid, *_descendants(pid)]:
        try:
            os.kill(process, signal.SIGKILL)
        except ProcessLookupError:
            pass


def _kill_when_saved(process: subprocess.Popen, checkpoint: str, before=lambda: None) -> list[str]:
    """Read a run's log until it has saved `checkpoint`, call `before`, then SIGKILL the run and every process below
    it, mid-training: a crashed machine. Returns the lines read."""
    lines = []
    try:
        for line in process.stdout:
            lines.append(line)
            if "Saved checkpoint" in line and line.rstrip().endswith(checkpoint):
                before()
                _kill_tree(process.pid)
                break
        process.wait(timeout=60)
    finally:
        if process.poll() is None:
            _kill_tree(process.pid)
            process.wait()
    return lines


@pytest.mark.skipif(not os.path.isdir("/proc"), reason="finds the worker processes through /proc")
def test_sigkilled_run_resumes_identically(two_process_run, trained, corpus):
    reference_dir, _ = two_process_run
    output = reference_dir.parent / "killed"
    # The reference ran with 2 DataLoader workers per process (the default); this run with 1, the resumed one with
    # none: the batches, and where a checkpoint says the data stands, do not depend on it.
    process = subprocess.Popen(_launch(corpus, trained / "vocab.txt", output, "--num-workers", "1"),
                               stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env=_env())
    workers = []

    def find_workers():
        training = [p for p in _descendants(process.pid) if "hf_elmo.cli" in _cmdline(p)]
        # The training processes, not their DataLoader workers (forked: the same command line).
        workers.extend(p for p in training if _parent(p) not in training)

    lines = _kill_when_saved(process, "checkpoint-4", find_workers)  # the launcher and both workers
    assert process.returncode == -signal.SIGKILL and len(workers) == 2, "".join(lines)[-6000:]
    deadline = time.monotonic() + 30
    while any(_alive(worker) for worker in workers) and time.monotonic() < deadline:
        time.sleep(0.1)
    assert not any(_alive(worker) for worker in workers)
    # Killed before the end. (On a loaded machine the kill may land a few steps late, even after checkpoint-8.)
    assert not os.path.exists(output / "model.safetensors"), "".join(lines)[-6000:]
    resume_from = latest_checkpoint(str(output))
    assert resume_from in (str(output / "checkpoint-4"), str(output / "checkpoint-8")), os.listdir(output)
    # Data only (and the model's code files, which save_pretrained adds and resuming never imports).
    assert sorted(name for name in os.listdir(resume_from) if not name.endswith(".py")) == [
        "config.json", "model.safetensors", "optimizer.bin", "rng_state_0.json", "rng_state_1.json",
        "tokenizer_config.json", "training_state.json", "vocab.txt",
    ]
    # Pickles where Accelerate keeps its custom and random states, each of which would leave a folder if unpickled.
    planted = output / "payload-ran"
    for name in ("custom_checkpoint_0.pkl", "custom_checkpoint_1.pkl", "custom_checkpoint_2.pkl",
                 "random_states_0.pkl", "random_states_1.pkl", "scheduler.bin"):
        (Path(resume_from) / name).write_bytes(pickle.dumps(Payload(str(planted / name))))

    code, log = _run_launch(_launch(corpus, trained / "vocab.txt", output, "--resume", "--num-workers", "0"))
    assert code == 0, launch_failure_report(log)
    assert not planted.exists()
    assert f"Resumed from {resume_from}: step {resume_from.rsplit('-', 1)[1]}" in log
    reference = load_file(reference_dir / "model.safetensors")
    resumed = load_file(output / "model.safetensors")
    worst = max(float((reference[k] - resumed[k]).abs().max()) for k in reference)
    assert worst <= 1e-6, f"resumed run differs from the uninterrupted one by {worst}"
    assert json.loads((output / "eval_results.json").read_text()) == json.loads(
        (reference_dir / "eval_results.json").read_text())


def test_a_checkpoint_keeps_its_processs_choice_of_training_products(monkeypatch):
    from hf_elmo import cpu_tuning
    from hf_elmo.pretraining_checkpoints import CheckpointError, rng_state, set_rng_state

    cpu, threads = torch.device("cpu"), torch.get_num_threads()
    monkeypatch.delenv(cpu_tuning.TUNING_VARIABLE, raising=False)
    monkeypatch.setattr(cpu_tuning, "_ONEDNN_TRAINS", {threads: True})  # as the interrupted run measured
    state = json.loads(json.dumps(rng_state(cpu)))  # through JSON, as the checkpoint holds it
    assert state["cpu_products"] == {"threads": threads, "onednn": True}
    # The resumed process takes it, and measures nothing.
    monkeypatch.setattr(cpu_tuning, "_ONEDNN_TRAINS", {})
    monkeypatch.setattr(cpu_tuning, "_onednn_is_faster_for_training", lambda: pytest.fail("measured again"))
    set_rng_state(state, cpu, "rng_state_0.json")
    assert cpu_tuning.training_products_choice() == {"threads": threads, "onednn": True}
    assert cpu_tuning.onednn_trains(torch.empty(1)) == cpu_tuning.has_onednn_linear(torch.empty(1))
    # A process that made no choice records none; a damaged one is one line naming the file.
    monkeypatch.setattr(cpu_tuning, "_ONEDNN_TRAINS", {})
    assert "cpu_products" not in rng_state(cpu)
    for damaged in ({"threads": "two", "onednn": True}, {"threads": 2, "onednn": 1}, {"onednn": True}, [2, True]):
        with pytest.raises(CheckpointError, match=r"^--resume: rng_state_0.json is not usable \(") as caught:
            set_rng_state({**state, "cpu_products": damaged}, cpu, "rng_state_0.json")
        assert "\n" not in str(caught.value) and not cpu_tuning._ONEDNN_TRAINS


def _streaming_command(corpus, folder, output, *extra):
    return [sys.executable, "-m", "hf_elmo.cli", "pretrain", "--dataset-name", str(folder), "--streaming",
            "--config", str(corpus / "tiny.json"), "--output-dir", str(output), "--vocab", str(folder / "vocab.txt"),
            "--max-sentence-words", "30", "--seed", "1", "--batch-size", "8", "--shuffle-window", "40",
            "--num-softmax-samples", "256", "--max-steps", "14", "--save-steps", "4", "--logging-steps", "1",
            "--report-to", "none", *extra]


@pytest.mark.skipif(not os.path.isdir("/proc"), reason="finds the training process through /proc")
def test_a_sigkilled_streaming_run_resumes_to_the_uninterrupted_runs_weights(corpus, tmp_path):
    # A local datasets folder of 3 JSON-lines shards, records of one to three sentences and some without text, read
    # with --streaming: 14 steps of 8 sentences cross shard ends, windows of 40 and the end of the first epoch.
    lines = (corpus / "train.txt").read_text(encoding="utf-8").splitlines()[:90]
    folder = tmp_path / "stream"
    folder.mkdir()
    records = []
    while lines:
        take = 1 + len(records) % 3
        records.append({"text": "\n".join(lines[:take])})
        lines = lines[take:]
    records[4]["text"], records[11]["text"] = None, " "
    for shard in range(3):
        (folder / f"train-{shard}.jsonl").write_text("".join(json.dumps(r) + "\n" for r in records[shard::3]),
                                                    encoding="utf-8")
    words = Counter(w for r in records if r["text"] for w in r["text"].split())
    write_vocab(build_vocab(words), str(folder / "vocab.txt"))
    # Two runs started apart, compared bit for bit: each would time oneDNN against the BLAS for itself, and under
    # load the two chose differently (3 failures in 9 on a busy 2-core VM). A resumed run takes the interrupted
    # run's choice from its checkpoint (test_a_checkpoint_keeps_its_processs_choice_of_training_products).
    env = {**_env(), "HF_ELMO_CACHE": str(tmp_path / "cache"), "HF_ELMO_CPU_TUNING": "fixed"}

    reference, killed = tmp_path / "reference", tmp_path / "killed"
    with ThreadPoolExecutor(max_workers=1) as pool:  # the uninterrupted run beside the one to be killed
        uninterrupted = pool.submit(subprocess.run, _streaming_command(corpus, folder, reference, "--num-workers", "2"),
                                    capture_output=True, text=True, env=env, timeout=300)
        process = subprocess.Popen(_streaming_command(corpus, folder, killed, "--num-workers", "1"),
                                   stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env=env)
        log = _kill_when_saved(process, "checkpoint-4")  # the run and its DataLoader worker
        done = uninterrupted.result()
    assert done.returncode == 0, done.stderr[-4000:]
    assert "Streaming " + str(folder) + "[train], column 'text': 3 shard(s), read as the run trains" in done.stderr
    assert process.returncode == -signal.SIGKILL, "".join(log)[-4000:]
    assert not (killed / "model.safetensors").exists()
    resume_from = latest_checkpoint(str(killed))
    state = json.loads((Path(resume_from) / "training_state.json").read_text())
    # The checkpoint holds what the data are (the shards by name, size and SHA-256) and where the stream stands.
    assert state["data"]["dataset"] == {"dataset": "stream", "config": None, "split": "train", "column": "text",
                                        "data_files": [run_record.file_record(str(folder / f"train-{i}.jsonl"))
                                                       for i in range(3)]}
    assert state["stream"]["files"] == [f"{folder}[train] shard {i} of 3" for i in (1, 2, 3)]

    resumed = subprocess.run(_streaming_command(corpus, folder, killed, "--num-workers", "0", "--resume"),
                             capture_output=True, text=True, env=env, timeout=300)
    assert resumed.returncode == 0, resumed.stderr[-4000:]
    assert f"Resumed from {resume_from}" in resumed.stderr
    expected, got = load_file(reference / "model.safetensors"), load_file(killed / "model.safetensors")
    assert all(torch.equal(expected[k], got[k]) for k in expected), "the resumed run's weights differ"
    # Each step's loss, logged by the two runs, is the uninterrupted run's.
    def losses(output):
        return {r["step"]: r["train/loss"] for r in map(json.loads, (output / "metrics.jsonl").read_text()
                                                                     .splitlines()) if "train/loss" in r}
    assert losses(killed) == losses(reference) and len(losses(reference)) == 14

    # Other text under the same name is refused on --resume, naming the difference.
    (folder / "train-2.jsonl").write_text(json.dumps({"text": "other text ."}) + "\n", encoding="utf-8")
    again = subprocess.run(_streaming_command(corpus, folder, killed, "--num-workers", "0", "--resume",
                                              "--max-steps", "20"),
                           capture_output=True, text=True, env=env, timeout=300)
    assert again.returncode == 1
    refusal = again.stderr.strip().splitlines()[-1]
    assert refusal.startswith(f"error: --resume: {killed / 'checkpoint-14'} was trained on other text than this run "
                              "would read (dataset.data_files.2.bytes: ")
    assert "dataset.data_files.2.sha256: " in refusal


def test_a_streamed_column_that_is_not_all_text_is_named_then_its_other_records_are_counted(corpus, tmp_path,
                                                                                            capsys):
    folder = tmp_path / "mixed"
    folder.mkdir()
    records = [{"text": "the cat sat ."}, {"text": 5}, {"text": "a dog ran ."}, {"text": None}, {"text": ["a"]}]
    (folder / "train.jsonl").write_text("".join(json.dumps(r) + "\n" for r in records), encoding="utf-8")
    command = ["--dataset-name", str(folder), "--streaming", "--config", str(corpus / "tiny.json"), "--build-vocab",
               "--batch-size", "2", "--max-steps", "2", "--logging-steps", "1", "--num-workers", "0",
               "--report-to", "none"]
    # JSON that mixes types has no column typed as text: one line, which says what to do.
    assert pretrain_main([*command, "--output-dir", str(tmp_path / "first")]) == 1
    assert error_lines(capsys)[-1] == (
        f"{folder}[train] has no column typed as text (its columns: text); name the text's column with "
        "--text-column (its records that hold no string are then counted and skipped).")
    assert not (tmp_path / "first").exists()
    _reset_accelerate()
    output = tmp_path / "second"
    assert pretrain_main([*command, "--text-column", "text", "--output-dir", str(output)]) == 0
    _reset_accelerate()
    logged = [json.loads(line) for line in (output / "metrics.jsonl").read_text().splitlines()]
    # Each step is one batch of both sentences; the three records without a string are counted once per epoch.
    assert [(m["train/sentences_seen"], m["data/records_without_text"]) for m in logged] == [(2, 3), (4, 6)]


@pytest.mark.parametrize("streaming", [True, False])
def test_a_dataset_file_that_is_not_utf8_is_one_line_naming_the_split(corpus, tmp_path, monkeypatch, capsys,
                                                                      streaming):
    monkeypatch.setenv("HF_ELMO_CACHE", str(tmp_path / "cache"))
    folder = tmp_path / "latin1"
    folder.mkdir()
    (folder / "train.jsonl").write_bytes('{"text": "caf\u00e9 au lait"}\n'.encode("latin-1"))
    write_vocab(build_vocab(Counter(["au", "lait"])), str(tmp_path / "vocab.txt"))
    output = tmp_path / "run"
    # Streamed, the file is first read in a DataLoader worker (the vocabulary is given); exported, while exporting.
    code = pretrain_main(["--dataset-name", str(folder), *(["--streaming"] if streaming else []), "--config",
                          str(corpus / "tiny.json"), "--vocab", str(tmp_path / "vocab.txt"), "--output-dir",
                          str(output), "--max-steps", "1", "--batch-size", "1", "--num-workers", "1",
                          "--report-to", "none"])
    _reset_accelerate()
    assert code == 1
    where = f"{folder}[train] shard 1 of 1" if streaming else f"{folder}[train]"
    assert error_lines(capsys)[-1] == (f"{where}: cannot be read ('utf-8' codec can't decode byte 0xe9 in position 3: "
                                       "invalid continuation byte) (datasets reads text files as UTF-8).")
    # No output folder, and no export half-written into the cache (its parent folder may stay, empty).
    assert not output.exists() and not list((tmp_path / "cache").glob("datasets/*"))


def test_a_save_to_disk_folder_streams_its_arrow_files_with_a_held_out_split(corpus, tmp_path, monkeypatch, caplog):
    import datasets

    monkeypatch.setenv("HF_ELMO_CACHE", str(tmp_path / "cache"))
    lines = (corpus / "train.txt").read_text(encoding="utf-8").splitlines()
    saved = tmp_path / "saved"
    datasets.DatasetDict({"train": datasets.Dataset.from_dict({"text": lines[:200]}),
                          "validation": datasets.Dataset.from_dict({"text": lines[200:230]})}).save_to_disk(str(saved))
    output = tmp_path / "run"
    with caplog.at_level("INFO"):
        assert pretrain_main(["--dataset-name", str(saved), "--streaming", "--eval-split", "validation", "--config",
                              str(corpus / "tiny.json"), "--build-vocab", "--output-dir", str(output), "--max-steps",
                              "2", "--save-steps", "2", "--batch-size", "4", "--num-workers", "0",
                              "--eval-max-sentences", "12", "--report-to", "none"]) == 0
    _reset_accelerate()
    # Only what is evaluated is exported of the held-out split; the vocabulary, counted over the whole stream
    # here, says what that costs.
    assert f"Exported {saved}[validation], column 'text': 12 held-out lines" in caplog.text
    assert "--build-vocab without --vocab-sentences reads the whole stream (downloads all of a Hub dataset)" in (
        caplog.text)
    assert f"Streaming {saved}[train], column 'text': 1 shard(s), read as the run trains" in caplog.text
    state = json.loads((output / "checkpoint-2" / "training_state.json").read_text())
    # A save_to_disk split is known by its fingerprint, which save_to_disk keeps.
    assert state["data"]["dataset"] == {"dataset": "saved", "config": None, "split": "train", "column": "text",
                                        "fingerprint": datasets.load_from_disk(str(saved))["train"]._fingerprint}
    assert "eval/forward_perplexity" in json.loads((output / "eval_results.json").read_text())


def test_two_processes_stream_a_dataset_each_its_share(corpus, tmp_path):
    # Each process reads the whole stream and trains on its batch of every pair (as from files): together they
    # see 2 x 8 sentences a step, and end with identical weights.
    lines = (corpus / "train.txt").read_text(encoding="utf-8").splitlines()[:300]
    folder = tmp_path / "data"
    folder.mkdir()
    for shard in range(3):
        (folder / f"train-{shard}.jsonl").write_text("".join(json.dumps({"text": line}) + "\n"
                                                             for line in lines[shard::3]), encoding="utf-8")
    output = tmp_path / "run"
    command = [sys.executable, "-m", "accelerate.commands.accelerate_cli", "launch", "--multi_gpu", "--num_processes",
               "2", "--num_machines", "1", "--main_process_port", str(free_port()), "--mixed_precision", "no",
               "--dynamo_backend", "no", "-m", "hf_elmo.cli", "pretrain", "--dataset-name", str(folder), "--streaming",
               "--config", str(corpus / "tiny.json"), "--build-vocab", "--output-dir", str(output), "--max-steps",
               "6", "--save-steps", "3", "--batch-size", "8", "--shuffle-window", "64", "--num-workers", "1",
               "--report-to", "none"]
    code, log = _run_launch(command)
    assert code == 0, launch_failure_report(log)
    assert "World size 2 (MULTI_CPU)" in log and "Weights identical on all 2 process(es)" in log
    assert json.loads((output / "eval_results.json").read_text())["sentences_seen"] == 6 * 2 * 8


def test_sampled_softmax_losses_and_gradients_equal_the_plain_formula_with_accidental_hits():
    # The loss is computed without concatenating the logits and with accidental hits found per target; against the
    # plain formula (cat, every pair compared, log_softmax), values and gradients, with several targets that are
    # also among the negatives and ignored positions.
    config = tiny_config(vocab_size=300, num_softmax_samples=40, lm_dropout=0.0)
    torch.manual_seed(0)
    model = ElmoForPreTraining(config)
    torch.manual_seed(3)
    candidates, tries = sample_log_uniform_candidates(40, 300)
    targets = torch.cat([candidates[:6], torch.randint(0, 300, (20,)), torch.tensor([-100, -100])])
    hidden = torch.randn(len(targets), config.projection_dim, requires_grad=True)
    torch.manual_seed(3)
    losses = model._sampled_softmax_losses(hidden, targets)
    grads = torch.autograd.grad(losses.sum(), [hidden, model.softmax.weight, model.softmax.bias])

    keep = targets != -100
    t = targets.clamp(min=0)
    w, b = model.softmax.weight, model.softmax.bias
    q_true = log_uniform_expected_count(t, 300, 40, tries).log().float()
    q_sampled = log_uniform_expected_count(candidates, 300, 40, tries).log().float()
    true_logit = (hidden * w[t]).sum(-1) + b[t] - q_true
    sampled = hidden @ w[candidates].t() + b[candidates] - q_sampled
    hits = candidates[None] == t[:, None]
    assert int(hits.sum()) >= 6
    sampled = sampled.masked_fill(hits, float("-inf"))
    expected = -torch.log_softmax(torch.cat([true_logit[:, None], sampled], 1), -1)[:, 0] * keep
    expected_grads = torch.autograd.grad(expected.sum(), [hidden, w, b])
    torch.testing.assert_close(losses, expected, rtol=0, atol=1e-5)
    assert losses[-2:].abs().max() == 0
    for actual, wanted in zip(grads, expected_grads):
        torch.testing.assert_close(actual, wanted, rtol=1e-5, atol=1e-6)


def test_sampled_softmax_loss_in_bf16_autocast_and_its_single_backward():
    # The scores are overwritten by the backward: under bf16 autocast its matmuls run in bf16 as the forward's did
    # (gradients within bf16 rounding of fp32's), and a second backward through the same graph fails loudly instead
    # of reading spent scores.
    config = tiny_config(vocab_size=300, num_softmax_samples=40, lm_dropout=0.0)
    torch.manual_seed(0)
    model = ElmoForPreTraining(config)
    targets = torch.randint(0, 300, (30,))
    hidden = torch.randn(len(targets), config.projection_dim, requires_grad=True)

    def losses_and_grads(autocast: bool):
        torch.manual_seed(3)
        with torch.autocast("cpu", dtype=torch.bfloat16, enabled=autocast):
            losses = model._sampled_softmax_losses(hidden, targets)
        return losses, torch.autograd.grad(losses.sum(), [hidden, model.softmax.weight, model.softmax.bias])

    exact, exact_grads = losses_and_grads(False)
    rounded, rounded_grads = losses_and_grads(True)
    assert rounded.dtype == torch.float32
    assert 0 < float((rounded - exact).detach().abs().max()) <= 0.05 * float(exact.detach().abs().max())
    for actual, wanted in zip(rounded_grads, exact_grads):
        assert actual.dtype == torch.float32
        assert 0 < float((actual - wanted).abs().max()) <= 0.02 * float(wanted.abs().max())

    torch.manual_seed(3)
    total = model._sampled_softmax_losses(hidden, targets).sum()
    total.backward(retain_graph=True)
    with pytest.raises(RuntimeError, match="modified by an inplace operation"):
        total.backward()


def test_cpu_batches_are_padded_to_their_longest_sentence_and_compiled_ones_to_a_multiple_of_8():
    config = tiny_config(vocab_size=300)
    assert padding_multiple(config, torch.device("cpu")) == 1
    assert padding_multiple(config, torch.device("cuda")) == COMPILED_LENGTH_BUCKET == 8
    config.elmo_implementation = "cuda"  # the compiled implementation, wherever it runs
    assert padding_multiple(config, torch.device("cpu")) == 8


# ------------------------------------------------------------------------------------------------ output folders
def test_pretrain_writes_only_into_folders_of_its_own(corpus, tmp_path, capsys):
    from hf_elmo.pretraining_checkpoints import LOCK_FILE, output_dir_lock

    def run(output, *extra) -> tuple[int, str]:
        code = pretrain_main(common_args(corpus, output, "--build-vocab", "--max-steps", "1", "--batch-size", "4",
                                         "--num-workers", "0", "--report-to", "none", *extra))
        return code, error_lines(capsys)[-1] if code else ""

    def snapshot(folder) -> dict:
        return {p.name: (p.read_bytes() if p.is_file() else None, p.stat().st_mtime_ns) for p in folder.iterdir()}

    # A folder of the user's: refused with or without --resume, every file as it was. A model folder, or another
    # trainer's output with its checkpoint-N, is not a run of ours either: --resume "into" it would have started at
    # step 0 and written a new model over the user's.
    users, model = tmp_path / "users", tmp_path / "model"
    (model / "checkpoint-500").mkdir(parents=True)
    for folder, files, listed, hint in (
        (users, {"vocab.txt": "mine\n", "modeling_elmo.py": "# mine\n", "metrics.jsonl": "{}\n"},
         "metrics.jsonl, modeling_elmo.py, vocab.txt", ""),
        (model, {"config.json": "{}\n", "model.safetensors": "weights", "training_args.bin": "x"},
         "checkpoint-500, config.json, model.safetensors, training_args.bin",
         " To train on from the model it holds, pass it as --init-from."),
    ):
        folder.mkdir(exist_ok=True)
        for name, text in files.items():
            (folder / name).write_text(text)
        before = snapshot(folder)
        for extra in ((), ("--resume",)):
            code, message = run(folder, *extra)
            assert code == 1 and message == (f"{folder} is not empty and holds no hf-elmo pretrain run ({listed}); "
                                             f"nothing was touched. Choose a new or empty --output-dir.{hint}")
            assert snapshot(folder) == before
    assert os.listdir(model / "checkpoint-500") == []
    before = snapshot(users)
    # A file where the folder would be: one line, and the file as it was.
    (tmp_path / "a-file").write_text("mine\n")
    code, message = run(tmp_path / "a-file")
    assert code == 1 and message == f"{tmp_path / 'a-file'}: exists and is not a folder; remove it or choose another " \
                                    "--output-dir."
    assert (tmp_path / "a-file").read_text() == "mine\n"
    # An input inside the output folder (here the corpus, which --build-vocab would overwrite as vocab.txt).
    code = pretrain_main(["--train-files", str(users / "vocab.txt"), "--config", str(corpus / "tiny.json"),
                          "--output-dir", str(users), "--build-vocab", "--max-steps", "1"])
    assert code == 1 and error_lines(capsys)[-1].startswith(
        f"{users}: is a folder holding the input {users / 'vocab.txt'}; writing there would destroy it.")
    assert snapshot(users) == before
    # A second run while another holds the folder: one line, and the folder (new to both) is left to its owner.
    held = tmp_path / "held"
    lock = output_dir_lock(str(held))
    try:
        code, message = run(held)
        assert code == 1 and message == (f"{held} is being written by another hf-elmo pretrain run (pid "
                                         f"{os.getpid()}); nothing was touched. Wait for that run to end, or choose "
                                         "another --output-dir.")
        assert sorted(p.name for p in held.iterdir()) == [LOCK_FILE]
    finally:
        lock.release()
    # What a start of ours left when killed before its first checkpoint (its lock file, vocab.txt) is taken over.
    killed = tmp_path / "killed"
    killed.mkdir()
    (killed / LOCK_FILE).write_text("pid 1\n")
    (killed / "vocab.txt").write_text("<S>\n</S>\n<UNK>\n")
    # ... but not beside anything such a start does not write, which may be the user's.
    (killed / "notes.txt").write_text("mine\n")
    code, message = run(killed)
    assert code == 1 and message.startswith(f"{killed} is not empty and holds no hf-elmo pretrain run (notes.txt, ")
    assert (killed / "notes.txt").read_text() == "mine\n"
    (killed / "notes.txt").unlink()
    assert run(killed)[0] == 0 and (killed / "model.safetensors").is_file() and not (killed / LOCK_FILE).exists()


@pytest.mark.parametrize("field, value, expected", [
    ("step", -3, "progress.step must be a whole number >= 0, got -3"),
    ("step", 1e30, "progress.step must be a whole number >= 0, got 1e+30"),
    ("step", "four", "progress.step must be a whole number >= 0, got 'four'"),
    ("tokens", None, "progress.tokens must be a whole number >= 0, got None"),
    ("sentences", 2.5, "progress.sentences must be a whole number >= 0, got 2.5"),
])
def test_a_damaged_training_state_is_one_line(trained, corpus, tmp_path, capsys, field, value, expected):
    output = tmp_path / "run"
    shutil.copytree(trained, output)
    state_file = output / "checkpoint-30" / "training_state.json"
    state = json.loads(state_file.read_text())
    state["progress"][field] = value
    state_file.write_text(json.dumps(state))
    code = pretrain_main(common_args(
        corpus, output, "--build-vocab", "--min-count", "2", "--num-softmax-samples", "512", "--batch-size", "16",
        "--optimizer", "adamw", "--learning-rate", "2e-2", "--max-steps", "40", "--save-steps", "15",
        "--report-to", "none", "--resume",
    ))
    assert code == 1
    assert error_lines(capsys)[-1] == (f"--resume: {state_file}: {expected}; the checkpoint is damaged (resume from an "
                                       "earlier one, or start afresh).")


def test_a_full_disk_at_metrics_jsonl_is_the_full_disk_line_and_keeps_whole_lines(corpus, tmp_path, capsys,
                                                                                  monkeypatch):
    import builtins
    import errno

    from hf_elmo import pretraining

    output = tmp_path / "run"
    metrics = output / "metrics.jsonl"

    def open_until_full(path, *args, **kwargs):
        handle = builtins.open(path, *args, **kwargs)
        if str(path) == str(metrics) and len(metrics.read_text().splitlines()) >= 2:
            handle.write('{"step": 3, "train/lo')  # half a line reaches the disk, then it is full
            handle.close()
            raise OSError(errno.ENOSPC, "No space left on device", str(path))
        return handle

    monkeypatch.setattr(pretraining, "open", open_until_full, raising=False)
    code = pretrain_main(common_args(corpus, output, "--build-vocab", "--max-steps", "6", "--batch-size", "4",
                                     "--num-workers", "0", "--report-to", "none", "--logging-steps", "1",
                                     "--save-steps", "2"))
    assert code == 1
    message = error_lines(capsys)[-1]
    assert message.startswith(f"cannot write {metrics}: the disk is full or a file-size limit was reached (")
    assert "the metrics logged before this step are kept. Free some space, or write elsewhere." in message
    assert message.endswith(f"{output / 'checkpoint-2'} is intact: --resume continues from it.")
    assert [json.loads(line)["step"] for line in metrics.read_text().splitlines()] == [1, 2]


SEGMENTER = '''
def characters(text):
    """One word per character that is not a space: a segmenter for text written without spaces."""
    return [character for character in text if not character.isspace()]
'''


def test_pretrain_with_a_segmenter_of_ones_own_records_it_in_the_tokenizer(corpus, tmp_path, monkeypatch, capsys):
    from hf_elmo import tokenization_elmo
    from hf_elmo.tokenization_elmo import ElmoTokenizer, register_pre_tokenizer

    (tmp_path / "segmenters.py").write_text(SEGMENTER, encoding="utf-8")
    monkeypatch.syspath_prepend(str(tmp_path))
    monkeypatch.setattr(tokenization_elmo, "_REGISTERED_PRE_TOKENIZERS", {})
    # Text written without spaces (sentences of our own, made here).
    phrases = ["我爱北京", "天安门上太阳升", "我们学习语言模型", "今天天气很好"]
    text = tmp_path / "zh.txt"
    text.write_text("".join(phrases[i % 4] + phrases[(i * 3) % 4] + "。\n" for i in range(200)), encoding="utf-8")
    output = tmp_path / "zh-bilm"
    command = ["--train-files", str(text), "--config", str(corpus / "tiny.json"), "--output-dir", str(output),
               "--build-vocab", "--max-steps", "2", "--batch-size", "8", "--num-workers", "0", "--report-to", "none"]
    with pytest.raises(SystemExit) as stopped:
        pretrain_main([*command, "--pre-tokenizer", "segmenters:nothing_here"])
    assert stopped.value.code == 2 and "--pre-tokenizer segmenters:nothing_here: cannot be imported" in (
        capsys.readouterr().err)
    assert pretrain_main([*command, "--pre-tokenizer", "segmenters:characters"]) == 0
    _reset_accelerate()
    config = json.loads((output / "tokenizer_config.json").read_text(encoding="utf-8"))
    assert config["pre_tokenizer"] == "segmenters:characters"
    vocabulary = (output / "vocab.txt").read_text(encoding="utf-8").split()
    assert "我" in vocabulary and "我爱北京" not in vocabulary and all(len(w) == 1 for w in vocabulary[3:])
    # Loading never imports the code a folder names: the function must be registered in this process first.
    monkeypatch.setattr(tokenization_elmo, "_REGISTERED_PRE_TOKENIZERS", {})
    with pytest.raises(ValueError, match=r"pre_tokenizer 'segmenters:characters' is a function of your own, not "
                                         r"registered in this process: call hf_elmo\.tokenization_elmo\."):
        ElmoTokenizer.from_pretrained(output)
    import segmenters

    register_pre_tokenizer("segmenters:characters", segmenters.characters)
    tokenizer = ElmoTokenizer.from_pretrained(output)
    encoding = tokenizer(["我爱 北京。"], return_offsets_mapping=True)
    assert tokenizer.tokenize("我爱 北京。") == ["我", "爱", "北", "京", "。"]
    assert encoding["offset_mapping"][0] == [(0, 1), (1, 2), (3, 4), (4, 5), (5, 6)]
    # A segmenter must return pieces of the text, in order.
    register_pre_tokenizer("backwards", lambda line: list(reversed(line.split())))
    with pytest.raises(ValueError, match=r"pre_tokenizer 'backwards' returned 'a', which is not the next piece of the "
                                         r"text \(from character 3\)"):
        ElmoTokenizer(pre_tokenizer="backwards").tokenize("a b")


def test_pretrain_from_a_local_datasets_folder_exports_once_and_resumes(corpus, tmp_path, monkeypatch, caplog,
                                                                        capsys):
    monkeypatch.setenv("HF_ELMO_CACHE", str(tmp_path / "cache"))
    lines = (corpus / "train.txt").read_text(encoding="utf-8").splitlines()[:300]
    folder = tmp_path / "wiki"
    folder.mkdir()
    # Records of two sentences each, as documents; one without text, one empty: counted and skipped.
    records = [{"id": i, "text": lines[2 * i] + "\n" + lines[2 * i + 1]} for i in range(150)]
    records[7]["text"], records[9]["text"] = None, ""
    (folder / "train.jsonl").write_text("".join(json.dumps(r) + "\n" for r in records), encoding="utf-8")
    output = tmp_path / "bilm"
    command = ["--dataset-name", str(folder), "--eval-fraction", "0.1", "--config", str(corpus / "tiny.json"),
               "--output-dir", str(output), "--build-vocab", "--vocab-sentences", "100", "--batch-size", "8",
               "--num-workers", "0", "--report-to", "none", "--save-steps", "2"]
    with caplog.at_level("INFO"):
        assert pretrain_main([*command, "--max-steps", "2"]) == 0
    _reset_accelerate()
    assert ("column 'text': 266 lines of text from 135 records (2 without text, skipped), 30 held-out lines"
            in caplog.text)
    assert re.search(r"Wrote \S+vocab.txt: \d+ entries \(\d+ distinct words in the 100 sentences counted\)", caplog.text)
    exported = list((tmp_path / "cache" / "datasets").iterdir())
    assert len(exported) == 1 and sorted(p.name for p in exported[0].iterdir()) == ["eval-00000.txt",
                                                                                    "train-00000.txt"]
    assert (exported[0] / "eval-00000.txt").read_text(encoding="utf-8").splitlines()[0] == lines[270]
    # The same command with --resume reads the same export: the checkpoint's record of the files holds.
    caplog.clear()
    with caplog.at_level("INFO"):
        assert pretrain_main([*command, "--max-steps", "4", "--resume"]) == 0
    _reset_accelerate()
    assert "from its export in" in caplog.text and f"Resumed from {output / 'checkpoint-2'}: step 2" in caplog.text
    # Two string columns and no --text-column: one line naming them; options without --dataset-name: usage errors.
    (folder / "train.jsonl").write_text(json.dumps({"text": "a b", "title": "c"}) + "\n", encoding="utf-8")
    assert pretrain_main([*command[:4], "--config", str(corpus / "tiny.json"), "--output-dir",
                          str(tmp_path / "other"), "--max-steps", "1"]) == 1
    assert error_lines(capsys)[-1] == f"{folder}[train]: give --text-column, one of its string columns (text, " \
                                      "title)"
    # Splits whose columns differ: one line, whether datasets finds it (data files) or the run does (save_to_disk).
    (folder / "train.jsonl").write_text(json.dumps({"text": "a b"}) + "\n", encoding="utf-8")
    (folder / "validation.jsonl").write_text(json.dumps({"body": "c d"}) + "\n", encoding="utf-8")
    other = ["--eval-split", "validation", "--config", str(corpus / "tiny.json"), "--output-dir",
             str(tmp_path / "other"), "--max-steps", "1"]
    assert pretrain_main(["--dataset-name", str(folder), *other]) == 1
    assert error_lines(capsys)[-1].startswith(f"--dataset-name {folder}: cannot be loaded (Couldn't cast body")
    import datasets

    saved = tmp_path / "saved"
    datasets.DatasetDict({"train": datasets.Dataset.from_dict({"text": ["a b"]}),
                          "validation": datasets.Dataset.from_dict({"body": ["c d"]})}).save_to_disk(str(saved))
    assert pretrain_main(["--dataset-name", str(saved), *other]) == 1
    assert error_lines(capsys)[-1] == f"{saved}[validation] has no column 'text' (it has body)."
    assert not (tmp_path / "other").exists()
    with pytest.raises(SystemExit) as stopped:
        pretrain_main(["--train-files", str(corpus / "train.txt"), "--text-column", "text", "--config",
                       str(corpus / "tiny.json"), "--output-dir", str(tmp_path / "x"), "--max-steps", "1"])
    assert stopped.value.code == 2 and "--text-column goes with --dataset-name" in capsys.readouterr().err
