"""Transformers pipelines on ELMo models: token classification (spans and offsets), text classification and feature
extraction, in this process and in one where hf_elmo cannot be imported (trust_remote_code=True)."""

import json
import re
import shutil

import numpy as np
import pytest
import torch
from transformers import (
    AutoModel,
    AutoModelForSequenceClassification,
    AutoModelForTokenClassification,
    AutoTokenizer,
    DataCollatorForTokenClassification,
    DataCollatorWithPadding,
    TokenClassificationPipeline,
    pipeline,
)

from hf_elmo import ElmoForSequenceClassification
from hf_elmo.finetuning import TaggedSentence, build_label_map, read_conll
from hf_elmo.pipeline_elmo import ElmoTokenClassificationPipeline

from remote_code import run_without_hf_elmo


# Two CoNLL-2003 fixture sentences plus two with multi-word entities (IOB1 tags, as in the fixture).
EXTRA = [
    ("Joel Grus lives in New York .", "I-PER I-PER O O I-LOC I-LOC O"),
    ("Seattle is far from Baghdad .", "I-LOC O O O I-LOC O"),
]
# The same words as training sentences, spaced differently: offsets must follow this text, not the words.
TEXT = "Joel Grus  lives in New York."
TEXT_WORDS = [("Joel", 0, 4), ("Grus", 5, 9), ("lives", 11, 16), ("in", 17, 19), ("New", 20, 23), ("York", 24, 28),
              (".", 28, 29)]
OTHER = "U.N. official Ekeus heads for Baghdad ."


def fit_classifier(model, features, collator, steps=300):
    """
    Fit the head's classifier to its training data in a few milliseconds: the biLM is frozen and the mix stays even,
    so the features are computed once and full-batch Adam runs on them (the Trainer is tested in test_heads.py).
    """
    model.eval()
    batch = collator(features)
    labels = batch.pop("labels")
    with torch.no_grad():
        features = model.encoder(*model.elmo_layers(batch["input_ids"], batch["attention_mask"]))
        if isinstance(model, ElmoForSequenceClassification):
            features = model.pool(features, batch["attention_mask"].bool())
    labelled = labels != -100
    optimizer = torch.optim.Adam(model.classifier.parameters(), lr=0.1)
    for _ in range(steps):
        optimizer.zero_grad()
        loss = torch.nn.functional.cross_entropy(model.classifier(features)[labelled], labels[labelled])
        loss.backward()
        optimizer.step()
    return model


@pytest.fixture(scope="module")
def ner_folder(converted_dir, fixtures_root, tmp_path_factory):
    """A token-classification model that fits its training sentences exactly, saved with its tokenizer."""
    sentences = read_conll(fixtures_root / "data" / "conll2003.txt")
    sentences += [TaggedSentence(text.split(), tags.split()) for text, tags in EXTRA]
    id2label = build_label_map([t for s in sentences for t in s.tags], outside="O")
    label2id = {v: k for k, v in id2label.items()}
    tokenizer = AutoTokenizer.from_pretrained(converted_dir)
    features = [{**tokenizer(s.words, is_split_into_words=True), "labels": [label2id[t] for t in s.tags]}
                for s in sentences]
    model = AutoModelForTokenClassification.from_pretrained(converted_dir, id2label=id2label, label2id=label2id)
    fit_classifier(model, features, DataCollatorForTokenClassification(tokenizer))
    with torch.no_grad():
        predicted = model(**DataCollatorForTokenClassification(tokenizer)(features)).logits.argmax(-1)
    assert [[id2label[int(i)] for i in row[: len(s.tags)]] for row, s in zip(predicted, sentences)] == [
        s.tags for s in sentences
    ]
    folder = tmp_path_factory.mktemp("ner") / "elmo-ner"
    model.save_pretrained(folder)
    tokenizer.save_pretrained(folder)
    return folder


@pytest.fixture(scope="module")
def sentiment_folder(converted_dir, tmp_path_factory):
    tokenizer = AutoTokenizer.from_pretrained(converted_dir)
    texts = ["What a World Cup .", "Don 't !", "That seems to have been their model up til now .",
             "Even so , Democrats slammed Bush as out of touch ."]
    labels = [1, 0, 1, 0]
    model = AutoModelForSequenceClassification.from_pretrained(
        converted_dir, id2label={0: "NEGATIVE", 1: "POSITIVE"}, label2id={"NEGATIVE": 0, "POSITIVE": 1})
    fit_classifier(model, [{**tokenizer(t), "labels": y} for t, y in zip(texts, labels)],
                   DataCollatorWithPadding(tokenizer))
    folder = tmp_path_factory.mktemp("sentiment") / "elmo-sentiment"
    model.save_pretrained(folder)
    tokenizer.save_pretrained(folder)
    return folder


def expected_word_entities(folder, text):
    """(label, score, index, word, start, end) of every word of `text`, straight from the model."""
    tokenizer = AutoTokenizer.from_pretrained(folder)
    model = AutoModelForTokenClassification.from_pretrained(folder).eval()
    batch = tokenizer(text, return_offsets_mapping=True, return_tensors="pt")
    offsets = batch.pop("offset_mapping")[0].tolist()
    with torch.no_grad():
        probabilities = model(**batch).logits[0].softmax(-1)
    result = []
    for index, ((start, end), scores) in enumerate(zip(offsets, probabilities)):
        label = model.config.id2label[int(scores.argmax())]
        result.append((label, float(scores.max()), index, text[start:end], start, end))
    return result


def simplify(entities):
    return [{k: (round(float(v), 5) if k == "score" else v) for k, v in e.items()} for e in entities]


def test_token_classification_entities_and_offsets(ner_folder):
    words = expected_word_entities(ner_folder, TEXT)
    assert [(w, s, e) for _, _, _, w, s, e in words] == TEXT_WORDS
    assert [label for label, *_ in words] == ["I-PER", "I-PER", "O", "O", "I-LOC", "I-LOC", "O"]
    model = AutoModelForTokenClassification.from_pretrained(ner_folder)
    tokenizer = AutoTokenizer.from_pretrained(ner_folder)

    def pipe(**kwargs):
        return pipeline("token-classification", model=model, tokenizer=tokenizer,
                        pipeline_class=ElmoTokenClassificationPipeline, **kwargs)

    none = pipe(aggregation_strategy="none")(TEXT)
    assert simplify(none) == [
        {"entity": label, "score": round(score, 5), "index": index, "word": word, "start": start, "end": end}
        for label, score, index, word, start, end in words if label != "O"
    ]
    simple = pipe(aggregation_strategy="simple")(TEXT)
    per, loc = words[0:2], words[4:6]
    assert simplify(simple) == [
        {"entity_group": "PER", "score": round(float(np.mean([s for _, s, *_ in per])), 5), "word": "Joel Grus",
         "start": 0, "end": 9},
        {"entity_group": "LOC", "score": round(float(np.mean([s for _, s, *_ in loc])), 5), "word": "New York",
         "start": 20, "end": 28},
    ]
    for entity in simple:
        assert TEXT[entity["start"]: entity["end"]] == entity["word"]
    # Every position is a whole word, so the word-level strategies agree with "simple".
    for strategy in ("first", "average", "max"):
        assert simplify(pipe(aggregation_strategy=strategy)(TEXT)) == simplify(simple)


def test_token_classification_from_a_folder(ner_folder):
    pipe = pipeline("token-classification", model=str(ner_folder), trust_remote_code=True,
                    aggregation_strategy="simple")
    assert type(pipe).__name__ == "ElmoTokenClassificationPipeline"
    alone = [simplify(pipe(text)) for text in (TEXT, OTHER)]
    assert [e["word"] for e in alone[0]] == ["Joel Grus", "New York"]
    assert [(e["entity_group"], e["word"], e["start"], e["end"]) for e in alone[1]] == [
        ("ORG", "U.N.", 0, 4), ("PER", "Ekeus", 14, 19), ("LOC", "Baghdad", 30, 37)]
    # Batched through the pipeline's own padding: same answers.
    assert [simplify(r) for r in pipe([TEXT, OTHER], batch_size=2)] == alone
    # Pre-split words: offsets index the words joined by single spaces.
    split = pipe([w for w, _, _ in TEXT_WORDS], is_split_into_words=True)
    assert [(e["word"], e["start"], e["end"]) for e in split[0]] == [("Joel Grus", 0, 9), ("New York", 19, 27)]
    # Transformers asks for trust_remote_code before it uses a pipeline class named by the model.
    with pytest.raises(ValueError, match="trust_remote_code=True"):
        pipeline("token-classification", model=str(ner_folder))
    # The folder names the pipeline under Transformers' alias too, so "ner" is the same call.
    assert json.loads((ner_folder / "config.json").read_text())["custom_pipelines"].keys() == {
        "token-classification", "ner"}
    ner = pipeline("ner", model=str(ner_folder), trust_remote_code=True, aggregation_strategy="simple")
    assert type(ner).__name__ == "ElmoTokenClassificationPipeline"
    assert simplify(ner(TEXT)) == alone[0]
    with pytest.raises(ValueError, match="trust_remote_code=True"):
        pipeline("ner", model=str(ner_folder))
    # The cost of two names: without a task, Transformers cannot choose and says so, naming both.
    with pytest.raises(RuntimeError, match="Pick one in ner, token-classification"):
        pipeline(model=str(ner_folder), trust_remote_code=True)


def test_stock_token_pipeline_used_by_mistake_names_the_right_call(ner_folder, tmp_path):
    model = AutoModelForTokenClassification.from_pretrained(ner_folder)
    tokenizer = AutoTokenizer.from_pretrained(ner_folder)
    # A model object: pipeline() never reads config.custom_pipelines for it, so the stock class is chosen.
    stock = pipeline("token-classification", model=model, tokenizer=tokenizer)
    assert type(stock) is TokenClassificationPipeline
    right_call = re.escape('pipeline("token-classification", model=model, tokenizer=tokenizer, '
                           "pipeline_class=ElmoTokenClassificationPipeline)")
    with pytest.raises(ValueError, match=right_call):
        stock(TEXT)
    with pytest.raises(ValueError, match=re.escape('model=FOLDER_OR_REPO_ID, trust_remote_code=True')):
        stock([w for w, _, _ in TEXT_WORDS], is_split_into_words=True)
    # A folder saved before "ner" was listed in custom_pipelines gets the stock class for the alias: same error.
    old_folder = tmp_path / "listed_once"
    shutil.copytree(ner_folder, old_folder)
    config = json.loads((old_folder / "config.json").read_text())
    config["custom_pipelines"].pop("ner")
    (old_folder / "config.json").write_text(json.dumps(config))
    alias = pipeline("ner", model=str(old_folder), trust_remote_code=True)
    assert type(alias) is TokenClassificationPipeline
    with pytest.raises(ValueError, match="the stock TokenClassificationPipeline cannot read"):
        alias(TEXT)
    # Only that pipeline is refused: the same objects work everywhere else.
    assert tokenizer(TEXT, return_tensors="pt")["input_ids"].shape == (1, 7, 50)
    ours = pipeline("token-classification", model=model, tokenizer=tokenizer,
                    pipeline_class=ElmoTokenClassificationPipeline, aggregation_strategy="simple")
    assert [e["word"] for e in ours(TEXT)] == ["Joel Grus", "New York"]


def test_text_classification_and_feature_extraction(sentiment_folder, converted_dir):
    model = AutoModelForSequenceClassification.from_pretrained(sentiment_folder).eval()
    tokenizer = AutoTokenizer.from_pretrained(sentiment_folder)
    texts = ["What a World Cup .", "Even so , Democrats slammed Bush as out of touch ."]
    with torch.no_grad():
        probabilities = model(**tokenizer(texts, padding=True, return_tensors="pt")).logits.softmax(-1)
    assert probabilities.argmax(-1).tolist() == [1, 0]
    classify = pipeline("text-classification", model=str(sentiment_folder))
    results = classify(texts)
    assert [r["label"] for r in results] == ["POSITIVE", "NEGATIVE"]
    assert [r["score"] for r in results] == pytest.approx(probabilities.max(-1).values.tolist(), abs=1e-6)
    every = classify(texts[0], top_k=None)
    assert {r["label"]: r["score"] for r in every} == pytest.approx(
        {"NEGATIVE": float(probabilities[0, 0]), "POSITIVE": float(probabilities[0, 1])}, abs=1e-6)

    extract = pipeline("feature-extraction", model=str(converted_dir))
    base = AutoModel.from_pretrained(converted_dir).eval()
    with torch.no_grad():
        expected = base(**tokenizer(texts[0], return_tensors="pt")).last_hidden_state
    features = np.array(extract(texts[0]))
    assert features.shape == (1, 5, 32) and np.abs(features - expected.numpy()).max() < 1e-6
    # batch_size > 1 (README "Pipelines"): padded to the batch's longest sentence with zero vectors, as for any model.
    batched = [np.array(item) for item in extract(texts, batch_size=2)]
    assert [item.shape for item in batched] == [(1, 11, 32), (1, 11, 32)]
    assert np.abs(batched[0][:, :5] - expected.numpy()).max() < 1e-6 and not batched[0][:, 5:].any()


REMOTE_SCRIPT = """
    import json, sys
    import torch, transformers

    spec = json.loads(sys.argv[1])
    ner = transformers.pipeline("token-classification", model=spec["ner"], trust_remote_code=True)
    classify = transformers.pipeline("text-classification", model=spec["sentiment"], trust_remote_code=True)
    extract = transformers.pipeline("feature-extraction", model=spec["ner"], trust_remote_code=True)
    report = {
        "classes": [type(p).__module__ + "." + type(p).__name__ for p in (ner, classify, extract)],
        "models": [type(p.model).__module__ for p in (ner, classify, extract)],
        "none": ner(spec["text"], aggregation_strategy="none"),
        "simple": ner(spec["text"], aggregation_strategy="simple"),
        "classify": classify(spec["texts"]),
        "features": extract(spec["text"]),
    }
    report["ner_alias"] = transformers.pipeline("ner", model=spec["ner"], trust_remote_code=True)(
        spec["text"], aggregation_strategy="simple")
    try:
        model = transformers.AutoModelForTokenClassification.from_pretrained(spec["ner"], trust_remote_code=True)
        tokenizer = transformers.AutoTokenizer.from_pretrained(spec["ner"], trust_remote_code=True)
        transformers.pipeline("token-classification", model=model, tokenizer=tokenizer)(spec["text"])
    except ValueError as error:
        report["stock_error"] = str(error)
    for entities in (report["none"], report["simple"], report["ner_alias"]):
        for e in entities:
            e["score"] = float(e["score"])
    print(json.dumps(report))
"""


def test_pipelines_without_hf_elmo_installed(ner_folder, sentiment_folder, tmp_path):
    texts = ["What a World Cup .", "Even so , Democrats slammed Bush as out of touch ."]
    spec = {"ner": str(ner_folder), "sentiment": str(sentiment_folder), "text": TEXT, "texts": texts}
    report = run_without_hf_elmo(REMOTE_SCRIPT, [json.dumps(spec)], tmp_path)
    assert report["classes"][0].startswith("transformers_modules.")
    assert report["classes"][0].endswith(".pipeline_elmo.ElmoTokenClassificationPipeline")
    assert all(m.startswith("transformers_modules.") for m in report["models"])
    assert "pipeline_class=ElmoTokenClassificationPipeline" in report["stock_error"]

    local = pipeline("token-classification", model=str(ner_folder), trust_remote_code=True)
    assert simplify(report["none"]) == simplify(local(TEXT, aggregation_strategy="none"))
    assert simplify(report["simple"]) == simplify(local(TEXT, aggregation_strategy="simple"))
    assert [(e["word"], e["start"], e["end"]) for e in report["simple"]] == [("Joel Grus", 0, 9), ("New York", 20, 28)]
    assert report["ner_alias"] == report["simple"]

    local_classify = pipeline("text-classification", model=str(sentiment_folder))(texts)
    assert [r["label"] for r in report["classify"]] == [r["label"] for r in local_classify]
    assert [r["score"] for r in report["classify"]] == pytest.approx([r["score"] for r in local_classify], abs=1e-6)

    local_features = pipeline("feature-extraction", model=str(ner_folder))(TEXT)
    assert np.abs(np.array(report["features"]) - np.array(local_features)).max() < 1e-6
