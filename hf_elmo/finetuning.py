"""Data files, metrics and plots for fine-tuning the ELMo task heads (used by examples/run_*_classification.py).

- `read_conll`: CoNLL-style files (one word per line with its columns, blank lines between sentences).
- `read_text_classification_file`: TSV/CSV files with a text column and a label column.
- `entity_scores`: entity-level precision / recall / F1 per type, with the chunk rules of the CoNLL `conlleval`
  script (the default, non-strict mode of seqeval): IOB1, IOB2 and IOBES tags all work.
- `plot_layer_weights`: the learned softmax weight of each biLM layer per task, as in Figure 2 of the ELMo paper.

Every reading error names the file and line. Nothing here is copied for `trust_remote_code`.
"""

from __future__ import annotations

import csv
import logging
import os
from dataclasses import dataclass


logger = logging.getLogger(__name__)

DOCSTART = "-DOCSTART-"
OUTSIDE = "O"


@dataclass
class TaggedSentence:
    words: list[str]
    tags: list[str]
    line: int  # line of the first word, for messages


class DataFileError(ValueError):
    """A data file that cannot be used as it is; the message names the file and the line."""


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
    with open(path, encoding="utf-8") as handle:
        for number, raw in enumerate(handle, start=1):
            line = raw.strip()
            if not line or line.startswith(DOCSTART):
                if words:
                    sentences.append(TaggedSentence(words, tags, first_line))
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
        sentences.append(TaggedSentence(words, tags, first_line))
    if not sentences:
        raise DataFileError(f"{path}: no sentences found (the file is empty or holds only -DOCSTART- lines).")
    return sentences


@dataclass
class LabelledText:
    text: str
    label: str
    line: int


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
    with open(path, encoding="utf-8", newline="") as handle:
        reader = csv.reader(handle, delimiter=delimiter)
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
            rows.append(LabelledText(fields[text_index], label, number))
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
    """Map label names to ids; an unknown label raises with `where(i)`, e.g. "file:line"."""
    ids = []
    for i, label in enumerate(labels):
        if label not in label2id:
            raise DataFileError(
                f"{where(i)}: label {label!r} is not one of the model's labels {sorted(label2id)} (labels come from "
                "the training file or the model's id2label)."
            )
        ids.append(label2id[label])
    return ids


# ---------------------------------------------------------------------------------------------
# Entity-level scores, conlleval's chunk rules.
# ---------------------------------------------------------------------------------------------
def _split_tag(tag: str) -> tuple[str, str]:
    """`"B-PER"` -> `("B", "PER")`; `"O"` -> `("O", "")`; an unprefixed label `"PER"` -> `("I", "PER")`."""
    if tag == OUTSIDE:
        return OUTSIDE, ""
    prefix, sep, kind = tag.partition("-")
    if sep and prefix in ("B", "I", "E", "S"):
        return prefix, kind
    return "I", tag


def _ends_chunk(prev_prefix, prev_kind, prefix, kind) -> bool:
    if prev_prefix in ("E", "S"):
        return True
    if prev_prefix in ("B", "I") and prefix in ("B", "S", OUTSIDE):
        return True
    return prev_prefix != OUTSIDE and prev_kind != kind


def _starts_chunk(prev_prefix, prev_kind, prefix, kind) -> bool:
    if prefix in ("B", "S"):
        return True
    if prev_prefix in ("E", "S", OUTSIDE) and prefix in ("E", "I"):
        return True
    return prefix != OUTSIDE and prev_kind != kind


def entity_spans(tags: list[str]) -> set[tuple[str, int, int]]:
    """The entities of one tag sequence as `(type, first_word, last_word + 1)`."""
    spans, start = set(), None
    prev_prefix, prev_kind = OUTSIDE, ""
    for position, tag in enumerate([*tags, OUTSIDE]):
        prefix, kind = _split_tag(tag)
        if start is not None and _ends_chunk(prev_prefix, prev_kind, prefix, kind):
            spans.add((prev_kind, start, position))
            start = None
        if _starts_chunk(prev_prefix, prev_kind, prefix, kind):
            start = position
        prev_prefix, prev_kind = prefix, kind
    return spans


def entity_scores(gold: list[list[str]], predicted: list[list[str]]) -> dict[str, dict[str, float]]:
    """
    Entity-level precision, recall, F1 and support (gold entities) per entity type and `"overall"` (micro-averaged):
    an entity counts as found only with the same type and exactly the same words.
    """
    if len(gold) != len(predicted):
        raise ValueError(f"entity_scores: {len(gold)} gold sentences but {len(predicted)} predicted ones.")
    counts: dict[str, list[int]] = {}  # type -> [correct, predicted, gold]
    for index, (gold_tags, predicted_tags) in enumerate(zip(gold, predicted)):
        if len(gold_tags) != len(predicted_tags):
            raise ValueError(
                f"entity_scores: sentence {index} has {len(gold_tags)} gold tags but {len(predicted_tags)} predicted."
            )
        gold_spans, predicted_spans = entity_spans(gold_tags), entity_spans(predicted_tags)
        for kind, *_ in gold_spans | predicted_spans:
            counts.setdefault(kind, [0, 0, 0])
        for span in gold_spans & predicted_spans:
            counts[span[0]][0] += 1
        for span in predicted_spans:
            counts[span[0]][1] += 1
        for span in gold_spans:
            counts[span[0]][2] += 1
    totals = [sum(c[i] for c in counts.values()) for i in range(3)]
    scores = {kind: _prf(*counts[kind]) for kind in sorted(counts)}
    scores["overall"] = _prf(*totals)
    return scores


def _prf(correct: int, predicted: int, gold: int) -> dict[str, float]:
    precision = correct / predicted if predicted else 0.0
    recall = correct / gold if gold else 0.0
    f1 = 2 * precision * recall / (precision + recall) if precision + recall else 0.0
    return {"precision": precision, "recall": recall, "f1": f1, "support": gold}


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
    figure.tight_layout()
    os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
    figure.savefig(path, dpi=120)
    plt.close(figure)
    return path


__all__ = [
    "DataFileError",
    "LabelledText",
    "TaggedSentence",
    "build_label_map",
    "entity_scores",
    "entity_spans",
    "label_ids",
    "layer_names",
    "plot_layer_weights",
    "read_conll",
    "read_text_classification_file",
]
