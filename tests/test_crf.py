"""The CRF output layer of ElmoForTokenClassification (`head_crf`), against brute-force enumeration of every
labelling of short sentences; and the head fed the biLM's layers computed once (`elmo_hidden_states`)."""

import itertools
import math

import pytest
import torch

from hf_elmo import ElmoConfig, ElmoForTokenClassification, ElmoTokenizer
from hf_elmo.modeling_elmo import FORBIDDEN_TRANSITION, ElmoCrf, iob2_transitions


LABELS = {0: "O", 1: "B-PER", 2: "I-PER", 3: "B-LOC", 4: "I-LOC"}


def random_crf(seed: int, id2label=LABELS) -> ElmoCrf:
    generator = torch.Generator().manual_seed(seed)
    crf = ElmoCrf(len(LABELS), id2label)
    with torch.no_grad():
        for parameter in crf.parameters():
            parameter.copy_(torch.randn(parameter.shape, generator=generator))
    return crf


@torch.no_grad()
def every_labelling(crf: ElmoCrf, emissions: torch.Tensor, length: int) -> dict[tuple, float]:
    """Score of every labelling of one sentence's first `length` words, summed by hand."""
    names = [LABELS[i] for i in range(len(LABELS))]
    scores = {}
    for path in itertools.product(range(len(names)), repeat=length):
        score = float(crf.start_scores[path[0]]) + float(crf.end_scores[path[-1]])
        score += sum(float(emissions[t, label]) for t, label in enumerate(path))
        score += sum(float(crf.transitions[a, b]) for a, b in zip(path, path[1:]))
        if crf.constraints is not None:
            allowed, allowed_first = crf.constraints
            score += FORBIDDEN_TRANSITION * (not allowed_first[path[0]])
            score += FORBIDDEN_TRANSITION * sum(not allowed[a][b] for a, b in zip(path, path[1:]))
        scores[path] = score
    return scores


@pytest.mark.parametrize("constrained", [True, False])
def test_crf_matches_brute_force_on_short_sentences(constrained):
    crf = random_crf(0, LABELS if constrained else None)
    assert (crf.constraints is not None) == constrained
    lengths = [4, 1, 3, 0]
    emissions = torch.randn(4, 4, 5, generator=torch.Generator().manual_seed(1)) * 2
    mask = torch.arange(4)[None, :] < torch.tensor(lengths)[:, None]
    labels = torch.randint(0, 5, (4, 4), generator=torch.Generator().manual_seed(2))
    with torch.no_grad():
        log_z = crf.log_partition(emissions, mask)
        path_scores = crf.path_scores(emissions, labels, mask)
        best = crf.decode(emissions, mask)
        max_marginals = crf.max_marginals(emissions, mask)
    for row, length in enumerate(lengths):
        if length == 0:
            assert log_z[row] == 0 and path_scores[row] == 0 and (best[row] == -100).all()
            continue
        scores = every_labelling(crf, emissions[row], length)
        assert float(log_z[row]) == pytest.approx(math.log(sum(math.exp(s) for s in scores.values())), rel=1e-5)
        assert float(path_scores[row]) == pytest.approx(scores[tuple(labels[row, :length].tolist())], rel=1e-5)
        viterbi = max(scores, key=scores.get)
        assert best[row, :length].tolist() == list(viterbi) and (best[row, length:] == -100).all()
        for t in range(length):
            for label in range(5):
                expected = max(s for path, s in scores.items() if path[t] == label)
                assert float(max_marginals[row, t, label]) == pytest.approx(expected, rel=1e-5, abs=1e-4)
        # The argmax of the max-marginals is the Viterbi labelling.
        assert max_marginals[row, :length].argmax(dim=-1).tolist() == list(viterbi)


def test_iob2_constraints_are_never_broken_by_decoding():
    assert iob2_transitions({0: "O", 1: "PER"}) is None  # not an IOB2 label set: no constraint
    allowed, first = iob2_transitions(LABELS)
    assert first == [True, True, False, True, False]
    assert [row[2] for row in allowed] == [False, True, True, False, False]  # I-PER after B-PER / I-PER only
    crf = ElmoCrf(5, LABELS)
    # The classifier alone would say I-LOC I-PER I-PER O I-LOC: a forbidden sequence.
    emissions = torch.full((1, 5, 5), -5.0)
    for t, label in enumerate([4, 2, 2, 0, 4]):
        emissions[0, t, label] = 5.0
    emissions[0, :, 1] = 0.0
    emissions[0, :, 3] = 1.0
    mask = torch.ones(1, 5, dtype=torch.bool)
    # The best allowed sequence: the I- tags become B- tags where nothing of their type comes before.
    path = crf.decode(emissions, mask)[0].tolist()
    assert [LABELS[label] for label in path] == ["B-PER", "I-PER", "I-PER", "O", "B-LOC"]
    assert crf.max_marginals(emissions, mask)[0].argmax(-1).tolist() == path


def tiny_head(**kwargs) -> ElmoForTokenClassification:
    torch.manual_seed(0)
    config = ElmoConfig(char_filters=[[1, 8], [2, 8]], n_highway=1, char_embedding_dim=8, lstm_dim=32,
                        projection_dim=8, num_lstm_layers=2, num_labels=5, id2label=LABELS,
                        label2id={v: k for k, v in LABELS.items()}, **kwargs)
    return ElmoForTokenClassification(config)


@pytest.fixture(scope="module")
def batch():
    return dict(ElmoTokenizer()([["Jim", "lives", "in", "Paris"], ["Ann", "Lee"], ["Oslo"]], is_split_into_words=True,
                                padding=True, return_tensors="pt"))


def test_crf_head_loss_decoding_and_errors(batch):
    model = tiny_head(head_crf=True, head_lstm_dim=6, mix_dropout=0.0).eval()
    with torch.no_grad():
        for parameter in model.crf.parameters():
            parameter.normal_()
    labels = torch.tensor([[1, 0, 0, 3], [1, 2, -100, -100], [3, -100, -100, -100]])
    output = model(**batch, labels=labels)
    best = model.decode(**batch)
    mask = batch["attention_mask"].bool()
    assert (output.logits.argmax(-1).masked_fill(~mask, -100) == best).all()
    # The loss is the sentences' negative log-likelihood per labelled word.
    with torch.no_grad():
        emissions = model.classifier(model.encoder(*model.elmo_layers(batch["input_ids"], batch["attention_mask"])))
        nll = model.crf.log_partition(emissions, mask) - model.crf.path_scores(emissions, labels, mask)
    assert float(output.loss.detach()) == pytest.approx(float(nll.sum()) / 7, rel=1e-5)
    output.loss.backward()
    assert model.crf.transitions.grad.abs().sum() > 0
    # A training step needs only the loss: the same loss, and `logits` are the classifier's scores (the max-marginals,
    # two of the CRF's three passes over the words, are left out).
    model.train()
    training = model(**batch, labels=labels)
    assert float(training.loss.detach()) == pytest.approx(float(output.loss.detach()), rel=1e-6)
    assert torch.allclose(training.logits, emissions, atol=1e-6)
    assert not torch.allclose(output.logits, emissions, atol=1e-3)
    model.eval()

    with pytest.raises(ValueError, match=r"labels\[1, 1\] is I-LOC after B-PER, which IOB2 forbids"):
        model(**batch, labels=torch.tensor([[1, 0, 0, 3], [1, 4, -100, -100], [3, -100, -100, -100]]))
    with pytest.raises(ValueError, match=r"labels\[2, 0\] is I-LOC at the start, which IOB2 forbids"):
        model(**batch, labels=torch.tensor([[1, 0, 0, 3], [1, 2, -100, -100], [4, -100, -100, -100]]))
    with pytest.raises(ValueError, match=r"labels\[0, 2\] is -100 but the CRF scores whole sentences"):
        model(**batch, labels=torch.tensor([[1, 0, -100, 3], [1, 2, -100, -100], [3, -100, -100, -100]]))


def test_crf_head_saves_and_reloads(batch, tmp_path):
    model = tiny_head(head_crf=True).eval()
    with torch.no_grad():
        model.crf.transitions.normal_()
    model.save_pretrained(tmp_path / "crf")
    loaded = ElmoForTokenClassification.from_pretrained(tmp_path / "crf").eval()
    assert loaded.crf.constraints == model.crf.constraints
    assert torch.equal(loaded.crf.transitions, model.crf.transitions)
    assert all(torch.equal(tensor, model.state_dict()[name]) for name, tensor in loaded.state_dict().items())
    with torch.no_grad():
        # The same function of equal weights, though not bit for bit: MKL rounds some products differently for
        # operands at other addresses (seen on an AMD EPYC: 4e-9 apart in the LSTM layers).
        torch.testing.assert_close(loaded(**batch).logits, model(**batch).logits, rtol=1e-6, atol=1e-6)


@pytest.mark.parametrize("crf", [False, True])
def test_cached_biLM_layers_give_the_same_result(batch, crf):
    model = tiny_head(head_crf=crf, head_lstm_dim=6).eval()
    labels = torch.tensor([[1, 0, 0, 3], [1, 2, -100, -100], [3, -100, -100, -100]])
    with torch.no_grad():
        direct = model(**batch, labels=labels)
        layers = model.elmo(**batch, output_hidden_states=True).hidden_states
        cached = model(elmo_hidden_states=torch.stack(layers, dim=1), attention_mask=batch["attention_mask"],
                       labels=labels)
    assert torch.equal(direct.logits, cached.logits) and torch.equal(direct.loss, cached.loss)
    with pytest.raises(ValueError, match=r"elmo_hidden_states must have shape \(batch, 3, words, 16\)"):
        model(elmo_hidden_states=torch.zeros(3, 2, 4, 16), attention_mask=batch["attention_mask"])
    with pytest.raises(ValueError, match="elmo_hidden_states needs the attention_mask"):
        model(elmo_hidden_states=torch.stack(layers, dim=1))


def test_the_token_classification_pipeline_decodes_with_viterbi():
    from transformers import pipeline

    from hf_elmo.pipeline_elmo import ElmoTokenClassificationPipeline

    model = tiny_head(head_crf=True).eval()
    torch.manual_seed(4)
    with torch.no_grad():
        model.crf.transitions.normal_(0.0, 3.0)
        model.classifier.weight.normal_(0.0, 3.0)
    tokenizer = ElmoTokenizer()
    words = ["Jim", "Lee", "lives", "in", "Paris", "and", "Oslo", "."]
    tagger = pipeline("token-classification", model=model, tokenizer=tokenizer,
                      pipeline_class=ElmoTokenClassificationPipeline)
    tagged = tagger(" ".join(words))
    viterbi = model.decode(**tokenizer([words], is_split_into_words=True, return_tensors="pt"))[0].tolist()
    assert {LABELS[i][:2] for i in viterbi} >= {"B-", "I-"}  # entities of several words: transitions matter
    assert [entity["entity"] for entity in tagged] == [LABELS[i] for i in viterbi if LABELS[i] != "O"]
    assert [entity["index"] for entity in tagged] == [i for i, label in enumerate(viterbi) if LABELS[label] != "O"]


@pytest.mark.parametrize("crf", [True, False])
def test_sentences_of_no_words_give_empty_outputs_and_a_zero_loss(crf):
    # A batch whose sentences are all empty ("" in a pipeline) reached torch's LSTM with a sequence of length 0
    # ("Expected sequence length to be larger than 0 in RNN"), and the CRF indexed word 0 of it.
    from transformers import pipeline

    from hf_elmo.pipeline_elmo import ElmoTokenClassificationPipeline

    model = tiny_head(head_crf=crf, head_lstm_dim=4)
    inputs = ElmoTokenizer()([[], []], is_split_into_words=True, return_tensors="pt")
    assert tuple(inputs["input_ids"].shape) == (2, 0, 50)
    loss = model(**inputs, labels=torch.zeros(2, 0, dtype=torch.long)).loss
    loss.backward()  # a training step on them runs (and learns nothing)
    assert loss.item() == 0.0
    model.eval()
    with torch.no_grad():
        assert tuple(model(**inputs).logits.shape) == (2, 0, len(LABELS))
        assert tuple(model.decode(**inputs).shape) == (2, 0)
    tagger = pipeline("token-classification", model=model, tokenizer=ElmoTokenizer(),
                      pipeline_class=ElmoTokenClassificationPipeline)
    assert tagger(["", "  "]) == [[], []]
