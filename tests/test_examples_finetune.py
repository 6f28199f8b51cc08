"""The fine-tuning examples end to end (examples/finetuning_cli.py), and the data readers and metrics they rely on
(hf_elmo/finetuning.py).

The example runs are real: bilm-tf's fixture model, real CoNLL-2003-format text from allennlp's fixtures and real
sentences from bilm-tf's `sentences.json`, a real Trainer with per-epoch checkpoints, and real PNG/JSON outputs.
"""

import codecs
import csv
import hashlib
import json
import os
import re
import shutil
import subprocess
import sys

from pathlib import Path

import pytest
from transformers import AutoModelForSequenceClassification, AutoModelForTokenClassification, AutoTokenizer

from hf_elmo.finetuning import (
    DataFileError,
    TaggedSentence,
    classification_scores,
    entity_scores,
    has_chunk_tags,
    read_conll,
    read_text_classification_file,
)
from hf_elmo.testing_utils import conll2003_english

from example_scripts import load_example


REPO_ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
PNG_SIGNATURE = b"\x89PNG\r\n\x1a\n"


@pytest.fixture(scope="module")
def token_example():
    return load_example("run_token_classification")


@pytest.fixture(scope="module")
def sequence_example():
    return load_example("run_sequence_classification")


@pytest.fixture
def conll_text(fixtures_root):
    return (fixtures_root / "data" / "conll2003.txt").read_text(encoding="utf-8")


# ---------------------------------------------------------------------------------------------
# End to end
# ---------------------------------------------------------------------------------------------
def test_token_classification_example_fits_conll(token_example, converted_dir, conll_text, fixtures_root, tmp_path):
    train = tmp_path / "train.conll"
    train.write_text(conll_text * 8, encoding="utf-8")  # 16 sentences: a few steps per epoch
    fixture = str(fixtures_root / "data" / "conll2003.txt")
    output = tmp_path / "ner"
    metrics = token_example.main([
        "--model_name_or_path", str(converted_dir), "--train_file", str(train), "--validation_file", fixture,
        "--test_file", fixture, "--output_dir", str(output), "--num_train_epochs", "8",
        "--per_device_train_batch_size", "2", "--learning_rate", "0.1", "--mix_dropout", "0", "--head_lstm_dim", "0",
        "--task_name", "NER", "--logging_steps", "5", "--disable_tqdm", "true",
    ])
    for split in ("validation", "test"):
        assert metrics[split]["token_accuracy"] == 1.0
        entities = metrics[split]["entities"]
        assert entities["overall"] == {"precision": 1.0, "recall": 1.0, "f1": 1.0, "support": 6}
        assert {kind: scores["support"] for kind, scores in entities.items()} == {"LOC": 2, "ORG": 2, "PER": 2,
                                                                                 "overall": 6}
    assert metrics["task"] == "NER" and len(metrics["layer_weights"]) == 3
    assert sum(metrics["layer_weights"]) == pytest.approx(1.0, abs=1e-6)

    on_disk = json.loads((output / "metrics.json").read_text())
    assert on_disk["validation"] == metrics["validation"] and on_disk["layer_weights"] == metrics["layer_weights"]
    # The base model, a local folder, by its name only: no absolute path of the user's goes into what publish uploads.
    assert on_disk["model"] == converted_dir.name and on_disk["base_model"] is None
    assert str(converted_dir.parent) not in (output / "metrics.json").read_text()
    assert str(converted_dir.parent) not in (output / "README.md").read_text()
    labels = json.loads((output / "labels.json").read_text())
    assert labels == {"id2label": {"0": "O", "1": "I-LOC", "2": "I-ORG", "3": "I-PER"}}
    assert (output / "layer_weights.png").read_bytes()[:8] == PNG_SIGNATURE
    # The best epoch's checkpoint (which the default early stopping keeps; F1 reaches 1.0 after a few epochs, and
    # rounding in the last digits decides which epoch first scores highest) and the last.
    best = json.loads((output / "checkpoint-64" / "trainer_state.json").read_text())["best_global_step"]
    assert {p.name for p in output.glob("checkpoint-*")} == {f"checkpoint-{best}", "checkpoint-64"}
    model = AutoModelForTokenClassification.from_pretrained(output)
    assert model.config.id2label == {0: "O", 1: "I-LOC", 2: "I-ORG", 3: "I-PER"}
    assert model.layer_weights().tolist() == pytest.approx(metrics["layer_weights"], abs=1e-7)
    # As Transformers' run_ner.py writes them.
    assert (output / "predictions.txt").read_text() == ("I-ORG O I-PER O O I-LOC O\nI-ORG O I-PER O O I-LOC O\n")
    results = {name: json.loads((output / f"{name}_results.json").read_text()) for name in ("train", "eval",
                                                                                          "predict", "all")}
    assert results["train"]["train_samples"] == 16 and results["train"]["epoch"] == 8.0
    assert results["eval"]["eval_f1"] == 1.0 and results["predict"]["predict_token_accuracy"] == 1.0
    assert results["all"] == {**results["train"], **results["eval"], **results["predict"]}
    assert metrics["data_files"] == {"train": "train.conll", "validation": "conll2003.txt", "test": "conll2003.txt"}
    assert oct(os.stat(output / "model.safetensors").st_mode & 0o777) == oct(0o666 & ~_umask())
    # Provenance: the biLM's bilm-tf source (kept, the biLM was frozen), the task, data files and settings.
    assert (output / "bilm_tf_source.json").read_bytes() == (converted_dir / "bilm_tf_source.json").read_bytes()
    card = (output / "README.md").read_text()
    assert ("The weights of its biLM are those of bilm-tf's own test model (allennlp 0.9.0 `tests/fixtures/elmo`), "
            "for which bilm-tf's outputs are published.") in card
    assert (f"Task `NER`, fine-tuned from `{converted_dir.name}` on `train.conll` (train), `conll2003.txt` (validation), "
            "`conll2003.txt` (test) with hf_elmo's example scripts (the biLM frozen, a learned scalar mix of its "
            "layers, a linear classifier).") in card
    assert ("Training arguments: `learning_rate=0.1`, `num_train_epochs=8.0`, `max_steps=-1`, "
            "`per_device_train_batch_size=2`, `gradient_accumulation_steps=1`, `weight_decay=0.0`, `warmup_steps=0`, "
            "`lr_scheduler_type=linear`, `seed=42`.") in card


def test_token_example_defaults_learn_conll2003(token_example, converted_dir, tmp_path):
    # CoNLL-2003 English (Reuters text under a research licence, read from the pip cache only). With the defaults
    # and the biLM frozen, one epoch over 4,000 sentences tags entities (F1 0.44 here; measured: a linear
    # classifier at the old lr 1e-3 tagged every word O, F1 0).
    data = conll2003_english()
    metrics = token_example.main([
        "--model_name_or_path", str(converted_dir), "--train_file", str(data["train"]), "--validation_file",
        str(data["valid"]), "--max_train_samples", "4000", "--max_eval_samples", "500", "--num_train_epochs", "1",
        "--output_dir", str(tmp_path / "ner"), "--save_strategy", "no", "--disable_tqdm", "true",
    ])
    assert metrics["training_arguments"]["learning_rate"] == 0.01 and metrics["validation"]["loss"] < 0.6
    assert metrics["validation"]["entities"]["overall"]["f1"] > 0.3


def test_sequence_classification_example_fits_real_sentences(sequence_example, converted_dir, elmo_fixture, tmp_path):
    with open(elmo_fixture / "sentences.json", encoding="utf-8") as f:
        sentences = sorted((s for group in json.load(f) for s in group), key=lambda s: len(s.split()))[:10]
    train = tmp_path / "train.tsv"
    with open(train, "w", encoding="utf-8", newline="") as f:
        writer = csv.writer(f, delimiter="\t")
        writer.writerow(["sentence", "has_number"])
        for sentence in sentences * 4:  # a few steps per epoch
            writer.writerow([sentence, "yes" if any(c.isdigit() for c in sentence) else "no"])
    output = tmp_path / "numbers"
    metrics = sequence_example.main([
        "--model_name_or_path", str(converted_dir), "--train_file", str(train), "--validation_file", str(train),
        "--text_column_name", "sentence", "--label_column_name", "has_number", "--pooling", "final",
        "--output_dir", str(output), "--num_train_epochs", "6", "--per_device_train_batch_size", "10",
        "--learning_rate", "0.1", "--mix_dropout", "0", "--head_lstm_dim", "0", "--save_total_limit", "1",
        "--disable_tqdm", "true",
    ])
    report = metrics["validation"]
    assert report["accuracy"] == 1.0 and report["macro"]["f1"] == 1.0
    assert {label: scores["support"] for label, scores in report["classes"].items()} == {"no": 32, "yes": 8}
    assert metrics["task"] == "text-classification" and sum(metrics["layer_weights"]) == pytest.approx(1.0, abs=1e-6)
    assert (output / "layer_weights.png").read_bytes()[:8] == PNG_SIGNATURE
    assert json.loads((output / "labels.json").read_text()) == {"id2label": {"0": "no", "1": "yes"}}
    model = AutoModelForSequenceClassification.from_pretrained(output)
    assert model.config.classifier_pooling == "final" and model.config.id2label == {0: "no", 1: "yes"}
    # Scored again from its folder, without the options: the same head (final pooling, no biLSTM), the same scores.
    again = sequence_example.main([
        "--model_name_or_path", str(output), "--validation_file", str(train), "--text_column_name", "sentence",
        "--label_column_name", "has_number", "--do_eval", "--output_dir", str(tmp_path / "again"),
    ])
    assert again["validation"]["accuracy"] == 1.0 and again["validation"]["loss"] == pytest.approx(report["loss"])
    config = json.loads((tmp_path / "again" / "config.json").read_text())
    assert (config["classifier_pooling"], config["head_lstm_dim"]) == ("final", None)


def test_sequence_example_runs_on_the_shipped_sample(sequence_example, converted_dir, tmp_path):
    # examples/data/sentiment is what the README's command points to.
    data = os.path.join(REPO_ROOT, "examples", "data", "sentiment")
    assert [len(read_text_classification_file(os.path.join(data, f))) for f in ("train.tsv", "dev.tsv")] == [24, 8]
    metrics = sequence_example.main([
        "--model_name_or_path", str(converted_dir), "--train_file", os.path.join(data, "train.tsv"),
        "--validation_file", os.path.join(data, "dev.tsv"), "--test_file", os.path.join(data, "dev.tsv"),
        "--output_dir", str(tmp_path / "sentiment"), "--num_train_epochs", "1", "--per_device_train_batch_size", "8",
        "--disable_tqdm", "true",
    ])
    assert metrics["task"] == "text-classification"
    lines = (tmp_path / "sentiment" / "predictions.txt").read_text().splitlines()
    assert lines[0] == "index\tprediction" and len(lines) == 9
    assert all(re.fullmatch(r"\d\t(positive|negative)", line) for line in lines[1:])
    assert {label: s["support"] for label, s in metrics["validation"]["classes"].items()} == {"negative": 4,
                                                                                             "positive": 4}


@pytest.mark.parametrize("name", ["run_token_classification", "run_sequence_classification"])
def test_help_shows_the_transformers_options_and_ours(name, capsys):
    module = load_example(name)
    with pytest.raises(SystemExit) as exit_info:
        module.main(["--help"])
    assert exit_info.value.code == 0
    text = " ".join(capsys.readouterr().out.split())
    # Every TrainingArguments option, as in Transformers' examples, and ours, each explained.
    for option in ("--bf16", "--lr_scheduler_type", "--load_best_model_at_end", "--push_to_hub", "--report_to",
                   "--overwrite_output_dir", "--max_train_samples", "--max_eval_samples", "--max_predict_samples",
                   "--label_list", "--unfreeze_elmo", "--head_lstm_dim", "--mix_layer_norm", "--train_file",
                   "--dataset_name", "--task_name"):
        assert f"{option} " in text, option
    assert "peak AdamW learning rate. (default: 0.01)" in text and "Example" in text


def _umask() -> int:
    umask = os.umask(0)
    os.umask(umask)
    return umask


def _ner(token_example, converted_dir, fixtures_root, output, *options):
    fixture = str(fixtures_root / "data" / "conll2003.txt")
    return token_example.main([
        "--model_name_or_path", str(converted_dir), "--train_file", fixture, "--validation_file", fixture,
        "--output_dir", str(output), "--num_train_epochs", "1", "--per_device_train_batch_size", "1",
        "--disable_tqdm", "true", *options,
    ])


def test_token_example_fixed_labels_and_sample_limits(token_example, converted_dir, fixtures_root, tmp_path):
    labels = ["O", "B-PER", "I-PER", "B-LOC", "I-LOC", "B-ORG", "I-ORG"]
    metrics = _ner(token_example, converted_dir, fixtures_root, tmp_path / "out", "--label_list", *labels,
                   "--max_train_samples", "1", "--max_eval_samples", "1")
    assert json.loads((tmp_path / "out" / "labels.json").read_text())["id2label"] == {
        str(i): label for i, label in enumerate(labels)}
    results = json.loads((tmp_path / "out" / "all_results.json").read_text())
    assert (results["train_samples"], results["eval_samples"]) == (1, 1)
    assert metrics["validation"]["entities"]["overall"]["support"] == 3  # the first sentence's ORG, PER, LOC
    with pytest.raises(DataFileError, match="--label_list: O given more than once"):
        _ner(token_example, converted_dir, fixtures_root, tmp_path / "again", "--label_list", "O", "I-PER", "O")
    assert not (tmp_path / "again").exists()


def test_token_example_output_folder_rules(token_example, converted_dir, fixtures_root, tmp_path, caplog):
    output = tmp_path / "ner"
    _ner(token_example, converted_dir, fixtures_root, output)
    first_weights = (output / "model.safetensors").read_bytes()
    # The same command again resumes from the run's checkpoint (as Transformers' run_ner.py does): nothing to train.
    with caplog.at_level("INFO"):
        _ner(token_example, converted_dir, fixtures_root, output)
    assert f"Checkpoint found: resuming from {output / 'checkpoint-2'}" in caplog.text
    assert (output / "model.safetensors").read_bytes() == first_weights

    # A folder holding other things is refused, unless --overwrite_output_dir; the base model's folder always.
    other = tmp_path / "notes"
    other.mkdir()
    (other / "todo.txt").write_text("mine\n")
    with pytest.raises(FileExistsError, match=f"{other} already exists and is not empty; pass --overwrite_output_dir"):
        _ner(token_example, converted_dir, fixtures_root, other)
    for base in (converted_dir, converted_dir.parent):
        with pytest.raises(OSError, match="writing there would destroy it"):
            _ner(token_example, converted_dir, fixtures_root, base, "--overwrite_output_dir")
    with pytest.raises(OSError, match="--overwrite_output_dir only replaces a folder hf_elmo wrote"):
        _ner(token_example, converted_dir, fixtures_root, other, "--overwrite_output_dir")
    assert os.listdir(other) == ["todo.txt"]
    # Nor an hf-elmo pretrain run: an ELMo model folder too, beside its checkpoints.
    pretrained = tmp_path / "elmo-news"
    shutil.copytree(converted_dir, pretrained)
    (pretrained / "training_args.json").write_text("{}")
    with pytest.raises(OSError) as refused:
        _ner(token_example, converted_dir, fixtures_root, pretrained, "--overwrite_output_dir")
    assert str(refused.value) == (f"{pretrained}: holds an hf-elmo pretrain run (training_args.json); "
                                  "--overwrite_output_dir replaces a fine-tuning run's folder, never a pretraining "
                                  "run. Choose another --output_dir (and pass the pretrained model as "
                                  "--model_name_or_path).")
    assert sorted(os.listdir(pretrained)) == sorted(os.listdir(converted_dir) + ["training_args.json"])

    # --overwrite_output_dir starts over and replaces the folder as a whole at the end; a run that fails (here the
    # Trainer, on a checkpoint of this run whose trainer_state.json is damaged) leaves the old one as it was.
    broken = tmp_path / "broken"
    shutil.copytree(output / "checkpoint-2", broken)
    (broken / "trainer_state.json").write_text("{")
    with pytest.raises(ValueError):
        _ner(token_example, converted_dir, fixtures_root, output, "--overwrite_output_dir", "--resume_from_checkpoint",
             str(broken))
    assert (output / "model.safetensors").read_bytes() == first_weights
    shutil.rmtree(broken)
    _ner(token_example, converted_dir, fixtures_root, output, "--overwrite_output_dir", "--seed", "7",
         "--save_strategy", "no")
    assert (output / "model.safetensors").read_bytes() != first_weights
    assert not list(output.glob("checkpoint-*")) and not [p for p in os.listdir(tmp_path) if p.startswith(".")]


def test_a_rerun_resumes_only_a_checkpoint_of_its_own_run(token_example, converted_dir, fixtures_root, conll_text,
                                                           tmp_path, caplog):
    output = tmp_path / "ner"
    _ner(token_example, converted_dir, fixtures_root, output)
    record = json.loads((output / "checkpoint-2" / "hf_elmo_run.json").read_text())
    assert record["data"]["train_file"] == {"file": "conll2003.txt", "bytes": len(conll_text.encode()),
                                            "sha256": hashlib.sha256(conll_text.encode()).hexdigest()}
    assert "test_file" not in record["data"]  # what is scored at the end does not shape the run
    assert record["labels"] == ["O", "I-LOC", "I-ORG", "I-PER"] and record["training"]["seed"] == 42
    before = {p: p.read_bytes() for p in output.rglob("*") if p.is_file()}

    # Other data with the same number of labels: it resumed the old run at its last step and saved the old model
    # under the new labels. Now one line names what differs, and the folder is as it was.
    other = tmp_path / "other.conll"
    other.write_text(conll_text.replace("Ekeus", "Blix"), encoding="utf-8")
    digests = [hashlib.sha256(text.encode()).hexdigest()[:12] for text in (conll_text, other.read_text())]
    with pytest.raises(FileExistsError) as error:
        _ner(token_example, converted_dir, fixtures_root, output, "--train_file", str(other))
    assert str(error.value) == (
        f"{output / 'checkpoint-2'} is a checkpoint of another run (data.train_file.bytes: 286 then, 285 now; "
        "data.train_file.file: 'conll2003.txt' then, 'other.conll' now; data.train_file.sha256: "
        f"{digests[0]}… then, {digests[1]}… now); resuming it would "
        "continue that run, and nothing was touched. Pass --overwrite_output_dir to start afresh (the folder is "
        "replaced when this run has finished), or choose another --output_dir.")
    with pytest.raises(FileExistsError, match=r"\(training\.learning_rate: 0\.01 then, 0\.5 now\)"):
        _ner(token_example, converted_dir, fixtures_root, output, "--learning_rate", "0.5")
    with pytest.raises(FileExistsError, match=r"\(labels\.1: 'I-LOC' then, 'I-PER' now; labels\.3: 'I-PER' then"):
        _ner(token_example, converted_dir, fixtures_root, output, "--label_list", "O", "I-PER", "I-ORG", "I-LOC")
    # A checkpoint named on the command line must be this run's too.
    with pytest.raises(FileExistsError, match="; resuming it would continue that run, and nothing was touched. Resume "
                       "only a checkpoint of this run, or leave --resume_from_checkpoint out."):
        _ner(token_example, converted_dir, fixtures_root, tmp_path / "new", "--train_file", str(other),
             "--resume_from_checkpoint", str(output / "checkpoint-2"))
    assert not (tmp_path / "new").exists()

    # A checkpoint-N of the user's (no record): never taken for the Trainer's, never removed.
    users = output / "checkpoint-5"
    users.mkdir()
    (users / "model.ckpt").write_bytes(b"mine")
    with pytest.raises(FileExistsError, match=f"^{users} is not a checkpoint of this script's runs"):
        _ner(token_example, converted_dir, fixtures_root, output)
    assert (users / "model.ckpt").read_bytes() == b"mine"
    shutil.rmtree(users)
    assert {p: p.read_bytes() for p in output.rglob("*") if p.is_file()} == before

    # A checkpoint of this run that a kill cut short (its record written, trainer_state.json not): skipped with a line
    # naming it, the complete one resumed, and the short one left (this run did not make it).
    short = output / "checkpoint-3"
    shutil.copytree(output / "checkpoint-2", short)
    (short / "trainer_state.json").unlink()
    with caplog.at_level("INFO"):
        _ner(token_example, converted_dir, fixtures_root, output)
    assert f"Skipping {short}: incomplete (a run stopped while writing it)" in caplog.text
    assert f"Checkpoint found: resuming from {output / 'checkpoint-2'}" in caplog.text
    assert short.is_dir()


def test_early_stopping_stops_on_the_validation_rule_and_says_why(token_example, converted_dir, fixtures_root,
                                                                   tmp_path, caplog):
    with caplog.at_level("INFO"):
        _ner(token_example, converted_dir, fixtures_root, tmp_path / "ner", "--num_train_epochs", "30",
             "--early_stopping_patience", "2")
    stopped = re.search(r"Training stopped at step (\d+) of 60: early stopping: f1 did not improve for 2 "
                        r"evaluations in a row; the best checkpoint \(step (\d+), f1 ([\d.]+)\) is kept", caplog.text)
    assert stopped, caplog.text[-2000:]
    step, best = int(stopped.group(1)), int(stopped.group(2))
    # The rule: two evaluations (an epoch each, 2 steps) after the best one, and no more.
    assert step == best + 2 * 2 < 60
    evaluations = re.findall(r"Validation at epoch [\d.]+, step (\d+): loss [\d.]+, token_accuracy", caplog.text)
    assert [int(s) for s in evaluations] == list(range(2, step + 1, 2))
    # Without validation data it cannot work: one line, before training.
    fixture = str(fixtures_root / "data" / "conll2003.txt")
    with pytest.raises(DataFileError, match="^--early_stopping_patience needs validation data: give --validation_file"):
        token_example.main(["--model_name_or_path", str(converted_dir), "--train_file", fixture, "--output_dir",
                            str(tmp_path / "no-validation"), "--early_stopping_patience", "2"])


def test_default_training_length_stops_on_the_validation_rule(token_example, converted_dir, fixtures_root, tmp_path,
                                                               caplog):
    """Issue 43: without --num_train_epochs or --early_stopping_patience, a small slice (2 sentences, batch 1) may
    train the rule's 30 epochs, is scored every epoch, stops when entity F1 has not improved for HEAD_PATIENCE
    evaluations in a row, and keeps the best epoch; without validation data every epoch of the rule runs."""
    fixture = str(fixtures_root / "data" / "conll2003.txt")
    common = ["--model_name_or_path", str(converted_dir), "--train_file", fixture, "--per_device_train_batch_size",
              "1", "--disable_tqdm", "true"]
    with caplog.at_level("INFO"):
        metrics = token_example.main([*common, "--validation_file", fixture, "--output_dir", str(tmp_path / "ner")])
    assert ("Training length (the default; --num_train_epochs and --early_stopping_patience set it): up to 30 "
            "epochs: 2 training examples in batches of 1 (the default takes enough epochs for 2500 optimizer steps, "
            "at least 3 and at most 30), scored on the validation data every epoch; training stops when the score "
            "has not improved for 5 evaluations in a row, and the best epoch is kept") in caplog.text
    stopped = re.search(r"Training stopped at step (\d+) of 60: early stopping: f1 did not improve for 5 "
                        r"evaluations in a row; the best checkpoint \(step (\d+), f1 ([\d.]+)\) is kept", caplog.text)
    assert stopped, caplog.text[-2000:]
    step, best, best_f1 = int(stopped.group(1)), int(stopped.group(2)), float(stopped.group(3))
    assert step == best + 5 * 2 < 60  # five evaluations, an epoch (2 steps) each, after the best one
    evaluations = re.findall(r"Validation at epoch [\d.]+, step (\d+): loss [\d.]+, token_accuracy", caplog.text)
    assert [int(s) for s in evaluations] == list(range(2, step + 1, 2))
    assert round(metrics["validation"]["entities"]["overall"]["f1"], 4) == best_f1  # the kept model is the best epoch's
    state = json.loads((tmp_path / "ner" / f"checkpoint-{step}" / "trainer_state.json").read_text())
    assert state["best_global_step"] == best and state["max_steps"] == 60
    caplog.clear()
    with caplog.at_level("INFO"):
        token_example.main([*common, "--output_dir", str(tmp_path / "no-validation"), "--save_strategy", "no"])
    assert ("Training length (the default; --num_train_epochs and --early_stopping_patience set it): 30 epochs: 2 "
            "training examples in batches of 1 (the default takes enough epochs for 2500 optimizer steps, at least 3 "
            "and at most 30); every epoch runs and the last one is kept (stopping early needs validation data, "
            "scored when a checkpoint is saved)") in caplog.text
    assert "Training stopped at step 60 of 60: all 30 epochs ran" in caplog.text


def test_the_default_epochs_follow_the_measured_rule():
    from hf_elmo.finetuning import default_head_epochs

    # CoNLL-2003 at batch 32: the README's subsets and the full training set.
    assert [default_head_epochs(n, 32) for n in (16, 500, 1000, 2000, 5000, 14041)] == [30, 30, 30, 30, 16, 6]
    assert default_head_epochs(0, 32) == 30 and default_head_epochs(64000, 32) == 3  # 2,000 steps in 1 epoch


def test_output_folder_removes_only_what_the_failed_run_created(token_example, tmp_path):
    cli = load_example("finetuning_cli")
    record = {"data": {"train_file": {"file": "a.conll", "bytes": 1, "sha256": "0" * 64}}}
    output = tmp_path / "out"
    theirs = output / "checkpoint-4"  # a checkpoint of this run that an earlier kill cut short
    theirs.mkdir(parents=True)
    (theirs / "hf_elmo_run.json").write_text(json.dumps(record))

    def fails(folder):
        for step in (6, 8):
            os.makedirs(os.path.join(folder, f"checkpoint-{step}"))
            (Path(folder) / f"checkpoint-{step}" / "hf_elmo_run.json").write_text(json.dumps(record))
        (Path(folder) / "checkpoint-6" / "model.safetensors").write_bytes(b"")
        (Path(folder) / "checkpoint-6" / "trainer_state.json").write_text("{}")
        raise KeyboardInterrupt

    folder = cli.OutputFolder(str(output), overwrite=False, inputs=[], record=record)
    assert folder.resume_from is None and (tmp_path / ".out.lock").read_text() == f"pid {os.getpid()}\n"
    # A second run on the same folder meanwhile: one line, nothing touched.
    with pytest.raises(FileExistsError, match=f"^{output} is being written by another fine-tuning run \\(pid "
                       f"{os.getpid()}\\); nothing was touched. Wait for that run to end, or choose another "
                       "--output_dir.$"):
        cli.OutputFolder(str(output), overwrite=False, inputs=[], record=record)
    with pytest.raises(KeyboardInterrupt):
        folder.run(fails)
    folder.release()
    # checkpoint-8 (this run's, cut short) went; the complete checkpoint-6 and the earlier run's checkpoint-4 stay.
    assert sorted(os.listdir(output)) == ["checkpoint-4", "checkpoint-6"] and not (tmp_path / ".out.lock").exists()
    # A folder this run created, with no complete checkpoint in the end, goes whole.
    new = tmp_path / "new"
    folder = cli.OutputFolder(str(new), overwrite=False, inputs=[], record=record)
    with pytest.raises(ZeroDivisionError):
        folder.run(lambda path: (os.makedirs(os.path.join(path, "checkpoint-2")), 1 / 0))
    folder.release()
    assert not new.exists()


# ---------------------------------------------------------------------------------------------
# Bad input: clear errors naming the file and line
# ---------------------------------------------------------------------------------------------
def test_conll_reader_errors_name_file_and_line(tmp_path, conll_text):
    path = tmp_path / "bad.conll"
    path.write_text("-DOCSTART- -X- -X- O\n\nU.N. NNP I-NP I-ORG\nofficial NN\n", encoding="utf-8")
    with pytest.raises(DataFileError, match=rf"{path}:4: expected 4 whitespace-separated columns .* got 2: 'official NN'"):
        read_conll(path)
    path.write_text("U.N.\n", encoding="utf-8")
    with pytest.raises(DataFileError, match=rf"{path}:1: expected a word and a tag"):
        read_conll(path)
    path.write_text("-DOCSTART- -X- -X- O\n\n\n", encoding="utf-8")
    with pytest.raises(DataFileError, match=rf"{path}: no sentences found"):
        read_conll(path)
    path.write_text(conll_text, encoding="utf-8")
    with pytest.raises(DataFileError, match=rf"{path}:3: label_column=7 but the lines have 4 columns"):
        read_conll(path, label_column=7)
    with pytest.raises(FileNotFoundError, match="missing.conll: no such file"):
        read_conll(tmp_path / "missing.conll")

    sentences = read_conll(path, label_column=1)
    assert [s.words for s in sentences] == ["U.N. official Ekeus heads for Baghdad .".split(),
                                            "AI2 engineer Joel lives in Seattle .".split()]
    assert sentences[1].tags == ["NNP", "NN", "NNP", "VBZ", "IN", "NNP", "."]
    assert [s.where(2) for s in sentences] == [f"{path}:5", f"{path}:15"]


@pytest.mark.parametrize("reader", [read_conll, read_text_classification_file])
def test_readers_take_utf8_and_name_any_other_encoding(reader, tmp_path):
    text = "text\tlabel\nCafé\tB-LOC\n\n"
    path = tmp_path / "data.tsv"
    path.write_bytes(text.encode("utf-8-sig"))  # a UTF-8 byte-order mark (some editors write one) is dropped
    rows = reader(path)
    assert (rows[0].words[0] if reader is read_conll else rows[0].label) == ("text" if reader is read_conll else
                                                                            "B-LOC")
    path.write_bytes(text.encode("latin-1"))
    with pytest.raises(DataFileError, match=rf"^{path}:2: not UTF-8 text \(byte 3: b'\\xe9\\tB-'\); expected "
                                            "UTF-8. Convert the file, e.g. iconv -f LATIN1 -t UTF-8 for Latin-1.$"):
        reader(path)
    for encoding, name in (("utf-16", "UTF-16"), ("utf-32", "UTF-32"), ("utf-16-be", "UTF-16"),
                           ("utf-32-be", "UTF-32")):
        mark = {"utf-16-be": codecs.BOM_UTF16_BE, "utf-32-be": codecs.BOM_UTF32_BE}.get(encoding, b"")
        path.write_bytes(mark + text.encode(encoding))  # with its byte-order mark
        with pytest.raises(DataFileError, match=rf"^{path}: the file is {name} \(it starts with a {name} byte-order "
                                                rf"mark\); expected UTF-8. Convert it: iconv -f {name} -t UTF-8 {path} "
                                                "> NEW_FILE$"):
            reader(path)


def test_token_example_rejects_unknown_labels_and_reports_the_line(converted_dir, conll_text, tmp_path):
    train, dev = tmp_path / "train.conll", tmp_path / "dev.conll"
    train.write_text(conll_text, encoding="utf-8")
    dev.write_text(conll_text.replace("Baghdad\tNNP\tI-NP\tI-LOC", "Baghdad\tNNP\tI-NP\tI-MISC"), encoding="utf-8")
    result = subprocess.run(
        [sys.executable, os.path.join(REPO_ROOT, "examples", "run_token_classification.py"), "--model_name_or_path",
         str(converted_dir), "--train_file", str(train), "--validation_file", str(dev), "--output_dir",
         str(tmp_path / "out")],
        capture_output=True, text=True, cwd=REPO_ROOT, timeout=300,
        env={**os.environ, "PYTHONPATH": REPO_ROOT, "HF_HUB_OFFLINE": "1"},
    )
    assert result.returncode == 1
    assert (f"error: {dev}:8: label 'I-MISC' is not one of the model's labels ['I-LOC', 'I-ORG', 'I-PER', 'O']"
            in result.stderr)
    assert not (tmp_path / "out").exists()


def test_example_with_a_mistyped_model_folder_stops_at_once(conll_text, tmp_path):
    # A path that cannot be a Hub id fails before any Hub request (no retries), in one line.
    train = tmp_path / "train.conll"
    train.write_text(conll_text, encoding="utf-8")
    result = subprocess.run(
        [sys.executable, os.path.join(REPO_ROOT, "examples", "run_token_classification.py"), "--model_name_or_path",
         str(tmp_path / "elmo-fixtur"), "--train_file", str(train), "--output_dir", str(tmp_path / "out")],
        capture_output=True, text=True, cwd=REPO_ROOT, timeout=300,
        env={**os.environ, "PYTHONPATH": REPO_ROOT, "HF_HUB_OFFLINE": "0", "HF_ENDPOINT": "http://127.0.0.1:9"},
    )
    assert result.returncode == 1
    assert result.stderr.strip().splitlines()[-1] == (
        f"error: {tmp_path / 'elmo-fixtur'}: no such folder (and not a Hub repo id of the form owner/name).")
    assert "Traceback" not in result.stderr and not (tmp_path / "out").exists()


def test_token_example_rejects_word_and_tag_count_mismatches(token_example, converted_dir):
    tokenizer = AutoTokenizer.from_pretrained(converted_dir)
    label2id = {"O": 0, "I-PER": 1}
    row = TaggedSentence(["Joel", "lives", "here"], ["I-PER", "O"], "conll2003[train]", 41, from_file=False)
    with pytest.raises(DataFileError, match=r"conll2003\[train\] row 41 word 0: the sentence has 3 words but 2 tags"):
        token_example.encode(tokenizer, [row], label2id)
    row.tags.append("I-LOC")
    with pytest.raises(DataFileError, match=r"conll2003\[train\] row 41 word 2: label 'I-LOC' is not one of"):
        token_example.encode(tokenizer, [row], label2id)
    row.tags[2] = "O"
    assert token_example.encode(tokenizer, [row], label2id)[0]["labels"] == [1, 0, 0]


def test_text_file_reader_errors(tmp_path):
    path = tmp_path / "data.tsv"
    path.write_text("", encoding="utf-8")
    with pytest.raises(DataFileError, match=rf"{path}: the file is empty"):
        read_text_classification_file(path)
    path.write_text("sentence\tlabel\n", encoding="utf-8")
    with pytest.raises(DataFileError, match=r"data.tsv:1: no column named 'text' in the header \['sentence', 'label'\]"):
        read_text_classification_file(path)
    with pytest.raises(DataFileError, match=rf"{path}: no rows after the header"):
        read_text_classification_file(path, text_column="sentence")
    path.write_text("text\tlabel\nGood film .\tpos\nBad\tfilm\tneg\n", encoding="utf-8")
    with pytest.raises(DataFileError, match=rf"{path}:3: expected 2 fields as in the header, got 3"):
        read_text_classification_file(path)
    path.write_text("text\tlabel\nGood film .\tpos\nBad film .\t \n", encoding="utf-8")
    with pytest.raises(DataFileError, match=rf"{path}:3: the 'label' field is empty"):
        read_text_classification_file(path)
    csv_path = tmp_path / "data.csv"
    csv_path.write_text('label,text\npos,"Good, really good."\n\nneg,"Two\nlines"\n', encoding="utf-8")
    rows = read_text_classification_file(csv_path)
    assert [(r.text, r.label, r.where()) for r in rows] == [
        ("Good, really good.", "pos", f"{csv_path}:2"), ("Two\nlines", "neg", f"{csv_path}:5")]


def test_sequence_example_rejects_a_single_label(sequence_example, converted_dir, tmp_path):
    path = tmp_path / "one.csv"
    path.write_text("text,label\nGood film .,pos\nGreat film .,pos\n", encoding="utf-8")
    with pytest.raises(DataFileError, match=rf"^{path}: a single label \['pos'\]; a classifier needs at least two.$"):
        sequence_example.main(["--model_name_or_path", str(converted_dir), "--train_file", str(path),
                               "--output_dir", str(tmp_path / "out")])


# ---------------------------------------------------------------------------------------------
# Metrics
# ---------------------------------------------------------------------------------------------
def test_entity_scores_follow_conlleval_chunk_rules():
    def found(tags):
        # Score the tags against themselves: every entity is found once, so the supports count the entities.
        return {kind: s["support"] for kind, s in entity_scores([tags], [tags]).items()}

    # IOB1 (CoNLL-2003): I- starts an entity after O or another type; B- only separates two same-type entities.
    assert found(["I-PER", "I-PER", "I-LOC", "O", "I-ORG", "B-ORG"]) == {"LOC": 1, "ORG": 2, "PER": 1, "overall": 4}
    # IOB2 and IOBES.
    assert found(["B-PER", "I-PER", "B-PER", "O", "I-LOC"]) == {"LOC": 1, "PER": 2, "overall": 3}
    assert found(["S-PER", "B-LOC", "I-LOC", "E-LOC", "E-LOC"]) == {"LOC": 2, "PER": 1, "overall": 3}
    assert found(["O", "O"]) == {"overall": 0}
    # A boundary error is a miss, not a partial hit: I-LOC I-LOC predicted as one entity then another.
    scores = entity_scores([["I-LOC", "I-LOC"]], [["I-LOC", "B-LOC"]])
    assert scores["LOC"] == {"precision": 0.0, "recall": 0.0, "f1": 0.0, "support": 1}


def test_entity_scores_refuse_tags_without_a_chunk_prefix():
    # seqeval would read POS tags such as NNP as chunks of type "NP"; the example reports token accuracy instead.
    assert has_chunk_tags(["O", "B-PER", "I-PER", "E-LOC", "S-MISC"])
    assert not has_chunk_tags(["NNP", "VBZ", "O"]) and not has_chunk_tags(["PER"]) and not has_chunk_tags(["B-"])
    with pytest.raises(ValueError, match=r"tags \['LOC', 'PER'\] are neither O nor B-/I-/E-/S- plus a type"):
        entity_scores([["PER", "O"]], [["LOC", "O"]])


def test_entity_scores_exact_values():
    gold = [["I-PER", "I-PER", "O", "I-LOC"], ["B-ORG", "I-ORG", "O", "B-PER"]]
    predicted = [["I-PER", "I-PER", "O", "I-ORG"], ["B-ORG", "O", "O", "B-PER"]]
    scores = entity_scores(gold, predicted)
    # Gold: PER x2, LOC, ORG. Predicted: PER x2 (both right), ORG (wrong type at 3), ORG (too short).
    assert scores["PER"] == {"precision": 1.0, "recall": 1.0, "f1": 1.0, "support": 2}
    assert scores["LOC"] == {"precision": 0.0, "recall": 0.0, "f1": 0.0, "support": 1}
    assert scores["ORG"] == {"precision": 0.0, "recall": 0.0, "f1": 0.0, "support": 1}
    assert scores["overall"] == {"precision": 0.5, "recall": 0.5, "f1": 0.5, "support": 4}
    with pytest.raises(ValueError, match="sentence 1 has 4 gold tags but 3 predicted"):
        entity_scores(gold, [predicted[0], predicted[1][:3]])


def test_token_example_reports_token_accuracy_alone_for_pos_tags(token_example, caplog):
    gold, predicted = [["NNP", "VBZ", "."]], [["NNP", "NN", "."]]
    report = token_example.evaluation_report(gold, predicted, chunk_tags=False)
    assert report == {"token_accuracy": pytest.approx(2 / 3)}
    with caplog.at_level("INFO", logger="run_token_classification"):
        token_example.log_report("validation", report)
    assert [r.getMessage() for r in caplog.records] == ["validation: token accuracy 0.6667"]


def test_classification_scores_exact_values():
    scores = classification_scores(["pos", "pos", "neg", "neg"], ["pos", "neg", "neg", "neg"])
    assert scores["accuracy"] == 0.75
    assert scores["classes"]["pos"] == {"precision": 1.0, "recall": 0.5, "f1": pytest.approx(2 / 3), "support": 2}
    assert scores["classes"]["neg"] == {"precision": pytest.approx(2 / 3), "recall": 1.0, "f1": 0.8, "support": 2}
    assert scores["macro"]["f1"] == pytest.approx((2 / 3 + 0.8) / 2)


# ---------------------------------------------------------------------------------------------
# `datasets` input (a local folder, as load_dataset reads it; a Hub name goes through the same call)
# ---------------------------------------------------------------------------------------------
def test_token_example_reads_a_datasets_folder(token_example, converted_dir, fixtures_root, tmp_path):
    datasets = pytest.importorskip("datasets")
    sentences = read_conll(fixtures_root / "data" / "conll2003.txt")
    names = ["O", "I-PER", "I-ORG", "I-LOC"]
    features = datasets.Features({"tokens": datasets.Sequence(datasets.Value("string")),
                                  "ner_tags": datasets.Sequence(datasets.ClassLabel(names=names))})
    folder = tmp_path / "conll-dataset"
    folder.mkdir()
    table = {"tokens": [s.words for s in sentences], "ner_tags": [[names.index(t) for t in s.tags] for s in sentences]}
    for split in ("train", "validation"):
        datasets.Dataset.from_dict(table, features=features).to_parquet(str(folder / f"{split}.parquet"))
    metrics = token_example.main([
        "--model_name_or_path", str(converted_dir), "--dataset_name", str(folder), "--output_dir",
        str(tmp_path / "out"), "--num_train_epochs", "2", "--per_device_train_batch_size", "2", "--learning_rate",
        "0.05", "--mix_dropout", "0", "--disable_tqdm", "true",
    ])
    assert metrics["task"] == "token-classification"
    assert metrics["validation"]["entities"]["overall"]["support"] == 6
    # The ClassLabel ids were turned back into their names.
    assert json.loads((tmp_path / "out" / "labels.json").read_text())["id2label"] == {
        "0": "O", "1": "I-LOC", "2": "I-ORG", "3": "I-PER"}


def test_sequence_example_reads_a_datasets_folder(sequence_example, converted_dir, tmp_path):
    datasets = pytest.importorskip("datasets")
    features = datasets.Features({"sentence": datasets.Value("string"),
                                  "label": datasets.ClassLabel(names=["negative", "positive"])})
    folder = tmp_path / "reviews"
    folder.mkdir()
    table = {"sentence": ["What a World Cup .", "Don 't !", "Even so , Democrats slammed Bush ."], "label": [1, 0, 0]}
    datasets.Dataset.from_dict(table, features=features).to_parquet(str(folder / "train.parquet"))
    metrics = sequence_example.main([
        "--model_name_or_path", str(converted_dir), "--dataset_name", str(folder), "--text_column_name", "sentence",
        "--output_dir", str(tmp_path / "out"), "--num_train_epochs", "1", "--per_device_train_batch_size", "3",
        "--task_name", "reviews", "--disable_tqdm", "true",
    ])
    # The ClassLabel ids were turned back into their names.
    assert json.loads((tmp_path / "out" / "labels.json").read_text())["id2label"] == {"0": "negative", "1": "positive"}
    assert metrics["task"] == "reviews" and "validation" not in metrics


EXAMPLE_WITH_FILE_SIZE_LIMIT = """
import os, resource, runpy, sys
resource.setrlimit(resource.RLIMIT_FSIZE, (65536, 65536))  # as a full disk: a write fails (Python ignores SIGXFSZ)
sys.argv = sys.argv[1:]
sys.path.insert(0, os.path.dirname(sys.argv[0]))  # as `python SCRIPT` would
runpy.run_path(sys.argv[0], run_name="__main__")
"""


def test_token_example_on_a_full_disk_is_one_line(converted_dir, conll_text, tmp_path):
    (tmp_path / "train.conll").write_text(conll_text, encoding="utf-8")
    result = subprocess.run(
        [sys.executable, "-c", EXAMPLE_WITH_FILE_SIZE_LIMIT, os.path.join(REPO_ROOT, "examples",
         "run_token_classification.py"), "--model_name_or_path", str(converted_dir), "--train_file",
         str(tmp_path / "train.conll"), "--output_dir", str(tmp_path / "out"), "--num_train_epochs", "1"],
        capture_output=True, text=True, cwd=REPO_ROOT, timeout=300,
        env={**os.environ, "PYTHONPATH": REPO_ROOT, "HF_HUB_OFFLINE": "1"},
    )
    assert result.returncode == 1, result.stderr[-3000:]
    assert "Traceback" not in result.stderr
    errors = re.findall(r"error: .*", result.stderr)  # the progress bar may share its line
    assert len(errors) == 1, result.stderr[-3000:]
    assert errors[0].startswith(f"error: cannot write {tmp_path / 'out'}: the disk is full or a file-size limit was "
                                "reached (")
    assert errors[0].endswith("; complete checkpoints are kept. Free some space, or write elsewhere.")
    # The folder this run created held no complete checkpoint: nothing is left.
    assert not (tmp_path / "out").exists()


def test_options_files_and_unknown_options_are_checked_as_the_command_line_is(tmp_path, capsys):
    import finetuning_cli

    script = load_example("run_token_classification")
    parse = lambda argv: finetuning_cli.parse_arguments(  # noqa: E731
        script.TokenDataArguments, script.TokenModelArguments, argv=argv)
    required = {"model_name_or_path": "m", "train_file": "t.txt", "output_dir": str(tmp_path / "o")}
    # "false" for a flag is false (it built a CRF head and stored the string), a list gives several values.
    (tmp_path / "ok.json").write_text(json.dumps({**required, "head_crf": "false", "label_list": ["O", "B-X"],
                                                  "num_train_epochs": 4, "seed": None}))
    model, data, training = parse([str(tmp_path / "ok.json")])
    assert model.head_crf is False and data.label_list == ["O", "B-X"] and training.num_train_epochs == 4.0
    cases = {
        "unknown.json": (json.dumps({**required, "bogus": 3}), "unknown.json: unknown options bogus"),
        "list.json": ("[1, 2]", "list.json: expected a JSON object of options and values, got a JSON list"),
        "type.json": (json.dumps({**required, "num_train_epochs": "abc"}),
                      "argument --num_train_epochs/--num-train-epochs: invalid float value: 'abc'"),
        "broken.json": ("{bad", "broken.json: not valid JSON (line 1, column 2: Expecting property name enclosed in "
                                "double quotes)"),
    }
    for name, (text, message) in cases.items():
        (tmp_path / name).write_text(text)
        with pytest.raises(SystemExit) as exit_info:
            parse([str(tmp_path / name)])
        assert exit_info.value.code == 2 and message in capsys.readouterr().err, name
    for argv, message in (([str(tmp_path / "nope.json")], "nope.json: no such options file"),
                          (["--model_name_or_path", "m", "--train_file", "t", "--output_dir", "o", "--bogus", "1"],
                           "error: unrecognized arguments: --bogus 1"),
                          # The training length's overrides: epochs above 0, a patience of 0 or more (0: off).
                          (["--model_name_or_path", "m", "--train_file", "t", "--output_dir", "o",
                            "--num_train_epochs", "0"], "error: --num_train_epochs must be > 0, got 0"),
                          (["--model_name_or_path", "m", "--train_file", "t", "--output_dir", "o",
                            "--early_stopping_patience", "-1"],
                           "error: --early_stopping_patience must be >= 0 (0: off), got -1")):
        with pytest.raises(SystemExit) as exit_info:
            parse(argv)
        assert exit_info.value.code == 2 and message in capsys.readouterr().err
    assert sorted(os.listdir(tmp_path)) == sorted([*cases, "ok.json"])  # nothing written


def test_trackers_optimizers_and_settings_the_trainer_refuses_are_usage_errors(tmp_path, capsys):
    # The Trainer found these when it was built or at its first step, after the data stage, with a traceback.
    import importlib.util

    import torch

    import finetuning_cli

    script = load_example("run_token_classification")
    required = ["--model_name_or_path", "m", "--train_file", "t", "--output_dir", str(tmp_path / "o")]
    cases = [(["--report_to", "bogus"], "error: --report_to bogus: bogus is not supported, only azure_ml, ")]
    if importlib.util.find_spec("wandb") is None:
        cases.append((["--report_to", "wandb"],
                      "error: --report_to wandb: WandbCallback requires wandb to be installed. Run `pip install wandb`."))
    if importlib.util.find_spec("bitsandbytes") is None:
        cases.append((["--optim", "adamw_bnb_8bit"], "error: --optim adamw_bnb_8bit: You need to install "
                                                     "`bitsandbytes` in order to use bitsandbytes optimizers"))
    if not torch.cuda.is_available():  # TrainingArguments' own check, a ValueError from the parser
        cases.append((["--bf16"], "error: Your setup doesn't support bf16/gpu. You need to assign use_cpu"))
    for extra, message in cases:
        with pytest.raises(SystemExit) as exit_info:
            finetuning_cli.parse_arguments(script.TokenDataArguments, script.TokenModelArguments,
                                           argv=required + extra)
        assert exit_info.value.code == 2 and message in capsys.readouterr().err, extra
    assert not (tmp_path / "o").exists()


@pytest.mark.parametrize("option, value, message", [
    ("--learning_rate", "-1", "--learning_rate must be a non-negative number, got -1.0"),
    ("--weight_decay", "-0.5", "--weight_decay must be a non-negative number, got -0.5"),
    ("--max_grad_norm", "nan", "--max_grad_norm must be a non-negative number, got nan"),
    ("--per_device_train_batch_size", "0", "--per_device_train_batch_size must be >= 1, got 0"),
    ("--gradient_accumulation_steps", "0", "--gradient_accumulation_steps must be >= 1, got 0"),
    ("--mix_dropout", "1.5", "--mix_dropout must be a probability in [0, 1), got 1.5."),
    ("--mix_l2_coef", "-1", "--mix_l2_coef must be a number >= 0, got -1.0."),
    ("--head_lstm_layers", "0", "--head_lstm_layers must be a positive integer, got 0."),
])
def test_numbers_that_fail_mid_run_or_pass_silently_are_usage_errors(option, value, message, tmp_path, capsys):
    # Each was a traceback once the run had started (torch's optimizer, DataLoader or modules; a ZeroDivisionError
    # for 0 accumulation steps), or was taken without a word (a NaN norm limit turns clipping off).
    import finetuning_cli

    script = load_example("run_token_classification")
    with pytest.raises(SystemExit) as exit_info:
        finetuning_cli.parse_arguments(script.TokenDataArguments, script.TokenModelArguments, argv=[
            "--model_name_or_path", "m", "--train_file", "t", "--output_dir", str(tmp_path / "o"), option, value])
    assert exit_info.value.code == 2 and f"error: {message}" in capsys.readouterr().err
    assert not (tmp_path / "o").exists()


def test_do_predict_with_only_a_test_file_predicts(token_example, converted_dir, fixtures_root, tmp_path):
    # TrainingArguments turns do_eval on with our per-epoch evaluation; this was refused for lack of validation data.
    output = tmp_path / "predicted"
    token_example.main([
        "--model_name_or_path", str(converted_dir), "--test_file", str(fixtures_root / "data" / "conll2003.txt"),
        "--do_predict", "--label_list", "O", "B-PER", "I-PER", "B-LOC", "I-LOC", "B-ORG", "I-ORG", "B-MISC", "I-MISC",
        "--output_dir", str(output), "--report_to", "none",
    ])
    assert (output / "predictions.txt").read_text().count("\n") == 2  # the fixture's two sentences
    assert (output / "predict_results.json").is_file() and not (output / "eval_results.json").exists()
    assert not (output / "train_results.json").exists()


def test_a_missing_optional_package_is_found_before_training(token_example, converted_dir, fixtures_root, tmp_path,
                                                              monkeypatch, capsys):
    import importlib.util

    from hf_elmo.cli import run_reporting_errors

    # As without the examples extra: seqeval (and matplotlib) absent. It was found after the whole training.
    real = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec",
                        lambda name, *a: None if name in ("seqeval", "matplotlib") else real(name, *a))
    conll = str(fixtures_root / "data" / "conll2003.txt")
    output = tmp_path / "out"
    code = run_reporting_errors(lambda: token_example.main([
        "--model_name_or_path", str(converted_dir), "--train_file", conll, "--validation_file", conll,
        "--output_dir", str(output), "--report_to", "none"]), "fine-tuning")
    assert code == 1
    assert capsys.readouterr().err.strip().splitlines()[-1] == (
        'error: this run needs matplotlib, seqeval, not installed: pip install "hf-elmo[examples]"')
    assert not output.exists()


def test_head_crf_with_iob1_tags_is_refused_before_training(token_example, converted_dir, conll_text, tmp_path,
                                                            capsys):
    from hf_elmo.cli import run_reporting_errors

    # The fixture is IOB1 (each entity here starts with I-): IOB1 in the test file only was found after the whole
    # training. The training file is its IOB2 form (every entity here is one word, so each I- becomes B-).
    iob1 = tmp_path / "test.conll"
    iob1.write_text(conll_text, encoding="utf-8")
    first = next(n for n, line in enumerate(conll_text.splitlines(), 1) if "\tI-" in line)
    train = tmp_path / "train.conll"
    train.write_text(conll_text.replace("\tI-", "\tB-"), encoding="utf-8")
    output = tmp_path / "out"
    code = run_reporting_errors(lambda: token_example.main([
        "--model_name_or_path", str(converted_dir), "--train_file", str(train), "--test_file", str(iob1),
        "--head_crf", "--label_list", "O", "B-ORG", "I-ORG", "B-PER", "I-PER", "B-LOC", "I-LOC",
        "--output_dir", str(output), "--report_to", "none"]), "fine-tuning")
    assert code == 1
    message = capsys.readouterr().err.strip().splitlines()[-1]
    assert message.startswith(f"error: {iob1}:{first}: I-") and "which IOB2 forbids" in message, message
    assert "these look like IOB1 tags. Convert them to IOB2, or train without --head_crf." in message
    assert not output.exists()


class _Planted:
    """A pickle that would create a file if unpickled."""

    def __init__(self, path: str):
        self.path = path

    def __reduce__(self):
        return (open, (self.path, "w"))


def test_a_pickle_planted_in_a_trainer_checkpoint_is_one_line_and_never_runs(token_example, converted_dir,
                                                                             fixtures_root, tmp_path):
    import torch

    output = tmp_path / "ner"
    _ner(token_example, converted_dir, fixtures_root, output)
    ran = tmp_path / "payload-ran"
    torch.save({"state": _Planted(str(ran))}, output / "checkpoint-2" / "optimizer.pt")
    # The same command resumes from the run's checkpoint: torch's weights-only loader refuses the file, and the
    # run says so in one line instead of a 67-line traceback advising weights_only=False.
    with pytest.raises(DataFileError) as error:
        _ner(token_example, converted_dir, fixtures_root, output)
    assert str(error.value) == (
        f"--resume: a file of {output / 'checkpoint-2'} holds more than tensors and plain values, and loading it would "
        "mean unpickling it, which can run any code in the file: the checkpoint is not trusted, and nothing of it "
        f"was loaded. Remove {output / 'checkpoint-2'} to resume from an earlier checkpoint, or pass "
        "--overwrite_output_dir to start afresh.")
    assert "weights_only=False" not in str(error.value) and not ran.exists()


def test_predictions_keep_the_file_order_when_training_batches_are_grouped_by_length(token_example, converted_dir,
                                                                                  tmp_path):
    # Transformers 5 orders evaluation by length too under train_sampling_strategy="group_by_length", so predict()
    # returned the test sentences longest first, and predictions.txt paired them with the wrong sentences.
    sentences = [["Peter", "Blackburn"], ["EU", "rejects", "German", "call", "to", "boycott", "lamb"],
                 ["BRUSSELS", "1996-08-22", "The", "Commission"]]
    test_file = tmp_path / "test.conll"
    test_file.write_text("\n".join("\n".join(f"{word} O" for word in words) + "\n" for words in sentences),
                         encoding="utf-8")
    output = tmp_path / "predicted"
    token_example.main([
        "--model_name_or_path", str(converted_dir), "--test_file", str(test_file), "--do_predict",
        "--label_list", "O", "B-PER", "I-PER", "--train_sampling_strategy", "group_by_length",
        "--output_dir", str(output), "--report_to", "none",
    ])
    lines = (output / "predictions.txt").read_text().splitlines()
    assert [len(line.split()) for line in lines] == [2, 7, 4]


def test_every_recorded_training_argument_is_one_the_trainer_has(tmp_path):
    # A name TrainingArguments no longer has (Transformers 5 replaced group_by_length with train_sampling_strategy)
    # was recorded as None, so a resumed run could not see that it had changed.
    from finetuning_cli import TRAINING_ARGUMENTS_RECORDED, ElmoTrainingArguments  # beside the examples

    arguments = ElmoTrainingArguments(output_dir=str(tmp_path))
    assert [name for name in TRAINING_ARGUMENTS_RECORDED if not hasattr(arguments, name)] == []
    assert "train_sampling_strategy" in TRAINING_ARGUMENTS_RECORDED


IOB2_TRAIN = "EU B-ORG\nrejects O\nGerman B-MISC\ncall O\n\nPeter B-PER\nBlackburn I-PER\n"


def test_a_fine_tuned_head_keeps_its_own_options_unless_given(token_example, converted_dir, tmp_path):
    # The head options' defaults (a 128-unit biLSTM, no CRF, no layer norm) rebuilt a fine-tuned head another way
    # when it was only used to predict: a size-mismatch traceback, or silently no CRF and no layer norm.
    data = tmp_path / "train.conll"
    data.write_text(IOB2_TRAIN, encoding="utf-8")
    trained, predicted = tmp_path / "trained", tmp_path / "predicted"
    token_example.main([
        "--model_name_or_path", str(converted_dir), "--train_file", str(data), "--test_file", str(data),
        "--output_dir", str(trained), "--head_crf", "--mix_layer_norm", "--head_lstm_dim", "16", "--mix_dropout",
        "0.1", "--num_train_epochs", "2", "--report_to", "none",
    ])
    token_example.main([
        "--model_name_or_path", str(trained), "--test_file", str(data), "--do_predict", "--output_dir",
        str(predicted), "--report_to", "none",
    ])
    head = ("head_crf", "mix_layer_norm", "head_lstm_dim", "head_lstm_layers", "mix_dropout", "mix_l2_coef")
    config = json.loads((predicted / "config.json").read_text())
    assert {key: config[key] for key in head} == {"head_crf": True, "mix_layer_norm": True, "head_lstm_dim": 16,
                                                  "head_lstm_layers": 1, "mix_dropout": 0.1, "mix_l2_coef": 0.0}
    assert (predicted / "predictions.txt").read_text() == (trained / "predictions.txt").read_text()
    assert (predicted / "model.safetensors").read_bytes() == (trained / "model.safetensors").read_bytes()
    # An option given still decides: training the fine-tuned head further without its dropout.
    again = tmp_path / "again"
    token_example.main([
        "--model_name_or_path", str(trained), "--train_file", str(data), "--output_dir", str(again),
        "--mix_dropout", "0", "--num_train_epochs", "1", "--report_to", "none",
    ])
    config = json.loads((again / "config.json").read_text())
    assert (config["mix_dropout"], config["head_crf"], config["head_lstm_dim"]) == (0.0, True, 16)

    # The Trainer's label smoother takes the labels away from the model and scores its per-word outputs with a
    # softmax: a CRF head then trained on its max-marginals, not on its sentence likelihood, and said nothing.
    for model, where in ((converted_dir, "(--head_crf)"), (trained, f"({trained} has one)")):
        with pytest.raises(DataFileError) as error:
            token_example.main([
                "--model_name_or_path", str(model), "--train_file", str(data), "--output_dir", str(tmp_path / "ls"),
                "--label_smoothing_factor", "0.1", *(["--head_crf"] if model == converted_dir else []),
            ])
        assert str(error.value) == ("--label_smoothing_factor smooths a per-word softmax, and a CRF head "
                                    f"{where} is trained on whole tag sequences instead: drop one of the two.")
    assert not (tmp_path / "ls").exists()
