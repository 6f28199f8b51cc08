#!/usr/bin/env python
"""Fine-tune ELMo for token classification (NER, POS tagging, chunking) with the Transformers Trainer.

The paper's recipe: the biLM stays frozen, the task learns a softmax-normalised weight per biLM layer and a scale
to mix them, then a classifier (optionally after a biLSTM, --head-lstm-dim) labels every word.

Data: CoNLL-format files (one word per line with its columns, blank lines between sentences, -DOCSTART- lines
skipped; --label-column picks the tag column) or, with network access, a `datasets` name (--dataset-name, e.g.
conll2003) or a local folder of train/validation/test data files. Labels come from the training data (or from
--model when it is a token-classification model already); any other label in validation or test data is an error.

Output in --output-dir: the model and tokenizer (load them with AutoModelForTokenClassification, or
pipeline("token-classification", model=DIR, trust_remote_code=True)), labels.json, metrics.json (token accuracy
and, for IOB1/IOB2/IOBES tags, entity precision / recall / F1 per type computed by seqeval), layer_weights.png
(the learned layer weights, the analogue of Figure 2 of the paper), the epoch checkpoints and a model card
(README.md: labels, metrics, the plot). --push-to-hub pushes to the Hub as the Trainer does, the finished folder
last; --report-to sends the training logs to tensorboard, wandb, ... (default: none).

Example with bilm-tf's small test model (`python examples/quickstart.py` writes it to out/elmo-bilm-tf-fixture):

    python examples/run_token_classification.py --model out/elmo-bilm-tf-fixture \\
        --train-file train.conll --validation-file dev.conll --output-dir out/ner
"""

import argparse
import logging
import sys

import numpy as np
from transformers import (
    AutoConfig,
    AutoModelForTokenClassification,
    AutoTokenizer,
    DataCollatorForTokenClassification,
)

import hf_elmo  # noqa: F401  (registers the ELMo Auto classes)
from hf_elmo.finetuning import (
    DataFileError,
    TaggedSentence,
    build_label_map,
    entity_scores,
    has_chunk_tags,
    label_ids,
    read_conll,
)
from finetuning_cli import (  # beside this script
    add_finetuning_arguments,
    check_finetuning_arguments,
    dataset_splits,
    existing_label_map,
    head_options,
    run_example,
    train_and_report,
)


logger = logging.getLogger("run_token_classification")


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    data = parser.add_argument_group("data (CoNLL files, or --dataset-name)")
    data.add_argument("--train-file", help="CoNLL-format training file")
    data.add_argument("--validation-file", help="CoNLL-format file evaluated after every epoch and at the end")
    data.add_argument("--test-file", help="CoNLL-format file evaluated once at the end")
    data.add_argument("--word-column", type=int, default=0, help="0-based column of the words (default: %(default)s)")
    data.add_argument("--label-column", type=int, default=-1,
                      help="0-based column of the tags; negative counts from the end (default: %(default)s, the "
                      "last column: the NER tags of CoNLL-2003; -2 or 2 there are the chunk tags, 1 the POS tags)")
    data.add_argument("--dataset-name",
                      help="instead of files: a `datasets` name such as conll2003 (needs network access and "
                      "`pip install \"hf-elmo[examples]\"`) or a local folder of train/validation/test data files")
    data.add_argument("--dataset-config", help="configuration name of --dataset-name, if it has several")
    data.add_argument("--tokens-column", default="tokens",
                      help="--dataset-name column holding each sentence's words (default: %(default)s)")
    data.add_argument("--tags-column", default="ner_tags",
                      help="--dataset-name column holding each sentence's tags (default: %(default)s)")
    return add_finetuning_arguments(parser)


def parse_args(argv=None):
    parser = build_parser()
    args = parser.parse_args(argv)
    if bool(args.train_file) == bool(args.dataset_name):
        parser.error("give either --train-file (CoNLL files) or --dataset-name")
    if args.dataset_name and (args.validation_file or args.test_file):
        parser.error("--validation-file / --test-file go with --train-file, not with --dataset-name")
    check_finetuning_arguments(parser, args)
    return args


def read_files(args) -> dict[str, list[TaggedSentence]]:
    files = {"train": args.train_file, "validation": args.validation_file, "test": args.test_file}
    return {
        split: read_conll(path, label_column=args.label_column, word_column=args.word_column)
        for split, path in files.items()
        if path
    }


def read_dataset(args) -> dict[str, list[TaggedSentence]]:
    splits = {}
    tables = dataset_splits(args.dataset_name, args.dataset_config, (args.tokens_column, args.tags_column))
    for split, table in tables.items():
        names = getattr(table.features[args.tags_column], "feature", None)
        names = getattr(names, "names", None)  # tags stored as ClassLabel ids
        sentences = []
        for row, (words, tags) in enumerate(zip(table[args.tokens_column], table[args.tags_column])):
            tags = [names[t] for t in tags] if names else [str(t) for t in tags]
            sentences.append(TaggedSentence(list(words), tags, f"{args.dataset_name}[{split}]", row, from_file=False))
        splits[split] = sentences
    return splits


def encode(tokenizer, sentences: list[TaggedSentence], label2id: dict) -> list[dict]:
    """Tokenizer features plus one label id per word (the model labels word i at position i)."""
    features = []
    for sentence in sentences:
        if len(sentence.tags) != len(sentence.words):
            raise DataFileError(
                f"{sentence.where()}: the sentence has {len(sentence.words)} words but {len(sentence.tags)} tags."
            )
        encoded = tokenizer(sentence.words, is_split_into_words=True)
        features.append({**encoded, "labels": label_ids(sentence.tags, label2id, sentence.where)})
    return features


def predicted_tags(predictions: np.ndarray, label_ids_: np.ndarray, id2label: dict) -> tuple[list, list]:
    """Gold and predicted tag sequences over the labelled positions of each sentence."""
    gold, predicted = [], []
    for row_predictions, row_labels in zip(predictions, label_ids_):
        keep = row_labels != -100
        gold.append([id2label[int(i)] for i in row_labels[keep]])
        predicted.append([id2label[int(i)] for i in row_predictions[keep]])
    return gold, predicted


def evaluation_report(gold, predicted, chunk_tags: bool = True) -> dict:
    """Token accuracy, and entity scores (seqeval) when the labels are chunk tags (IOB1, IOB2, IOBES)."""
    tokens = sum(len(g) for g in gold)
    correct = sum(a == b for g, p in zip(gold, predicted) for a, b in zip(g, p))
    report = {"token_accuracy": correct / tokens if tokens else 0.0}
    if chunk_tags:
        report["entities"] = entity_scores(gold, predicted)
    return report


def log_report(split: str, report: dict):
    logger.info("%s: token accuracy %.4f", split, report["token_accuracy"])
    if "entities" not in report:
        return
    logger.info("  %-10s %9s %9s %9s %8s", "entity", "precision", "recall", "f1", "support")
    for kind, scores in report["entities"].items():
        logger.info("  %-10s %9.4f %9.4f %9.4f %8d", kind, scores["precision"], scores["recall"], scores["f1"],
                    scores["support"])


def main(argv=None):
    args = parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(message)s")
    splits = read_dataset(args) if args.dataset_name else read_files(args)

    tokenizer = AutoTokenizer.from_pretrained(args.model)
    id2label = existing_label_map(AutoConfig.from_pretrained(args.model), "ElmoForTokenClassification")
    if id2label is None:
        id2label = build_label_map([tag for s in splits["train"] for tag in s.tags], outside="O")
    label2id = {label: i for i, label in id2label.items()}
    features = {split: encode(tokenizer, sentences, label2id) for split, sentences in splits.items()}
    logger.info("Labels: %s; sentences: %s", list(id2label.values()),
                {split: len(f) for split, f in features.items()})

    chunk_tags = has_chunk_tags(id2label.values())
    if not chunk_tags:
        logger.info("The labels are not IOB1/IOB2/IOBES chunk tags (B-/I-/E-/S- plus a type, or O): reporting token "
                    "accuracy only, no entity scores.")

    model = AutoModelForTokenClassification.from_pretrained(
        args.model, id2label=id2label, label2id=label2id, **head_options(args)
    )

    def score(predictions, label_ids_):
        return evaluation_report(*predicted_tags(predictions, label_ids_, id2label), chunk_tags=chunk_tags)

    def summarise(report):
        summary = {"token_accuracy": report["token_accuracy"]}
        if "entities" in report:
            summary.update({k: v for k, v in report["entities"]["overall"].items() if k != "support"})
        return summary

    return train_and_report(args, model, tokenizer, features, id2label, DataCollatorForTokenClassification(tokenizer),
                            score, summarise, log_report)


if __name__ == "__main__":
    sys.exit(run_example(main))
