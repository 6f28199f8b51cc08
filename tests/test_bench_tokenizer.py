"""benchmarks/bench_tokenizer.py (issue 12): its prototypes give ElmoTokenizer's outputs, and the script runs.

No timing is asserted: only that the compared tokenizers agree, on awkward input too, and that the script
prints one JSON line saying so.
"""

import json
import sys
from pathlib import Path

import numpy as np
import torch

from hf_elmo.configuration_elmo import word_to_char_ids
from hf_elmo.tokenization_elmo import ElmoTokenizer


REPO = Path(__file__).resolve().parent.parent
BENCHMARKS = REPO / "benchmarks"
sys.path.insert(0, str(BENCHMARKS))

import bench_tokenizer  # noqa: E402


AWKWARD_TEXTS = [
    "I don't know... it's $3.50 in the U.S.",
    "",
    "Ünïcode 😀 café <S> </S> <pad>",
    "a lone \ud800 surrogate",
    "a" * 80 + " b " + "é" * 30,
]


def test_vectorised_rows_match_word_to_char_ids():
    words = ["<S>", "</S>", "a", "", "é" * 30, "x" + "😀" * 20, "ab\ud800cd", "\ud800", "<S>x", "日本語"]
    words.append("a" * 100)
    lengths = np.array([len(w) for w in words])
    starts = np.concatenate([[0], np.cumsum(lengths)[:-1]])
    for width in (50, 6, 3):
        rows = bench_tokenizer.char_rows_from_offsets(words, starts, starts + lengths, width)
        expected = np.array([word_to_char_ids(w, width) for w in words])
        assert rows.tolist() == expected.tolist(), width


def test_prototypes_give_elmo_tokenizer_outputs():
    slow = ElmoTokenizer()
    expected = slow(AWKWARD_TEXTS, padding=True, return_tensors="pt", return_offsets_mapping=True)
    for other in (bench_tokenizer.FastElmoPrototype(), bench_tokenizer.VectorisedElmoTokenizer()):
        got = other(AWKWARD_TEXTS, padding=True, return_tensors="pt", return_offsets_mapping=True)
        for key in ("input_ids", "attention_mask", "offset_mapping"):
            assert torch.equal(got[key], expected[key]), (type(other).__name__, key)
        assert [got.word_ids(i) for i in range(len(AWKWARD_TEXTS))] == [
            expected.word_ids(i) for i in range(len(AWKWARD_TEXTS))
        ]
    assert bench_tokenizer.FastElmoPrototype().is_fast


def test_script_help_and_tiny_run(tmp_path, capsys):
    try:
        bench_tokenizer.parse_args(["--help"])
    except SystemExit as stop:
        assert stop.code == 0
    shown = capsys.readouterr().out
    assert "--batch-sizes" in shown and "fast_prototype" in shown

    text = tmp_path / "sentences.txt"
    text.write_text("\n".join(t for t in AWKWARD_TEXTS if "\ud800" not in t) + "\nThe end.\n", encoding="utf-8")
    bench_tokenizer.main(["--text", str(text), "--batch-sizes", "2", "3", "--rounds", "1"])
    lines = capsys.readouterr().out.strip().splitlines()
    assert len(lines) == 1
    report = json.loads(lines[0])
    assert report["identical"] is True
    assert report["n_sentences"] == 4
    assert [(r["batch_size"], r["offsets"]) for r in report["results"]] == [(2, False), (2, True), (3, False),
                                                                            (3, True)]
    for row in report["results"]:
        for side in ("ElmoTokenizer", "fast_prototype", "python_vectorised"):
            assert row[side]["sentences_per_s"] > 0
    assert report["stock_methods"]["vocab_size"] != "same"  # the stock fast backend's answers differ
    assert report["machine"]["tokenizers"]
