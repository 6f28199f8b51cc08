"""`hf-elmo pretrain --dataset-name`: a `datasets` corpus (a Hub dataset or a local folder) as the run's text files.

The split's text column is written once, one line of text per line, into text files in the user cache
(`$HF_ELMO_CACHE/datasets/NAME-FINGERPRINT/`, keyed by the dataset's own fingerprint and these options), and the run
reads those files exactly as it reads `--train-files`. So every guarantee of the file path holds unchanged:
shuffling, one share per process, a bit-exact `--resume` (the checkpoint records the files' SHA-256, which the same
dataset exports to again). A record whose text is missing, empty or not a string is counted and skipped. The whole
split is read (downloaded, where it is on the Hub) before training: a streamed corpus, read only as far as the run
trains, is not supported yet.
"""

import hashlib
import logging
import os
import re

from .pretraining_data import CorpusError
from .user_cache import user_cache_dir


logger = logging.getLogger(__name__)

# Text files of this many lines at most: shards the stream shuffles between.
LINES_PER_SHARD = 1_000_000


class DatasetCorpusError(CorpusError):
    """The dataset cannot give the run its text, as asked (one line, as the corpus's other errors)."""


def text_column(table, name: str | None, where: str) -> str:
    """`name`, which `table` must have; or, when None, its only string column (an error lists them otherwise)."""
    strings = [column for column, feature in table.features.items()
               if getattr(feature, "dtype", None) in ("string", "large_string")]
    if name is not None:
        if name not in table.column_names:
            raise DatasetCorpusError(f"{where} has no column {name!r} (it has {', '.join(table.column_names)}).")
        return name
    if len(strings) != 1:
        raise DatasetCorpusError(f"{where}: give --text-column, one of its string columns ({', '.join(strings)})"
                                 if strings else f"{where} has no string column; its columns are "
                                 f"{', '.join(table.column_names)}.")
    return strings[0]


def _write_lines(table, column: str, folder: str, prefix: str) -> tuple[int, int]:
    """Each record's text, split into lines, into `folder/PREFIX-00000.txt, ...`; (lines, skipped records)."""
    lines, skipped, handle = 0, 0, None
    try:
        for text in (text for batch in table.iter(batch_size=1000) for text in batch[column]):
            pieces = [line for line in text.splitlines() if line.strip()] if isinstance(text, str) else []
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


def export_dataset(args) -> None:
    """
    `--dataset-name` (with `--dataset-config`, `--dataset-split`, `--text-column`, `--eval-split` or
    `--eval-fraction`) as text files in the user cache, exported once; sets `args.train_files` and `args.eval_file`
    to them. Every process of a run calls it; each gets the same files.
    """
    try:
        import datasets
    except ImportError:
        raise DatasetCorpusError('--dataset-name needs the datasets package: pip install "hf-elmo[examples]" (or '
                                 "pip install datasets).") from None
    name, split = args.dataset_name, args.dataset_split
    where = f"{name}" + (f" ({args.dataset_config})" if args.dataset_config else "")
    try:
        # A folder written by save_to_disk: of a Dataset (dataset_info.json) or of a DatasetDict (dataset_dict.json).
        if os.path.isdir(name) and any(os.path.isfile(os.path.join(name, marker))
                                       for marker in ("dataset_info.json", "dataset_dict.json")):
            loaded = datasets.load_from_disk(name)
        else:
            loaded = datasets.load_dataset(name, args.dataset_config)
    except (FileNotFoundError, ValueError, datasets.exceptions.DatasetNotFoundError,
            datasets.exceptions.DatasetGenerationError) as error:
        # A generation error (data files of the splits that do not agree, a malformed file) says why in its cause.
        reason = " ".join(str(error.__cause__ or error).split())
        raise DatasetCorpusError(f"--dataset-name {where}: cannot be loaded ({reason}).") from None
    splits = loaded if isinstance(loaded, datasets.DatasetDict) else {"train": loaded}
    for wanted in (split, args.eval_split):
        if wanted is not None and wanted not in splits:
            raise DatasetCorpusError(f"--dataset-name {where} has no split {wanted!r} (it has "
                                     f"{', '.join(splits)}).")
    table = splits[split]
    column = text_column(table, args.text_column, f"{where}[{split}]")
    eval_table = splits[args.eval_split] if args.eval_split else None
    if eval_table is not None:
        text_column(eval_table, column, f"{where}[{args.eval_split}]")  # the held-out split has the same column
    if args.eval_fraction:
        held_out = max(1, round(len(table) * args.eval_fraction))
        if held_out >= len(table):
            raise DatasetCorpusError(f"--eval-fraction {args.eval_fraction} leaves no training record of the "
                                     f"{len(table)} in {where}[{split}].")
        # The last records are held out: the same ones every time, none of them trained on.
        table, eval_table = table.select(range(len(table) - held_out)), table.select(range(len(table) - held_out,
                                                                                             len(table)))
    key = "-".join([table._fingerprint, column] + ([eval_table._fingerprint] if eval_table is not None else []))
    folder = user_cache_dir("datasets", re.sub(r"[^A-Za-z0-9_.-]+", "_", os.path.basename(os.path.normpath(name)))
                            + "-" + hashlib.sha256(key.encode()).hexdigest()[:16])
    if not os.path.isdir(folder):
        from .safe_output import atomic_output_dir

        try:
            with atomic_output_dir(folder) as staging:
                lines, skipped = _write_lines(table, column, staging, "train")
                if not lines:
                    raise DatasetCorpusError(f"{where}[{split}], column {column!r}: no record holds text.")
                eval_lines = _write_lines(eval_table, column, staging, "eval")[0] if eval_table is not None else 0
                logger.info("Exported %s[%s], column %r: %d lines of text from %d records (%d without text, "
                            "skipped), %d held-out lines, to %s", where, split, column, lines, len(table), skipped,
                            eval_lines, folder)
        except FileExistsError:  # another process of the run exported it meanwhile: the same files
            pass
    else:
        logger.info("Reading %s[%s], column %r, from its export in %s", where, split, column, folder)
    names = sorted(os.listdir(folder))
    args.train_files = [os.path.join(folder, n) for n in names if n.startswith("train-")]
    evals = [os.path.join(folder, n) for n in names if n.startswith("eval-")]
    if len(evals) > 1:
        raise DatasetCorpusError(f"the held-out part of {where} is over {LINES_PER_SHARD} lines; hold out less.")
    args.eval_file = evals[0] if evals else args.eval_file
