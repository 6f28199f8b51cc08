"""ELMo tokenizer: text -> words (with character offsets) -> one row of character ids per word.

ELMo reads characters, not a token vocabulary: every word becomes a row of
`max_characters_per_token` ids built by `word_to_char_ids` (the bilm-tf scheme, kept in
configuration_elmo.py). A sentence is therefore a 2-D array (words, 50) and a batch a 3-D one
(batch, words, 50). The stock Transformers tokenizer machinery assumes 1-D ids per sentence, so
this module overrides encoding, padding, decoding and the token/id conversions, and gives the
returned `BatchEncoding` per-sentence alignment objects so that `word_ids()`, `word_to_chars()`,
`char_to_word()`... work as they do for fast tokenizers.
"""

from __future__ import annotations

import contextlib
import functools
import os
import re
import sys
from collections.abc import Mapping

import numpy as np
from tokenizers import Regex, pre_tokenizers
from transformers import BatchEncoding, PreTrainedTokenizer
from transformers.tokenization_utils_base import TruncationStrategy
from transformers.utils import PaddingStrategy, TensorType, logging, to_py_obj

from .configuration_elmo import (
    BEGIN_SENTENCE_CHAR,
    BEGIN_SENTENCE_WORD,
    BEGIN_WORD_CHAR,
    CHAR_ID_SHIFT,
    END_SENTENCE_CHAR,
    END_SENTENCE_WORD,
    END_WORD_CHAR,
    PAD_CHAR,
    char_ids_to_word,
    package_module,
    quoted_word,
    word_byte_limit,
    word_is_cut,
    word_to_char_ids,
)


logger = logging.get_logger(__name__)

# ---------------------------------------------------------------------------------------------
# The word vocabulary file (bilm-tf's format), read and written here for the tokenizer, the converter and
# pretraining alike. One word per line, the line number being the word's id: `<S>`, `</S>` and `<UNK>` first, then
# the words most frequent first (the order the log-uniform sampled softmax assumes). Reading strips each line (a
# blank line stays, as an empty entry, so that ids keep their line numbers, as bilm-tf reads it), skips the
# `!!!MAXTERMID` bookkeeping line of some bilm-tf / lm_1b files, and ignores a byte-order mark.
# ---------------------------------------------------------------------------------------------
VOCAB_FILE_NAME = "vocab.txt"
UNKNOWN_WORD = "<UNK>"
SPECIAL_WORDS = (BEGIN_SENTENCE_WORD, END_SENTENCE_WORD, UNKNOWN_WORD)
MAX_TERM_ID_LINE = "!!!MAXTERMID"
CUT_WORD_NOTICE = "cut-word"  # its key in `deprecation_warnings`, where Transformers notes what a tokenizer said once
# Writes a file whole or not at all, where hf_elmo is installed; a saved folder's copy writes as Transformers does.
atomic_file = package_module("atomic_file")


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


def write_vocab(words: list[str], path, validate: bool = True) -> str:
    """
    Write a vocabulary file. With `validate` (new vocabularies) every entry must be a non-empty word without
    whitespace; without it (writing back a vocabulary that was read, blank entries included) the entries are
    written as they are, one per line.
    """
    bad = [w for w in words if not w or any(c.isspace() for c in w)] if validate else []
    if bad:
        raise ValueError(f"vocabulary words must be non-empty and hold no whitespace, got {bad[:5]!r}.")
    path = os.fspath(path)
    with atomic_file.atomic_write(path) if atomic_file else contextlib.nullcontext(path) as target:
        with open(target, "w", encoding="utf-8") as handle:
            handle.write("".join(word + "\n" for word in words))
    return path


VOCAB_FILES_NAMES = {"vocab_file": VOCAB_FILE_NAME}

# ---------------------------------------------------------------------------------------------
# Word splitting of raw text. "ptb" approximates the Penn-Treebank-style tokenisation of the news
# text ELMo was trained on, with `tokenizers` pre-tokenizers (no Rust model needed): split on
# whitespace, then isolate, in this order of preference at each position,
#   the stem of a negated verb ("do" of "don't"), the "n't" clitic, the clitics 's 're 've 'll 'd 'm,
#   dotted abbreviations (U.S., e.g.), numbers with inner separators (3.50, 1,000, 10:30),
#   words and hyphenated words (e-mail, well-known),
#   punctuation marks (a run of the same mark stays one word: "...", "--", "!!").
# Everything else (emoji, symbols) stays with its neighbours as one word, as in BERT's splitter. The invisible
# characters that belong inside a word (soft hyphen, ZWNJ, word joiner, zero-width no-break space, and ZWJ next to a
# letter or mark, not between the emoji it joins) count as word characters; `_DROPPED_FORMAT` below then removes
# those that change no letter.
# ---------------------------------------------------------------------------------------------
_W = r"(?:[\p{L}\p{M}\p{N}\x{00AD}\x{200C}\x{2060}\x{FEFF}]|(?<=[\p{L}\p{M}])\x{200D}|\x{200D}(?=[\p{L}\p{M}]))"
_APOSTROPHE = r"['\x{2019}]"
_PUNCT = r"[\p{P}\x{21}-\x{2F}\x{3A}-\x{40}\x{5B}-\x{60}\x{7B}-\x{7E}]"  # Unicode P* + ASCII non-alnum
_PTB_PATTERN = "|".join(
    [
        rf"{_W}+(?=(?i:n{_APOSTROPHE}t)(?!{_W}))",
        rf"(?i:n{_APOSTROPHE}t)(?!{_W})",
        rf"{_APOSTROPHE}(?i:s|re|ve|ll|d|m)(?!{_W})",
        r"(?:\p{L}\.){2,}",
        r"\p{N}+(?:[.,:]\p{N}+)+",
        rf"{_W}+(?:-{_W}+)*",
        rf"({_PUNCT})\1*",
    ]
)
# ---------------------------------------------------------------------------------------------
# The stock token-classification pipeline reads one id per token (`int(input_ids[idx])`) and fails on a row of
# character ids with "only one element tensors can be converted to Python scalars", which says nothing about the
# cause. pipeline() picks it for a model object (it reads `config.custom_pipelines` only for a folder or Hub id) and
# calls nothing of ELMo's while it chooses or builds the pipeline: the tokenizer is the one ELMo object the stock
# class calls before that failure, so this is where the mistake is caught, by looking at the caller.
# ---------------------------------------------------------------------------------------------
_STOCK_TOKEN_PIPELINE_MODULE = "transformers.pipelines.token_classification"
STOCK_TOKEN_PIPELINE_ERROR = (
    "ElmoTokenizer gives every word a row of character ids, which the stock TokenClassificationPipeline cannot read "
    "(it expects one id per token). Use the ELMo token-classification pipeline instead: "
    'pipeline("token-classification", model=FOLDER_OR_REPO_ID, trust_remote_code=True), or in-process '
    '`from hf_elmo.pipeline_elmo import ElmoTokenClassificationPipeline` and pipeline("token-classification", '
    "model=model, tokenizer=tokenizer, pipeline_class=ElmoTokenClassificationPipeline)."
)


def _called_from_stock_token_pipeline(max_depth: int = 12) -> bool:
    """Whether the stock `TokenClassificationPipeline.preprocess` itself (not an override) is calling the tokenizer."""
    module = sys.modules.get(_STOCK_TOKEN_PIPELINE_MODULE)
    if module is None:  # never imported in this process, so not in use
        return False
    stock = module.TokenClassificationPipeline.preprocess.__code__
    frame = sys._getframe(1)
    for _ in range(max_depth):
        if frame is None:
            return False
        if frame.f_code is stock:
            return True
        frame = frame.f_back
    return False


PRE_TOKENIZER_STYLES = ("ptb", "bert", "whitespace")
_SURROGATE = re.compile("[\ud800-\udfff]")
# Invisible format characters in raw text. A zero-width space separates words, as a space does. A byte-order mark
# (zero-width no-break space), word joiner, invisible operators, soft hyphen and direction marks or embeddings are
# dropped from the words (a word of nothing else is no word): they change no word's letters. ZWJ and ZWNJ stay, since
# they change how a word is written (Persian, Indic scripts, emoji sequences). Words given already split are kept.
_SEPARATING_FORMAT = re.compile("\u200b")
_DROPPED_FORMAT = re.compile("[\u00ad\u200e\u200f\u202a-\u202e\u2060-\u2064\u2066-\u2069\ufeff]")
# ZWJ and ZWNJ with nothing to join (a word of them alone, e.g. a ZWNJ after a zero-width space) are no word either.
_JOINERS = re.compile("[\u200c\u200d]")
_JOINERS_ONLY = re.compile("[\u200c\u200d]+")


# Word splitters of the user's own (`register_pre_tokenizer`): name -> function(text) -> words.
_REGISTERED_PRE_TOKENIZERS: dict = {}


def register_pre_tokenizer(name: str, function) -> None:
    """
    Make `function(text) -> list of words` (a segmenter for Chinese, Japanese, Thai, ...) usable as
    `ElmoTokenizer(pre_tokenizer=name)`. The name is what a saved tokenizer records, so that text is split as in
    training later too; a saved tokenizer naming a function is loaded only once this process registered it: loading
    never imports or runs code that a folder names. `hf-elmo pretrain --pre-tokenizer module:function` registers
    `module:function` itself, the module being one the user named.
    """
    if name in PRE_TOKENIZER_STYLES or not callable(function):
        raise ValueError(f"register_pre_tokenizer({name!r}, ...) takes a name other than {list(PRE_TOKENIZER_STYLES)} "
                         "and a function of a string that returns its words.")
    _REGISTERED_PRE_TOKENIZERS[name] = function


class _FunctionWordSplitter:
    """A registered function as a word splitter: the words it returns, each found in the text (after the previous
    one) for its offsets. A word that is not a piece of the text is an error naming it."""

    def __init__(self, name: str, function):
        self.name, self.function = name, function

    def pre_tokenize_str(self, text: str) -> list[tuple[str, tuple[int, int]]]:
        spans, position = [], 0
        for word in self.function(text):
            start = text.find(word, position) if isinstance(word, str) and word else -1
            if start < 0:
                raise ValueError(f"pre_tokenizer {self.name!r} returned {word!r}, which is not the next piece of the "
                                 f"text (from character {position}): it must return the text's own words, in order.")
            position = start + len(word)
            spans.append((word, (start, position)))
        return spans


def _build_word_splitter(style: str):
    if style == "ptb":
        return pre_tokenizers.Sequence(
            [pre_tokenizers.WhitespaceSplit(), pre_tokenizers.Split(Regex(_PTB_PATTERN), behavior="isolated")]
        )
    if style == "bert":
        return pre_tokenizers.BertPreTokenizer()
    if style == "whitespace":
        return pre_tokenizers.WhitespaceSplit()
    if style in _REGISTERED_PRE_TOKENIZERS:
        return _FunctionWordSplitter(style, _REGISTERED_PRE_TOKENIZERS[style])
    if isinstance(style, str) and ":" in style:
        raise ValueError(
            f"ElmoTokenizer: pre_tokenizer {style!r} is a function of your own, not registered in this process: "
            f"call hf_elmo.tokenization_elmo.register_pre_tokenizer({style!r}, function) first (a saved tokenizer "
            "never imports the code it names)."
        )
    raise ValueError(f"ElmoTokenizer: unknown pre_tokenizer {style!r}; choose one of {list(PRE_TOKENIZER_STYLES)}, "
                     "or a name given to register_pre_tokenizer.")


@functools.lru_cache(maxsize=1 << 16)
def _cached_char_row(word: str, width: int) -> tuple[tuple[int, ...], bool]:
    """A word's char row, and whether the row cut it (decided once per word, not on every call)."""
    return tuple(word_to_char_ids(word, width)), word_is_cut(word, width)


def _char_alphabet(pad_token: str) -> dict[str, int]:
    """Names of the 262 ids that can appear in an `input_ids` row (0 = padded word position)."""
    vocab = {pad_token: 0}
    for byte in range(256):
        vocab[f"<0x{byte:02X}>"] = byte + CHAR_ID_SHIFT
    for name, char in (
        ("<begin_sentence>", BEGIN_SENTENCE_CHAR),
        ("<end_sentence>", END_SENTENCE_CHAR),
        ("<begin_word>", BEGIN_WORD_CHAR),
        ("<end_word>", END_WORD_CHAR),
        ("<char_pad>", PAD_CHAR),
    ):
        vocab[name] = char + CHAR_ID_SHIFT
    return vocab


def _is_row(ids) -> bool:
    return bool(ids) and not isinstance(ids[0], (list, tuple))


def _ids_depth(ids) -> int:
    """0: one id, 1: one word row, 2: one sentence (rows), 3: a batch of sentences."""
    if hasattr(ids, "ndim"):
        return int(ids.ndim)
    if not isinstance(ids, (list, tuple)):
        return 0
    if not ids:
        return 2  # a sentence with zero words
    first = ids[0]
    if not isinstance(first, (list, tuple)):
        return 1
    return 2 if _is_row(first) else 3


def _load_word_vocab(path) -> list[str]:
    path = os.fspath(path)
    if not os.path.isfile(path):
        raise FileNotFoundError(f"ElmoTokenizer: the vocabulary file {path!r} does not exist (or is not a file).")
    try:
        words = read_vocab(path)
    except UnicodeDecodeError as err:
        raise ValueError(f"ElmoTokenizer: the vocabulary file {path!r} is not UTF-8 text ({err}).") from err
    missing = missing_special_words(words)
    if missing:
        raise ValueError(
            f"ElmoTokenizer: the vocabulary file {path!r} lacks the required entries {missing}. A bilm-tf "
            f"vocabulary lists one word per line, frequency sorted, with {BEGIN_SENTENCE_WORD}, "
            f"{END_SENTENCE_WORD} and {UNKNOWN_WORD} among them."
        )
    return words


class ElmoEncoding:
    """
    Alignment of one encoded sentence, with the fields and methods of `tokenizers.Encoding` that
    [`BatchEncoding`] reads (`word_ids`, `tokens`, `offsets`, `word_to_chars`, `char_to_word`, ...).

    Each input word is exactly one position, so position `p` holds word `word_ids[p]` (the word's
    index in the input; it differs from `p` only after left truncation) and padded positions map to
    `None`. Offsets are `(start, end)` character spans, `(0, 0)` for padding, `None` if unknown.
    """

    n_sequences = 1

    def __init__(self, word_ids, offsets=None, tokens=None):
        self._word_ids = list(word_ids)
        self._offsets = None if offsets is None else [tuple(o) for o in offsets]
        self._tokens = None if tokens is None else list(tokens)

    def __len__(self):
        return len(self._word_ids)

    def __repr__(self):
        return f"ElmoEncoding(num_positions={len(self)}, num_words={sum(w is not None for w in self._word_ids)})"

    @property
    def word_ids(self) -> list[int | None]:
        return list(self._word_ids)

    @property
    def words(self) -> list[int | None]:
        return self.word_ids

    @property
    def sequence_ids(self) -> list[int | None]:
        return [None if w is None else 0 for w in self._word_ids]

    @property
    def attention_mask(self) -> list[int]:
        return [0 if w is None else 1 for w in self._word_ids]

    @property
    def special_tokens_mask(self) -> list[int]:
        return [1 if w is None else 0 for w in self._word_ids]

    @property
    def offsets(self) -> list[tuple[int, int]] | None:
        return None if self._offsets is None else list(self._offsets)

    @property
    def tokens(self) -> list[str]:
        if self._tokens is None:
            raise ValueError(
                "The words of this encoding are not known (it was built by `pad` from ids alone); use "
                "`tokenizer.convert_ids_to_tokens(batch['input_ids'][i])`."
            )
        return list(self._tokens)

    @property
    def overflowing(self) -> list:
        return []

    def _checked_position(self, token_index: int) -> int:
        if not 0 <= token_index < len(self._word_ids):
            raise IndexError(f"position {token_index} is out of range (0..{len(self._word_ids) - 1})")
        return token_index

    def _real_positions(self) -> list[tuple[int, tuple[int, int] | None, str | None]]:
        """(word index, offsets, word) of every non-padding position, in order."""
        offsets = self._offsets or [None] * len(self)
        tokens = self._tokens or [None] * len(self)
        return [(w, o, t) for w, o, t in zip(self._word_ids, offsets, tokens) if w is not None]

    def _position_of_word(self, word_index: int) -> int | None:
        try:
            return self._word_ids.index(word_index)
        except ValueError:
            return None

    def _require_offsets(self):
        if self._offsets is None:
            raise ValueError("Character offsets are not known for this encoding (it was built by `pad` from ids).")
        return self._offsets

    def token_to_sequence(self, token_index: int) -> int | None:
        return None if self._word_ids[self._checked_position(token_index)] is None else 0

    def token_to_word(self, token_index: int) -> int | None:
        return self._word_ids[self._checked_position(token_index)]

    def token_to_chars(self, token_index: int) -> tuple[int, int] | None:
        position = self._checked_position(token_index)
        if self._word_ids[position] is None:
            return None
        return self._require_offsets()[position]

    def word_to_tokens(self, word_index: int, sequence_index: int = 0) -> tuple[int, int] | None:
        position = self._position_of_word(word_index) if sequence_index == 0 else None
        return None if position is None else (position, position + 1)

    def word_to_chars(self, word_index: int, sequence_index: int = 0) -> tuple[int, int] | None:
        position = self._position_of_word(word_index) if sequence_index == 0 else None
        return None if position is None else self._require_offsets()[position]

    def char_to_token(self, char_pos: int, sequence_index: int = 0) -> int | None:
        if sequence_index != 0:
            return None
        for position, (word, (start, end)) in enumerate(zip(self._word_ids, self._require_offsets())):
            if word is not None and start <= char_pos < end:
                return position
        return None

    def char_to_word(self, char_pos: int, sequence_index: int = 0) -> int | None:
        position = self.char_to_token(char_pos, sequence_index)
        return None if position is None else self._word_ids[position]


class ElmoTokenizer(PreTrainedTokenizer):
    r"""
    Character tokenizer of ELMo (Peters et al., 2018): every word becomes one row of
    `max_characters_per_token` character ids, exactly as bilm-tf builds it (UTF-8 bytes cut to
    `max_characters_per_token - 2`, begin/end-of-word marks, padding, every id shifted by +1 so that
    an all-zero row means "no word here"; the literal words `<S>` and `</S>` give the
    sentence-boundary rows). `input_ids` has shape `(batch, words, max_characters_per_token)` and
    `attention_mask` `(batch, words)`. The first word cut is logged, once per tokenizer.

    **No special tokens are added.** The model wraps each sentence in `<S>` ... `</S>` itself, so
    word `i` of the input is position `i` of the output and word-level labels need no alignment.
    `add_special_tokens` is accepted and ignored; `special_tokens_mask` is 0 on words, 1 on padding.

    **Words from raw text** come from `tokenizers.pre_tokenizers`, with character offsets
    (`return_offsets_mapping=True` gives `(batch, words, 2)` spans into the input string). ELMo is
    cased: nothing is lowercased or normalised. `pre_tokenizer` picks the splitter:

    - `"ptb"` (default): whitespace split, then Penn-Treebank-like isolation of punctuation and
      clitics, close to the tokenised news text ELMo was trained on: `"I don't know... it's $3.50
      in the U.S."` -> `I do n't know ... it 's $ 3.50 in the U.S.`; hyphenated words stay whole.
    - `"bert"`: `BertPreTokenizer` (whitespace, then every punctuation character on its own).
    - `"whitespace"`: split on whitespace only (text that is already tokenised).

    **Pre-split words** (`is_split_into_words=True`, a list of words or a batch of such lists) are
    used as given, one position each, never split further. Their offsets follow the convention of
    the fast Transformers tokenizers: relative to each word, i.e. `(0, len(word))`; add the start of
    the word in your own text to get absolute spans (the token-classification pipeline does so).
    With `is_split_into_words=True` an empty list is one sentence of zero words.

    **Lengths** (`max_length`, `truncation`, `pad_to_multiple_of`, `return_length`) count words.
    `return_length` gives the number of real (unpadded) words. Padding is on the right only (the
    model needs the words as a prefix); padded positions are all-zero rows with attention 0.
    `truncation_side="left"` keeps the last words (their `word_ids` keep their input indices).

    **Alignment.** The returned [`BatchEncoding`] carries one [`ElmoEncoding`] per sentence, so
    `word_ids(i)`, `sequence_ids`, `tokens`, `token_to_word`, `word_to_tokens`, `word_to_chars`,
    `char_to_word` and `encoding[i]` work as for fast tokenizers (hence `BatchEncoding.is_fast` is
    `True`, although `tokenizer.is_fast` is `False`).

    **Ids and tokens.** Tokens are words. `convert_tokens_to_ids(word)` gives the word's char row;
    `convert_ids_to_tokens(row)` the word (lossy past the byte cut). The padding token (`pad_token`,
    default `"<pad>"`) has the scalar id `pad_token_id == 0`, which is what Trainer and collators
    read; inside a sequence it is the all-zero row, which `decode` skips.
    `vocab_size == len(tokenizer) == 262`: the character alphabet. `get_vocab()` names those 262
    ids: `pad_token` -> 0, `"<0x00>"`..`"<0xFF>"` -> 1..256 (UTF-8 bytes), `"<begin_sentence>"`,
    `"<end_sentence>"`, `"<begin_word>"`, `"<end_word>"`, `"<char_pad>"` -> 257..261. Tokens cannot be
    added (`add_tokens` raises): every string already has a representation.

    **Word vocabulary** (optional, for language-model heads): `vocab_file`, a bilm-tf vocabulary
    (one word per line, frequency sorted, `<S>`, `</S>`, `<UNK>` first; a `!!!MAXTERMID` line is
    skipped). It gives `word_vocab`, `word_to_index`, `words_to_indices`, `index_to_word`, and is
    saved as `vocab.txt` by `save_pretrained`. It plays no part in encoding.

    Args:
        vocab_file (`str`, *optional*): bilm-tf word vocabulary file.
        max_characters_per_token (`int`, defaults to 50): length of a char row (must match the model).
        pre_tokenizer (`str`, defaults to `"ptb"`): one of `"ptb"`, `"bert"`, `"whitespace"`, or the name of a
            function given to `register_pre_tokenizer` (a segmenter for scripts written without spaces).
        pad_token (`str`, defaults to `"<pad>"`): name of the padding token (its id is always 0).
    """

    vocab_files_names = VOCAB_FILES_NAMES
    model_input_names = ["input_ids", "attention_mask"]
    padding_side = "right"

    def __init__(
        self,
        vocab_file=None,
        max_characters_per_token: int = 50,
        pre_tokenizer: str = "ptb",
        pad_token: str = "<pad>",
        **kwargs,
    ):
        if (
            isinstance(max_characters_per_token, bool)
            or not isinstance(max_characters_per_token, int)
            or max_characters_per_token < 3
        ):
            raise ValueError(
                "ElmoTokenizer: max_characters_per_token must be an integer >= 3 (begin, end and one byte), "
                f"got {max_characters_per_token!r}."
            )
        self.max_characters_per_token = max_characters_per_token
        self.pre_tokenizer = pre_tokenizer
        self._word_splitter = _build_word_splitter(pre_tokenizer)
        self.vocab_file = None if vocab_file is None else os.fspath(vocab_file)
        self._word_vocab = None if vocab_file is None else _load_word_vocab(vocab_file)
        self._word_index = None
        if self._word_vocab is not None:
            self._word_index = {}
            for index, word in enumerate(self._word_vocab):
                self._word_index.setdefault(word, index)
            if len(self._word_index) != len(self._word_vocab):
                logger.warning(
                    f"ElmoTokenizer: {len(self._word_vocab) - len(self._word_index)} duplicate words in "
                    f"{self.vocab_file}; each maps to its first line."
                )
        super().__init__(
            vocab_file=self.vocab_file,
            max_characters_per_token=max_characters_per_token,
            pre_tokenizer=pre_tokenizer,
            pad_token=pad_token,
            **kwargs,
        )
        self._check_padding_side(self.padding_side)

    # -----------------------------------------------------------------------------------------
    # Vocabulary: the character alphabet, and the optional word vocabulary
    # -----------------------------------------------------------------------------------------
    @property
    def vocab_size(self) -> int:
        return 262

    def __len__(self) -> int:
        return self.vocab_size

    def get_vocab(self) -> dict[str, int]:
        return _char_alphabet(str(self.pad_token))

    @property
    def all_special_ids(self) -> list[int]:
        return [0]

    @property
    def word_vocab(self) -> list[str] | None:
        """The word vocabulary (a list, index = word id), or `None` without a `vocab_file`."""
        return self._word_vocab

    @property
    def word_vocab_size(self) -> int | None:
        return None if self._word_vocab is None else len(self._word_vocab)

    def _require_word_vocab(self):
        if self._word_index is None:
            raise ValueError("This ElmoTokenizer has no word vocabulary: create it with `vocab_file=...`.")
        return self._word_index

    @property
    def unk_word_index(self) -> int:
        return self._require_word_vocab()[UNKNOWN_WORD]

    @property
    def bos_word_index(self) -> int:
        return self._require_word_vocab()[BEGIN_SENTENCE_WORD]

    @property
    def eos_word_index(self) -> int:
        return self._require_word_vocab()[END_SENTENCE_WORD]

    def word_to_index(self, word: str) -> int:
        """Index of `word` in the word vocabulary; unknown words give the index of `<UNK>`."""
        index = self._require_word_vocab()
        if not isinstance(word, str):
            raise TypeError(f"word_to_index expects a str, got {type(word).__name__}.")
        return index.get(word, index[UNKNOWN_WORD])

    def words_to_indices(self, words) -> list:
        """`word_to_index` over a list of words (or, recursively, a list of such lists)."""
        return [self.words_to_indices(w) if isinstance(w, (list, tuple)) else self.word_to_index(w) for w in words]

    def index_to_word(self, index: int) -> str:
        self._require_word_vocab()
        return self._word_vocab[index]

    def save_vocabulary(self, save_directory: str, filename_prefix: str | None = None) -> tuple[str, ...]:
        if self._word_vocab is None:
            return ()
        path = os.path.join(
            save_directory, (filename_prefix + "-" if filename_prefix else "") + VOCAB_FILES_NAMES["vocab_file"]
        )
        return (write_vocab(self._word_vocab, path, validate=False),)  # written back as read

    def _add_tokens(self, new_tokens, special_tokens: bool = False) -> int:
        if special_tokens or not new_tokens:
            # Named special tokens are only names here: the pad token always has id 0 and any other
            # string is encoded from its characters. Nothing goes into an added-token table.
            return 0
        raise ValueError(
            "ElmoTokenizer cannot add tokens: it has no token vocabulary, every word is encoded from its characters."
        )

    # -----------------------------------------------------------------------------------------
    # Words
    # -----------------------------------------------------------------------------------------
    def _split_text(self, text: str) -> tuple[list[str], list[tuple[int, int]]]:
        """Words of a raw string and their `(start, end)` character spans in it."""
        # The Rust splitter cannot take lone surrogates (they are not valid Unicode text). Each is
        # replaced by one letter for splitting only, which keeps the offsets and keeps it inside its
        # word; the words are read back from the original string, and encoding drops the surrogate.
        safe = _SURROGATE.sub("x", text) if _SURROGATE.search(text) else text
        if "\u200b" in safe:
            safe = _SEPARATING_FORMAT.sub(" ", safe)  # one character for one: the offsets stay those of `text`
        spans = [span for _, span in self._word_splitter.pre_tokenize_str(safe)]
        if not _DROPPED_FORMAT.search(text) and not _JOINERS.search(text):  # the common case, as fast as before
            return [text[start:end] for start, end in spans], spans
        words = [_DROPPED_FORMAT.sub("", text[start:end]) for start, end in spans]
        kept = [i for i, word in enumerate(words) if word and not _JOINERS_ONLY.fullmatch(word)]
        return [words[i] for i in kept], [spans[i] for i in kept]

    def tokenize(self, text: str, **kwargs) -> list[str]:
        """The words of `text` (a list of str); no special tokens, no lowercasing."""
        if not isinstance(text, str):
            raise TypeError(f"tokenize expects a str, got {type(text).__name__}.")
        return self._split_text(text)[0]

    def _tokenize(self, text, **kwargs):
        return self._split_text(text)[0]

    def _char_row(self, word: str) -> list[int]:
        row, cut = _cached_char_row(word, self.max_characters_per_token)
        if cut and not self.deprecation_warnings.get(CUT_WORD_NOTICE):
            self.deprecation_warnings[CUT_WORD_NOTICE] = True
            logger.warning(
                f"ElmoTokenizer: the model reads a word as its first {word_byte_limit(self.max_characters_per_token)} "
                f"UTF-8 bytes, as bilm-tf does, and sees nothing of the rest of {quoted_word(word)} "
                f"({len(word.encode('utf-8', errors='ignore'))} bytes). Longer words are not reported again."
            )
        return list(row)

    def _zero_row(self) -> list[int]:
        return [0] * self.max_characters_per_token

    # -----------------------------------------------------------------------------------------
    # Token <-> id conversions
    # -----------------------------------------------------------------------------------------
    def _convert_token_to_id(self, token: str) -> list[int]:
        return self._char_row(token)

    def _convert_token_to_id_with_added_voc(self, token):
        if not isinstance(token, str):
            raise TypeError(f"A token must be a str, got {type(token).__name__}.")
        return 0 if token == str(self.pad_token) else self._char_row(token)

    def convert_tokens_to_ids(self, tokens):
        """A word -> its char row (the pad token -> 0); a list of words -> rows (pad token -> zero row)."""
        if isinstance(tokens, str):
            return self._convert_token_to_id_with_added_voc(tokens)
        pad = str(self.pad_token)
        rows = []
        for position, token in enumerate(tokens):
            if not isinstance(token, str):
                raise TypeError(f"tokens[{position}] is a {type(token).__name__}, expected a str.")
            rows.append(self._zero_row() if token == pad else self._char_row(token))
        return rows

    def _convert_id_to_token(self, index: int) -> str:
        if index == 0:
            return str(self.pad_token)
        names = {v: k for k, v in self.get_vocab().items()}
        if index not in names:
            raise ValueError(f"{index} is not a character id (0..{self.vocab_size - 1}).")
        return names[index]

    def _row_to_token(self, row) -> str:
        if not any(row):
            return str(self.pad_token)
        return char_ids_to_word(row, self.max_characters_per_token)

    def convert_ids_to_tokens(self, ids, skip_special_tokens: bool = False):
        """A char row -> its word; a sentence (rows) -> words; an int -> the name of that character id.

        All-zero rows give `pad_token`, or are dropped with `skip_special_tokens=True` (in a sentence).
        """
        depth = _ids_depth(ids)
        ids = to_py_obj(ids)
        if depth == 0:
            return self._convert_id_to_token(int(ids))
        if depth == 1:
            return self._row_to_token(ids)
        if depth == 2:
            return [self._row_to_token(row) for row in ids if not (skip_special_tokens and not any(row))]
        return [self.convert_ids_to_tokens(sentence, skip_special_tokens) for sentence in ids]

    def convert_tokens_to_string(self, tokens: list[str]) -> str:
        return " ".join(tokens)

    def _decode(self, token_ids, skip_special_tokens=False, clean_up_tokenization_spaces=None, **kwargs) -> str:
        words = [char_ids_to_word(row, self.max_characters_per_token) for row in token_ids if any(row)]
        text = " ".join(words)
        if clean_up_tokenization_spaces is None:
            clean_up_tokenization_spaces = self.clean_up_tokenization_spaces
        return self.clean_up_tokenization(text) if clean_up_tokenization_spaces else text

    def decode(self, token_ids, skip_special_tokens: bool = False, clean_up_tokenization_spaces=None, **kwargs):
        """The `input_ids` of one sentence -> its words joined by single spaces (padding skipped).

        A batch `(batch, words, chars)` gives a list of strings, a single row its word.
        """
        depth = _ids_depth(token_ids)
        token_ids = to_py_obj(token_ids)
        if depth == 0:
            return self._convert_id_to_token(int(token_ids))
        if depth == 1:
            return char_ids_to_word(token_ids, self.max_characters_per_token) if any(token_ids) else ""
        if depth == 2:
            return self._decode(token_ids, skip_special_tokens, clean_up_tokenization_spaces, **kwargs)
        return [self._decode(s, skip_special_tokens, clean_up_tokenization_spaces, **kwargs) for s in token_ids]

    def batch_decode(self, sequences, skip_special_tokens: bool = False, clean_up_tokenization_spaces=None, **kwargs):
        """`decode` of every sentence of a batch `(batch, words, chars)`; a single sentence gives a 1-list."""
        result = self.decode(sequences, skip_special_tokens, clean_up_tokenization_spaces, **kwargs)
        return [result] if isinstance(result, str) else result

    # -----------------------------------------------------------------------------------------
    # Special tokens: there are none to add
    # -----------------------------------------------------------------------------------------
    def num_special_tokens_to_add(self, pair: bool = False) -> int:
        return 0

    def build_inputs_with_special_tokens(self, token_ids_0, token_ids_1=None):
        return list(token_ids_0) + (list(token_ids_1) if token_ids_1 else [])

    def create_token_type_ids_from_sequences(self, token_ids_0, token_ids_1=None):
        return [0] * (len(token_ids_0) + (len(token_ids_1) if token_ids_1 else 0))

    def get_special_tokens_mask(self, token_ids_0, token_ids_1=None, already_has_special_tokens: bool = False):
        if already_has_special_tokens:
            if token_ids_1 is not None:
                raise ValueError("Do not pass a second sequence with already_has_special_tokens=True.")
            return [0 if any(row) else 1 for row in to_py_obj(token_ids_0)]
        return [0] * (len(token_ids_0) + (len(token_ids_1) if token_ids_1 else 0))

    # -----------------------------------------------------------------------------------------
    # Encoding
    # -----------------------------------------------------------------------------------------
    @staticmethod
    def _check_padding_side(padding_side):
        if padding_side not in (None, "right"):
            raise ValueError(
                f"ElmoTokenizer pads on the right only (got padding_side={padding_side!r}): the model reads "
                "the words of each sentence as a prefix of its row and wraps them in <S> ... </S> itself."
            )

    @staticmethod
    def _checked_words(words, where: str) -> list[str]:
        for position, word in enumerate(words):
            if not isinstance(word, str):
                raise TypeError(f"{where}[{position}] is a {type(word).__name__}, expected a str (one word).")
        return list(words)

    def _collect_sentences(self, text, is_split_into_words: bool):
        """-> ([(words, offsets), ...], batched)"""
        if is_split_into_words:
            if not isinstance(text, (list, tuple)):
                raise TypeError(
                    "With is_split_into_words=True, pass a list of words (or a batch: a list of lists of "
                    f"words), got a {type(text).__name__}."
                )
            if text and isinstance(text[0], (list, tuple)):
                sentences = []
                for i, words in enumerate(text):
                    if not isinstance(words, (list, tuple)):
                        raise TypeError(
                            f"text[{i}] is a {type(words).__name__}: in a batch of pre-split sentences every item "
                            "must be a list of words."
                        )
                    words = self._checked_words(words, f"text[{i}]")
                    sentences.append((words, [(0, len(w)) for w in words]))
                return sentences, True
            words = self._checked_words(text, "text")
            return [(words, [(0, len(w)) for w in words])], False
        if isinstance(text, str):
            return [self._split_text(text)], False
        if isinstance(text, (list, tuple)):
            if not text:
                raise ValueError(
                    "ElmoTokenizer got an empty batch (an empty list of texts): pass at least one text. An empty "
                    "string is a valid text of zero words; an empty list of words needs is_split_into_words=True."
                )
            for i, item in enumerate(text):
                if not isinstance(item, str):
                    hint = ""
                    if isinstance(item, (list, tuple)):
                        hint = " (for pre-split words pass is_split_into_words=True)"
                    raise TypeError(f"text[{i}] is a {type(item).__name__}, expected a str{hint}.")
            return [self._split_text(t) for t in text], True
        raise TypeError(f"ElmoTokenizer expects a str, a list of str, or pre-split words; got a {type(text).__name__}.")

    def _encode_plus(
        self,
        text,
        text_pair=None,
        add_special_tokens: bool = True,
        padding_strategy: PaddingStrategy = PaddingStrategy.DO_NOT_PAD,
        truncation_strategy: TruncationStrategy = TruncationStrategy.DO_NOT_TRUNCATE,
        max_length: int | None = None,
        stride: int = 0,
        is_split_into_words: bool = False,
        pad_to_multiple_of: int | None = None,
        padding_side: str | None = None,
        return_tensors=None,
        return_token_type_ids: bool | None = None,
        return_attention_mask: bool | None = None,
        return_overflowing_tokens: bool = False,
        return_special_tokens_mask: bool = False,
        return_offsets_mapping: bool = False,
        return_length: bool = False,
        verbose: bool = True,
        split_special_tokens: bool = False,
        **kwargs,
    ) -> BatchEncoding:
        if _called_from_stock_token_pipeline():
            raise ValueError(STOCK_TOKEN_PIPELINE_ERROR)
        if text_pair is not None:
            raise ValueError("ElmoTokenizer encodes single sentences; sentence pairs (text_pair) are not supported.")
        if return_overflowing_tokens:
            raise ValueError("ElmoTokenizer does not support return_overflowing_tokens.")
        if kwargs:
            logger.warning(f"ElmoTokenizer: ignoring unknown keyword arguments {sorted(kwargs)}.")
        self._check_padding_side(padding_side)
        if truncation_strategy == TruncationStrategy.ONLY_SECOND:
            raise ValueError("truncation='only_second' needs a sentence pair, which ElmoTokenizer does not support.")
        if return_attention_mask is None:
            return_attention_mask = "attention_mask" in self.model_input_names
        if return_token_type_ids is None:
            return_token_type_ids = "token_type_ids" in self.model_input_names

        sentences, batched = self._collect_sentences(text, is_split_into_words)
        truncate = truncation_strategy != TruncationStrategy.DO_NOT_TRUNCATE and max_length is not None
        examples, word_spans = [], []
        for words, offsets in sentences:
            first = 0
            if truncate and len(words) > max_length:
                first = len(words) - max_length if self.truncation_side == "left" else 0
                words, offsets = words[first : first + max_length], offsets[first : first + max_length]
            n = len(words)
            example = {"input_ids": [self._char_row(w) for w in words]}
            if return_token_type_ids:
                example["token_type_ids"] = [0] * n
            if return_attention_mask:
                example["attention_mask"] = [1] * n
            if return_special_tokens_mask:
                example["special_tokens_mask"] = [0] * n
            if return_offsets_mapping:
                example["offset_mapping"] = list(offsets)
            examples.append(example)
            word_spans.append((first, words, offsets))

        padded = self._pad_examples(
            examples, padding_strategy, max_length, pad_to_multiple_of, padding_side, return_attention_mask
        )
        encodings = []
        for example, (first, words, offsets) in zip(padded, word_spans):
            n_pad = len(example["input_ids"]) - len(words)
            if return_length:
                example["length"] = len(words)
            encodings.append(
                ElmoEncoding(
                    list(range(first, first + len(words))) + [None] * n_pad,
                    list(offsets) + [(0, 0)] * n_pad,
                    list(words) + [str(self.pad_token)] * n_pad,
                )
            )
        data = {key: [example[key] for example in padded] for key in padded[0]}
        # As for every tokenizer, a single text comes back without a batch axis, except as tensors.
        return self._batch_encoding(data, encodings, batched or return_tensors is not None, return_tensors)

    # -----------------------------------------------------------------------------------------
    # Padding
    # -----------------------------------------------------------------------------------------
    def _pad(
        self,
        encoded_inputs,
        max_length: int | None = None,
        padding_strategy: PaddingStrategy = PaddingStrategy.DO_NOT_PAD,
        pad_to_multiple_of: int | None = None,
        padding_side: str | None = None,
        return_attention_mask: bool | None = None,
    ) -> dict:
        """Pad ONE example (a dict whose `input_ids` is a list of char rows) with all-zero rows on the right."""
        if return_attention_mask is None:
            return_attention_mask = "attention_mask" in self.model_input_names
        rows = encoded_inputs[self.model_input_names[0]]
        n = len(rows)
        if padding_strategy == PaddingStrategy.LONGEST:
            max_length = n
        if max_length is not None and pad_to_multiple_of is not None and max_length % pad_to_multiple_of != 0:
            max_length = (max_length // pad_to_multiple_of + 1) * pad_to_multiple_of
        if return_attention_mask and "attention_mask" not in encoded_inputs:
            encoded_inputs["attention_mask"] = [1 if any(row) else 0 for row in rows]
        elif return_attention_mask is False:
            encoded_inputs.pop("attention_mask", None)
        if padding_strategy == PaddingStrategy.DO_NOT_PAD or max_length is None or n >= max_length:
            return encoded_inputs
        self._check_padding_side(padding_side if padding_side is not None else self.padding_side)
        missing = max_length - n
        width = len(rows[0]) if n else self.max_characters_per_token
        encoded_inputs[self.model_input_names[0]] = list(rows) + [[0] * width for _ in range(missing)]
        fills = (("attention_mask", 0), ("token_type_ids", self.pad_token_type_id), ("special_tokens_mask", 1))
        for key, fill in fills:
            if key in encoded_inputs:
                encoded_inputs[key] = list(encoded_inputs[key]) + [fill] * missing
        if "offset_mapping" in encoded_inputs:
            encoded_inputs["offset_mapping"] = list(encoded_inputs["offset_mapping"]) + [(0, 0)] * missing
        return encoded_inputs

    def _pad_examples(
        self, examples, padding_strategy, max_length, pad_to_multiple_of, padding_side, return_attention_mask
    ):
        if padding_strategy == PaddingStrategy.LONGEST:
            max_length = max(len(example[self.model_input_names[0]]) for example in examples)
            padding_strategy = PaddingStrategy.MAX_LENGTH
        return [
            self._pad(
                example,
                max_length=max_length,
                padding_strategy=padding_strategy,
                pad_to_multiple_of=pad_to_multiple_of,
                padding_side=padding_side,
                return_attention_mask=return_attention_mask,
            )
            for example in examples
        ]

    def pad(
        self,
        encoded_inputs,
        padding=True,
        max_length: int | None = None,
        pad_to_multiple_of: int | None = None,
        padding_side: str | None = None,
        return_attention_mask: bool | None = None,
        return_tensors=None,
        verbose: bool = True,
    ) -> BatchEncoding:
        """
        Pad encoded sentences (a `BatchEncoding`, a dict of lists, or a list of feature dicts as a
        `DataLoader` collate function receives them) to the same number of words, with all-zero char
        rows, attention 0, `special_tokens_mask` 1 and offsets `(0, 0)`. Other keys (e.g. `labels`)
        are passed through unchanged, as the stock `pad` does. Lists, NumPy arrays and torch tensors
        are accepted; tensors in give tensors out unless `return_tensors` says otherwise.
        """
        self._check_padding_side(padding_side)
        sources = None
        if isinstance(encoded_inputs, (list, tuple)):
            if not encoded_inputs:
                raise ValueError("ElmoTokenizer.pad got an empty batch (an empty list of features).")
            if not isinstance(encoded_inputs[0], Mapping):
                raise TypeError(
                    f"ElmoTokenizer.pad expects a dict, a BatchEncoding or a list of dicts, got a list of "
                    f"{type(encoded_inputs[0]).__name__}."
                )
            sources = [self._source_encoding(feature, 0) for feature in encoded_inputs]
            keys = list(encoded_inputs[0].keys())
            encoded_inputs = {key: [feature[key] for feature in encoded_inputs] for key in keys}
            batched = True
        elif isinstance(encoded_inputs, Mapping):
            original = encoded_inputs
            encoded_inputs = dict(encoded_inputs)
            batched = None
        else:
            raise TypeError(
                f"ElmoTokenizer.pad expects a dict or a list of dicts, got {type(encoded_inputs).__name__}."
            )

        main = self.model_input_names[0]
        if main not in encoded_inputs:
            raise ValueError(
                f"You should supply an encoding or a list of encodings that includes {main}, but you provided "
                f"{list(encoded_inputs.keys())}."
            )
        ids = encoded_inputs[main]
        if return_tensors is None:
            return_tensors = self._tensor_kind(ids)
        if batched is None:
            depth = _ids_depth(ids)
            if depth not in (2, 3):
                raise ValueError(
                    f"`{main}` must be one sentence (words, chars) or a batch (batch, words, chars) of char ids; "
                    f"got {depth} dimension(s)."
                )
            batched = depth == 3
            n_examples = len(ids) if batched else 1
            sources = [self._source_encoding(original, i) for i in range(n_examples)]
        encoded_inputs = {key: to_py_obj(value) for key, value in encoded_inputs.items()}

        padding_strategy, _, max_length, _ = self._get_padding_truncation_strategies(
            padding=padding, max_length=max_length, verbose=verbose
        )
        if batched:
            lengths = {key: len(value) for key, value in encoded_inputs.items()}
            n_examples = lengths[main]
            if any(length != n_examples for length in lengths.values()):
                raise ValueError(f"Some items in the batch have a different batch size than others: {lengths}.")
            examples = [{key: value[i] for key, value in encoded_inputs.items()} for i in range(n_examples)]
        else:
            examples = [encoded_inputs]
        padded = self._pad_examples(
            examples, padding_strategy, max_length, pad_to_multiple_of, padding_side, return_attention_mask
        )

        encodings = []
        for example, source in zip(padded, sources):
            word_ids = [p if any(row) else None for p, row in enumerate(example[main])]
            offsets = example.get("offset_mapping")
            tokens = None
            known = source._real_positions() if source is not None else None
            if known is not None and len(known) == sum(w is not None for w in word_ids):
                # Features straight from this tokenizer: keep their word indices, offsets and words.
                real = iter(known)
                items = [None if w is None else next(real) for w in word_ids]
                word_ids = [None if item is None else item[0] for item in items]
                if offsets is None and source.offsets is not None:
                    offsets = [(0, 0) if item is None else item[1] for item in items]
                if source._tokens is not None:
                    tokens = [str(self.pad_token) if item is None else item[2] for item in items]
            encodings.append(ElmoEncoding(word_ids, offsets, tokens))
        data = {key: [example[key] for example in padded] for key in padded[0]}
        return self._batch_encoding(data, encodings, batched, return_tensors)

    @staticmethod
    def _source_encoding(mapping, index):
        encodings = getattr(mapping, "encodings", None) if isinstance(mapping, BatchEncoding) else None
        # Duck-typed: with trust_remote_code each copy of this module has its own ElmoEncoding class.
        if encodings and index < len(encodings) and hasattr(encodings[index], "_real_positions"):
            return encodings[index]
        return None

    @staticmethod
    def _tensor_kind(value):
        if isinstance(value, (list, tuple)) and value:
            value = value[0]
        if isinstance(value, np.ndarray):
            return "np"
        if type(value).__module__.startswith("torch"):
            return "pt"
        return None

    # -----------------------------------------------------------------------------------------
    # Output
    # -----------------------------------------------------------------------------------------
    _ROW_KEYS = {"attention_mask", "token_type_ids", "special_tokens_mask"}

    def _as_array(self, key: str, values: list):
        """Stack one key over a batch, with the right shape even when a sentence has zero words."""
        if key in ("input_ids", "offset_mapping") or key in self._ROW_KEYS:
            lengths = [len(v) for v in values]
            if len(set(lengths)) > 1:
                raise ValueError(
                    f"Unable to build a tensor of `{key}`: the sentences have different numbers of words "
                    f"({lengths}). Pass padding=True (or padding='max_length') to get tensors."
                )
            n_words = lengths[0] if lengths else 0
            if key == "input_ids":
                widths = {len(row) for v in values for row in v}
                if len(widths) > 1:
                    raise ValueError(f"`input_ids` rows have different widths {sorted(widths)}.")
                tail = (widths.pop() if widths else self.max_characters_per_token,)
            else:
                tail = (2,) if key == "offset_mapping" else ()
            array = np.zeros((len(values), n_words, *tail), dtype=np.int64)
            for i, value in enumerate(values):
                if n_words:
                    array[i] = np.asarray(value, dtype=np.int64)
            return array
        try:
            array = np.asarray(values)
        except ValueError as err:
            raise ValueError(f"Unable to build a tensor of `{key}`: its items have different shapes.") from err
        if array.dtype == object:
            raise ValueError(f"Unable to build a tensor of `{key}`: its items have different shapes.")
        if array.size == 0 and array.dtype.kind == "f":
            array = array.astype(np.int64)
        return array

    def _batch_encoding(self, data: dict, encodings: list, batch_axis: bool, return_tensors) -> BatchEncoding:
        """`data` holds one list item per sentence; without `batch_axis` there is exactly one sentence."""
        if return_tensors is not None:
            data = {key: self._as_array(key, value) for key, value in data.items()}
            if TensorType(return_tensors) == TensorType.PYTORCH:
                import torch

                data = {key: torch.from_numpy(array) for key, array in data.items()}
        if not batch_axis:
            data = {key: value[0] for key, value in data.items()}
        return BatchEncoding(data, encoding=encodings, tensor_type=return_tensors, n_sequences=1)


__all__ = ["ElmoTokenizer", "ElmoEncoding"]
