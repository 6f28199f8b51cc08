"""Corpus side of ELMo pretraining: shard files, the word vocabulary, and a resumable stream of sentence batches.

The corpus is plain text, one sentence per line, in any number of shard files. It is streamed, never loaded whole:
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
import logging
import math
import os
import random
import tempfile
from collections.abc import Callable, Iterator
from dataclasses import asdict, dataclass

import torch

from .configuration_elmo import BEGIN_SENTENCE_WORD, END_SENTENCE_WORD


logger = logging.getLogger(__name__)

UNKNOWN_WORD = "<UNK>"
SPECIAL_WORDS = (BEGIN_SENTENCE_WORD, END_SENTENCE_WORD, UNKNOWN_WORD)


class CorpusError(ValueError):
    """A training or evaluation file that cannot be used, with the file (and line) at fault."""


def resolve_shards(patterns: list[str] | str, what: str = "--train-files") -> list[str]:
    """The sorted, de-duplicated files matched by glob `patterns`; each must hold at least one non-blank line."""
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
        if not _has_text(path):
            raise CorpusError(
                f"{what}: {path} is empty (no non-blank line). Every shard must hold sentences, one per line; "
                "remove the file or fix the pattern."
            )
    return files


def _has_text(path: str) -> bool:
    with open(path, "rb") as handle:
        return any(line.strip() for line in handle)


def _decode(raw: bytes, path: str, line_number: int) -> str:
    try:
        return raw.decode("utf-8")
    except UnicodeDecodeError as error:
        raise CorpusError(f"{path}:{line_number}: not UTF-8 text ({error}).") from None


# ---------------------------------------------------------------------------------------------------------------
# Word vocabulary (bilm-tf's vocabulary file format: one word per line, <S> </S> <UNK> first, then by frequency)
# ---------------------------------------------------------------------------------------------------------------
def count_words(files: list[str], split_words: Callable[[str], list[str]]) -> collections.Counter:
    counts = collections.Counter()
    for path in files:
        with open(path, "rb") as handle:
            for line_number, raw in enumerate(handle, 1):
                counts.update(split_words(_decode(raw, path, line_number)))
    for word in SPECIAL_WORDS:
        counts.pop(word, None)
    return counts


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
    words = sorted((w for w, c in counts.items() if c >= min_count), key=lambda w: (-counts[w], w))
    vocab = [*SPECIAL_WORDS, *words]
    return vocab if max_size is None else vocab[:max_size]


def write_vocab(words: list[str], path: str) -> str:
    """Write a vocabulary file atomically (a temporary file renamed into place)."""
    bad = [w for w in words if not w or any(c.isspace() for c in w)]
    if bad:
        raise ValueError(f"vocabulary words must be non-empty and hold no whitespace, got {bad[:5]!r}.")
    directory = os.path.dirname(os.path.abspath(path))
    os.makedirs(directory, exist_ok=True)
    fd, staging = tempfile.mkstemp(dir=directory, prefix=".vocab-", suffix=".tmp")
    try:
        with os.fdopen(fd, "w", encoding="utf-8") as handle:
            handle.write("".join(word + "\n" for word in words))
        os.replace(staging, path)
    except BaseException:
        if os.path.exists(staging):
            os.remove(staging)
        raise
    return path


# ---------------------------------------------------------------------------------------------------------------
# The stream
# ---------------------------------------------------------------------------------------------------------------
@dataclass(frozen=True)
class CorpusPosition:
    """Where a read starts: pass `epoch`, `shard` (index in that epoch's shard order), byte `offset`, `line` number."""

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
        files: list[str],
        split_words: Callable[[str], list[str]],
        batch_size: int,
        seed: int,
        rank: int = 0,
        world_size: int = 1,
        shuffle_window: int = 100_000,
        max_words: int = 100,
        group_by_length: bool = True,
    ):
        if not files:
            raise CorpusError("no training files.")
        if batch_size < 1 or max_words < 1 or shuffle_window < 1:
            raise ValueError("batch_size, max_words and shuffle_window must be >= 1.")
        self.files = list(files)
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
    def state_dict(self) -> dict:
        return {
            "window_start": asdict(self.window_start),
            "groups_done": self.groups_done,
            "stats": asdict(self.stats),
            "files": self.files,
            "batch_size": self.batch_size,
            "world_size": self.world_size,
            "seed": self.seed,
            "window": self.window,
            "max_words": self.max_words,
            "group_by_length": self.group_by_length,
        }

    def load_state_dict(self, state: dict) -> None:
        for key in ("files", "batch_size", "world_size", "seed", "window", "max_words", "group_by_length"):
            if state[key] != getattr(self, key):
                raise CorpusError(
                    f"the checkpoint's data stream was made with {key}={state[key]!r}, this run has "
                    f"{getattr(self, key)!r}: resuming would not replay the same data. Use the original settings."
                )
        self.window_start = CorpusPosition(**state["window_start"])
        self.groups_done = state["groups_done"]
        self.stats = StreamStats(**state["stats"])
        self._batches = None

    @property
    def epoch(self) -> int:
        return self.window_start.epoch

    # ---- reading ----
    def shard_order(self, epoch: int) -> list[int]:
        order = list(range(len(self.files)))
        random.Random(f"shards:{self.seed}:{epoch}").shuffle(order)
        return order

    def _lines(self, start: CorpusPosition) -> Iterator[tuple[str, CorpusPosition]]:
        """Every line from `start` on, endlessly, with the position just after it."""
        epoch, shard, offset, line_number = start.epoch, start.shard, start.offset, start.line
        while True:
            order = self.shard_order(epoch)
            while shard < len(order):
                path = self.files[order[shard]]
                with open(path, "rb") as handle:
                    handle.seek(offset)
                    for raw in handle:
                        offset += len(raw)
                        line_number += 1
                        yield _decode(raw, path, line_number), CorpusPosition(epoch, shard, offset, line_number)
                shard, offset, line_number = shard + 1, 0, 0
                yield None, CorpusPosition(epoch, shard, 0, 0)  # end of a shard
            epoch, shard = epoch + 1, 0

    def _read_window(self) -> None:
        sentences, stats = [], StreamStats()
        position = self.window_start
        for text, position in self._lines(self.window_start):
            if text is not None:
                words = self.split_words(text)
                if not words:
                    stats.empty_lines_skipped += 1
                    continue
                if len(words) > self.max_words:
                    stats.long_lines_split += 1
                sentences.extend(words[i : i + self.max_words] for i in range(0, len(words), self.max_words))
            end_of_epoch = position.shard == len(self.files)
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


def make_batch(tokenizer, sentences: list[list[str]]) -> dict[str, torch.Tensor]:
    """Model inputs for a batch of sentences: char ids, attention mask, and word-id `labels` (-100 on padding)."""
    encoded = tokenizer(sentences, is_split_into_words=True, padding=True, return_tensors="pt")
    labels = torch.full(encoded["attention_mask"].shape, -100, dtype=torch.long)
    for row, words in enumerate(sentences):
        labels[row, : len(words)] = torch.tensor(tokenizer.words_to_indices(words), dtype=torch.long)
    return {"input_ids": encoded["input_ids"], "attention_mask": encoded["attention_mask"], "labels": labels}
