"""`hf-elmo pretrain --dataset-name`: a `datasets` corpus (a Hub dataset or a local folder) as the run's shards.

Without `--streaming`, the split's text column is written once, one line of text per line, into text files in the
user cache (`$HF_ELMO_CACHE/datasets/NAME-FINGERPRINT/`, keyed by the dataset's own fingerprint and these options),
and the run reads those files exactly as it reads `--train-files`: every guarantee of the file path holds unchanged
(the checkpoint records the files' SHA-256, which the same dataset exports to again). The whole split is read
(downloaded, where it is on the Hub) first.

With `--streaming`, the split is read as the run trains (`StreamedDataset`): the stream's shards are the dataset's
own shards (its data files), a place in one is "records read, and lines read of the next record", so the checkpoint
holds the stream's position as it does for files, and a resumed run reads on from there. Only what is trained on is
read; memory holds the shuffle window, not the corpus.

Either way a record's text is split into lines, each line a sentence for the pre-tokenizer (`record_lines`); a
record whose text is missing, empty or not a string is counted and skipped.
"""

import hashlib
import json
import logging
import os
import re

from .pretraining_data import CorpusError
from .run_record import dataset_name_record, file_record
from .user_cache import user_cache_dir


logger = logging.getLogger(__name__)

# Text files of this many lines at most: shards the stream shuffles between.
LINES_PER_SHARD = 1_000_000
# Records decoded at a time from a streamed shard.
RECORDS_PER_READ = 256


class DatasetCorpusError(CorpusError):
    """The dataset cannot give the run its text, as asked (one line, as the corpus's other errors)."""


def record_lines(text) -> list[str]:
    """A record's sentences: the non-blank lines of its text; none for a missing or non-string text."""
    return [line for line in text.splitlines() if line.strip()] if isinstance(text, str) else []


def text_column(table, name: str | None, where: str) -> str:
    """`name`, which `table` must have; or, when None, its only string column (an error lists them otherwise)."""
    features = table.features
    if features is None:  # a stream whose format names no types (e.g. JSON lines): its first record says
        features = _features_of_first_record(table, where)
    columns = list(features)
    strings = [column for column, feature in features.items()
               if getattr(feature, "dtype", None) in ("string", "large_string")]
    if name is not None:
        if name not in columns:
            raise DatasetCorpusError(f"{where} has no column {name!r} (it has {', '.join(columns)}).")
        return name
    if len(strings) != 1:
        raise DatasetCorpusError(f"{where}: give --text-column, one of its string columns ({', '.join(strings)})"
                                 if strings else f"{where} has no column typed as text (its columns: "
                                 f"{', '.join(columns)}); name the text's column with --text-column (its records "
                                 "that hold no string are then counted and skipped).")
    return strings[0]


def _features_of_first_record(table, where: str) -> dict:
    import datasets

    first = next(iter(_decoded(table.take(1), where)), {})
    return {key: datasets.Value("string") if isinstance(value, str) else None for key, value in first.items()}


def _decoded(records, where: str):
    """`records` (an iteration over a dataset) as they come; a data file that `datasets` cannot decode on the way (not
    UTF-8, JSON broken after its first lines: a ValueError of some kind) is one DatasetCorpusError naming `where`."""
    try:
        yield from records
    except ValueError as error:
        hint = " (datasets reads text files as UTF-8)" if isinstance(error, UnicodeDecodeError) else ""
        raise DatasetCorpusError(f"{where}: cannot be read ({' '.join(str(error).split())}){hint}.") from None


def _write_lines(table, column: str, folder: str, prefix: str, where: str,
                 max_lines: int | None = None) -> tuple[int, int]:
    """Each record's text, split into lines, into `folder/PREFIX-00000.txt, ...`, up to `max_lines` lines (all by
    default: nothing after them is read); (lines, skipped records)."""
    lines, skipped, handle = 0, 0, None
    try:
        for text in (text for batch in _decoded(table.iter(batch_size=1000), where) for text in batch[column]):
            if max_lines is not None and lines >= max_lines:
                break
            pieces = record_lines(text)[:None if max_lines is None else max_lines - lines]
            if not pieces:
                skipped += 1
                continue
            for piece in pieces:
                if lines % LINES_PER_SHARD == 0:
                    if handle is not None:
                        handle.close()
                    shard = os.path.join(folder, f"{prefix}-{lines // LINES_PER_SHARD:05d}.txt")
                    handle = open(shard, "w", encoding="utf-8", newline="\n")
                handle.write(piece + "\n")
                lines += 1
    finally:
        if handle is not None:
            handle.close()
    return lines, skipped


def _where(name: str, config: str | None) -> str:
    return f"{name}" + (f" ({config})" if config else "")


def _is_saved_to_disk(name: str) -> bool:
    # A folder written by save_to_disk: of a Dataset (dataset_info.json) or of a DatasetDict (dataset_dict.json).
    return os.path.isdir(name) and any(os.path.isfile(os.path.join(name, marker))
                                       for marker in ("dataset_info.json", "dataset_dict.json"))


def load_splits(name: str, config: str | None, streaming: bool, revision: str | None = None) -> tuple[dict, dict]:
    """
    The dataset's splits ({split: Dataset}, or {split: IterableDataset} when `streaming`, which reads nothing yet),
    and what identifies each split's data for a checkpoint's record: {split: the data files (a Hub one by its
    address, which holds the revision; a local one, when streaming, by name, size and SHA-256)}, or the fingerprint
    of a save_to_disk folder's split.
    """
    try:
        import datasets
    except ImportError:
        raise DatasetCorpusError('--dataset-name needs the datasets package: pip install "hf-elmo[examples]" (or '
                                 "pip install datasets).") from None
    if streaming and not hasattr(datasets.IterableDataset, "shard"):  # and num_shards: both came in 3.2
        raise DatasetCorpusError(f"--streaming needs datasets 3.2 or later (this is {datasets.__version__}): pip "
                                 'install -U "datasets>=3.2".')
    try:
        if _is_saved_to_disk(name):
            loaded = datasets.load_from_disk(name)
            splits = dict(loaded) if isinstance(loaded, datasets.DatasetDict) else {"train": loaded}
            identity = {split: {"fingerprint": table._fingerprint} for split, table in splits.items()}
            if streaming:  # its arrow files are the stream's shards
                splits = {split: table.to_iterable_dataset(num_shards=max(1, len(table.cache_files)))
                          for split, table in splits.items()}
            return splits, identity
        builder = datasets.load_dataset_builder(name, config, revision=revision)
        data_files = builder.config.data_files or {}
        # Local files are hashed only for a stream, whose checkpoint records them (an export is known by its
        # fingerprint, and its text files are recorded instead).
        identity = {str(split): {"data_files": [file_record(path) if streaming and os.path.isfile(path) else path
                                                for path in files]}
                    for split, files in data_files.items()}
        if streaming:
            splits = dict(builder.as_streaming_dataset())
        else:
            splits = dict(datasets.load_dataset(name, config, revision=revision))
        return {str(split): table for split, table in splits.items()}, identity
    except (FileNotFoundError, ValueError, datasets.exceptions.DatasetNotFoundError,
            datasets.exceptions.DatasetGenerationError) as error:
        # A generation error (data files of the splits that do not agree, a malformed file) says why in its cause.
        reason = " ".join(str(error.__cause__ or error).split())
        raise DatasetCorpusError(f"--dataset-name {_where(name, config)}: cannot be loaded ({reason}).") from None


def hub_revision(identity: dict) -> str | None:
    """The commit of a Hub dataset that `load_splits` resolved (its data files' addresses name it); None for local
    data."""
    for split in identity.values():
        for data_file in split.get("data_files", []):
            found = isinstance(data_file, str) and re.search(r"@([0-9a-f]{40})/", data_file)
            if found:
                return found.group(1)
    return None


def _check_splits(splits: dict, where: str, *wanted: str | None) -> None:
    for split in wanted:
        if split is not None and split not in splits:
            raise DatasetCorpusError(f"--dataset-name {where} has no split {split!r} (it has {', '.join(splits)}).")


def _cache_folder(name: str, key: str) -> str:
    return user_cache_dir("datasets", re.sub(r"[^A-Za-z0-9_.-]+", "_", os.path.basename(os.path.normpath(name)))
                          + "-" + hashlib.sha256(key.encode()).hexdigest()[:16])


def _export(folder: str, parts: list[tuple[str, str, object]], column: str,
            max_lines: int | None = None) -> dict[str, tuple[int, int]]:
    """`parts` [(prefix, where, table)] written once into `folder` (atomically: another process of the run may be
    writing the same), each up to `max_lines` lines; {prefix: (lines, records without text)} for what this process
    wrote, {} where it was there. A part without a line of text is an error, and leaves nothing."""
    from .safe_output import atomic_output_dir

    if os.path.isdir(folder):
        return {}
    try:
        with atomic_output_dir(folder) as staging:
            written = {}
            for prefix, where, table in parts:
                written[prefix] = _write_lines(table, column, staging, prefix, where, max_lines)
                if not written[prefix][0]:
                    raise DatasetCorpusError(f"{where}, column {column!r}: no record holds text.")
            return written
    except FileExistsError:  # another process of the run exported it meanwhile: the same files
        return {}


def _open_splits(args, streaming: bool) -> tuple[dict, dict, str, str]:
    """The options' dataset opened (`load_splits`) and checked: the split and `--eval-split` exist and have the text
    column. Sets `args.dataset_revision` to the commit read, where the dataset is on the Hub (every process and
    worker reads that one, and the card names it). Returns (splits, identity, where, column)."""
    name, split = args.dataset_name, args.dataset_split
    where = _where(name, args.dataset_config)
    splits, identity = load_splits(name, args.dataset_config, streaming=streaming, revision=args.dataset_revision)
    args.dataset_revision = hub_revision(identity) or args.dataset_revision
    _check_splits(splits, where, split, args.eval_split)
    column = text_column(splits[split], args.text_column, f"{where}[{split}]")
    if args.eval_split:
        text_column(splits[args.eval_split], column, f"{where}[{args.eval_split}]")  # the same column
    return splits, identity, where, column


def export_dataset(args) -> None:
    """
    `--dataset-name` (with `--dataset-config`, `--dataset-split`, `--text-column`, `--eval-split` or
    `--eval-fraction`) as text files in the user cache, exported once; sets `args.train_files` and `args.eval_file`
    to them. Every process of a run calls it; each gets the same files.
    """
    name, split = args.dataset_name, args.dataset_split
    splits, _, where, column = _open_splits(args, streaming=False)
    table = splits[split]
    eval_table = splits[args.eval_split] if args.eval_split else None
    if args.eval_fraction:
        held_out = max(1, round(len(table) * args.eval_fraction))
        if held_out >= len(table):
            raise DatasetCorpusError(f"--eval-fraction {args.eval_fraction} leaves no training record of the "
                                     f"{len(table)} in {where}[{split}].")
        # The last records are held out: the same ones every time, none of them trained on.
        table, eval_table = table.select(range(len(table) - held_out)), table.select(range(len(table) - held_out,
                                                                                             len(table)))
    key = "-".join([table._fingerprint, column] + ([eval_table._fingerprint] if eval_table is not None else []))
    folder = _cache_folder(name, key)
    parts = [("train", f"{where}[{split}]", table)]
    if eval_table is not None:
        parts.append(("eval", f"{where}[{args.eval_split or split}] (held out)", eval_table))
    written = _export(folder, parts, column)
    if written:
        (lines, skipped), eval_lines = written["train"], written.get("eval", (0, 0))[0]
        logger.info("Exported %s[%s], column %r: %d lines of text from %d records (%d without text, skipped), %d "
                    "held-out lines, to %s", where, split, column, lines, len(table), skipped, eval_lines, folder)
    else:
        logger.info("Reading %s[%s], column %r, from its export in %s", where, split, column, folder)
    names = sorted(os.listdir(folder))
    args.train_files = [os.path.join(folder, n) for n in names if n.startswith("train-")]
    evals = [os.path.join(folder, n) for n in names if n.startswith("eval-")]
    if len(evals) > 1:
        raise DatasetCorpusError(f"the held-out part of {where} is over {LINES_PER_SHARD} lines; hold out less.")
    args.eval_file = evals[0] if evals else args.eval_file


class StreamedDataset:
    """
    A `datasets` split read as the run trains, as the stream's shards (the interface `pretraining_data.TextFiles`
    describes): shard i is the split's shard i (a data file, or an arrow file of a save_to_disk folder), and a
    place in it is (records read, lines read of the next record). A record's lines come as `record_lines` splits
    them; a record without text comes as None, which the stream counts.

    Each process (and each DataLoader worker) opens the split itself, lazily, and checks that its data are the
    ones recorded when the run started (a Hub dataset updated meanwhile would be other text).
    """

    def __init__(self, name: str, config: str | None, split: str, column: str, identity: dict, num_shards: int,
                 revision: str | None = None):
        self.name, self.config, self.split, self.column = name, config, split, column
        self.identity, self.revision = identity, revision
        where = f"{_where(name, config)}[{split}]"
        self.names = [f"{where} shard {index + 1} of {num_shards}" for index in range(num_shards)]
        self._table = None

    def __len__(self) -> int:
        return len(self.names)

    def __getstate__(self) -> dict:
        return {**self.__dict__, "_table": None}

    def record(self) -> dict:
        """What the checkpoint holds of the data (compared on --resume): the dataset, split, column, and its data
        files or fingerprint."""
        return {"dataset": dataset_name_record(self.name)["name"], "config": self.config, "split": self.split,
                "column": self.column, **self.identity}

    def _opened(self):
        if self._table is None:
            splits, identity = load_splits(self.name, self.config, streaming=True, revision=self.revision)
            if identity.get(self.split) != self.identity:
                raise DatasetCorpusError(f"{self.names[0].rsplit(' shard', 1)[0]} changed while the run was reading "
                                         "it (other data files): restart the run on one version of the data.")
            self._table = splits[self.split].select_columns([self.column])
        return self._table

    def read(self, index: int, records: int, lines: int):
        shard = self._opened().shard(num_shards=len(self.names), index=index)
        if records:
            shard = shard.skip(records)
        # .iter, not iteration: in a DataLoader worker `datasets` would give each worker a part of the shards,
        # and here every worker reads the whole stream (pretraining_data.PretrainingBatches).
        for batch in _decoded(shard.iter(batch_size=RECORDS_PER_READ), self.names[index]):
            for text in batch[self.column]:
                pieces = record_lines(text)
                records += 1
                if not pieces:
                    yield None, records, 0
                for number in range(lines, len(pieces)):
                    done = number + 1 == len(pieces)
                    yield pieces[number], records if done else records - 1, 0 if done else number + 1
                lines = 0


def open_streamed_dataset(args) -> StreamedDataset:
    """
    `--dataset-name ... --streaming`: the training split as the stream's shards, opened without reading it. An
    `--eval-split` is exported once to a text file in the user cache (held-out text is read whole at every
    evaluation), only its first `--eval-max-sentences` lines when that is given, and set as `args.eval_file`.
    """
    name, split = args.dataset_name, args.dataset_split
    splits, identity, where, column = _open_splits(args, streaming=True)
    if args.eval_split:
        limit = args.eval_max_sentences
        key = json.dumps({"split": args.eval_split, "column": column, "max_lines": limit,
                          **identity.get(args.eval_split, {})}, sort_keys=True)
        folder = _cache_folder(name, key)
        eval_table = splits[args.eval_split].select_columns([column])
        written = _export(folder, [("eval", f"{where}[{args.eval_split}]", eval_table)], column, limit)
        if written:
            logger.info("Exported %s[%s], column %r: %d held-out lines, to %s", where, args.eval_split, column,
                        written["eval"][0], folder)
        evals = sorted(n for n in os.listdir(folder) if n.startswith("eval-"))
        if len(evals) != 1:
            raise DatasetCorpusError(f"{where}[{args.eval_split}] is over {LINES_PER_SHARD} lines of held-out text: "
                                     "give a smaller --eval-split, or an --eval-file.")
        args.eval_file = os.path.join(folder, evals[0])
    shards = StreamedDataset(name, args.dataset_config, split, column, identity.get(split, {}),
                             splits[split].num_shards, args.dataset_revision)
    logger.info("Streaming %s[%s], column %r: %d shard(s), read as the run trains", where, split, column, len(shards))
    return shards
