#!/usr/bin/env python
"""Fine-tune ELMo for token classification (NER, POS tagging, chunking) with the Transformers Trainer.

The paper's recipe: the biLM stays frozen, the task learns a softmax-normalised weight per biLM layer and a scale
to mix them, then a biLSTM (--head_lstm_dim, 0 for none) and a classifier label every word.

The options are those of Transformers' run_ner.py: --model_name_or_path, the data options below, and every
TrainingArguments option (--learning_rate, --num_train_epochs, --bf16, --lr_scheduler_type,
--load_best_model_at_end, --push_to_hub, --report_to, ...), with defaults measured for a frozen ELMo. One .json file
of options works too. Without --do_train / --do_eval / --do_predict, it does every step the data allows.

Data: CoNLL-format files (one word per line with its columns, blank lines between sentences, -DOCSTART- lines
skipped; --tag_column picks the tag column) or a `datasets` name or folder (--dataset_name). Labels come from
--label_list, else from --model_name_or_path when it is a token-classification model already, else from the
training data; any other label in the data is an error.

--output_dir receives the model and tokenizer (load them with AutoModelForTokenClassification), labels.json,
metrics.json (token accuracy and, for IOB1/IOB2/IOBES tags, seqeval's entity precision / recall / F1 per type),
train/eval/predict/all_results.json, predictions.txt (the test data's predicted tags, one sentence a line),
layer_weights.png (the learned layer weights, Figure 2 of the paper), the checkpoints and a model card. A non-empty
--output_dir is refused unless it holds this run's checkpoints (resumed from) or --overwrite_output_dir is given.

Example with bilm-tf's small test model (`python examples/quickstart.py` writes it to out/elmo-bilm-tf-fixture):

    python examples/run_token_classification.py --model_name_or_path out/elmo-bilm-tf-fixture \\
        --train_file train.conll --validation_file dev.conll --test_file test.conll --output_dir out/ner
"""

import logging
import sys
from dataclasses import dataclass, field

from hf_elmo.threads import keep_compiled_code_in_user_cache

keep_compiled_code_in_user_cache()  # first: Transformers' imports create torch's compile cache folder

import numpy as np
from transformers import (
    AutoModelForTokenClassification,
    AutoTokenizer,
    DataCollatorForTokenClassification,
)

import hf_elmo  # noqa: F401  (registers the ELMo Auto classes)
from hf_elmo.model_source import resolve_model
from hf_elmo.modeling_elmo import iob2_transitions
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


logger = logging.getLogger("run_token_classification")


@dataclass
class TokenModelArguments(ModelArguments):
    HEAD_OPTIONS = (*ModelArguments.HEAD_OPTIONS, "head_crf")

    head_crf: bool = field(default=False, metadata={"help": (
        "a linear-chain CRF over the labels, decoded with Viterbi (the paper's NER model is a biLSTM-CRF); with IOB2 "
        "labels it never predicts a transition IOB2 forbids, and refuses IOB1 data, whose entities may start with I-."
    )})


@dataclass
class TokenDataArguments(DataArguments):
    word_column: int = field(default=0, metadata={"help": "CoNLL files: 0-based column of the words."})
    tag_column: int = field(default=-1, metadata={"help": (
        "CoNLL files: 0-based column of the tags; negative counts from the end (-1, the last column: CoNLL-2003's "
        "NER tags; -2 or 2 there are the chunk tags, 1 the POS tags)."
    )})
    text_column_name: str = field(default="tokens", metadata={"help": "--dataset_name: column of the words."})
    label_column_name: str = field(default="ner_tags", metadata={"help": "--dataset_name: column of the tags."})


def read_files(args) -> dict[str, list[TaggedSentence]]:
    files = {"train": args.train_file, "validation": args.validation_file, "test": args.test_file}
    return {
        split: read_conll(path, label_column=args.tag_column, word_column=args.word_column)
        for split, path in files.items()
        if path
    }


def read_dataset(args) -> dict[str, list[TaggedSentence]]:
    splits = {}
    tables = dataset_splits(args.dataset_name, args.dataset_config_name, (args.text_column_name,
                                                                          args.label_column_name))
    for split, table in tables.items():
        names = getattr(table.features[args.label_column_name], "feature", None)
        names = getattr(names, "names", None)  # tags stored as ClassLabel ids
        sentences = []
        for row, (words, tags) in enumerate(zip(table[args.text_column_name], table[args.label_column_name])):
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


def check_crf_tags(splits: dict, id2label: dict, label2id: dict) -> None:
    """
    With --head_crf and IOB2-style labels, every sentence of every split must keep IOB2's rule (`iob2_transitions`:
    an I- tag continues a B- or I- tag of its type), or one line names the first word that breaks it, before any
    training: IOB1 tags, in the test file only, were found after the whole training.
    """
    transitions = iob2_transitions(id2label)
    if transitions is None:
        return
    allowed, allowed_first = transitions
    for sentences in splits.values():
        for sentence in sentences:
            ids = [label2id.get(tag) for tag in sentence.tags]
            for word, (previous, current) in enumerate(zip([None, *ids], ids)):
                if current is None or (allowed_first[current] if previous is None else allowed[previous][current]):
                    continue
                after = "at the start of its sentence" if previous is None else f"after {id2label[previous]}"
                raise DataFileError(
                    f"{sentence.where(word)}: {id2label[current]} {after}, which IOB2 forbids (an I- tag continues a "
                    "B- or I- tag of its type) and --head_crf's CRF never predicts: these look like IOB1 tags. "
                    "Convert them to IOB2, or train without --head_crf."
                )


def main(argv=None):
    model_args, data_args, training_args = parse_arguments(TokenDataArguments, TokenModelArguments, argv=argv,
                                                           description=__doc__)
    logging.basicConfig(level=logging.INFO, format="%(message)s")
    splits = limited(read_dataset(data_args) if data_args.dataset_name else read_files(data_args), data_args)

    # A mistyped folder fails here at once, without Hub requests and their retries.
    name, load_options = resolve_model(model_args.model_name_or_path)
    tokenizer = AutoTokenizer.from_pretrained(name, **load_options)
    fine_tuned = fine_tuned_config(name, load_options, "ElmoForTokenClassification")
    head_options = model_args.head_options(fine_tuned)
    if head_options["head_crf"] and training_args.label_smoothing_factor:
        # The Trainer's label smoother takes the labels from the model and scores its per-word outputs itself.
        crf = "--head_crf" if "head_crf" in model_args.options_given else f"{model_args.model_name_or_path} has one"
        raise DataFileError(f"--label_smoothing_factor smooths a per-word softmax, and a CRF head ({crf}) is trained "
                            "on whole tag sequences instead: drop one of the two.")
    id2label = choose_labels(data_args, fine_tuned, "train" in splits and (
        lambda: build_label_map([tag for s in splits["train"] for tag in s.tags], outside="O")))
    label2id = {label: i for i, label in id2label.items()}
    if head_options["head_crf"]:
        check_crf_tags(splits, id2label, label2id)
    features = {split: encode(tokenizer, sentences, label2id) for split, sentences in splits.items()}
    logger.info("Labels: %s; sentences: %s", list(id2label.values()),
                {split: len(f) for split, f in features.items()})

    chunk_tags = has_chunk_tags(id2label.values())
    if not chunk_tags:
        logger.info("The labels are not IOB1/IOB2/IOBES chunk tags (B-/I-/E-/S- plus a type, or O): reporting token "
                    "accuracy only, no entity scores.")

    model = AutoModelForTokenClassification.from_pretrained(
        name, **load_options, id2label=id2label, label2id=label2id, **head_options
    )

    def score(predictions, label_ids_):
        return evaluation_report(*predicted_tags(predictions, label_ids_, id2label), chunk_tags=chunk_tags)

    def summarise(report):
        summary = {"token_accuracy": report["token_accuracy"]}
        if "entities" in report:
            summary.update({k: v for k, v in report["entities"]["overall"].items() if k != "support"})
        return summary

    def prediction_lines(predictions, label_ids_):
        # As run_ner.py's predictions.txt: each sentence's predicted tags, one sentence a line.
        return [" ".join(tags) for tags in predicted_tags(predictions, label_ids_, id2label)[1]]

    task = Task("token-classification", features, id2label, DataCollatorForTokenClassification(tokenizer), score,
                summarise, log_report, prediction_lines, needs=("seqeval",) if chunk_tags else (),
                best_metric="f1" if chunk_tags else "token_accuracy")
    return run_finetuning(model_args, data_args, training_args, model, tokenizer, task, load_options)


if __name__ == "__main__":
    sys.exit(run_example(main))
