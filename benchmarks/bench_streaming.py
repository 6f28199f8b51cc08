"""
Memory of `hf-elmo pretrain --streaming` over a corpus larger than memory: one JSON line.

Writes a generated corpus of `--gigabytes` of JSON lines (`--shards` files, one record per line, each record one
to three sentences; the words are `workload.synthetic_sentences`, so nothing is downloaded) into `--workdir`, then
reads one whole epoch of it through the run's own stream (`pretraining_datasets.open_streamed_dataset` and
`pretraining_data.SentenceBatchStream`, `--shuffle-window` sentences at a time, batches of `--batch-size`), and
records the process's resident memory after every window. To make the corpus larger than the memory the process
may use, run it in a memory cgroup (the figures in benchmarks/README.md say how they were made); the line records
the cgroup's limit when there is one.

Fields: `corpus_bytes`, `records`, `sentences`, `windows`; `rss_mib`, the resident memory after 10 windows spread over
the epoch (first to last); `rss_growth_mib`, the last of them minus the one after the second window;
`peak_rss_mib` (VmHWM, the whole process); `memory_limit_mib` (the cgroup's, or null); `sentences_per_s` (reading,
splitting and shuffling only, no model); `write_s`, the seconds the corpus took to write.
"""

import argparse
import json
import shutil
import sys
import tempfile
import time
from pathlib import Path
from types import SimpleNamespace


HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))
sys.path.insert(0, str(HERE.parent))

import bench_utils  # noqa: E402
import workload  # noqa: E402

from hf_elmo.pretraining_data import SentenceBatchStream  # noqa: E402
from hf_elmo.pretraining_datasets import open_streamed_dataset  # noqa: E402


def parse_args(argv=None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--gigabytes", type=float, default=1.0, help="size of the generated corpus (default: 1).")
    parser.add_argument("--shards", type=int, default=8, help="JSON-lines files it is written to (default: 8).")
    parser.add_argument("--shuffle-window", type=int, default=100_000,
                        help="sentences read and shuffled together, as hf-elmo pretrain's option (default: 100000).")
    parser.add_argument("--batch-size", type=int, default=64, help="sentences per batch (default: 64).")
    parser.add_argument("--workdir", default=None,
                        help="where the corpus is written (default: a temporary folder, removed at the end).")
    return parser.parse_args(argv)


def cgroup_memory_limit_mib() -> float | None:
    """This process's memory cgroup limit (v2 memory.max, or v1 memory.limit_in_bytes), or None if unlimited."""
    try:
        with open("/proc/self/cgroup", encoding="utf-8") as handle:
            entries = [line.rstrip("\n").split(":", 2) for line in handle]
    except OSError:
        return None
    for _, controllers, path in entries:
        if controllers == "":  # the v2 hierarchy
            candidate = f"/sys/fs/cgroup{path}/memory.max"
        elif "memory" in controllers.split(","):
            candidate = f"/sys/fs/cgroup/memory{path}/memory.limit_in_bytes"
        else:
            continue
        try:
            with open(candidate, encoding="utf-8") as handle:
                value = handle.read().strip()
        except OSError:
            continue
        if value != "max" and int(value) < 1 << 60:  # v1 writes "unlimited" as a huge number
            return int(value) / 2**20
    return None


def write_corpus(folder: Path, gigabytes: float, shards: int) -> tuple[int, int]:
    """The generated corpus; (bytes, records)."""
    sentences = [" ".join(words) for words in workload.synthetic_sentences(10_007)]
    target, written, records = int(gigabytes * 2**30), 0, 0
    handles = [open(folder / f"train-{shard:03d}.jsonl", "w", encoding="utf-8") for shard in range(shards)]
    try:
        while written < target:
            take = 1 + records % 3
            text = "\n".join(f"{sentences[(records * 7 + k) % len(sentences)]} {records}" for k in range(take))
            line = json.dumps({"id": records, "text": text}) + "\n"
            handles[records % shards].write(line)
            written, records = written + len(line), records + 1
    finally:
        for handle in handles:
            handle.close()
    return written, records


def main(argv=None) -> None:
    args = parse_args(argv)
    workdir = Path(args.workdir or tempfile.mkdtemp(prefix="hf_elmo_stream_"))
    corpus = workdir / "corpus"
    corpus.mkdir(parents=True, exist_ok=True)
    try:
        start = time.perf_counter()
        corpus_bytes, records = write_corpus(corpus, args.gigabytes, args.shards)
        write_s = time.perf_counter() - start
        options = SimpleNamespace(dataset_name=str(corpus), dataset_config=None, dataset_revision=None,
                                  dataset_split="train", text_column="text", eval_split=None, eval_file=None,
                                  eval_max_sentences=None)
        stream = SentenceBatchStream(open_streamed_dataset(options), str.split, batch_size=args.batch_size, seed=0,
                                     shuffle_window=args.shuffle_window)
        batches_per_window = stream.window // args.batch_size
        after_window, start = [], time.perf_counter()
        while stream.epoch == 0:
            for _ in range(batches_per_window):
                stream.next_batch()
                if stream.epoch:
                    break
            after_window.append(bench_utils.proc_status_mib("VmRSS"))
        read_s = time.perf_counter() - start
    finally:
        if args.workdir is None:
            shutil.rmtree(workdir, ignore_errors=True)
        else:
            shutil.rmtree(corpus, ignore_errors=True)
    spread = [after_window[round(i * (len(after_window) - 1) / 9)] for i in range(10)] if after_window else []
    print(json.dumps({
        "benchmark": "streaming",
        "corpus_bytes": corpus_bytes,
        "records": records,
        "shards": args.shards,
        "sentences": stream.stats.sentences,
        "shuffle_window": stream.window,
        "windows": len(after_window),
        "rss_mib": [round(v, 1) for v in spread if v is not None],
        "rss_growth_mib": (round(after_window[-1] - after_window[1], 1)
                           if len(after_window) > 2 and after_window[1] is not None else None),
        "peak_rss_mib": round(bench_utils.proc_status_mib("VmHWM") or 0, 1) or None,
        "memory_limit_mib": cgroup_memory_limit_mib(),
        "sentences_per_s": round(stream.stats.sentences / read_s),
        "write_s": round(write_s, 1),
        "machine": bench_utils.machine_description("cpu"),
    }))


if __name__ == "__main__":
    main()
