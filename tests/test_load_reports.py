"""What `from_pretrained` reports when an ELMo folder is loaded into another ELMo class.

A pretraining output (`ElmoForPreTraining`: the biLM plus its softmax) is meant to be loaded as the biLM
(`AutoModel`) or under a task head: its `softmax.*` weights are expected to go unused there, and the load report
should not list them as UNEXPECTED: ElmoPreTrainedModel declares them with `_keys_to_ignore_on_load_unexpected`.
"""

import pytest
import torch
from transformers import AutoModel, AutoModelForTokenClassification

from hf_elmo import ElmoConfig, ElmoForPreTraining


@pytest.fixture(scope="module")
def pretraining_output(tmp_path_factory):
    config = ElmoConfig(char_filters=((1, 4), (2, 8)), n_highway=1, char_embedding_dim=4, lstm_dim=16,
                        projection_dim=8, vocab_size=20)
    torch.manual_seed(0)
    model = ElmoForPreTraining(config)
    folder = tmp_path_factory.mktemp("pretrained") / "elmo-lm"
    model.save_pretrained(folder)  # what hf-elmo-pretrain writes at the end
    return folder, model


def test_biLM_from_a_pretraining_output_reports_no_unexpected_softmax(pretraining_output, capfd):
    folder, trained = pretraining_output
    capfd.readouterr()
    model, info = AutoModel.from_pretrained(folder, output_loading_info=True)
    report = capfd.readouterr()
    assert info["unexpected_keys"] == set() and info["missing_keys"] == set()
    assert "UNEXPECTED" not in report.out + report.err
    # The biLM weights did load.
    assert all(torch.equal(value, trained.state_dict()[f"elmo.{key}"]) for key, value in model.state_dict().items()
               if f"elmo.{key}" in trained.state_dict())


def test_head_from_a_pretraining_output_reports_only_its_new_weights(pretraining_output):
    folder, _ = pretraining_output
    _, info = AutoModelForTokenClassification.from_pretrained(folder, num_labels=3, output_loading_info=True)
    assert info["unexpected_keys"] == set()
    assert info["missing_keys"] == {"classifier.weight", "classifier.bias", "encoder.mix.scalar_weights",
                                    "encoder.mix.gamma"}


def test_a_pretraining_output_keeps_its_softmax(pretraining_output):
    folder, trained = pretraining_output
    model, info = ElmoForPreTraining.from_pretrained(folder, output_loading_info=True)
    assert info["unexpected_keys"] == set() and info["missing_keys"] == set()
    assert torch.equal(model.softmax.weight, trained.softmax.weight)
