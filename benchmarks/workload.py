"""The sentences a benchmark runs on, and how they are cut into batches.

Three sources, all ending as lists of words (one list per sentence):

- real running text (the default): the Wikipedia sample of `hf_elmo.testing_utils.english_text_sample()` (4000
  sentences from the gensim 4.4.0 wheel's test data, fetched once with pip), or any file with one sentence per
  line (`--text FILE`). Raw lines are split into words by `ElmoTokenizer`'s default "ptb" pre-tokenizer; a file
  that is already tokenised (`--pretokenized`) is split on whitespace.
- `--synthetic`: the earlier workload (an LCG picks 5-40 words a sentence from a list of ~200), kept so that new
  figures can be set beside old ones. Its words repeat far more than real text's, which flatters every
  per-distinct-word shortcut.

A workload file written by `write_words` (one sentence per line, words joined by single spaces) is what
`side_by_side.py` hands to both sides, so that they read the very same words. Nothing here imports hf_elmo
unless raw text has to be tokenised or the Wikipedia sample fetched.
"""

import argparse
import hashlib


# The synthetic workload's word list and LCG, unchanged since the first benchmarks (workload_sha1 stays comparable).
SYNTHETIC_WORDS = (
    "the of and to a in that is was he for it with as his on be at by I this had not are but "
    "from or have an they which one you were her all she there would their we him been has when "
    "who will more no if out so said what up its about into than them can only other new some "
    "could time these two may then do first any my now such like our over man me even most made "
    "after also did many before must through back years where much your way well down should "
    "because each just those people Mr. how too little state good very make world still own see "
    "men work long get here between both life being under never day same another know while last "
    "might us great old year off come since against go came right used take three , . ; : ' \" ( ) "
    "-- 1984 3.14 U.S. New-York Prevention Argentinian seventh-seeded peacemaking unflattering "
    "bio-identical controversial Congestion Nalbandian Washington mildness outbreaks disambiguate "
    "internationalization représentation naïve café Zürich straße Ελληνικά русский 日本語 😀"
).split()


def synthetic_sentences(n_sentences: int, seed: int = 42) -> list[list[str]]:
    """The synthetic workload: x <- (1103515245 x + 12345) mod 2^31 picks each length (5-40) and each word."""
    x = seed
    sentences = []
    for _ in range(n_sentences):
        x = (1103515245 * x + 12345) % (2**31)
        length = 5 + x % 36
        words = []
        for _ in range(length):
            x = (1103515245 * x + 12345) % (2**31)
            words.append(SYNTHETIC_WORDS[x % len(SYNTHETIC_WORDS)])
        sentences.append(words)
    return sentences


def spread(lines: list[str], n: int) -> list[str]:
    """`n` of `lines`, evenly spaced over the whole file (so a sample is not all about one article's topic)."""
    if n >= len(lines):
        return list(lines)
    return [lines[i * len(lines) // n] for i in range(n)]


def text_sentences(path: str | None, n_sentences: int, pretokenized: bool = False) -> tuple[list[list[str]], str]:
    """
    `n_sentences` non-empty lines of `path` (default: the Wikipedia sample), evenly spaced over the file, as
    word lists. Returns the sentences and a name of the source for the JSON line.
    """
    if path is None:
        from hf_elmo.testing_utils import english_text_sample

        path = str(english_text_sample())
        source = "wikipedia-sample (hf_elmo.testing_utils.english_text_sample)"
    else:
        source = path
    with open(path, encoding="utf-8") as handle:
        lines = [line.strip() for line in handle if line.strip()]
    lines = spread(lines, n_sentences)
    if pretokenized:
        sentences = [line.split() for line in lines]
    else:
        from hf_elmo.tokenization_elmo import ElmoTokenizer

        tokenizer = ElmoTokenizer(pre_tokenizer="ptb")
        sentences = [tokenizer.tokenize(line) for line in lines]
    sentences = [s for s in sentences if s]
    if not sentences:
        raise ValueError(f"{path}: no words in it.")
    return sentences, source


def read_words(path: str) -> list[list[str]]:
    """A file written by `write_words`: one sentence per line, words separated by whitespace."""
    with open(path, encoding="utf-8") as handle:
        sentences = [line.split() for line in handle]
    return [s for s in sentences if s]


def write_words(sentences: list[list[str]], path: str):
    for sentence in sentences:
        for word in sentence:
            if not word or any(c.isspace() for c in word):
                raise ValueError(f"word {word!r} is empty or holds whitespace: it would not survive a words file.")
    with open(path, "w", encoding="utf-8") as handle:
        handle.write("".join(" ".join(s) + "\n" for s in sentences))


def digest(sentences: list[list[str]]) -> str:
    """sha1 of the words, one sentence a line: equal on both sides of a comparison when they read the same text."""
    return hashlib.sha1("\n".join(" ".join(s) for s in sentences).encode("utf-8")).hexdigest()


def batches(sentences: list[list[str]], batch_size: int) -> list[list[list[str]]]:
    """Consecutive groups of `batch_size` sentences, in order (no sorting by length: both sides pad the same)."""
    return [sentences[i : i + batch_size] for i in range(0, len(sentences), batch_size)]


def describe(sentences: list[list[str]], batch_size: int) -> dict:
    """Counts that say how much a per-distinct-word shortcut can save on this workload."""
    groups = batches(sentences, batch_size)
    distinct = [len({w for s in group for w in s}) for group in groups]
    words = [sum(len(s) for s in group) for group in groups]
    return {
        "n_sentences": len(sentences),
        "n_words": sum(words),
        "n_batches": len(groups),
        "words_per_batch": words,
        "distinct_words_per_batch": distinct,
        "distinct_fraction": round(sum(distinct) / max(1, sum(words)), 3),
        "workload_sha1": digest(sentences),
    }


def add_workload_arguments(parser: argparse.ArgumentParser) -> None:
    """The workload options of the inference benchmarks: which sentences, how many, in batches of how many."""
    group = parser.add_argument_group("workload")
    source = group.add_mutually_exclusive_group()
    source.add_argument("--text", metavar="FILE", help="one sentence per line (default: the Wikipedia sample)")
    source.add_argument("--synthetic", action="store_true", help="the earlier 200-word-list sentences instead")
    group.add_argument("--pretokenized", action="store_true", help="--text is already split into words by spaces")
    group.add_argument("--n-sentences", type=int, default=64, help="sentences to time (default %(default)s)")
    group.add_argument("--batch-size", type=int, default=32, help="sentences per batch (default %(default)s)")


def sentences_from_args(parser: argparse.ArgumentParser, args) -> tuple[list[list[str]], str]:
    """The sentences `add_workload_arguments`' options ask for, and the name of their source."""
    if args.pretokenized and not args.text:
        parser.error("--pretokenized needs --text")
    if args.synthetic:
        return synthetic_sentences(args.n_sentences), "synthetic"
    return text_sentences(args.text, args.n_sentences, args.pretokenized)


def add_timing_arguments(parser, repeats: int, wait_quiet: float | None = None) -> None:
    """The timing options the benchmarks share: CPU threads, timed passes, and (where given) waiting for quiet
    (`bench_utils.time_passes`). Here, not in bench_utils, so that a parent process parses them without torch."""
    group = parser.add_argument_group("timing")
    group.add_argument("--threads", type=int, default=2, help="torch.set_num_threads, CPU threads (default %(default)s)")
    group.add_argument("--repeats", type=int, default=repeats,
                       help=f"timed passes; each batch counts at its fastest (default {repeats})")
    if wait_quiet is not None:
        group.add_argument("--wait-quiet", type=float, default=wait_quiet, metavar="SECONDS",
                           help="before each pass, wait up to SECONDS for other processes to use < 15%% of the CPUs "
                                f"(default {wait_quiet:g})")
