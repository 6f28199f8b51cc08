"""Corpus side of ELMo pretraining: shard files, the word vocabulary, and a resumable stream of sentence batches.

The corpus is plain text, one sentence per line, in any number of shard files, or a streamed `datasets` split (its
shards read the same way, hf_elmo.pretraining_datasets). It is streamed, never loaded whole:
sentences are read a window at a time (`shuffle_window` sentences), shuffled inside the window, cut into batches,
and the batches are dealt round-robin to the processes. Everything about the order is a pure function of the seed
and the position in the corpus, so the stream's state is just "which window, how far into it" (`state_dict`), and
a resumed run reads exactly the batches an uninterrupted run would have read.

Batches are whole sentences, each read from a zero LSTM state (not bilm-tf's fixed 20-token windows with the state
carried from batch to batch): that is how `ElmoModel` is used downstream (stateless, one sentence at a time), every
batch is independent of the previous one (so data-parallel ranks and resumption need no LSTM state), and a sentence
never straddles two batches.
"""

import collections
import itertools
import logging
import math
import os
import random
from collections.abc import Callable, Iterator
from dataclasses import asdict, dataclass

import numpy as np
import torch

from .configuration_elmo import char_id_rows
from .text_encoding import not_utf8_message
from .tokenization_elmo import SPECIAL_WORDS, UNKNOWN_WORD


logger = logging.getLogger(__name__)


class CorpusError(ValueError):
    """A training or evaluation file that cannot be used, with the file (and line) at fault."""


def resolve_shards(
    patterns: list[str] | str, what: str = "--train-files", split_words: Callable[[str], list[str]] = str.split
) -> list[str]:
    """
    The sorted, de-duplicated files matched by glob `patterns`; each must hold at least one line in which
    `split_words` finds a word (pass the splitter the run uses: a line can look non-blank and still hold no word).
    """
    import glob

    if isinstance(patterns, str):
        patterns = [patterns]
    files = []
    for pattern in patterns:
        matched = sorted(glob.glob(os.path.expanduser(pattern)))
        if not matched:
            raise CorpusError(f"{what}: {pattern!r} matches no file.")
        files.extend(path for path in matched if path not in files)
    for path in files:
        if not os.path.isfile(path):
            raise CorpusError(f"{what}: {path} is not a file.")
        if not _has_words(path, split_words):
            advice = ("Every shard must hold sentences, one per line; remove the file or fix the pattern."
                      if what == "--train-files" else "Expected sentences, one per line.")
            raise CorpusError(f"{what}: {path} is empty (no non-blank line). {advice}")
    return files


def _has_words(path: str, split_words: Callable[[str], list[str]]) -> bool:
    # Lines of Unicode whitespace only (U+00A0, U+3000, ...) are not blank bytes but hold no word; a shard made
    # of them would have the stream search forever for a sentence.
    with open(path, "rb") as handle:
        for line_number, raw in enumerate(handle, 1):
            if raw.strip() and split_words(_decode(raw, path, line_number)):
                return True
    return False


def _decode(raw: bytes, path: str, line_number: int) -> str:
    try:
        return raw.decode("utf-8")
    except UnicodeDecodeError as error:
        raise CorpusError(not_utf8_message(path, f"{path}:{line_number}", raw, error)) from None


class PreTokenizerError(ValueError):
    """`--pre-tokenizer module:function` names no importable function."""


def use_pre_tokenizer(style: str) -> None:
    """
    Make `--pre-tokenizer` usable in this process: a built-in style as it is; `module:function`, a segmenter of the
    user's own that the command line named, imported and registered under that name (`register_pre_tokenizer`),
    which the saved tokenizer then records.
    """
    from .tokenization_elmo import _REGISTERED_PRE_TOKENIZERS, PRE_TOKENIZER_STYLES, register_pre_tokenizer

    if style in PRE_TOKENIZER_STYLES or style in _REGISTERED_PRE_TOKENIZERS:
        return
    module_name, _, function_name = style.partition(":")
    if not module_name or not function_name:
        raise PreTokenizerError(f"--pre-tokenizer {style!r}: expected one of {', '.join(PRE_TOKENIZER_STYLES)}, or "
                                "module:function (a function of a string that returns its words)")
    import importlib

    try:
        function = getattr(importlib.import_module(module_name), function_name)
    except (ImportError, AttributeError) as error:
        raise PreTokenizerError(f"--pre-tokenizer {style}: cannot be imported ({error})") from None
    if not callable(function):
        raise PreTokenizerError(f"--pre-tokenizer {style}: {function_name} is not a function")
    register_pre_tokenizer(style, function)


class WordSplitter:
    """
    `ElmoTokenizer(pre_tokenizer=style).tokenize` as a small picklable callable: DataLoader workers started by
    spawn or forkserver receive it pickled and build their own tokenizer.
    """

    def __init__(self, style: str):
        self.style = style
        self._tokenize = None

    def __call__(self, text: str) -> list[str]:
        if self._tokenize is None:
            from .tokenization_elmo import ElmoTokenizer

            use_pre_tokenizer(self.style)  # a worker started by spawn has not registered the user's function
            self._tokenize = ElmoTokenizer(pre_tokenizer=self.style).tokenize
        return self._tokenize(text)

    def __getstate__(self) -> dict:
        return {"style": self.style, "_tokenize": None}


# ---------------------------------------------------------------------------------------------------------------
# Shards: where the stream's lines come from
# ---------------------------------------------------------------------------------------------------------------
class TextFiles:
    """
    A corpus of UTF-8 text files, one sentence per line, as the stream's shards: shard i is file i, and a place in
    it is a byte offset and the number of lines before it (for error messages). The other kind of shards is a
    streamed `datasets` split (`pretraining_datasets.StreamedDataset`), read through the same two members:

    - `names`: one name per shard, what the stream's `settings()` records and its errors show;
    - `read(index, offset, line)`: shard `index`'s lines from that place on, each as `(text, offset, line)` with
      the place just after it; `text` is None for a record that holds no text (never from a text file).
    """

    def __init__(self, paths: list[str]):
        self.names = list(paths)

    def __len__(self) -> int:
        return len(self.names)

    def read(self, index: int, offset: int, line: int) -> Iterator[tuple[str | None, int, int]]:
        path = self.names[index]
        with open(path, "rb") as handle:
            handle.seek(offset)
            for raw in handle:
                offset += len(raw)
                line += 1
                yield _decode(raw, path, line), offset, line


def as_shards(shards) -> "TextFiles":
    """A list of file paths as `TextFiles`; shards of either kind as they are."""
    return TextFiles(shards) if isinstance(shards, (list, tuple)) else shards


# ---------------------------------------------------------------------------------------------------------------
# Word vocabulary: counting the corpus and building the list (the file's format: tokenization_elmo.py)
# ---------------------------------------------------------------------------------------------------------------
def build_vocab(counts: collections.Counter, min_count: int = 1, max_size: int | None = None) -> list[str]:
    """
    `<S>`, `</S>`, `<UNK>`, then every word seen at least `min_count` times, most frequent first (ties in string
    order, so the result does not depend on the order of the corpus). `max_size` caps the total, specials included.
    Frequency order is what the log-uniform sampled softmax assumes.
    """
    if min_count < 1:
        raise ValueError(f"min_count must be >= 1, got {min_count}.")
    if max_size is not None and max_size <= len(SPECIAL_WORDS):
        raise ValueError(f"max_size must be larger than {len(SPECIAL_WORDS)} (the special words), got {max_size}.")
    words = sorted((w for w, c in counts.items() if c >= min_count and w not in SPECIAL_WORDS),
                   key=lambda w: (-counts[w], w))
    vocab = [*SPECIAL_WORDS, *words]
    return vocab if max_size is None else vocab[:max_size]


def count_words(shards: "TextFiles | list[str]", split_words: Callable[[str], list[str]],
                max_sentences: int | None = None) -> tuple[collections.Counter, int]:
    """The words of the corpus (its shards in their own order: text files sorted, a dataset's shards by number)
    and their counts, over the first `max_sentences` lines that hold a word (all by default); with how many such
    lines were counted. Shards after the limit are not opened."""
    shards = as_shards(shards)
    counts, sentences = collections.Counter(), 0
    for index in range(len(shards)):
        if max_sentences is not None and sentences >= max_sentences:
            break
        for text, _, _ in shards.read(index, 0, 0):
            words = split_words(text) if text is not None else []
            counts.update(words)
            sentences += bool(words)
            if max_sentences is not None and sentences >= max_sentences:
                break
    for word in SPECIAL_WORDS:
        counts.pop(word, None)
    return counts, sentences


# ---------------------------------------------------------------------------------------------------------------
# The stream
# ---------------------------------------------------------------------------------------------------------------
# What the stream's line reader gives after a shard's last line.
END_OF_SHARD = object()


@dataclass(frozen=True)
class CorpusPosition:
    """Where a read starts: pass `epoch`, `shard` (index in that epoch's shard order), and the place in that shard
    (`offset`, `line`: a text file's byte offset and line number; a dataset shard's records read and lines read of
    the next record)."""

    epoch: int = 0
    shard: int = 0
    offset: int = 0
    line: int = 0


@dataclass
class StreamStats:
    sentences: int = 0
    words: int = 0
    empty_lines_skipped: int = 0
    long_lines_split: int = 0
    records_without_text: int = 0  # a dataset's records whose text is missing, empty or not a string


class SentenceBatchStream:
    """
    Endless, deterministic, resumable stream of this process's batches of sentences (lists of words).

    Window by window: read the next `shuffle_window` sentences (never past the end of an epoch), shuffle them,
    optionally sort them by length so that a batch holds sentences of similar lengths (less padding), cut them into
    `num_batches` near-equal batches (a multiple of `world_size`, about `batch_size` sentences each), shuffle the
    batch order, and deal every group of `world_size` consecutive batches out, batch `r` of a group to rank `r`.
    Shards are read in a fresh shuffled order each epoch. Empty lines are skipped (and counted in `stats`); lines of
    more than `max_words` words are cut into consecutive pieces of at most `max_words` words (also counted).
    """

    def __init__(
        self,
        shards: "TextFiles | list[str]",
        split_words: Callable[[str], list[str]],
        batch_size: int,
        seed: int,
        rank: int = 0,
        world_size: int = 1,
        shuffle_window: int = 100_000,
        max_words: int = 100,
        group_by_length: bool = True,
    ):
        shards = as_shards(shards)
        if not len(shards):
            raise CorpusError("no training files.")
        if batch_size < 1 or max_words < 1 or shuffle_window < 1:
            raise ValueError("batch_size, max_words and shuffle_window must be >= 1.")
        self.shards = shards
        self.split_words = split_words
        self.batch_size = batch_size
        self.seed = seed
        self.rank = rank
        self.world_size = world_size
        # A whole number of groups of `world_size` batches.
        self.window = math.ceil(max(shuffle_window, batch_size * world_size) / (batch_size * world_size)) * (
            batch_size * world_size
        )
        self.max_words = max_words
        self.group_by_length = group_by_length
        self.window_start = CorpusPosition()
        self.groups_done = 0
        self.stats = StreamStats()
        self._batches: list[list[list[str]]] | None = None
        self._window_end: CorpusPosition | None = None
        self._window_stats = StreamStats()

    # ---- state ----
    def position(self) -> dict:
        """Where the stream stands (plain JSON data): the part of `state_dict` that changes with every batch."""
        return {"window_start": asdict(self.window_start), "groups_done": self.groups_done, "stats": asdict(self.stats)}

    def set_position(self, position: dict) -> None:
        """Move to a `position()` of a stream with the same settings (e.g. one read in a DataLoader worker)."""
        self.window_start = CorpusPosition(**position["window_start"])
        self.groups_done = position["groups_done"]
        self.stats = StreamStats(**position["stats"])
        self._batches = None

    def settings(self) -> dict:
        """What fixes the order of the batches: a resumed stream must have the same."""
        return {
            "files": self.shards.names,  # the key of every checkpoint so far: a dataset's shards are named too
            "batch_size": self.batch_size,
            "world_size": self.world_size,
            "seed": self.seed,
            "window": self.window,
            "max_words": self.max_words,
            "group_by_length": self.group_by_length,
        }

    def state_dict(self) -> dict:
        return {**self.position(), **self.settings()}

    def load_state_dict(self, state: dict) -> None:
        for key, value in self.settings().items():
            if state[key] != value:
                raise CorpusError(
                    f"the checkpoint's data stream was made with {key}={state[key]!r}, this run has "
                    f"{value!r}: resuming would not replay the same data. Use the original settings."
                )
        self.set_position(state)

    @property
    def epoch(self) -> int:
        return self.window_start.epoch

    # ---- reading ----
    def shard_order(self, epoch: int) -> list[int]:
        order = list(range(len(self.shards)))
        random.Random(f"shards:{self.seed}:{epoch}").shuffle(order)
        return order

    def _lines(self, start: CorpusPosition) -> Iterator[tuple[object, CorpusPosition]]:
        """Every line from `start` on, endlessly, with the position just after it; None for a record without
        text, END_OF_SHARD after each shard's last line."""
        epoch, shard, offset, line_number = start.epoch, start.shard, start.offset, start.line
        while True:
            order = self.shard_order(epoch)
            while shard < len(order):
                for text, offset, line_number in self.shards.read(order[shard], offset, line_number):
                    yield text, CorpusPosition(epoch, shard, offset, line_number)
                shard, offset, line_number = shard + 1, 0, 0
                yield END_OF_SHARD, CorpusPosition(epoch, shard, 0, 0)
            epoch, shard = epoch + 1, 0

    def _read_window(self) -> None:
        sentences, stats = [], StreamStats()
        position = self.window_start
        # An epoch read from its start that gives no sentence means none ever will: stop instead of reading on.
        whole_epoch = self.window_start.shard == 0 and self.window_start.offset == 0
        sentences_at_epoch_start = 0
        for text, position in self._lines(self.window_start):
            if text is None:
                stats.records_without_text += 1
                continue
            if text is not END_OF_SHARD:
                words = self.split_words(text)
                if not words:
                    stats.empty_lines_skipped += 1
                    continue
                if len(words) > self.max_words:
                    stats.long_lines_split += 1
                sentences.extend(words[i : i + self.max_words] for i in range(0, len(words), self.max_words))
            end_of_epoch = position.shard == len(self.shards)
            if end_of_epoch:
                if whole_epoch and len(sentences) == sentences_at_epoch_start:
                    names = self.shards.names
                    shown = ", ".join(names[:3]) + (f" and {len(names) - 3} more" if len(names) > 3 else "")
                    raise CorpusError(
                        f"no sentence in a whole epoch of {shown}: every line is empty or whitespace only "
                        "(Unicode spaces such as U+00A0 included)."
                    )
                whole_epoch, sentences_at_epoch_start = True, len(sentences)
            if len(sentences) >= self.window or (end_of_epoch and len(sentences) >= self.world_size):
                break
        if end_of_epoch:
            position = CorpusPosition(position.epoch + 1, 0, 0, 0)
        stats.sentences = len(sentences)
        stats.words = sum(len(s) for s in sentences)

        rng = random.Random(f"window:{self.seed}:{self.window_start}")
        rng.shuffle(sentences)
        if self.group_by_length:
            sentences.sort(key=len)
        # A multiple of world_size, and never more batches than sentences (no batch is empty).
        groups_wanted = math.ceil(len(sentences) / (self.batch_size * self.world_size))
        num_batches = self.world_size * max(1, min(groups_wanted, len(sentences) // self.world_size))
        bounds = [round(i * len(sentences) / num_batches) for i in range(num_batches + 1)]
        batches = [sentences[a:b] for a, b in zip(bounds, bounds[1:])]
        groups = [batches[i : i + self.world_size] for i in range(0, num_batches, self.world_size)]
        rng.shuffle(groups)
        self._batches = [group[self.rank] for group in groups]
        self._window_end = position
        self._window_stats = stats

    def next_batch(self) -> list[list[str]]:
        """This rank's next batch; every rank must call it the same number of times."""
        if self._batches is None:
            self._read_window()
        batch = self._batches[self.groups_done]
        self.groups_done += 1
        if self.groups_done == len(self._batches):
            for field in asdict(self.stats):
                setattr(self.stats, field, getattr(self.stats, field) + getattr(self._window_stats, field))
            self.window_start, self.groups_done, self._batches = self._window_end, 0, None
        return batch


def read_eval_sentences(
    path: str, split_words: Callable[[str], list[str]], max_words: int, max_sentences: int | None = None
) -> tuple[list[list[str]], int]:
    """The held-out file's sentences in file order (long lines cut as in training) and how many empty lines it had."""
    sentences, empty = [], 0
    with open(path, "rb") as handle:
        for line_number, raw in enumerate(handle, 1):
            words = split_words(_decode(raw, path, line_number))
            if not words:
                empty += 1
                continue
            sentences.extend(words[i : i + max_words] for i in range(0, len(words), max_words))
            if max_sentences is not None and len(sentences) >= max_sentences:
                sentences = sentences[:max_sentences]
                break
    if not sentences:
        raise CorpusError(f"--eval-file: {path} holds no sentence (all lines are empty).")
    return sentences, empty


# ---------------------------------------------------------------------------------------------------------------
# Batches: sentences -> model inputs, in DataLoader workers
# ---------------------------------------------------------------------------------------------------------------
class BatchEncoder:
    """
    Model inputs for a batch of sentences: char ids `(batch, words, max_characters_per_token)`, attention mask and
    word-id `labels` (-100 on padding), equal to what `ElmoTokenizer` and `words_to_indices` give (tested), but
    built with array operations over the batch's distinct words instead of a Python loop over characters, so that
    the data never holds the model back (the speed-up, with the machine it was measured on, is in
    benchmarks/README.md, "Pretraining"). Keeps nothing between batches.

    `num_tokens` is the number of predictions per direction (words + one `</S>` per sentence), counted here so that
    the training loop needs no device-to-host copy to count them. With `pad_to_multiple_of`, the padded length is
    rounded up to a multiple of it, so that a run meets a few batch shapes only (on a GPU, compiled code and the
    memory allocator's blocks are reused across batches; padding costs the CPU's packed recurrence nothing). With
    `pad_rows_to`, rows without words (which predict nothing) fill every batch up to that many rows: the captured
    training step's graphs then have one row count.
    """

    def __init__(self, word_vocab: list[str], max_characters_per_token: int = 50, pad_to_multiple_of: int = 1,
                 pad_rows_to: int = 0):
        for name, value, least, kind in (("pad_to_multiple_of", pad_to_multiple_of, 1, "a positive"),
                                         ("pad_rows_to", pad_rows_to, 0, "a non-negative")):
            if isinstance(value, bool) or not isinstance(value, int) or value < least:
                raise ValueError(f"{name} must be {kind} integer, got {value!r}.")
        self.pad_to_multiple_of = pad_to_multiple_of
        self.pad_rows_to = pad_rows_to
        self.width = max_characters_per_token
        self.word_index = {}
        for index, word in enumerate(word_vocab):
            self.word_index.setdefault(word, index)  # as the tokenizer: a duplicated word maps to its first line
        self.unk_index = self.word_index[UNKNOWN_WORD]

    def padded_length(self, words: int) -> int:
        """The words a batch whose longest sentence has `words` words is padded to."""
        return -(-words // self.pad_to_multiple_of) * self.pad_to_multiple_of

    @classmethod
    def from_tokenizer(cls, tokenizer, pad_to_multiple_of: int = 1, pad_rows_to: int = 0) -> "BatchEncoder":
        return cls(tokenizer.word_vocab, tokenizer.max_characters_per_token, pad_to_multiple_of, pad_rows_to)

    def char_rows(self, distinct: dict[str, int]) -> np.ndarray:
        """`(len(distinct) + 1, width)` char ids: row i = `word_to_char_ids` of the word numbered i, then zeros."""
        return np.concatenate([char_id_rows(distinct, self.width), np.zeros((1, self.width), dtype=np.int64)])

    def __call__(self, sentences: list[list[str]]) -> dict:
        distinct: dict[str, int] = {}
        positions = [distinct.setdefault(word, len(distinct)) for sentence in sentences for word in sentence]
        table = self.char_rows(distinct)
        words = list(distinct)
        word_ids = np.fromiter(
            (self.word_index.get(word, self.unk_index) for word in words), dtype=np.int64, count=len(words)
        )
        word_ids = np.append(word_ids, -100)
        lengths = np.fromiter(map(len, sentences), dtype=np.int64, count=len(sentences))
        num_tokens = int(lengths.sum()) + len(sentences)
        if len(sentences) < self.pad_rows_to:
            lengths = np.concatenate([lengths, np.zeros(self.pad_rows_to - len(sentences), dtype=np.int64)])
        padded_length = self.padded_length(int(lengths.max(initial=0)))
        mask = np.arange(padded_length)[None, :] < lengths[:, None]
        index = np.full(mask.shape, len(words), dtype=np.int64)
        index[mask] = positions
        return {
            "input_ids": torch.from_numpy(table[index]),
            "attention_mask": torch.from_numpy(mask.astype(np.int64)),
            "labels": torch.from_numpy(word_ids[index]),
            "num_tokens": num_tokens,
        }


def make_batch(tokenizer, sentences: list[list[str]]) -> dict[str, torch.Tensor]:
    """Model inputs for a batch of sentences: char ids, attention mask, and word-id `labels` (-100 on padding)."""
    batch = BatchEncoder.from_tokenizer(tokenizer)(sentences)
    del batch["num_tokens"]
    return batch


class PretrainingBatches(torch.utils.data.IterableDataset):
    """
    This process's training batches as a DataLoader dataset: `SentenceBatchStream` from `start` (a stream
    `state_dict`, or None), each batch encoded by `encoder`, endlessly.

    With N DataLoader workers, every worker reads the whole stream (reading and splitting lines costs much less
    than encoding) and encodes batches k, k + N, ... of it, where k is its worker id: the DataLoader takes one
    batch from each worker in turn, so it yields the stream's batches in the stream's order whatever N is. Each
    batch carries `stream_position`, the stream's `position()` just after it; the training loop takes it as the
    position once the model has used the batch, so a checkpoint never counts batches that were only prefetched.
    A corpus error comes as a batch `{"error": message}`, in the place of the batch that could not be read.
    """

    def __init__(self, stream_settings: dict, encoder: BatchEncoder, start: dict | None = None):
        super().__init__()
        self.stream_settings = stream_settings
        self.encoder = encoder
        self.start = start

    def __iter__(self):
        worker = torch.utils.data.get_worker_info()
        worker_id, num_workers = (worker.id, worker.num_workers) if worker is not None else (0, 1)
        stream = SentenceBatchStream(**self.stream_settings)
        if self.start is not None:
            stream.load_state_dict(self.start)
        for index in itertools.count():
            try:
                sentences = stream.next_batch()
            except CorpusError as error:
                # As data, not as an exception: the DataLoader would wrap it in a worker traceback.
                yield {"error": str(error)}
                return
            if index % num_workers == worker_id:
                yield {**self.encoder(sentences), "stream_position": stream.position()}
