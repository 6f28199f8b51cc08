"""The word vocabulary file, read, built and written by one set of rules (bilm-tf's format).

A vocabulary lists one word per line, the line number being the word's id: `<S>`, `</S>` and `<UNK>` first, then
the words most frequent first (the order the log-uniform sampled softmax assumes). Reading it:

- each line is stripped of surrounding whitespace (a blank line stays, as an empty entry, so that ids keep their
  line numbers, as bilm-tf reads it);
- a `!!!MAXTERMID` line, bookkeeping that some bilm-tf / lm_1b files carry, is not a word and is skipped;
- a byte-order mark (some editors write one) is not part of the first word;
- `<S>`, `</S>` and `<UNK>` must be present (`missing_special_words`; each caller words the error for its users).

The tokenizer (`ElmoTokenizer(vocab_file=...)`), the bilm-tf converter and pretraining all go through here.
"""

import collections
import os

from .configuration_elmo import BEGIN_SENTENCE_WORD, END_SENTENCE_WORD
from .atomic_file import atomic_write


VOCAB_FILE_NAME = "vocab.txt"
UNKNOWN_WORD = "<UNK>"
SPECIAL_WORDS = (BEGIN_SENTENCE_WORD, END_SENTENCE_WORD, UNKNOWN_WORD)
MAX_TERM_ID_LINE = "!!!MAXTERMID"


def read_vocab(path) -> list[str]:
    """
    The entries of a vocabulary file, index = word id. Errors are the ones of reading a file (`FileNotFoundError`,
    `IsADirectoryError`, `UnicodeDecodeError`); the special words are not checked (see `missing_special_words`).
    """
    with open(os.fspath(path), encoding="utf-8-sig") as handle:
        return [word for word in (line.strip() for line in handle) if word != MAX_TERM_ID_LINE]


def missing_special_words(words) -> list[str]:
    """Which of `<S>`, `</S>`, `<UNK>` the vocabulary `words` lacks, in that order."""
    present = set(words)
    return [word for word in SPECIAL_WORDS if word not in present]


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


def write_vocab(words: list[str], path, validate: bool = True) -> str:
    """
    Write a vocabulary file atomically (a temporary file renamed into place). With `validate` (new vocabularies)
    every entry must be a non-empty word without whitespace; without it (writing back a vocabulary that was read,
    blank entries included) the entries are written as they are, one per line.
    """
    bad = [w for w in words if not w or any(c.isspace() for c in w)] if validate else []
    if bad:
        raise ValueError(f"vocabulary words must be non-empty and hold no whitespace, got {bad[:5]!r}.")
    with atomic_write(path) as partial, open(partial, "w", encoding="utf-8") as handle:
        handle.write("".join(word + "\n" for word in words))
    return os.fspath(path)
