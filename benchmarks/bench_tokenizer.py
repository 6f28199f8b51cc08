"""Time ElmoTokenizer against a throwaway "fast" (tokenizers-backed) prototype on real text; one JSON line.

Issue 12 asks whether a Transformers fast tokenizer (`TokenizersBackend`, `is_fast == True`) would be simpler
and at least as fast as `hf_elmo.ElmoTokenizer` (a Python-backend `PreTrainedTokenizer` whose `input_ids` are
3-D: one row of 50 char ids per word). Three tokenizers encode the same sentences:

- `ElmoTokenizer`, the package's tokenizer as it is;
- `fast_prototype` (`FastElmoPrototype` below): a `tokenizers.Tokenizer` (the same "ptb" pre-tokenizer in Rust,
  a one-entry WordLevel model so that every word is one token) gives the words' offsets, word ids, attention
  mask and padding for the whole batch in one `encode_batch` call; the char-id rows are then cut out of the
  batch's UTF-8 bytes by vectorised NumPy code (bilm-tf's scheme, as `word_to_char_ids`);
- `python_vectorised` (`VectorisedElmoTokenizer`), the control: ElmoTokenizer with only its padded-tensor path
  using the same vectorised rows, words still split per sentence in Python. If it is as fast as the prototype,
  the speed comes from vectorising, not from the fast backend.

Each encodes all `--n-sentences` sentences in batches of each `--batch-sizes`, `padding=True`,
`return_tensors="pt"`, with and without `return_offsets_mapping`, over `--rounds` rounds, the order rotating
every round (the machine may be busy: the sides share its noise). Reported: sentences/s and words/s from the
fastest round (and the median round), their ratio to ElmoTokenizer, CPU time over wall time. Before timing,
every side encodes every sentence and must give ElmoTokenizer's `input_ids`, `attention_mask`,
`offset_mapping` and `word_ids` (`identical`).

The prototypes cover what is timed (raw text, padded batches): enough to measure, not a replacement.
`stock_methods` in the output compares, on small inputs, what the methods the prototype inherits from
`TokenizersBackend` give with ElmoTokenizer's answer, i.e. what an adoption would still have to override.
`words_and_offsets_only_s` times the word splitting alone: Rust `encode_batch` against `pre_tokenize_str`.

Run from the repository root (about 40 s with the defaults):

    python benchmarks/bench_tokenizer.py                        # Wikipedia sample, batch 32 and 1024
    python benchmarks/bench_tokenizer.py --text my.txt --rounds 5 --batch-sizes 32 256
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import platform
import statistics
import sys
import tempfile
import time
from pathlib import Path

import numpy as np
import tokenizers
import torch
import transformers
from tokenizers import Tokenizer, models
from transformers import BatchEncoding
from transformers.tokenization_utils_base import TruncationStrategy
from transformers.tokenization_utils_tokenizers import TokenizersBackend
from transformers.utils import PaddingStrategy


REPO = Path(__file__).resolve().parent.parent
if str(REPO) not in sys.path:
    sys.path.insert(0, str(REPO))
sys.path.insert(0, str(Path(__file__).resolve().parent))

from bench_utils import cpu_description  # noqa: E402
from hf_elmo.configuration_elmo import (  # noqa: E402
    BEGIN_SENTENCE_CHAR,
    BEGIN_WORD_CHAR,
    CHAR_ID_SHIFT,
    END_SENTENCE_CHAR,
    END_WORD_CHAR,
    PAD_CHAR,
)
from hf_elmo.tokenization_elmo import _SURROGATE, ElmoEncoding, ElmoTokenizer, _build_word_splitter  # noqa: E402


logger = logging.getLogger("bench_tokenizer")

WORD_TOKEN = "<word>"  # what the one-entry WordLevel model calls every word


# ---------------------------------------------------------------------------------------------------------------
# The prototype
# ---------------------------------------------------------------------------------------------------------------
def char_rows_from_offsets(texts: list[str], starts: np.ndarray, ends: np.ndarray, width: int) -> np.ndarray:
    """
    The bilm-tf char rows of the words `texts[b][starts[k]:ends[k]]` (character offsets; `b` is given by the
    caller through `starts`/`ends` already shifted to the concatenation of `texts`), shape (n_words, width).

    Vectorised over the whole batch: the concatenated text is encoded to UTF-8 once, a code point -> byte
    position table maps the character offsets to byte offsets, and each row takes its word's first `width - 2`
    bytes between begin/end-of-word marks, padded, shifted by +1. Lone surrogates count zero bytes (dropped, as
    `word.encode("utf-8", errors="ignore")` does); the words `<S>` and `</S>` get the sentence-boundary rows.
    """
    joined = "".join(texts)
    code_points = np.frombuffer(joined.encode("utf-32-le", "surrogatepass"), dtype=np.uint32)
    n_bytes = (
        1 + (code_points >= 0x80) + (code_points >= 0x800) + (code_points >= 0x10000)
    ).astype(np.int64)
    n_bytes[(code_points >= 0xD800) & (code_points <= 0xDFFF)] = 0
    byte_at = np.zeros(len(code_points) + 1, dtype=np.int64)
    np.cumsum(n_bytes, out=byte_at[1:])
    utf8 = np.frombuffer(joined.encode("utf-8", "ignore") + b"\0", dtype=np.uint8)

    byte_start, byte_end = byte_at[starts], byte_at[ends]
    full = byte_end - byte_start
    kept = np.minimum(full, width - 2)
    inner = np.arange(width - 2)
    inside = inner[None, :] < kept[:, None]
    gathered = utf8[np.where(inside, byte_start[:, None] + inner[None, :], 0)].astype(np.int64)
    rows = np.empty((len(starts), width), dtype=np.int64)
    rows[:, 0] = BEGIN_WORD_CHAR
    rows[:, 1:-1] = np.where(inside, gathered, PAD_CHAR)
    rows[:, -1] = PAD_CHAR
    rows[np.arange(len(starts)), kept + 1] = END_WORD_CHAR
    for marker, char in ((b"<S>", BEGIN_SENTENCE_CHAR), (b"</S>", END_SENTENCE_CHAR)):
        candidates = np.flatnonzero(full == len(marker))
        if candidates.size:
            window = utf8[byte_start[candidates, None] + np.arange(len(marker))[None, :]]
            hits = candidates[(window == np.frombuffer(marker, dtype=np.uint8)).all(axis=1)]
            rows[hits, 1:] = PAD_CHAR
            rows[hits, 1] = char
            rows[hits, 2] = END_WORD_CHAR
    return rows + CHAR_ID_SHIFT


class FastElmoPrototype(TokenizersBackend):
    """
    THROWAWAY prototype (issue 12): ElmoTokenizer's raw-text `__call__` on a `tokenizers.Tokenizer`.

    The backend is the "ptb" pre-tokenizer and a WordLevel model whose vocabulary is `{pad: 0, "<word>": 1}`, so
    every word is one token and padding positions are id 0. Rust gives offsets, word ids, attention mask and
    right padding; `_encode_plus` replaces the 2-D ids by 3-D char rows. Nothing else is overridden on purpose:
    `stock_behaviour()` below shows what the inherited methods then do.
    """

    model_input_names = ["input_ids", "attention_mask"]
    padding_side = "right"

    def __init__(self, max_characters_per_token: int = 50, pre_tokenizer: str = "ptb", pad_token: str = "<pad>",
                 **kwargs):
        backend = Tokenizer(models.WordLevel({pad_token: 0, WORD_TOKEN: 1}, unk_token=WORD_TOKEN))
        backend.pre_tokenizer = _build_word_splitter(pre_tokenizer)
        self.max_characters_per_token = max_characters_per_token
        # split_special_tokens: the literal text "<pad>" must be split and spelled like any other text, as
        # ElmoTokenizer does, not matched as the added pad token.
        super().__init__(tokenizer_object=backend, pad_token=pad_token, split_special_tokens=True,
                         max_characters_per_token=max_characters_per_token, pre_tokenizer=pre_tokenizer, **kwargs)

    def _encode_plus(self, text, text_pair=None, add_special_tokens=True,
                     padding_strategy=PaddingStrategy.DO_NOT_PAD,
                     truncation_strategy=TruncationStrategy.DO_NOT_TRUNCATE, max_length=None, stride=0,
                     is_split_into_words=False, pad_to_multiple_of=None, padding_side=None, return_tensors=None,
                     return_token_type_ids=None, return_attention_mask=None, return_overflowing_tokens=False,
                     return_special_tokens_mask=False, return_offsets_mapping=False, return_length=False,
                     verbose=True, split_special_tokens=None, **kwargs):
        if text_pair is not None or return_overflowing_tokens:
            raise NotImplementedError("prototype: single sentences only")
        if is_split_into_words:
            # Stock behaviour, kept to show it: Rust runs the pre-tokenizer again on every given word.
            batched = bool(text) and isinstance(text[0], (list, tuple))
            sentences = [list(words) for words in text] if batched else [list(text)]
            texts = ["".join(words) for words in sentences]
            inputs = sentences
        else:
            batched = not isinstance(text, str)
            texts = list(text) if batched else [text]
            # The Rust side cannot take lone surrogates: one letter stands in for each (offsets are unchanged).
            inputs = [_SURROGATE.sub("x", t) if _SURROGATE.search(t) else t for t in texts]
            sentences = None
        self.set_truncation_and_padding(padding_strategy, truncation_strategy, max_length, stride,
                                        pad_to_multiple_of, padding_side)
        self._tokenizer.encode_special_tokens = True
        encodings = self._tokenizer.encode_batch(inputs, add_special_tokens=False, is_pretokenized=is_split_into_words)
        if sentences is not None:  # offsets are relative to each given word: make them relative to `texts`
            text_offsets = []
            for words, encoding in zip(sentences, encodings):
                word_start = np.concatenate([[0], np.cumsum([len(w) for w in words])]).tolist()
                text_offsets.append([(0, 0) if w is None else (word_start[w] + a, word_start[w] + b)
                                     for w, (a, b) in zip(encoding.word_ids, encoding.offsets)])
        else:
            text_offsets = None
        if padding_strategy == PaddingStrategy.DO_NOT_PAD and len({len(e) for e in encodings}) > 1:
            # Ragged: one sentence at a time (not the timed path).
            parts = [self._arrays([texts[i]], [encodings[i]], text_offsets and [text_offsets[i]])
                     for i in range(len(texts))]
            arrays = {key: [part[key][0] for part in parts] for key in parts[0]}
            if return_tensors == "pt":
                raise ValueError("sentences of different lengths need padding=True for tensors")
        else:
            arrays = self._arrays(texts, encodings, text_offsets)
        data = {"input_ids": arrays["input_ids"]}
        if return_attention_mask is not False:
            data["attention_mask"] = arrays["attention_mask"]
        if return_special_tokens_mask:
            data["special_tokens_mask"] = [1 - m for m in arrays["attention_mask"]]
        if return_offsets_mapping:
            data["offset_mapping"] = arrays["offset_mapping"]
        if return_length:
            data["length"] = [m.sum() for m in arrays["attention_mask"]]
        if return_tensors == "pt":
            data = {key: torch.from_numpy(np.asarray(value)) for key, value in data.items()}
        elif return_tensors is None:
            data = {key: [np.asarray(v).tolist() for v in value] for key, value in data.items()}
            if not batched:
                data = {key: value[0] for key, value in data.items()}
        return BatchEncoding(data, encodings, tensor_type=return_tensors, n_sequences=1)

    def _arrays(self, texts: list[str], encodings, text_offsets=None) -> dict[str, np.ndarray]:
        """input_ids (B, L, width), attention_mask (B, L), offset_mapping (B, L, 2) of equally long encodings.

        `text_offsets` (pre-split words): each position's span in `texts`, where the encodings' own offsets are
        relative to the given words.
        """
        mask = np.array([e.attention_mask for e in encodings], dtype=np.int64).reshape(len(texts), -1)
        offsets = np.array([e.offsets for e in encodings], dtype=np.int64).reshape(len(texts), -1, 2)
        spans = offsets if text_offsets is None else np.array(text_offsets, dtype=np.int64).reshape(offsets.shape)
        real = mask.astype(bool)
        text_start = np.zeros(len(texts), dtype=np.int64)
        np.cumsum([len(t) for t in texts[:-1]], out=text_start[1:])
        word_start = (spans[..., 0] + text_start[:, None])[real]
        word_end = (spans[..., 1] + text_start[:, None])[real]
        width = self.max_characters_per_token
        input_ids = np.zeros((*mask.shape, width), dtype=np.int64)
        input_ids[real] = char_rows_from_offsets(texts, word_start, word_end, width)
        return {"input_ids": input_ids, "attention_mask": mask, "offset_mapping": offsets}


class VectorisedElmoTokenizer(ElmoTokenizer):
    """
    Control for the prototype: ElmoTokenizer as it is (Python backend, `is_fast` False, per-sentence
    `pre_tokenize_str`), with only its padded raw-text path replaced by the same vectorised char rows and NumPy
    padding. It tells whether the prototype's speed comes from the Rust `encode_batch` or from the vectorising.
    """

    def _encode_plus(self, text, text_pair=None, padding_strategy=PaddingStrategy.DO_NOT_PAD,
                     is_split_into_words=False, return_tensors=None, return_offsets_mapping=False, **kwargs):
        simple = (text_pair is None and not is_split_into_words and isinstance(text, list) and text
                  and padding_strategy == PaddingStrategy.LONGEST and return_tensors == "pt"
                  and kwargs.get("truncation_strategy") in (None, TruncationStrategy.DO_NOT_TRUNCATE)
                  and not any(kwargs.get(k) for k in ("return_special_tokens_mask", "return_length",
                                                      "pad_to_multiple_of", "return_token_type_ids")))
        if not simple:
            return super()._encode_plus(text, text_pair=text_pair, padding_strategy=padding_strategy,
                                        is_split_into_words=is_split_into_words, return_tensors=return_tensors,
                                        return_offsets_mapping=return_offsets_mapping, **kwargs)
        split = [self._split_text(t) for t in text]
        lengths = np.array([len(words) for words, _ in split], dtype=np.int64)
        n_words = int(lengths.max())
        spans = np.array([span for _, spans in split for span in spans], dtype=np.int64).reshape(-1, 2)
        text_start = np.zeros(len(text), dtype=np.int64)
        np.cumsum([len(t) for t in text[:-1]], out=text_start[1:])
        shift = np.repeat(text_start, lengths)
        real = np.arange(n_words)[None, :] < lengths[:, None]
        input_ids = np.zeros((len(text), n_words, self.max_characters_per_token), dtype=np.int64)
        input_ids[real] = char_rows_from_offsets(text, spans[:, 0] + shift, spans[:, 1] + shift,
                                                 self.max_characters_per_token)
        data = {"input_ids": torch.from_numpy(input_ids), "attention_mask": torch.from_numpy(real.astype(np.int64))}
        offsets = np.zeros((len(text), n_words, 2), dtype=np.int64)
        offsets[real] = spans
        if return_offsets_mapping:
            data["offset_mapping"] = torch.from_numpy(offsets)
        pad = str(self.pad_token)
        encodings = []
        for (words, word_spans), n in zip(split, lengths.tolist()):
            missing = n_words - n
            encodings.append(ElmoEncoding(list(range(n)) + [None] * missing, word_spans + [(0, 0)] * missing,
                                          words + [pad] * missing))
        return BatchEncoding(data, encoding=encodings, tensor_type="pt", n_sequences=1)


def saved_files(tokenizer) -> list[str]:
    with tempfile.TemporaryDirectory() as folder:
        return sorted(Path(p).name for p in tokenizer.save_pretrained(folder))


def stock_behaviour(fast: FastElmoPrototype, slow: ElmoTokenizer) -> dict:
    """What the methods the prototype inherits from `TokenizersBackend` do, against ElmoTokenizer's answer."""
    sentences = ["The cat sat.", "Hello there , world !"]
    probes = {
        "pad": lambda t: t.pad([{"input_ids": t(s)["input_ids"]} for s in sentences], return_tensors="pt")[
            "input_ids"].shape,
        "decode": lambda t: t.decode(t("The cat sat.")["input_ids"]),
        "convert_ids_to_tokens": lambda t: t.convert_ids_to_tokens(t("The cat")["input_ids"]),
        "convert_tokens_to_ids": lambda t: t.convert_tokens_to_ids(["cat"])[0][:4],
        "tokenize": lambda t: t.tokenize("I don't know."),
        "vocab_size": lambda t: t.vocab_size,
        "len": lambda t: len(t),
        "batch.tokens": lambda t: t(sentences, padding=True).tokens(0),
        "batch.word_ids": lambda t: t(sentences, padding=True).word_ids(1),
        "pre_split_words.word_ids": lambda t: t([["can't", "U.S.", ""]], is_split_into_words=True).word_ids(0),
        "text_with_pad_token": lambda t: t("a <pad> b")["attention_mask"],
        "save_pretrained": saved_files,
    }
    report = {}
    for name, probe in probes.items():
        try:
            expected = repr(probe(slow))
        except Exception as err:  # noqa: BLE001 - a probe reports any failure as it is
            expected = f"error: {type(err).__name__}"
        try:
            got = repr(probe(fast))
        except Exception as err:  # noqa: BLE001
            got = f"error: {type(err).__name__}: {str(err).splitlines()[0][:120] if str(err) else ''}"
        report[name] = "same" if got == expected else {"fast_prototype": got[:160], "ElmoTokenizer": expected[:160]}
    return report


# ---------------------------------------------------------------------------------------------------------------
# Measuring
# ---------------------------------------------------------------------------------------------------------------
def read_sentences(path: Path, limit: int | None) -> list[str]:
    lines = [line.rstrip("\n") for line in path.read_text(encoding="utf-8").splitlines()]
    lines = [line for line in lines if line.strip()]
    return lines[:limit] if limit else lines


def batches_of(sentences: list[str], size: int) -> list[list[str]]:
    return [sentences[i : i + size] for i in range(0, len(sentences), size)]


def encode_all(tokenizer, batches, offsets: bool) -> list[BatchEncoding]:
    return [tokenizer(b, padding=True, return_tensors="pt", return_offsets_mapping=offsets) for b in batches]


def same_outputs(slow, fast, batches) -> bool:
    for a, b in zip(encode_all(slow, batches, True), encode_all(fast, batches, True)):
        for key in ("input_ids", "attention_mask", "offset_mapping"):
            if a[key].shape != b[key].shape or not torch.equal(a[key], b[key]):
                logger.error("outputs differ in %s: %s vs %s", key, tuple(a[key].shape), tuple(b[key].shape))
                return False
        if [a.word_ids(i) for i in range(len(a["input_ids"]))] != [b.word_ids(i) for i in
                                                                  range(len(b["input_ids"]))]:
            logger.error("word_ids differ")
            return False
    return True


def split_timings(slow: ElmoTokenizer, fast: FastElmoPrototype, sentences, sizes, rounds) -> dict:
    """Best seconds to get only the words' offsets (and padding mask) of all sentences: the Rust `encode_batch`
    the prototype calls, against the per-sentence `pre_tokenize_str` ElmoTokenizer calls."""
    backend = fast.backend_tokenizer
    backend.enable_padding(pad_id=0, pad_token=str(fast.pad_token))
    timings = {}
    for size in sizes:
        batches = batches_of(sentences, size)
        candidates = {
            "rust_encode_batch": lambda: [[(e.attention_mask, e.offsets) for e in backend.encode_batch(b)]
                                          for b in batches],
            "pre_tokenize_str_per_sentence": lambda: [[slow._split_text(t) for t in b] for b in batches],
        }
        for name, run in candidates.items():
            best = float("inf")
            for _ in range(rounds):
                started = time.perf_counter()
                run()
                best = min(best, time.perf_counter() - started)
            timings[f"{name}@{size}"] = round(best, 4)
    return timings


class HelpFormatter(argparse.RawDescriptionHelpFormatter, argparse.ArgumentDefaultsHelpFormatter):
    pass


def parse_args(argv=None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(
        description=__doc__.split("\n\nRun from")[0],
        formatter_class=HelpFormatter,
    )
    parser.add_argument("--text", type=Path, default=None,
                        help="UTF-8 file, one sentence of raw (untokenised) text per line; default: the Wikipedia "
                             "sample of hf_elmo.testing_utils.english_text_sample() (4000 sentences, fetched once)")
    parser.add_argument("--n-sentences", type=int, default=2048,
                        help="use the first N non-empty lines of the text (0: all of them)")
    parser.add_argument("--batch-sizes", type=int, nargs="+", default=[32, 1024],
                        help="sentences per tokenizer call; each size is timed on all N sentences")
    parser.add_argument("--rounds", type=int, default=3,
                        help="rounds; each round times every tokenizer once per batch size and offsets setting")
    parser.add_argument("--max-characters-per-token", type=int, default=50, help="char row width")
    return parser.parse_args(argv)


def main(argv=None) -> dict:
    args = parse_args(argv)
    logging.basicConfig(level=logging.WARNING, format="%(name)s: %(message)s")
    if args.text is None:
        from hf_elmo.testing_utils import english_text_sample

        args.text = english_text_sample()
    sentences = read_sentences(args.text, args.n_sentences or None)
    if not sentences:
        raise SystemExit(f"{args.text}: no non-empty line to encode")

    slow = ElmoTokenizer(max_characters_per_token=args.max_characters_per_token)
    fast = FastElmoPrototype(max_characters_per_token=args.max_characters_per_token)
    n_words = sum(len(slow.tokenize(s)) for s in sentences)
    control = VectorisedElmoTokenizer(max_characters_per_token=args.max_characters_per_token)
    sides = {"ElmoTokenizer": slow, "fast_prototype": fast, "python_vectorised": control}
    identical = {
        name: all(same_outputs(slow, tokenizer, batches_of(sentences, size)) for size in args.batch_sizes)
        for name, tokenizer in sides.items() if tokenizer is not slow
    }

    settings = [(size, offsets) for size in args.batch_sizes for offsets in (False, True)]
    seconds = {(name, size, offsets): [] for name in sides for size, offsets in settings}
    cpu_seconds = {key: [] for key in seconds}
    for size, offsets in settings:  # warm-up: ElmoTokenizer's per-word row cache, first-call costs
        for tokenizer in sides.values():
            encode_all(tokenizer, batches_of(sentences, size), offsets)
    for round_index in range(args.rounds):
        for size, offsets in settings:
            batches = batches_of(sentences, size)
            names = list(sides)
            order = names[round_index % len(names):] + names[: round_index % len(names)]  # rotate who goes first
            for name in order:
                started, cpu_started = time.perf_counter(), time.process_time()
                encode_all(sides[name], batches, offsets)
                seconds[(name, size, offsets)].append(time.perf_counter() - started)
                cpu_seconds[(name, size, offsets)].append(time.process_time() - cpu_started)

    results = []
    for size, offsets in settings:
        row = {"batch_size": size, "offsets": offsets}
        for name in sides:
            best = min(seconds[(name, size, offsets)])
            median = statistics.median(seconds[(name, size, offsets)])
            cpu = statistics.median(cpu_seconds[(name, size, offsets)])
            row[name] = {
                "sentences_per_s": round(len(sentences) / best),
                "words_per_s": round(n_words / best),
                "sentences_per_s_median": round(len(sentences) / median),
                "best_s": round(best, 4),
                "median_s": round(median, 4),
                "cpu_over_wall": round(cpu / median, 2),  # > 1: more than one core busy (Rust threads)
            }
        for name in list(sides)[1:]:
            row[f"speedup_{name}"] = {
                "best": round(row["ElmoTokenizer"]["best_s"] / row[name]["best_s"], 2),
                "median": round(row["ElmoTokenizer"]["median_s"] / row[name]["median_s"], 2),
            }
        results.append(row)

    report = {
        "benchmark": "tokenizer",
        "date_utc": time.strftime("%Y-%m-%d %H:%M", time.gmtime()),
        "text": str(args.text),
        "n_sentences": len(sentences),
        "n_words": n_words,
        "rounds": args.rounds,
        "identical": all(identical.values()),
        "identical_per_side": identical,
        "results": results,
        "words_and_offsets_only_s": split_timings(slow, fast, sentences, args.batch_sizes, args.rounds),
        "stock_methods": stock_behaviour(fast, slow),
        "loadavg": list(os.getloadavg()),
        "machine": {
            "cpu": cpu_description(),
            "python": platform.python_version(),
            "torch": torch.__version__,
            "transformers": transformers.__version__,
            "tokenizers": tokenizers.__version__,
            "numpy": np.__version__,
            "env": {k: os.environ[k] for k in ("TOKENIZERS_PARALLELISM", "RAYON_NUM_THREADS") if k in os.environ},
        },
    }
    print(json.dumps(report))
    return report


if __name__ == "__main__":
    main()
