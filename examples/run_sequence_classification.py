#!/usr/bin/env python
"""Fine-tune ELMo for sentence classification (sentiment, topic, ...) with the Transformers Trainer.

The paper's recipe: the biLM stays frozen, the task learns a softmax-normalised weight per biLM layer and a scale
to mix them; the word vectors (after a biLSTM, --head_lstm_dim, 0 for none) are pooled into one sentence vector
(--pooling) and a linear classifier labels the sentence.

The options are those of Transformers' run_glue.py: --model_name_or_path, the data options below, and every
TrainingArguments option (--learning_rate, --num_train_epochs, --bf16, --lr_scheduler_type,
--load_best_model_at_end, --push_to_hub, --report_to, ...), with defaults measured for a frozen ELMo. One .json file
of options works too. Without --do_train / --do_eval / --do_predict, it does every step the data allows.

Data: TSV or CSV files whose first line names the columns (--text_column_name, --label_column_name; a tab
separates the fields of .tsv files and a comma those of other files unless --delimiter says otherwise; fields may
be quoted as in the csv module), or a `datasets` name or folder (--dataset_name). Labels come from --label_list,
else from --model_name_or_path when it is a sequence-classification model already, else from the training data;
any other label in the data is an error.

--output_dir receives the model and tokenizer (load them with AutoModelForSequenceClassification, or
pipeline("text-classification", model=DIR)), labels.json, metrics.json (accuracy, precision / recall / F1 per class
and macro-averaged, by scikit-learn), train/eval/predict/all_results.json, predictions.txt (index and predicted
label of each test example, as run_glue.py writes them), layer_weights.png (the learned layer weights, Figure 2 of
the paper), the checkpoints and a model card. A non-empty --output_dir is refused unless it holds this run's
checkpoints (resumed from) or --overwrite_output_dir is given.

Example with bilm-tf's small test model (`python examples/quickstart.py` writes it to out/elmo-bilm-tf-fixture):

    python examples/run_sequence_classification.py --model_name_or_path out/elmo-bilm-tf-fixture \\
        --train_file examples/data/sentiment/train.tsv --validation_file examples/data/sentiment/dev.tsv \\
        --output_dir out/sentiment
"""

import logging
import sys
from dataclasses import dataclass, field

from hf_elmo.threads import keep_compiled_code_in_user_cache

keep_compiled_code_in_user_cache()  # first: Transformers' imports create torch's compile cache folder

import numpy as np
from transformers import AutoModelForSequenceClassification, AutoTokenizer, DataCollatorWithPadding

import hf_elmo  # noqa: F401  (registers the ELMo Auto classes)
from hf_elmo.model_source import resolve_model
from hf_elmo.finetuning import (
    DataFileError,
    LabelledText,
    build_label_map,
    classification_scores,
    label_ids,
    read_text_classification_file,
)
from finetuning_cli import (  # beside this script
    DataArguments,
    ModelArguments,
    Task,
    choose_labels,
    dataset_splits,
    fine_tuned_config,
    limited,
    parse_arguments,
    run_example,
    run_finetuning,
)


logger = logging.getLogger("run_sequence_classification")


@dataclass
class SequenceModelArguments(ModelArguments):
    HEAD_OPTIONS = (*ModelArguments.HEAD_OPTIONS, "pooling")
    CONFIG_KEYS = {"pooling": "classifier_pooling"}

    pooling: str = field(default="mean", metadata={"choices": ("mean", "max", "final"), "help": (
        "how word vectors become one sentence vector: mean or max over the words, or final (forward state at the "
        "last word with backward state at the first)."
    )})


@dataclass
class SequenceDataArguments(DataArguments):
    text_column_name: str = field(default="text", metadata={"help": "column of the text."})
    label_column_name: str = field(default="label", metadata={"help": "column of the label."})
    delimiter: str | None = field(default=None, metadata={"help": (
        "field separator of the files (default: a tab for .tsv files, a comma otherwise)."
    )})


def read_files(args) -> dict[str, list[LabelledText]]:
    files = {"train": args.train_file, "validation": args.validation_file, "test": args.test_file}
    return {
        split: read_text_classification_file(path, args.text_column_name, args.label_column_name, args.delimiter)
        for split, path in files.items()
        if path
    }


def read_dataset(args) -> dict[str, list[LabelledText]]:
    splits = {}
    tables = dataset_splits(args.dataset_name, args.dataset_config_name, (args.text_column_name,
                                                                          args.label_column_name))
    for split, table in tables.items():
        names = getattr(table.features[args.label_column_name], "names", None)  # labels stored as ClassLabel ids
        splits[split] = [
            LabelledText(text, names[label] if names else str(label), f"{args.dataset_name}[{split}]", row,
                         from_file=False)
            for row, (text, label) in enumerate(zip(table[args.text_column_name], table[args.label_column_name]))
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
    model_args, data_args, training_args = parse_arguments(SequenceDataArguments, SequenceModelArguments, argv=argv,
                                                           description=__doc__)
    logging.basicConfig(level=logging.INFO, format="%(message)s")
    splits = limited(read_dataset(data_args) if data_args.dataset_name else read_files(data_args), data_args)

    # A mistyped folder fails here at once, without Hub requests and their retries.
    name, load_options = resolve_model(model_args.model_name_or_path)
    tokenizer = AutoTokenizer.from_pretrained(name, **load_options)
    fine_tuned = fine_tuned_config(name, load_options, "ElmoForSequenceClassification")
    id2label = choose_labels(data_args, fine_tuned, "train" in splits and (
        lambda: build_label_map(row.label for row in splits["train"])))
    if len(id2label) < 2:
        where = splits["train"][0].source if "train" in splits else "--label_list"
        raise DataFileError(f"{where}: a single label {list(id2label.values())}; a classifier needs at least two.")
    label2id = {label: i for i, label in id2label.items()}
    features = {split: encode(tokenizer, rows, label2id) for split, rows in splits.items()}
    logger.info("Labels: %s; texts: %s", list(id2label.values()), {split: len(f) for split, f in features.items()})

    model = AutoModelForSequenceClassification.from_pretrained(
        name, **load_options, id2label=id2label, label2id=label2id,
        problem_type="single_label_classification", **model_args.head_options(fine_tuned)
    )

    def score(predictions, label_ids_):
        return evaluation_report(predictions, label_ids_, id2label)

    def summarise(report):
        return {"accuracy": report["accuracy"], "macro_f1": report["macro"]["f1"]}

    def prediction_lines(predictions, label_ids_):
        # As run_glue.py's predictions file: a header, then the index and predicted label of each example.
        return ["index\tprediction"] + [f"{i}\t{id2label[int(p)]}" for i, p in enumerate(predictions)]

    task = Task("text-classification", features, id2label, DataCollatorWithPadding(tokenizer), score, summarise,
                log_report, prediction_lines, needs=("sklearn",))
    return run_finetuning(model_args, data_args, training_args, model, tokenizer, task, load_options)


if __name__ == "__main__":
    sys.exit(run_example(main))
