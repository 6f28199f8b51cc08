"""Data files, metrics and plots for fine-tuning the ELMo task heads (used by examples/run_*_classification.py).

- `read_conll`: CoNLL-style files (one word per line with its columns, blank lines between sentences).
- `read_text_classification_file`: TSV/CSV files with a text column and a label column.
- `entity_scores`: entity-level precision / recall / F1 per type, computed by seqeval in its default mode (the chunk
  rules of CoNLL's `conlleval`): IOB1, IOB2 and IOBES tags all work; `has_chunk_tags` says whether a tag set is one.
- `classification_scores`: accuracy and per-class / macro precision, recall, F1 for sentence labels.
- `plot_layer_weights`: the learned softmax weight of each biLM layer per task, as in Figure 2 of the ELMo paper.
- `compute_elmo_layers` and `ElmoLayersCollator`: a frozen biLM's layers computed once, and batched for the heads'
  `elmo_hidden_states` input, so that training a head never runs the biLM again.

The example scripts' command-line options and Trainer run live beside them, in `examples/finetuning_cli.py`.

Every reading error names the file and line. Nothing here is copied for `trust_remote_code`.
"""

from __future__ import annotations

import codecs
import csv
import logging
import os
import re
import warnings
from dataclasses import dataclass

from .safe_output import atomic_output_file
from .text_encoding import not_utf8_message


logger = logging.getLogger(__name__)

DOCSTART = "-DOCSTART-"
OUTSIDE = "O"


@dataclass
class TaggedSentence:
    words: list[str]
    tags: list[str]
    source: str = "<memory>"  # the file, or the dataset and split, it came from
    line: int = 0  # line of its first word in a CoNLL file (one word per line), or its row in a dataset
    from_file: bool = True

    def where(self, word: int = 0) -> str:
        """Where a word of this sentence came from: `file:line`, or `dataset row R word W`."""
        if self.from_file:
            return f"{self.source}:{self.line + word}"
        return f"{self.source} row {self.line} word {word}"


class DataFileError(ValueError):
    """A data file that cannot be used as it is; the message names the file and the line."""


def utf8_lines(path: str):
    """
    (1-based number, text with its line ending) of each line of a UTF-8 file (a UTF-8 byte-order mark is dropped).
    A file in another encoding stops with its name, line and the bytes that are not UTF-8, not a UnicodeDecodeError.
    """
    with open(path, "rb") as handle:
        handle.seek(len(codecs.BOM_UTF8) if handle.read(3) == codecs.BOM_UTF8 else 0)
        for number, raw in enumerate(handle, start=1):
            try:
                yield number, raw.decode("utf-8")
            except UnicodeDecodeError as error:
                raise DataFileError(not_utf8_message(path, f"{path}:{number}", raw, error)) from None


def read_conll(path: str | os.PathLike, label_column: int = -1, word_column: int = 0) -> list[TaggedSentence]:
    """
    Sentences of a CoNLL-format file: one word per line, columns separated by whitespace (spaces or tabs), blank
    lines between sentences, `-DOCSTART-` lines ignored. `label_column` picks the tag column (0-based; negative
    counts from the end, default the last: the NER tags of CoNLL-2003). Every word line must have as many columns
    as the first one.
    """
    path = os.fspath(path)
    if not os.path.isfile(path):
        raise FileNotFoundError(f"{path}: no such file.")
    sentences, words, tags = [], [], []
    first_line = n_columns = None
    for number, raw in utf8_lines(path):
        line = raw.strip()
        if not line or line.startswith(DOCSTART):
            if words:
                sentences.append(TaggedSentence(words, tags, path, first_line))
                words, tags = [], []
            continue
        columns = line.split()
        if n_columns is None:
            n_columns = len(columns)
            for column, name in ((label_column, "label_column"), (word_column, "word_column")):
                if not -n_columns <= column < n_columns:
                    raise DataFileError(
                        f"{path}:{number}: {name}={column} but the lines have {n_columns} columns: {line!r}."
                    )
            if n_columns < 2:
                raise DataFileError(f"{path}:{number}: expected a word and a tag separated by whitespace, got {line!r}.")
        elif len(columns) != n_columns:
            raise DataFileError(
                f"{path}:{number}: expected {n_columns} whitespace-separated columns as on the first word line, "
                f"got {len(columns)}: {line!r}."
            )
        if not words:
            first_line = number
        words.append(columns[word_column])
        tags.append(columns[label_column])
    if words:
        sentences.append(TaggedSentence(words, tags, path, first_line))
    if not sentences:
        raise DataFileError(f"{path}: no sentences found (the file is empty or holds only -DOCSTART- lines).")
    return sentences


@dataclass
class LabelledText:
    text: str
    label: str
    source: str = "<memory>"  # the file, or the dataset and split, it came from
    line: int = 0  # its line in the file, or its row in a dataset
    from_file: bool = True

    def where(self) -> str:
        return f"{self.source}:{self.line}" if self.from_file else f"{self.source} row {self.line}"


def read_text_classification_file(
    path: str | os.PathLike, text_column: str = "text", label_column: str = "label", delimiter: str | None = None
) -> list[LabelledText]:
    """
    Rows of a TSV or CSV file with a header line naming its columns (quoted fields as in the `csv` module).
    `delimiter` defaults to a tab for `.tsv` files and a comma otherwise.
    """
    path = os.fspath(path)
    if not os.path.isfile(path):
        raise FileNotFoundError(f"{path}: no such file.")
    if delimiter is None:
        delimiter = "\t" if path.lower().endswith(".tsv") else ","
    rows = []
    reader = csv.reader((text for _, text in utf8_lines(path)), delimiter=delimiter)
    header = next(reader, None)
    if header is None:
        raise DataFileError(f"{path}: the file is empty (expected a header line naming the columns).")
    for name in (text_column, label_column):
        if name not in header:
            raise DataFileError(
                f"{path}:1: no column named {name!r} in the header {header} (delimiter {delimiter!r})."
            )
    text_index, label_index = header.index(text_column), header.index(label_column)
    for fields in reader:
        number = reader.line_num
        if not fields:
            continue
        if len(fields) != len(header):
            raise DataFileError(
                f"{path}:{number}: expected {len(header)} fields as in the header, got {len(fields)}: {fields!r}."
            )
        label = fields[label_index].strip()
        if not label:
            raise DataFileError(f"{path}:{number}: the {label_column!r} field is empty.")
        rows.append(LabelledText(fields[text_index], label, path, number))
    if not rows:
        raise DataFileError(f"{path}: no rows after the header line.")
    return rows


def build_label_map(labels, outside: str | None = None) -> dict[int, str]:
    """`id2label` over the labels seen (sorted, with `outside` first when present, so "O" gets id 0)."""
    names = sorted(set(labels))
    if outside is not None and outside in names:
        names.remove(outside)
        names.insert(0, outside)
    return dict(enumerate(names))


def label_ids(labels, label2id: dict[str, int], where) -> list[int]:
    """Map label names to ids; an unknown label raises naming `where(i)` (e.g. "file:line") for label i."""
    ids = []
    for i, label in enumerate(labels):
        if label not in label2id:
            raise DataFileError(
                f"{where(i)}: label {label!r} is not one of the model's labels {sorted(label2id)} (they come from "
                "the training data, or from --model when it already has a classification head)."
            )
        ids.append(label2id[label])
    return ids


# ---------------------------------------------------------------------------------------------
# Entity-level scores, through seqeval (as the Transformers token-classification examples compute them).
# ---------------------------------------------------------------------------------------------
_CHUNK_TAG = re.compile(r"^[BIES]-.+$")


def has_chunk_tags(tags) -> bool:
    """
    Whether a tag set is a chunk scheme that entity scores apply to: every tag is `O` or `B-`/`I-`/`E-`/`S-` plus a
    type (IOB1, IOB2, IOBES). POS tags or other labels without a prefix are not (seqeval would read `NNP` as a
    chunk of type `NP`), so the examples report token accuracy alone for them.
    """
    return all(tag == OUTSIDE or _CHUNK_TAG.match(tag) for tag in tags)


def entity_scores(gold: list[list[str]], predicted: list[list[str]]) -> dict[str, dict[str, float]]:
    """
    Entity-level precision, recall, F1 and support (gold entities) per entity type and `"overall"` (micro-averaged),
    computed by seqeval in its default mode, which applies the chunk rules of CoNLL's `conlleval` script: an entity
    counts as found only with the same type and exactly the same words. Tags must be IOB1, IOB2 or IOBES
    (`has_chunk_tags`). Needs seqeval (`pip install "hf-elmo[examples]"`).
    """
    try:
        from seqeval.metrics import classification_report
    except ImportError as err:
        raise ImportError('entity_scores needs seqeval: pip install "hf-elmo[examples]"') from err
    if len(gold) != len(predicted):
        raise ValueError(f"entity_scores: {len(gold)} gold sentences but {len(predicted)} predicted ones.")
    for index, (gold_tags, predicted_tags) in enumerate(zip(gold, predicted)):
        if len(gold_tags) != len(predicted_tags):
            raise ValueError(
                f"entity_scores: sentence {index} has {len(gold_tags)} gold tags but {len(predicted_tags)} predicted."
            )
    unprefixed = sorted({tag for tags in (*gold, *predicted) for tag in tags if not has_chunk_tags([tag])})
    if unprefixed:
        raise ValueError(
            f"entity_scores: tags {unprefixed[:5]} are neither O nor B-/I-/E-/S- plus a type; entity scores need "
            "IOB1, IOB2 or IOBES tags."
        )
    with warnings.catch_warnings():
        # Without any entity, seqeval's macro average is the mean of nothing; only the micro average is used here.
        warnings.simplefilter("ignore", RuntimeWarning)
        report = classification_report(gold, predicted, output_dict=True, zero_division=0)
    scores = {}
    for kind, values in report.items():
        if kind in ("macro avg", "weighted avg"):
            continue
        scores["overall" if kind == "micro avg" else kind] = {
            "precision": float(values["precision"]),
            "recall": float(values["recall"]),
            "f1": float(values["f1-score"]),
            "support": int(values["support"]),
        }
    return {kind: scores[kind] for kind in sorted(k for k in scores if k != "overall")} | {"overall": scores["overall"]}


def classification_scores(gold: list[str], predicted: list[str]) -> dict:
    """
    Accuracy, and precision / recall / F1 / support per class (every class seen in gold or predicted) and their
    macro average, by scikit-learn (a class never predicted has precision 0).
    """
    from sklearn.metrics import accuracy_score, precision_recall_fscore_support

    if len(gold) != len(predicted):
        raise ValueError(f"classification_scores: {len(gold)} gold labels but {len(predicted)} predicted.")
    if not gold:
        raise ValueError("classification_scores: no examples.")
    labels = sorted(set(gold) | set(predicted))
    precision, recall, f1, support = precision_recall_fscore_support(gold, predicted, labels=labels,
                                                                     zero_division=0)
    per_class = {
        label: {"precision": float(p), "recall": float(r), "f1": float(f), "support": int(n)}
        for label, p, r, f, n in zip(labels, precision, recall, f1, support)
    }
    macro = {key: float(sum(c[key] for c in per_class.values()) / len(per_class))
             for key in ("precision", "recall", "f1")}
    return {"accuracy": float(accuracy_score(gold, predicted)), "macro": macro, "classes": per_class}


# ---------------------------------------------------------------------------------------------
# How long a head trains when the user does not say. Measured on CoNLL-2003 subsets of 500 to 14,041 sentences
# (README "Small data"): few sentences need many passes (at 500, 3 epochs gave 39.6 test F1 and 15 gave 53.5), many
# need fewer, and every size needs enough optimizer steps. So a head trains for enough epochs to take HEAD_MIN_STEPS
# steps, no fewer than HEAD_MIN_EPOCHS and no more than HEAD_MAX_EPOCHS (6 on the whole of CoNLL-2003 at batch 32,
# about 1.3x the time of the 3 epochs before, where 7 cost 1.5x for no better score); with validation data it is
# scored every epoch, stops when the score has not improved for HEAD_PATIENCE evaluations in a row, and the best
# epoch is kept.
# ---------------------------------------------------------------------------------------------
HEAD_MIN_STEPS = 2500
HEAD_MIN_EPOCHS = 3
HEAD_MAX_EPOCHS = 30
HEAD_PATIENCE = 5


def default_head_epochs(examples: int, batch_size: int) -> int:
    """The epochs a head trains on `examples` training examples in batches of `batch_size` (all devices and
    accumulation steps together) by the small-data rule above."""
    steps_per_epoch = max(1, -(-examples // batch_size))
    return min(HEAD_MAX_EPOCHS, max(HEAD_MIN_EPOCHS, -(-HEAD_MIN_STEPS // steps_per_epoch)))


def head_training_rule(examples: int, batch_size: int, patience: int | None) -> str:
    """The small-data rule applied to a run, in words, for its log: the epochs it gives, why, and how the run stops."""
    epochs = default_head_epochs(examples, batch_size)
    why = (f"{epochs} epochs: {examples} training examples in batches of {batch_size} (the default takes enough "
           f"epochs for {HEAD_MIN_STEPS} optimizer steps, at least {HEAD_MIN_EPOCHS} and at most {HEAD_MAX_EPOCHS})")
    if patience is None:
        return (f"{why}; every epoch runs and the last one is kept (stopping early needs validation data, scored "
                "when a checkpoint is saved)")
    return (f"up to {why}, scored on the validation data every epoch; training stops when the score has not improved "
            f"for {patience} evaluations in a row, and the best epoch is kept")


# ---------------------------------------------------------------------------------------------
# A frozen biLM's layers, computed once: the head's epochs then never pay for the biLM (as AllenNLP users cached
# ELMo vectors). `ElmoForTokenClassification` / `ElmoForSequenceClassification` take them as `elmo_hidden_states`.
# ---------------------------------------------------------------------------------------------
def compute_elmo_layers(elmo, tokenizer, sentences: list[list[str]], batch_size: int = 64,
                        progress: bool = True) -> list:
    """
    Every biLM layer of each sentence (lists of words), `(num_lstm_layers + 1, words, hidden_size)` float32 tensors
    in the order given. Batches are formed from sentences of similar length (a sentence's vectors never depend on
    its batch); `elmo` is an `ElmoModel`, run without autograd.
    """
    import torch
    from tqdm.auto import tqdm

    order = sorted(range(len(sentences)), key=lambda i: len(sentences[i]))
    layers = [None] * len(sentences)
    was_training = elmo.training
    elmo.eval()
    try:
        with torch.no_grad():
            for start in tqdm(range(0, len(order), batch_size), desc="biLM layers", unit="batch",
                              disable=None if progress else True):
                chunk = order[start : start + batch_size]
                batch = tokenizer([sentences[i] for i in chunk], is_split_into_words=True, padding=True,
                                  return_tensors="pt")
                hidden = elmo(**batch.to(elmo.device), output_hidden_states=True).hidden_states
                stacked = torch.stack(hidden, dim=1).float().cpu()
                for row, index in enumerate(chunk):
                    layers[index] = stacked[row, :, : len(sentences[index])].clone()
    finally:
        elmo.train(was_training)
    return layers


class ElmoLayersCollator:
    """
    Batches of `{"elmo_hidden_states": (layers, words, dim), "labels": [...]}` features (labels optional; one per
    word for token tasks, one per sentence otherwise): the layers padded with zeros to the longest sentence, an
    `attention_mask`, and word labels padded with -100.
    """

    def __call__(self, features: list[dict]) -> dict:
        import torch

        longest = max(f["elmo_hidden_states"].shape[1] for f in features)
        first = features[0]["elmo_hidden_states"]
        states = first.new_zeros(len(features), first.shape[0], longest, first.shape[2])
        mask = torch.zeros(len(features), longest, dtype=torch.long)
        for row, feature in enumerate(features):
            words = feature["elmo_hidden_states"].shape[1]
            states[row, :, :words] = feature["elmo_hidden_states"]
            mask[row, :words] = 1
        batch = {"elmo_hidden_states": states, "attention_mask": mask}
        if "labels" in features[0]:
            labels = [feature["labels"] for feature in features]
            if isinstance(labels[0], (list, tuple)):
                batch["labels"] = torch.tensor([list(l) + [-100] * (longest - len(l)) for l in labels])
            else:
                batch["labels"] = torch.tensor(labels)
        return batch


# ---------------------------------------------------------------------------------------------
# Figure 2 of the paper: where each task puts its weight.
# ---------------------------------------------------------------------------------------------
def layer_names(num_layers: int) -> list[str]:
    return ["token layer"] + [f"biLSTM {i}" for i in range(1, num_layers)]


def plot_layer_weights(weights_by_task: dict[str, list[float]], path: str | os.PathLike, title: str | None = None):
    """
    A heat map of the softmax-normalised layer weights, one row per task and one column per biLM layer (token layer
    first), each cell labelled with its value. Needs matplotlib (`pip install "hf-elmo[examples]"`).
    """
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError as err:
        raise ImportError('plot_layer_weights needs matplotlib: pip install "hf-elmo[examples]"') from err
    if not weights_by_task:
        raise ValueError("plot_layer_weights: no tasks to plot.")
    widths = {len(w) for w in weights_by_task.values()}
    if len(widths) != 1:
        raise ValueError(f"plot_layer_weights: the tasks have different numbers of layers {sorted(widths)}.")
    num_layers = widths.pop()
    tasks = list(weights_by_task)
    values = [list(weights_by_task[t]) for t in tasks]

    figure, axes = plt.subplots(figsize=(1.6 + 1.3 * num_layers, 1.2 + 0.5 * len(tasks)))
    image = axes.imshow(values, cmap="Blues", vmin=0.0, vmax=1.0, aspect="auto")
    axes.set_xticks(range(num_layers), layer_names(num_layers))
    axes.set_yticks(range(len(tasks)), tasks)
    for row, task_values in enumerate(values):
        for column, value in enumerate(task_values):
            axes.text(column, row, f"{value:.2f}", ha="center", va="center", color="white" if value > 0.6 else "black")
    axes.set_title(title or "Learned ELMo layer weights (softmax-normalised)")
    figure.colorbar(image, ax=axes)
    try:
        with atomic_output_file(path) as partial:
            figure.savefig(partial, format="png", dpi=120, bbox_inches="tight")
    finally:
        plt.close(figure)
    return path


__all__ = [
    "DataFileError",
    "classification_scores",
    "LabelledText",
    "TaggedSentence",
    "build_label_map",
    "entity_scores",
    "has_chunk_tags",
    "label_ids",
    "layer_names",
    "plot_layer_weights",
    "read_conll",
    "read_text_classification_file",
]
