"""Model cards and `hf-elmo publish`: offline, with the Hub's network calls replaced at the HfApi boundary."""

import hashlib
import json
import os
import shutil
import subprocess
import sys
import tempfile

import pytest
import torch
from huggingface_hub import CommitInfo, CommitOperationAdd, HfApi, ModelCard, RepoUrl, constants
from safetensors.torch import load_file

from hf_elmo import ElmoConfig, ElmoForTokenClassification, ElmoModel, ElmoTokenizer
from hf_elmo.cli import main
from hf_elmo.model_card import BILM_TF_FIXTURE_WEIGHTS_SHA256, converted_model_card, elmo_model_card
from hf_elmo.publish import PublishError, publish

from example_scripts import load_example
from remote_code import run_without_hf_elmo


REPO_ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
# What `publish` uploads for a converted folder: re-saved model and tokenizer, the code for trust_remote_code,
# the converter's record of its sources, and the generated card.
PUBLISHED_FILES = sorted([
    "README.md", "bilm_tf_source.json", "config.json", "configuration_elmo.py", "model.safetensors",
    "modeling_elmo.py", "pipeline_elmo.py", "tokenization_elmo.py", "tokenizer_config.json", "vocab.txt",
])


def sha256(path) -> str:
    return hashlib.sha256(open(path, "rb").read()).hexdigest()


# ---------------------------------------------------------------------------------------------- cards
def test_converted_fixture_card_metadata_and_figures(converted_dir, elmo_fixture):
    card = ModelCard.load(converted_dir / "README.md")  # written by the converter
    meta = card.data.to_dict()
    assert sha256(elmo_fixture / "lm_weights.hdf5") == BILM_TF_FIXTURE_WEIGHTS_SHA256
    assert meta["library_name"] == "transformers" and meta["pipeline_tag"] == "feature-extraction"
    assert meta["license"] == "other"
    assert meta["tags"] == ["elmo", "bilm", "hf_elmo", "custom_code", "bilm-tf"]
    assert meta["hf_elmo"] == {
        "architecture": "ElmoModel",
        "shape": "2x64_16_124cnn_2xhighway",
        "hidden_size": 32,
        "num_output_layers": 3,
        "stateless": True,
        "converted_from_bilm_tf": True,
        "source_sha256": {
            "options": sha256(elmo_fixture / "options.json"),
            "weights": BILM_TF_FIXTURE_WEIGHTS_SHA256,
            "vocab": sha256(elmo_fixture / "vocab_test.txt"),
        },
        "verification": {
            "compared_with_bilm_tf_outputs": True,
            "max_abs_diff": {"token_layer": 7.2e-07, "top_layer_batch_0_zero_state": 9.6e-07,
                             "top_layer_10_batches_state_carried": 9.6e-07},
        },
    }
    text = card.text
    assert "| top layer, all 10 batches, LSTM state carried | 9.6e-07 |" in text
    assert f"| weights | `lm_weights.hdf5` | `{BILM_TF_FIXTURE_WEIGHTS_SHA256}` |" in text
    assert "layer 0 is the context-free token layer (char CNN) duplicated as `[x; x]`" in text
    assert "`ElmoScalarMix`" in text and "gamma * sum_j softmax(w)_j * layer_j" in text
    assert "lstm_state=previous.lstm_state" in text
    assert 'AutoModel.from_pretrained("PATH_OR_REPO_ID", trust_remote_code=True)' in text


def test_card_of_other_converted_weights_says_what_was_verified(converted_dir):
    config = ElmoConfig.from_pretrained(converted_dir)
    checksums = {"options": {"file": "options.json", "sha256": "a" * 64},
                 "weights": {"file": "weights.hdf5", "sha256": "b" * 64}}
    card = converted_model_card(config, checksums)
    assert card.data.hf_elmo["verification"]["compared_with_bilm_tf_outputs"] is False
    assert card.data.hf_elmo["source_sha256"] == {"options": "a" * 64, "weights": "b" * 64}
    assert "bilm-tf published no outputs for these weights, so they were not compared with bilm-tf" in card.text
    assert "reproduces bilm-tf's file layout bit for bit" in card.text


def test_card_of_a_head_names_its_task_and_pipeline(converted_dir):
    config = ElmoConfig.from_pretrained(converted_dir, architectures=["ElmoForTokenClassification"])
    card = elmo_model_card(config, repo_id="someone/elmo-ner", license="apache-2.0")
    assert card.data.pipeline_tag == "token-classification" and card.data.license == "apache-2.0"
    assert "bilm-tf" not in card.data.tags and "source_sha256" not in card.data.hf_elmo
    assert ('pipeline("token-classification", model="someone/elmo-ner", trust_remote_code=True, '
            'aggregation_strategy="simple")') in card.text
    assert card.data.hf_elmo["labels"] == ["LABEL_0", "LABEL_1"] and "| 1 | `LABEL_1` |" in card.text
    assert "Its biLM was not converted from bilm-tf files." in card.text
    assert "This model is published under `apache-2.0`." in card.text


# ---------------------------------------------------------------------------------------------- publish
@pytest.fixture
def hub(monkeypatch):
    """Publishing allowed (offline mode off, a token set); HfApi's network calls are replaced and recorded."""
    monkeypatch.setattr(constants, "HF_HUB_OFFLINE", False)
    monkeypatch.setenv("HF_TOKEN", "hf_not_a_real_token")
    calls = []

    def create_repo(self, repo_id, **kwargs):
        calls.append(("create_repo", repo_id, kwargs))
        return RepoUrl(f"https://huggingface.co/{repo_id}")

    def create_commit(self, repo_id, operations, **kwargs):
        # The files must exist while the commit is being made: read them now.
        uploaded = {}
        for operation in operations:
            assert isinstance(operation, CommitOperationAdd)
            with open(operation.path_or_fileobj, "rb") as f:
                uploaded[operation.path_in_repo] = f.read()
        calls.append(("create_commit", repo_id, kwargs, uploaded))
        pr_url = f"https://huggingface.co/{repo_id}/discussions/1" if kwargs.get("create_pr") else None
        return CommitInfo(commit_url=f"https://huggingface.co/{repo_id}/commit/{'0' * 40}",
                          commit_message=kwargs["commit_message"], commit_description="", oid="0" * 40, pr_url=pr_url)

    monkeypatch.setattr(HfApi, "create_repo", create_repo)
    monkeypatch.setattr(HfApi, "create_commit", create_commit)
    return calls


def test_publish_uploads_exactly_the_prepared_folder(converted_dir, hub, tmp_path, capsys):
    assert main(["publish", str(converted_dir), "--repo-id", "someone/elmo-fixture", "--private", "--create-pr"]) == 0
    assert [call[0] for call in hub] == ["create_repo", "create_commit"]
    _, repo_id, repo_kwargs = hub[0]
    assert repo_id == "someone/elmo-fixture"
    assert repo_kwargs == {"private": True, "exist_ok": True, "repo_type": "model"}
    _, repo_id, commit_kwargs, uploaded = hub[1]
    assert repo_id == "someone/elmo-fixture"
    assert commit_kwargs == {"commit_message": "Upload ELMo model with hf_elmo", "create_pr": True,
                             "repo_type": "model"}
    assert sorted(uploaded) == PUBLISHED_FILES
    published = f"Published {len(PUBLISHED_FILES)} files to someone/elmo-fixture"
    assert f"{published}: https://huggingface.co/someone/elmo-fixture/discussions/1" in capsys.readouterr().out

    (tmp_path / "up").mkdir()
    for name, content in uploaded.items():
        (tmp_path / "up" / name).write_bytes(content)
    # Real files: the same weights, the same code, the converter's record, a card made for this repo.
    original = load_file(converted_dir / "model.safetensors")
    published = load_file(tmp_path / "up" / "model.safetensors")
    assert original.keys() == published.keys() and all(torch.equal(original[k], published[k]) for k in original)
    for name in ("modeling_elmo.py", "bilm_tf_source.json", "vocab.txt"):
        assert uploaded[name] == (converted_dir / name).read_bytes()
    config = json.loads(uploaded["config.json"])
    assert config["auto_map"]["AutoModel"] == "modeling_elmo.ElmoModel"
    card = ModelCard.load(tmp_path / "up" / "README.md")
    assert card.data.library_name == "transformers" and card.data.hf_elmo["converted_from_bilm_tf"] is True
    assert 'AutoTokenizer.from_pretrained("someone/elmo-fixture", trust_remote_code=True)' in card.text
    assert ElmoTokenizer.from_pretrained(tmp_path / "up").word_vocab_size == 458


def test_publish_dry_run_touches_no_network_and_leaves_nothing(converted_dir, tmp_path, capsys, monkeypatch):
    def no_network(*args, **kwargs):
        raise AssertionError("a dry run must not call the Hub")

    monkeypatch.setattr(HfApi, "create_repo", no_network)
    monkeypatch.setattr(HfApi, "create_commit", no_network)
    # Training state and other weight formats beside the model are not published.
    folder = tmp_path / "trained"
    shutil.copytree(converted_dir, folder)
    for name in ("optimizer.pt", "trainer_state.json", "pytorch_model.bin"):
        (folder / name).write_bytes(b"x")
    (folder / "checkpoint-10").mkdir()
    (folder / "README.md").write_text("# My own notes\n")
    temp = tmp_path / "tmp"
    temp.mkdir()
    monkeypatch.setattr(tempfile, "tempdir", str(temp))
    assert main(["publish", str(folder), "--repo-id", "someone/elmo", "--dry-run"]) == 0
    lines = capsys.readouterr().out.splitlines()
    assert lines[0] == "Dry run: nothing was uploaded. someone/elmo would receive:"
    listed = len(PUBLISHED_FILES)
    assert lines[1 : 1 + listed] == [f"  {name}" for name in PUBLISHED_FILES]
    assert lines[1 + listed] == "Left out: checkpoint-10, optimizer.pt, pytorch_model.bin, trainer_state.json"
    assert lines[2 + listed] == "Model card (README.md):"
    card = ModelCard("\n".join(lines[3 + listed:]))
    assert card.data.tags[:3] == ["elmo", "bilm", "hf_elmo"] and "# My own notes" not in card.text
    assert os.listdir(temp) == []  # the prepared folder is gone: a dry run leaves nothing behind


def test_publish_a_head_with_a_hand_written_card(converted_dir, hub, tmp_path):
    head = ElmoForTokenClassification.from_pretrained(converted_dir, num_labels=5)
    head.save_pretrained(tmp_path / "ner")  # the model alone: publish adds the default tokenizer
    (tmp_path / "card.md").write_text("---\nlicense: mit\nlibrary_name: transformers\n---\n# NER\n")
    prepared, commit = publish(str(tmp_path / "ner"), "someone/ner", card_file=str(tmp_path / "card.md"))
    assert commit.pr_url is None
    uploaded = hub[1][3]
    assert uploaded["README.md"] == (tmp_path / "card.md").read_bytes()
    assert json.loads(uploaded["config.json"])["architectures"] == ["ElmoForTokenClassification"]
    assert json.loads(uploaded["tokenizer_config.json"])["auto_map"] == {
        "AutoTokenizer": ["tokenization_elmo.ElmoTokenizer", None]}
    assert not os.path.exists(prepared.path)  # the staging folder is removed after the upload


def test_publish_errors(converted_dir, tmp_path, monkeypatch, hub):
    with pytest.raises(PublishError, match="no config.json; expected a model folder written by hf-elmo convert or "):
        publish(str(tmp_path), "someone/x")
    # A pretraining run still going (or stopped before its end) has no final model: its checkpoints are models.
    run = tmp_path / "elmo-news"
    for step in (1000, 2000):
        shutil.copytree(converted_dir, run / f"checkpoint-{step}")
    (run / "training_args.json").write_text("{}")
    with pytest.raises(PublishError) as refused:
        publish(str(run), "someone/x")
    assert str(refused.value) == (f"{run}: an hf-elmo pretrain run that has not finished (no final model yet); "
                                  f"use one of its checkpoints instead, e.g. {run / 'checkpoint-2000'}.")
    monkeypatch.setattr(constants, "HF_TOKEN_PATH", str(tmp_path / "no-token"))
    monkeypatch.delenv("HF_TOKEN")
    with pytest.raises(PublishError, match="Not logged in to the Hugging Face Hub: run `hf auth login` or set HF_TO"):
        publish(str(converted_dir), "someone/x")
    assert hub == []


def test_publish_names_a_mistyped_folder_before_asking_for_a_login(tmp_path, monkeypatch):
    monkeypatch.setattr(constants, "HF_TOKEN_PATH", str(tmp_path / "no-token"))
    monkeypatch.delenv("HF_TOKEN", raising=False)
    (tmp_path / "a-file").write_text("not a model")
    expected = {
        tmp_path / "elmo-typo": "no such folder",
        tmp_path / "a-file": "not a folder",
        tmp_path: "no config.json",
    }
    for folder, problem in expected.items():
        with pytest.raises(PublishError) as refused:
            publish(str(folder), "someone/x")
        assert str(refused.value) == f"{folder}: {problem}; expected a model folder written by hf-elmo convert or " \
                                     "save_pretrained."


def test_publish_offline_is_a_clear_error_not_a_hang(converted_dir, tmp_path):
    env = {**os.environ, "PYTHONPATH": REPO_ROOT, "HF_HUB_OFFLINE": "1", "HF_TOKEN": "hf_not_a_real_token"}
    result = subprocess.run(
        [sys.executable, "-m", "hf_elmo.cli", "publish", str(converted_dir), "--repo-id", "someone/elmo"],
        capture_output=True, text=True, env=env, timeout=120, cwd=tmp_path,
    )
    assert result.returncode == 1
    assert result.stderr.strip().endswith(
        "error: HF_HUB_OFFLINE=1 is set, so nothing can be pushed to the Hub. Unset it to publish, or pass "
        "--dry-run to prepare the folder without network."
    )


def test_dry_run_folder_loads_without_hf_elmo(converted_dir, tmp_path):
    prepared, commit = publish(str(converted_dir), "someone/elmo", dry_run=True)
    assert commit is None
    tokenizer = ElmoTokenizer.from_pretrained(converted_dir)
    with torch.no_grad():
        expected = ElmoModel.from_pretrained(converted_dir)(**tokenizer(["A bank ."], return_tensors="pt"))
    report = run_without_hf_elmo(
        """
        import json, sys, torch
        from transformers import AutoModel, AutoTokenizer
        tokenizer = AutoTokenizer.from_pretrained(sys.argv[1], trust_remote_code=True)
        model = AutoModel.from_pretrained(sys.argv[1], trust_remote_code=True)
        with torch.no_grad():
            top = model(**tokenizer(["A bank ."], return_tensors="pt")).last_hidden_state
        print(json.dumps({"top": top.tolist(), "vocab": tokenizer.word_vocab_size, "module": type(model).__module__}))
        """,
        [prepared.path],
        tmp_path,
    )
    shutil.rmtree(prepared.path)
    assert report["module"].startswith("transformers_modules.") and report["vocab"] == 458
    assert (torch.tensor(report["top"]) - expected.last_hidden_state).abs().max() <= 1e-6


# ---------------------------------------------------------------------------------------------- fine-tuned heads
def run_ner_example(converted_dir, fixtures_root, output, *options):
    conll = str(fixtures_root / "data" / "conll2003.txt")
    return load_example("run_token_classification").main([
        "--model_name_or_path", str(converted_dir), "--train_file", conll, "--validation_file", conll, "--output_dir",
        str(output), "--num_train_epochs", "2", "--per_device_train_batch_size", "2", "--learning_rate", "0.05",
        "--mix_dropout", "0", "--head_lstm_dim", "0", "--task_name", "ner", "--disable_tqdm", "true",
        *options,
    ])


def test_fine_tuned_card_shows_labels_metrics_and_the_plot(converted_dir, fixtures_root, tmp_path):
    output = tmp_path / "ner"
    metrics = run_ner_example(converted_dir, fixtures_root, output)
    local = ModelCard.load(output / "README.md")  # written by the example run
    prepared, _ = publish(str(output), "someone/elmo-ner", dry_run=True)
    try:
        assert {"layer_weights.png", "metrics.json", "labels.json", "README.md"} <= set(prepared.files)
        assert not any(name.startswith("checkpoint-") for name in prepared.files)
        card = ModelCard.load(prepared.card_path)
    finally:
        shutil.rmtree(prepared.path)
    for text in (card.text, local.text):
        assert "| 0 | `O` |\n| 1 | `I-LOC` |\n| 2 | `I-ORG` |\n| 3 | `I-PER` |" in text
        assert "![Learned ELMo layer weights](layer_weights.png)" in text
    validation = metrics["validation"]
    overall = validation["entities"]["overall"]
    assert (f"| validation | {validation['token_accuracy']:.4f} | {overall['precision']:.4f} | "
            f"{overall['recall']:.4f} | {overall['f1']:.4f} |") in card.text
    per = validation["entities"]["PER"]
    assert f"| `PER` | {per['precision']:.4f} | {per['recall']:.4f} | {per['f1']:.4f} | 2 |" in card.text
    weights = metrics["layer_weights"]
    assert f"token layer {weights[0]:.3f}, biLSTM 1 {weights[1]:.3f}, biLSTM 2 {weights[2]:.3f}" in card.text
    assert ('pipeline("token-classification", model="someone/elmo-ner", trust_remote_code=True, '
            'aggregation_strategy="simple")') in card.text
    assert "model(**batch)" not in card.text
    meta = card.data.to_dict()
    assert meta["pipeline_tag"] == "token-classification"
    assert meta["hf_elmo"]["labels"] == ["O", "I-LOC", "I-ORG", "I-PER"] and meta["hf_elmo"]["task"] == "ner"
    # A local base model and local files are not Hub ids: no base_model / datasets / model-index metadata.
    assert "base_model" not in meta and "datasets" not in meta and "model-index" not in meta


def test_fine_tuned_card_metadata_for_hub_model_and_dataset(converted_dir):
    config = ElmoConfig.from_pretrained(converted_dir, architectures=["ElmoForSequenceClassification"],
                                        id2label={0: "negative", 1: "positive"})
    training = {
        "task": "imdb", "model": "someone/elmo-original", "base_model": "someone/elmo-original",
        "datasets": ["stanfordnlp/imdb"], "dataset_config": None, "train_loss": 0.3125,
        "layer_weights": [0.25, 0.5, 0.25], "gamma": 1.5,
        "test": {"accuracy": 0.875, "macro": {"precision": 0.9, "recall": 0.85, "f1": 0.86},
                 "classes": {"negative": {"precision": 0.8, "recall": 1.0, "f1": 0.8889, "support": 4},
                             "positive": {"precision": 1.0, "recall": 0.75, "f1": 0.8571, "support": 4}}},
    }
    card = elmo_model_card(config, repo_id="someone/elmo-imdb", training=training)
    again = ModelCard(str(card))  # what the Hub parses
    assert again.data.base_model == "someone/elmo-original" and again.data.datasets == ["stanfordnlp/imdb"]
    results = {(r.dataset_split, r.metric_name): (r.metric_type, r.metric_value) for r in again.data.eval_results}
    assert results == {("test", "accuracy"): ("accuracy", 0.875), ("test", "macro F1"): ("f1", 0.86)}
    assert again.data.model_name == "elmo-imdb"
    assert "| test | 0.8750 | 0.8600 |" in card.text
    assert "| `positive` | 1.0000 | 0.7500 | 0.8571 | 4 |" in card.text
    assert "[`stanfordnlp/imdb`](https://huggingface.co/datasets/stanfordnlp/imdb)" in card.text
    assert 'pipeline("text-classification", model="someone/elmo-imdb", trust_remote_code=True)' in card.text
    assert "![Learned ELMo layer weights]" not in card.text  # no plot given


def test_example_push_to_hub_pushes_the_finished_folder_with_its_card(converted_dir, fixtures_root, tmp_path, hub,
                                                                     monkeypatch):
    import huggingface_hub.hf_api

    # upload_folder's streamed (xet) path bypasses create_commit; the classic path commits through it. It also asks
    # the Hub to validate the card's YAML: parsed locally here instead.
    monkeypatch.setattr(huggingface_hub.hf_api, "is_xet_available", lambda: False)
    validated = []
    monkeypatch.setattr(HfApi, "_validate_yaml", lambda self, content, **kwargs: validated.append(ModelCard(content)))
    output = tmp_path / "ner"
    metrics = run_ner_example(converted_dir, fixtures_root, output, "--push_to_hub", "--hub_model_id",
                              "someone/elmo-ner", "--hub_private_repo", "true")
    assert hub[0] == ("create_repo", "someone/elmo-ner", {"token": None, "private": True, "exist_ok": True})
    commits = [call for call in hub if call[0] == "create_commit"]
    assert {call[1] for call in commits} == {"someone/elmo-ner"}
    _, _, kwargs, uploaded = commits[-1]
    assert kwargs["commit_message"] == "End of training"
    assert {"README.md", "metrics.json", "labels.json", "layer_weights.png", "model.safetensors", "config.json",
            "modeling_elmo.py", "pipeline_elmo.py", "tokenization_elmo.py"} <= set(uploaded)
    assert not any(name.startswith("checkpoint-") for name in uploaded)
    assert json.loads(uploaded["metrics.json"]) == json.loads((output / "metrics.json").read_text())
    card = uploaded["README.md"].decode()
    assert "![Learned ELMo layer weights](layer_weights.png)" in card
    assert f"| validation | {metrics['validation']['token_accuracy']:.4f} |" in card
    assert 'model="someone/elmo-ner", trust_remote_code=True' in card
    assert validated[-1].data.hf_elmo["labels"] == ["O", "I-LOC", "I-ORG", "I-PER"]


def test_example_hub_and_report_options(monkeypatch, tmp_path):
    load_example("run_sequence_classification")
    from finetuning_cli import ModelArguments, parse_arguments
    from run_sequence_classification import SequenceDataArguments

    def parse(*options):
        return parse_arguments(SequenceDataArguments, ModelArguments, argv=[*base, *options])[2]

    base = ["--model_name_or_path", "m", "--train_file", "t.tsv", "--output_dir", str(tmp_path / "out")]
    assert parse().report_to == [] and not parse().push_to_hub
    monkeypatch.setattr(constants, "HF_HUB_OFFLINE", False)
    monkeypatch.setenv("HF_TOKEN", "hf_not_a_real_token")
    training = parse("--push_to_hub", "--hub_model_id", "someone/x", "--report_to", "tensorboard")
    assert (training.push_to_hub, training.hub_model_id, training.report_to) == (True, "someone/x", ["tensorboard"])

    monkeypatch.setattr(constants, "HF_HUB_OFFLINE", True)
    with pytest.raises(SystemExit):
        parse("--push_to_hub")


def test_publish_never_uploads_what_a_link_outside_the_folder_points_to(converted_dir, tmp_path, capsys, hub):
    secret = tmp_path / "secret.txt"
    secret.write_text("my private notes\n", encoding="utf-8")
    folder = tmp_path / "linked"
    shutil.copytree(converted_dir, folder)
    os.symlink(secret, folder / "notes.json")
    for arguments in (["--dry-run"], []):
        assert main(["publish", str(folder), "--repo-id", "someone/elmo", *arguments]) == 1
        error = capsys.readouterr().err.strip()
        assert error == (
            f"error: {folder / 'notes.json'} is a link to {secret}, outside {folder}; publish never uploads a file "
            "from outside the model folder. Remove the link, or replace it with a copy of the file if it is meant "
            f"to be published (cp --remove-destination \"$(readlink -f {folder / 'notes.json'})\" "
            f"{folder / 'notes.json'})."
        )
    # The same for a file the model loads (a shared vocabulary kept elsewhere), and for a link to a folder.
    os.remove(folder / "notes.json")
    shared = tmp_path / "shared"
    shared.mkdir()
    os.replace(folder / "vocab.txt", shared / "vocab.txt")
    os.symlink(shared / "vocab.txt", folder / "vocab.txt")
    with pytest.raises(PublishError, match=r"vocab.txt is a link to .*shared/vocab.txt, outside"):
        publish(str(folder), "someone/elmo", dry_run=True)
    os.replace(shared / "vocab.txt", folder / "vocab.txt")
    os.symlink(shared, folder / "extra")
    with pytest.raises(PublishError, match=r"extra is a link to .*shared, outside"):
        publish(str(folder), "someone/elmo", dry_run=True)
    os.remove(folder / "extra")
    assert hub == []
    # A link that stays inside the folder is followed: its content is published under the link's name.
    (folder / "notes").mkdir()
    (folder / "notes" / "labels.json").write_text('{"a": 1}\n', encoding="utf-8")
    os.symlink(folder / "notes" / "labels.json", folder / "labels.json")
    prepared, _ = publish(str(folder), "someone/elmo")
    assert hub[1][3]["labels.json"] == b'{"a": 1}\n'
    assert prepared.left_out == ["notes"]
    # A hard link cannot be told from a file, but a file with more than one link can: refused, as it may be a
    # private file from elsewhere (it was uploaded).
    os.remove(folder / "labels.json")
    os.link(secret, folder / "notes.json")
    calls = len(hub)
    with pytest.raises(PublishError) as error:
        publish(str(folder), "someone/elmo", dry_run=True)
    assert str(error.value) == (
        f"{folder / 'notes.json'} has 2 hard links: it is also a file elsewhere, and publish never uploads a file "
        "that may come from outside the model folder. If it is meant to be published, give the folder a copy of its "
        f"own (cp {folder / 'notes.json'} {folder / 'notes.json'}.copy && mv {folder / 'notes.json'}.copy "
        f"{folder / 'notes.json'}).")
    assert len(hub) == calls


# ---------------------------------------------------------------------------------------------
# hf-elmo pretrain --push-to-hub
# ---------------------------------------------------------------------------------------------
TINY_BILM = {"char_filters": [[1, 8], [2, 8], [3, 16]], "n_highway": 1, "char_embedding_dim": 8, "lstm_dim": 64,
             "projection_dim": 16, "num_lstm_layers": 2}


@pytest.mark.usefixtures("fresh_accelerate_state")
def test_pretrain_pushes_the_finished_run_with_its_corpus_and_curve(english_corpus, hub, tmp_path, capsys,
                                                                   monkeypatch):
    import argparse

    from hf_elmo.pretraining import push_to_hub

    config = tmp_path / "tiny.json"
    config.write_text(json.dumps(TINY_BILM), encoding="utf-8")
    output = tmp_path / "bilm"
    command = ["pretrain", "--train-files", str(english_corpus / "train.txt"), "--eval-file",
               str(english_corpus / "heldout.txt"), "--eval-max-sentences", "40", "--config", str(config),
               "--build-vocab", "--output-dir", str(output), "--max-steps", "4", "--eval-steps", "2",
               "--batch-size", "8", "--num-workers", "0", "--report-to", "none"]
    # What cannot work is a usage error before anything is written.
    for extra, message in ((["--push-to-hub"], "--push-to-hub needs --hub-model-id OWNER/NAME"),
                           (["--hub-model-id", "someone/x"], "--hub-model-id and --hub-private go with --push-to-hub"),
                           (["--push-to-hub", "--hub-model-id", "nobody"], "--hub-model-id: 'nobody' is not a valid")):
        with pytest.raises(SystemExit) as stopped:
            main([*command, *extra])
        assert stopped.value.code == 2 and message in capsys.readouterr().err and not output.exists()

    assert main([*command, "--push-to-hub", "--hub-model-id", "someone/elmo-tiny", "--hub-private"]) == 0
    (_, repo_id, repo_options), (_, _, _, uploaded) = hub
    assert repo_id == "someone/elmo-tiny" and repo_options["private"] is True
    # What publish pushes, and not the run's options (local paths) or its raw metrics.
    assert {"model.safetensors", "config.json", "vocab.txt", "eval_results.json", "README.md",
            "perplexity_curve.png"} <= set(uploaded)
    assert "training_args.json" not in uploaded and "metrics.jsonl" not in uploaded
    assert uploaded["perplexity_curve.png"].startswith(b"\x89PNG\r\n\x1a\n")
    results = json.loads((output / "eval_results.json").read_text())
    card = ModelCard(uploaded["README.md"].decode("utf-8"))
    pretraining = card.data.hf_elmo["pretraining"]
    assert pretraining["train_files"] == ["train.txt"] and pretraining["step"] == 4
    assert pretraining["tokens_seen"] == results["tokens_seen"] > 0 and pretraining["train_wall_s"] > 0
    assert pretraining["heldout_perplexity"] == {"forward": results["eval/forward_perplexity"],
                                                 "backward": results["eval/backward_perplexity"]}
    assert "## Pretraining" in card.text and "![Held-out perplexity during pretraining](perplexity_curve.png)" in (
        card.text)
    assert "| `optimizer` | `adagrad` |" in card.text and str(tmp_path) not in card.text

    # A push that fails keeps the local result whole and says how to push it again.
    def refuse(self, *args, **kwargs):
        raise OSError("the Hub said no")

    monkeypatch.setattr(HfApi, "create_commit", refuse)
    with pytest.raises(PublishError) as error:
        push_to_hub(argparse.Namespace(output_dir=str(output), hub_model_id="someone/elmo-tiny", hub_private=False))
    assert str(error.value) == (f"the finished model is in {output}, but pushing it to someone/elmo-tiny failed (the "
                                f"Hub said no); push it with `hf-elmo publish {output} --repo-id someone/elmo-tiny`.")
    assert (output / "model.safetensors").is_file()


@pytest.mark.usefixtures("fresh_accelerate_state")
def test_a_streamed_datasets_run_is_pushed_with_a_card_that_names_the_dataset(english_corpus, hub, tmp_path,
                                                                             monkeypatch):
    from hf_elmo.cli import main

    monkeypatch.setenv("HF_ELMO_CACHE", str(tmp_path / "cache"))
    lines = (english_corpus / "train.txt").read_text(encoding="utf-8").splitlines()
    folder = tmp_path / "wiki"
    folder.mkdir()
    for split, part in (("train", lines[:200]), ("validation", lines[200:240])):
        (folder / f"{split}.jsonl").write_text("".join(json.dumps({"text": line}) + "\n" for line in part),
                                               encoding="utf-8")
    config = tmp_path / "tiny.json"
    config.write_text(json.dumps(TINY_BILM), encoding="utf-8")
    output = tmp_path / "bilm"
    assert main(["pretrain", "--dataset-name", str(folder), "--streaming", "--eval-split", "validation",
                 "--config", str(config), "--build-vocab", "--vocab-sentences", "150", "--output-dir", str(output),
                 "--max-steps", "4", "--eval-steps", "2", "--batch-size", "8", "--num-workers", "0",
                 "--report-to", "none", "--push-to-hub", "--hub-model-id", "someone/elmo-wiki"]) == 0
    uploaded = hub[-1][-1]
    results = json.loads((output / "eval_results.json").read_text())
    assert results["sentences_seen"] == 4 * 8  # 4 steps of 8 sentences
    card = ModelCard(uploaded["README.md"].decode("utf-8"))
    assert card.data.hf_elmo["pretraining"]["dataset"] == {
        "name": "wiki", "hub": False, "config": None, "split": "train", "revision": None, "text_column": None,
        "streaming": True}
    assert card.data.datasets is None  # a local folder is no Hub dataset to link to
    assert (f"Pretrained with `hf-elmo pretrain` on the local dataset `wiki` (split `train`, streamed) for 4 steps, "
            f"32 sentences and {results['tokens_seen']:,} tokens seen") in card.text
    assert "perplexity_curve.png" in uploaded and str(tmp_path) not in card.text


def test_the_card_of_a_hub_datasets_run_names_and_links_the_dataset(tmp_path):
    from hf_elmo.model_card import elmo_model_card
    from hf_elmo.publish import read_pretraining

    (tmp_path / "training_args.json").write_text(json.dumps({
        "train_files": None, "dataset_name": "wikimedia/wikipedia", "dataset_config": "20231101.nb",
        "dataset_split": "train", "dataset_revision": "b04c8d1ceb2f5cd4588862100d08de323dccfbaa",
        "text_column": None, "streaming": False, "optimizer": "adagrad"}))
    (tmp_path / "eval_results.json").write_text(json.dumps({"step": 6, "tokens_seen": 1200, "sentences_seen": 48}))
    pretraining = read_pretraining(str(tmp_path))
    assert pretraining["train_files"] == [] and pretraining["dataset"]["name"] == "wikimedia/wikipedia"
    card = elmo_model_card(ElmoConfig(**TINY_BILM), pretraining=pretraining)
    assert card.data.datasets == ["wikimedia/wikipedia"]
    # The revision recorded is the commit in the addresses datasets resolves a Hub dataset's data files to.
    from hf_elmo.pretraining_datasets import hub_revision

    sha = "b04c8d1ceb2f5cd4588862100d08de323dccfbaa"
    assert hub_revision({"train": {"data_files": [
        f"hf://datasets/wikimedia/wikipedia@{sha}/20231101.nb/train-00000-of-00004.parquet"]}}) == sha
    assert hub_revision({"train": {"data_files": [{"file": "train.jsonl", "bytes": 9, "sha256": "0" * 64}]}}) is None
    assert ("on the dataset `wikimedia/wikipedia` (config `20231101.nb`, split `train`, revision "
            "`b04c8d1ceb2f5cd4588862100d08de323dccfbaa`) for 6 steps, 48 sentences and 1,200 tokens seen") in card.text


def test_the_wall_time_of_a_resumed_pretraining_run_adds_its_parts(tmp_path):
    from hf_elmo.publish import read_pretraining

    (tmp_path / "training_args.json").write_text(json.dumps({"train_files": ["/home/me/corpus/*.txt"],
                                                             "optimizer": "adagrad"}))
    (tmp_path / "eval_results.json").write_text(json.dumps({"step": 6, "tokens_seen": 600}))
    # Two processes' lines: the second (a --resume) counts from its own start again.
    walls = [10.0, 20.0, 30.5, 2.0, 12.5]
    (tmp_path / "metrics.jsonl").write_text("".join(json.dumps({"step": i + 1, "wall_s": w}) + "\n"
                                                    for i, w in enumerate(walls)))
    pretraining = read_pretraining(str(tmp_path))
    assert pretraining["train_wall_s"] == 43.0 and pretraining["train_files"] == ["*.txt"]
    assert pretraining["recipe"] == {"optimizer": "adagrad"} and pretraining["heldout_perplexity"] is None
