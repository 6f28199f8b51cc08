"""Embed a text file with ELMo into HDF5 (`hf-elmo embed`): one dataset per input line.

Output layout (`format_version` 1), for an input of N lines and a model with L biLSTM layers and hidden size
H = 2 * projection_dim:

- dataset `"i"` (i = 0 .. N-1) holds line i + 1 of the input (0-based index, as AllenNLP's `elmo` command keyed
  its output), shape `(L + 1, words, H)` with `layers="all"` (layer 0 = token layer `[x; x]`, layer l =
  `[forward_l; backward_l]`), or `(words, H)` with `"top"` (the top layer) and `"average"` (mean of the L + 1
  layers). Its attributes: `line_number` (1-based), `text` (the line without its newline), `words` (JSON list of
  the words embedded, one per vector) and, for a line split into pieces, `pieces` (word offsets where each piece
  starts).
- file attributes: `format_version`, `layers`, `dtype`, `num_lines`, `num_layers` (L + 1), `hidden_size`,
  `tokenized`, `max_words`, `model`, `input`, `empty_lines`, `split_lines`, `cut_word_lines`.

Rules:
- A line with no words (blank, or only whitespace) is stored as an empty dataset (0 words), so that dataset `"i"`
  is always line i + 1. Such lines, split lines and lines with cut words (below) are logged with their line
  numbers: the first 20 of each kind one by one, then a summary.
- A word of more UTF-8 bytes than the model's char rows hold (48 for the released models) is read as its first
  48 bytes, as bilm-tf reads it, and its line counts among `cut_word_lines`.
- A line of more than `max_words` words is split into pieces of at most `max_words` words, each embedded as its
  own sentence (its own `<S>` ... `</S>`, so context does not cross a piece boundary); the pieces' vectors are
  stored one after the other, so the dataset still has one vector per word.
- The model is stateless: a line's vectors depend on that line only, not on its neighbours or position. Lines are
  sorted by length within a window of `window` lines to batch similar lengths together; this changes which lines
  share a batch, which can move float32 results by rounding (around 1e-6), never more. A run is repeatable: on
  the same machine, the same input and options give bit-identical vectors (on a CPU, a few matmul shapes are
  picked by a short timing in each run, only where one is clearly faster, so runs pick alike; were they to
  differ, by rounding only). `batch_size=1` makes every line's vectors bit-identical wherever it appears.
- The output is written to a hidden temporary file beside `output_path` and renamed into place only when complete:
  an interrupted run leaves no output file (a killed one may leave its `.NAME.<pid>.partial`, which the next run
  to the same output removes).
"""

from __future__ import annotations

import json
import logging
import os
import sys
from dataclasses import dataclass, field
from itertools import islice
from typing import TYPE_CHECKING

import numpy as np

from .model_source import resolve_model
from .safe_output import (
    OutputError,
    atomic_output_file,
    check_replaceable_file,
    raise_if_stop_requested,
    room_for,
)
from .text_encoding import not_utf8_message


if TYPE_CHECKING:
    from .modeling_elmo import ElmoModel
    from .tokenization_elmo import ElmoTokenizer
# torch, transformers and the model classes are imported by the functions that compute: `hf-elmo --help` builds
# its parser from this module (LAYER_CHOICES) and must not pay for them.


logger = logging.getLogger(__name__)

FORMAT_VERSION = 1
LAYER_CHOICES = ("all", "top", "average")
# How many line numbers a summary log lists before "...".
_LISTED = 20


class EmbedInputError(ValueError):
    """The input text file cannot be embedded as asked (not found, not UTF-8, ...)."""


class EmbedOutputError(RuntimeError):
    """The model produced vectors that must not be written (NaN or infinite values)."""


@dataclass
class EmbedSummary:
    output_path: str
    num_lines: int = 0
    num_words: int = 0
    empty_lines: int = 0
    split_lines: int = 0
    cut_word_lines: int = 0
    # The first few 1-based line numbers of each kind (memory stays bounded on any input).
    empty_line_numbers: list[int] = field(default_factory=list)
    split_line_numbers: list[int] = field(default_factory=list)
    cut_word_line_numbers: list[int] = field(default_factory=list)

    def note(self, kind: str, number: int) -> bool:
        """Count a line of `kind` ("empty", "split" or "cut_word"); True while it is among the first ones, to be
        logged."""
        setattr(self, f"{kind}_lines", getattr(self, f"{kind}_lines") + 1)
        listed = getattr(self, f"{kind}_line_numbers")
        if len(listed) < _LISTED:
            listed.append(number)
            return True
        return False


@dataclass
class _Piece:
    key: str  # dataset name
    start: int  # offset of its first word in the line
    words: list[str]


def count_lines(path: str) -> int:
    """Lines in a file (a last line without a newline counts), for the progress bar."""
    count, last = 0, b"\n"
    with open(path, "rb") as f:
        for block in iter(lambda: f.read(1 << 20), b""):
            count += block.count(b"\n")
            last = block[-1:]
    return count + (last != b"\n")


# The input name that means standard input, as for other Unix commands (a file named "-" is "./-").
STDIN = "-"
STDIN_NAME = "<stdin>"


def input_name(path: str) -> str:
    """How messages name the input."""
    return STDIN_NAME if path == STDIN else path


def check_input(path: str) -> None:
    """`open_input`'s errors, found without opening the input: a named pipe can be read only by one opening."""
    if path == STDIN:
        if sys.stdin is None or sys.stdin.closed:  # started with standard input closed (`<&-`): Python sets None
            raise EmbedInputError("-: standard input is closed; pipe the text in (... | hf-elmo embed - OUTPUT) or "
                                  "give INPUT as a file.")
        return
    if os.path.isdir(path):
        raise EmbedInputError(f"{path}: is a directory, expected a text file (one sentence per line).")
    if not os.path.exists(path):
        raise EmbedInputError(f"{path}: input file not found.")


def open_input(path: str):
    """The input file (or standard input, `-`) opened for `read_lines`, with a clear error when it cannot be."""
    check_input(path)
    if path == STDIN:
        return sys.stdin.buffer
    try:
        return open(path, "rb")
    except FileNotFoundError:  # removed since the check
        raise EmbedInputError(f"{path}: input file not found.") from None


def read_lines(handle, path: str):
    """(1-based line number, text without its line ending) of every line, decoded as UTF-8 line by line."""
    for number, raw in enumerate(handle, start=1):
        try:
            text = raw.decode("utf-8")
        except UnicodeDecodeError as error:
            raise EmbedInputError(not_utf8_message(path, f"{path}, line {number}", raw, error)) from None
        if "\0" in text:
            raise EmbedInputError(f"{path}, line {number}: contains a NUL character; expected plain text.")
        if number == 1 and text.startswith("\ufeff"):
            # A byte-order mark (some editors write one) is not text: it would become part of the first word.
            text = text[1:]
        text = text.rstrip("\r\n")
        if "\r" in text:
            # Lines ended by CR alone (old Mac files) would all be read as one line: refuse rather than guess.
            raise EmbedInputError(
                f"{path}, line {number}: contains a carriage return (CR) inside the line; CR-only line endings are "
                "not supported. Convert them to LF first, e.g. tr '\\r' '\\n' < IN > OUT."
            )
        yield number, text


def _lines(count: int) -> str:
    return f"{count} line" + ("s" if count != 1 else "")


def _line_numbers(numbers: list[int], count: int) -> str:
    listed = ", ".join(str(n) for n in numbers) + (", ..." if count > len(numbers) else "")
    return ("lines " if count != 1 else "line ") + listed


def load_model_and_tokenizer(
    model_name_or_path: str, device: str | None = None, int8_weights: bool = False
) -> tuple[ElmoModel, ElmoTokenizer]:
    """
    The biLM of any ELMo folder or Hub repo (a head checkpoint gives its biLM), and its tokenizer, on `device`
    (None: the GPU where there is one; the CPU with `int8_weights`). Weights that are missing or not finite, and
    tokenizer files that exist but cannot be loaded, are errors: either would give wrong vectors without a word.
    `int8_weights`: the biLM with int8 weights, for the CPU (`quantize_int8`).
    """
    # Resolved before torch and Transformers are imported (seconds): a wrong name is reported at once.
    name, extra = resolve_model(model_name_or_path)
    import torch
    from transformers.utils import cached_file

    from .modeling_elmo import ElmoModel
    from .tokenization_elmo import ElmoTokenizer

    if int8_weights:
        from .int8_weights import check_int8_cpu

        check_int8_cpu()  # before loading: a CPU without a fast int8 kernel is told at once
    if device is None:
        device = "cpu" if int8_weights or not torch.cuda.is_available() else "cuda"
    model = ElmoModel.from_pretrained(name, int8_weights=int8_weights, **extra).to(device).eval()
    config_file = cached_file(name, "tokenizer_config.json", _raise_exceptions_for_missing_entries=False, **extra)
    if config_file is None:
        logger.info("%s has no tokenizer files; using the default ElmoTokenizer", model_name_or_path)
        return model, ElmoTokenizer(max_characters_per_token=model.config.max_characters_per_token)
    try:
        tokenizer = ElmoTokenizer.from_pretrained(name, **extra)
    except (OSError, ValueError, TypeError, KeyError) as error:
        raise EmbedInputError(
            f"{config_file}: the model's tokenizer files cannot be loaded ({' '.join(str(error).split())}); fix or "
            "remove them (without them the default ElmoTokenizer is used)."
        ) from None
    return model, tokenizer


def embed_file(
    input_path: str,
    output_path: str,
    model: ElmoModel,
    tokenizer: ElmoTokenizer,
    layers: str = "all",
    tokenized: bool = False,
    float16: bool = False,
    batch_size: int = 32,
    window: int = 2048,
    max_words: int = 512,
    overwrite: bool = False,
    progress: bool = True,
    model_name: str | None = None,
) -> EmbedSummary:
    """
    Embed every line of `input_path` (one sentence per line) into the HDF5 file `output_path`; see the module
    docstring for the layout and the rules. `tokenized=True` splits lines on whitespace only; otherwise the
    tokenizer splits raw text into words. Memory stays bounded by `window` lines whatever the input size. The
    tokenizer's own notice of a cut word is turned off: lines with cut words are logged here, by line number.
    """
    import h5py
    from tqdm.auto import tqdm

    from .configuration_elmo import quoted_word, word_byte_limit, word_is_cut
    from .tokenization_elmo import CUT_WORD_NOTICE

    if layers not in LAYER_CHOICES:
        raise ValueError(f"layers must be one of {LAYER_CHOICES}, got {layers!r}.")
    for name, value in (("batch_size", batch_size), ("window", window), ("max_words", max_words)):
        if isinstance(value, bool) or not isinstance(value, int) or value < 1:
            raise ValueError(f"{name} must be a positive integer, got {value!r}.")
    output_path = os.path.abspath(output_path)
    check_replaceable_file(output_path, overwrite, inputs=[input_path])
    handle = open_input(input_path)
    total = count_lines(input_path) if input_path != STDIN and os.path.isfile(input_path) else None
    lines = read_lines(handle, input_name(input_path))
    config = model.config
    dtype = np.float16 if float16 else np.float32
    device = next(model.parameters()).device
    summary = EmbedSummary(output_path=output_path)
    width = tokenizer.max_characters_per_token
    # Lines with cut words are reported here, with their numbers: the tokenizer's one notice would repeat the first.
    tokenizer.deprecation_warnings[CUT_WORD_NOTICE] = True
    # The partial file is created on entry, before any work: a folder that cannot be written is reported at once,
    # in our words rather than h5py's. It is flushed and renamed into place only when the whole input is embedded.
    with handle, atomic_output_file(output_path, replace=overwrite) as partial:
        with h5py.File(partial, "w") as out, tqdm(total=total, unit=" lines", disable=not progress) as bar:
            while True:
                chunk = list(islice(lines, window))
                raise_if_stop_requested()
                if not chunk:
                    break
                pieces = []
                split = [(number, text, text.split() if tokenized else tokenizer.tokenize(text))
                         for number, text in chunk]
                _check_space(partial, output_path, split, layers, config, dtype)
                for number, text, words in split:
                    key = str(number - 1)
                    dataset = out.create_dataset(key, shape=_dataset_shape(layers, config, len(words)), dtype=dtype)
                    dataset.attrs["line_number"] = number
                    dataset.attrs["text"] = text
                    dataset.attrs["words"] = json.dumps(words, ensure_ascii=False)
                    summary.num_words += len(words)
                    cut = [word for word in words if word_is_cut(word, width)]
                    if cut and summary.note("cut_word", number):
                        logger.warning(
                            "%s, line %d: %d word(s) longer than %d UTF-8 bytes (the first: %s); the model reads "
                            "each as its first %d bytes, as bilm-tf does", input_name(input_path), number, len(cut),
                            word_byte_limit(width), quoted_word(cut[0]), word_byte_limit(width))
                    if not words:
                        if summary.note("empty", number):
                            logger.warning("%s, line %d: no words; stored as the empty dataset %r",
                                           input_name(input_path), number, key)
                        continue
                    starts = list(range(0, len(words), max_words))
                    if len(starts) > 1:
                        dataset.attrs["pieces"] = np.asarray(starts, dtype=np.int64)
                        if summary.note("split", number):
                            logger.warning(
                                "%s, line %d: %d words, more than max_words=%d; embedded as %d independent "
                                "pieces (context does not cross a piece boundary)",
                                input_name(input_path), number, len(words), max_words, len(starts),
                            )
                    pieces += [_Piece(key, s, words[s : s + max_words]) for s in starts]
                # Sort by length (stable, so the batching is a function of the input only) to limit padding.
                pieces.sort(key=lambda p: len(p.words))
                for first in range(0, len(pieces), batch_size):
                    raise_if_stop_requested()
                    _embed_batch(model, tokenizer, pieces[first : first + batch_size], layers, out, dtype, device)
                summary.num_lines += len(chunk)
                bar.update(len(chunk))
            out.attrs.update(
                {
                    "format_version": FORMAT_VERSION,
                    "layers": layers,
                    "dtype": np.dtype(dtype).name,
                    "num_lines": summary.num_lines,
                    "num_layers": config.num_lstm_layers + 1,
                    "hidden_size": config.hidden_size,
                    "tokenized": tokenized,
                    "max_words": max_words,
                    "model": model_name or str(getattr(config, "_name_or_path", "")),
                    "input": STDIN_NAME if input_path == STDIN else os.path.abspath(input_path),
                    "empty_lines": summary.empty_lines,
                    "split_lines": summary.split_lines,
                    "cut_word_lines": summary.cut_word_lines,
                }
            )
    if summary.num_lines == 0:  # an empty output is right for an empty input, but it is more often the wrong file
        logger.warning("%s has no lines: %s holds no datasets", input_name(input_path), output_path)
    if summary.empty_lines:
        logger.warning("%s without words, stored as empty datasets: %s", _lines(summary.empty_lines),
                       _line_numbers(summary.empty_line_numbers, summary.empty_lines))
    if summary.split_lines:
        logger.warning("%s longer than max_words=%d split into pieces: %s", _lines(summary.split_lines), max_words,
                       _line_numbers(summary.split_line_numbers, summary.split_lines))
    if summary.cut_word_lines:
        logger.warning("%s with words longer than %d UTF-8 bytes, each read as its first %d bytes: %s",
                       _lines(summary.cut_word_lines), word_byte_limit(width), word_byte_limit(width),
                       _line_numbers(summary.cut_word_line_numbers, summary.cut_word_lines))
    return summary


def _check_space(partial: str, output_path: str, lines, layers: str, config, dtype) -> None:
    """
    Refuse to start a window that would not fit on the disk (or under the process's file-size limit). HDF5 cannot
    report a failed write cleanly: it fails later while freeing its objects, with thousands of "Exception ignored"
    lines and possibly a crash, so running out of space must be caught before it happens.
    """
    per_word = (config.num_lstm_layers + 1 if layers == "all" else 1) * config.hidden_size * np.dtype(dtype).itemsize
    # Vectors, plus the text and word attributes and a generous allowance for HDF5's own structures per dataset.
    needed = sum(len(words) * per_word + 2 * len(text.encode()) + 4096 for _, text, words in lines) + (1 << 20)
    free = room_for(partial, written=os.path.getsize(partial) if os.path.exists(partial) else 0)
    if needed > free:
        first, last = lines[0][0], lines[-1][0]
        raise OutputError(
            f"{output_path}: not enough space to write lines {first}-{last} (about {needed / 1e6:.1f} MB needed, "
            f"{max(free, 0) / 1e6:.1f} MB available); nothing was written. Free some space or write elsewhere "
            "(--top or --float16 make the output smaller)."
        )


def _dataset_shape(layers: str, config, num_words: int) -> tuple[int, ...]:
    if layers == "all":
        return (config.num_lstm_layers + 1, num_words, config.hidden_size)
    return (num_words, config.hidden_size)


def _embed_batch(model, tokenizer, pieces: list[_Piece], layers: str, out, dtype, device) -> None:
    import torch

    batch = tokenizer([p.words for p in pieces], is_split_into_words=True, padding=True, return_tensors="pt")
    with torch.inference_mode():
        output = model(
            input_ids=batch["input_ids"].to(device),
            attention_mask=batch["attention_mask"].to(device),
            output_hidden_states=layers != "top",
        )
        if layers == "top":
            vectors = output.last_hidden_state  # (batch, words, H)
        else:
            stacked = torch.stack(output.hidden_states, dim=1)  # (batch, L + 1, words, H)
            vectors = stacked if layers == "all" else stacked.mean(dim=1)
        vectors = vectors.float().cpu().numpy()
    word_axis = 2 if layers == "all" else 1
    for row, piece in enumerate(pieces):
        own = vectors[row, :, : len(piece.words)] if word_axis == 2 else vectors[row, : len(piece.words)]
        if not np.isfinite(own).all():
            raise EmbedOutputError(
                f"the model gave NaN or infinite vectors for line {int(piece.key) + 1}; no output was written."
            )
    for row, piece in enumerate(pieces):
        n, span = len(piece.words), slice(piece.start, piece.start + len(piece.words))
        if layers == "all":
            out[piece.key][:, span] = vectors[row, :, :n].astype(dtype)
        else:
            out[piece.key][span] = vectors[row, :n].astype(dtype)
