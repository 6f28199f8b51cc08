#!/usr/bin/env python
"""Fine-tune ELMo for sentence classification (sentiment, topic, ...) with the Transformers Trainer.

The paper's recipe: the biLM stays frozen, the task learns a softmax-normalised weight per biLM layer and a scale
to mix them; the word vectors are pooled into one sentence vector (--pooling; optionally after a biLSTM,
--head-lstm-dim) and a linear classifier labels the sentence.

Data: TSV or CSV files whose first line names the columns (--text-column, --label-column; a tab separates the
fields of .tsv files and a comma those of other files unless --delimiter says otherwise; fields may be quoted as
in the csv module), or, with network access, a `datasets` name (--dataset-name, e.g. imdb) or a local folder of
train/validation/test data files. Labels come from the training data (or from --model when it is a
sequence-classification model already); any other label in validation or test data is an error.

Output in --output-dir: the model and tokenizer (load them with AutoModelForSequenceClassification, or
pipeline("text-classification", model=DIR)), labels.json, metrics.json (accuracy and precision / recall / F1 per
class and macro-averaged), layer_weights.png (the learned layer weights, the analogue of Figure 2 of the paper),
the epoch checkpoints and a model card (README.md: labels, metrics, the plot). --push-to-hub pushes to the Hub as
the Trainer does, the finished folder last; --report-to sends the training logs to tensorboard, wandb, ...
(default: none).

Example with bilm-tf's small test model (`python examples/quickstart.py` writes it to out/elmo-bilm-tf-fixture):

    python examples/run_sequence_classification.py --model out/elmo-bilm-tf-fixture \\
        --train-file train.tsv --validation-file dev.tsv --output-dir out/sentiment
"""

import argparse
import logging
import sys

import numpy as np
from transformers import AutoConfig, AutoModelForSequenceClassification, AutoTokenizer, DataCollatorWithPadding

import hf_elmo  # noqa: F401  (registers the ELMo Auto classes)
from hf_elmo.finetuning import (
    DataFileError,
    LabelledText,
    build_label_map,
    classification_scores,
    label_ids,
    read_text_classification_file,
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


logger = logging.getLogger("run_sequence_classification")


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    data = parser.add_argument_group("data (TSV/CSV files, or --dataset-name)")
    data.add_argument("--train-file", help="TSV or CSV training file with a header line")
    data.add_argument("--validation-file", help="file of the same format evaluated after every epoch and at the end")
    data.add_argument("--test-file", help="file of the same format evaluated once at the end")
    data.add_argument("--text-column", default="text", help="column holding the text (default: %(default)s)")
    data.add_argument("--label-column", default="label", help="column holding the label (default: %(default)s)")
    data.add_argument("--delimiter", default=None,
                      help="field separator (default: a tab for .tsv files, a comma otherwise)")
    data.add_argument("--dataset-name",
                      help="instead of files: a `datasets` name such as imdb (needs network access and "
                      "`pip install \"hf-elmo[examples]\"`) or a local folder of train/validation/test data files; "
                      "--text-column and --label-column name its columns")
    data.add_argument("--dataset-config", help="configuration name of --dataset-name, if it has several")
    data.add_argument("--pooling", choices=("mean", "max", "final"), default="mean",
                      help="how word vectors become one sentence vector: mean or max over the words, or final "
                      "(forward state at the last word with backward state at the first) (default: %(default)s)")
    return add_finetuning_arguments(parser)


def parse_args(argv=None):
    parser = build_parser()
    args = parser.parse_args(argv)
    if bool(args.train_file) == bool(args.dataset_name):
        parser.error("give either --train-file (TSV/CSV files) or --dataset-name")
    if args.dataset_name and (args.validation_file or args.test_file):
        parser.error("--validation-file / --test-file go with --train-file, not with --dataset-name")
    check_finetuning_arguments(parser, args)
    return args


def read_files(args) -> dict[str, list[LabelledText]]:
    files = {"train": args.train_file, "validation": args.validation_file, "test": args.test_file}
    return {
        split: read_text_classification_file(path, args.text_column, args.label_column, args.delimiter)
        for split, path in files.items()
        if path
    }


def read_dataset(args) -> dict[str, list[LabelledText]]:
    splits = {}
    tables = dataset_splits(args.dataset_name, args.dataset_config, (args.text_column, args.label_column))
    for split, table in tables.items():
        names = getattr(table.features[args.label_column], "names", None)  # labels stored as ClassLabel ids
        splits[split] = [
            LabelledText(text, names[label] if names else str(label), f"{args.dataset_name}[{split}]", row,
                         from_file=False)
            for row, (text, label) in enumerate(zip(table[args.text_column], table[args.label_column]))
        ]
    return splits


def encode(tokenizer, rows: list[LabelledText], label2id: dict) -> list[dict]:
    labels = label_ids([row.label for row in rows], label2id, lambda i: rows[i].where())
    return [{**tokenizer(row.text), "labels": label} for row, label in zip(rows, labels)]


def evaluation_report(predictions: np.ndarray, label_ids_: np.ndarray, id2label: dict) -> dict:
    return classification_scores([id2label[int(i)] for i in label_ids_], [id2label[int(i)] for i in predictions])


def log_report(split: str, report: dict):
    logger.info("%s: accuracy %.4f, macro F1 %.4f", split, report["accuracy"], report["macro"]["f1"])
    logger.info("  %-16s %9s %9s %9s %8s", "label", "precision", "recall", "f1", "support")
    for label, scores in report["classes"].items():
        logger.info("  %-16s %9.4f %9.4f %9.4f %8d", label, scores["precision"], scores["recall"], scores["f1"],
                    scores["support"])


def main(argv=None):
    args = parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(message)s")
    splits = read_dataset(args) if args.dataset_name else read_files(args)

    tokenizer = AutoTokenizer.from_pretrained(args.model)
    id2label = existing_label_map(AutoConfig.from_pretrained(args.model), "ElmoForSequenceClassification")
    if id2label is None:
        id2label = build_label_map(row.label for row in splits["train"])
    if len(id2label) < 2:
        raise DataFileError(f"{splits['train'][0].source}: the training data has a single label "
                            f"{list(id2label.values())}; a classifier needs at least two.")
    label2id = {label: i for i, label in id2label.items()}
    features = {split: encode(tokenizer, rows, label2id) for split, rows in splits.items()}
    logger.info("Labels: %s; texts: %s", list(id2label.values()), {split: len(f) for split, f in features.items()})

    model = AutoModelForSequenceClassification.from_pretrained(
        args.model, id2label=id2label, label2id=label2id, problem_type="single_label_classification",
        classifier_pooling=args.pooling, **head_options(args)
    )

    def score(predictions, label_ids_):
        return evaluation_report(predictions, label_ids_, id2label)

    def summarise(report):
        return {"accuracy": report["accuracy"], "macro_f1": report["macro"]["f1"]}

    return train_and_report(args, model, tokenizer, features, id2label, DataCollatorWithPadding(tokenizer), score,
                            summarise, log_report)


if __name__ == "__main__":
    sys.exit(run_example(main))
