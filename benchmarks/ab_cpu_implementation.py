#!/usr/bin/env python
"""Compare this checkout's ELMo on the CPU with an earlier revision's, in ONE process.

Why in one process: on a shared or virtual machine a process's speed moves by 10-30% from one run to the next with
the same code (benchmarks/README.md), more than most changes to the CPU path are worth. Here both versions run on
the same weights, the same batches and the same warm process, alternating round by round (A B, B A, ...), so the
machine's drift falls on both alike, and the ratio of each round says what the change did.

How: the baseline's whole `hf_elmo` package (`git archive REV hf_elmo`, or --baseline-dir) is imported under
another package name, without its `__init__` (so nothing is registered twice with Transformers), and its
`ElmoModel` loads the same converted folder as this checkout's. Both run with the "cpu" implementation. The whole
model is compared, so a change anywhere below it (the implementations, the shared LSTM maths, the CPU tuning)
counts.

What it prints, ONE JSON line: words per second per side and round (words / the sum over batches of each batch's
fastest of --repeats passes), the ratio current/baseline per round and its median, the largest difference between
the two sides' outputs over every layer of every batch, the workload and the machine.

Examples:
  python benchmarks/ab_cpu_implementation.py --baseline HEAD~1 --config small --rounds 10
  python benchmarks/ab_cpu_implementation.py --baseline-dir /tmp/old/hf_elmo --config original --rounds 4
  HF_ELMO_INT8_KERNEL=bf16-dot python benchmarks/ab_cpu_implementation.py --baseline HEAD~1 --config original --int8
"""

import argparse
import importlib
import io
import json
import os
import statistics
import subprocess
import sys
import tarfile
import tempfile
import time
import types

import torch


HERE = os.path.dirname(os.path.abspath(__file__))
REPO = os.path.dirname(HERE)
for _path in (HERE, REPO):
    if _path not in sys.path:
        sys.path.insert(0, _path)

import bench_utils  # noqa: E402
import random_bilm  # noqa: E402
import workload  # noqa: E402
from bench_inference import converted_folder, int8_kernel  # noqa: E402

from hf_elmo import ElmoModel, ElmoTokenizer  # noqa: E402


BASELINE_PACKAGE = "_hf_elmo_baseline"


def baseline_package(revision: str | None, path: str | None, scratch: str) -> tuple[str, str]:
    """The folder of the baseline's `hf_elmo` package and a description of where it came from."""
    if path is not None:
        if not os.path.isfile(os.path.join(path, "modeling_elmo.py")):
            sys.exit(f"ab_cpu_implementation: {path} is not an hf_elmo package folder (no modeling_elmo.py in it)")
        return path, os.path.abspath(path)
    try:
        archive = subprocess.run(["git", "-C", REPO, "archive", "--format=tar", revision, "hf_elmo"],
                                 capture_output=True)
    except FileNotFoundError:
        sys.exit("ab_cpu_implementation: --baseline needs git; give the package folder with --baseline-dir instead")
    if archive.returncode != 0:
        error = archive.stderr.decode(errors="replace").strip()
        sys.exit(f"ab_cpu_implementation: cannot read hf_elmo at {revision!r}: {error}")
    with tarfile.open(fileobj=io.BytesIO(archive.stdout)) as tar:
        tar.extractall(scratch, filter="data")
    sha = subprocess.run(["git", "-C", REPO, "rev-parse", revision], capture_output=True, text=True).stdout.strip()
    return os.path.join(scratch, "hf_elmo"), f"{revision} ({sha})"


def load_baseline(folder: str):
    """The baseline's `modeling_elmo` module, imported from `folder` as a package of its own."""
    # Modules of a baseline loaded before (another folder, in the same process) would be found first.
    for name in [name for name in sys.modules if name == BASELINE_PACKAGE or name.startswith(BASELINE_PACKAGE + ".")]:
        del sys.modules[name]
    package = types.ModuleType(BASELINE_PACKAGE)
    package.__path__ = [os.path.abspath(folder)]  # a package, but its __init__ is not run
    sys.modules[BASELINE_PACKAGE] = package
    return importlib.import_module(f"{BASELINE_PACKAGE}.modeling_elmo")


def add_baseline_arguments(parser: argparse.ArgumentParser) -> None:
    """--baseline REV or --baseline-dir PATH, one of them required (read by `baseline_package`)."""
    baseline = parser.add_mutually_exclusive_group(required=True)
    baseline.add_argument("--baseline", metavar="REV", help="a git revision of this repository (e.g. HEAD~1, main)")
    baseline.add_argument("--baseline-dir", metavar="PATH", help="an hf_elmo package folder instead of a revision")


def main(argv: list[str] | None = None):
    parser = argparse.ArgumentParser(
        description="Time this checkout's ELMo on the CPU against an earlier revision's, alternating in one "
                    "process; prints one JSON line.",
        formatter_class=argparse.RawDescriptionHelpFormatter, epilog="Examples:" + __doc__.split("Examples:")[1])
    add_baseline_arguments(parser)
    random_bilm.add_weights_arguments(parser)
    workload.add_workload_arguments(parser)
    workload.add_timing_arguments(parser, repeats=3)
    parser.add_argument("--rounds", type=int, default=6, help="rounds, each timing both sides (default 6)")
    parser.add_argument("--int8", action="store_true",
                        help="both sides with int8 weights (from_pretrained(int8_weights=True)); each side measures "
                             "its own kernel: HF_ELMO_INT8_KERNEL=bf16-dot (or int8-pack) gives both the same one")
    args = parser.parse_args(argv)
    if args.rounds < 1 or args.repeats < 1:
        parser.error("--rounds and --repeats must be at least 1")

    sentences, source_name = workload.sentences_from_args(parser, args)
    torch.set_num_threads(args.threads)
    # The baseline's files stay until the end: its modules may import others lazily.
    with tempfile.TemporaryDirectory(prefix="ab-baseline-") as scratch:
        compare(args, sentences, source_name, *baseline_package(args.baseline, args.baseline_dir, scratch))


def compare(args, sentences: list[list[str]], source_name: str, folder: str, origin: str):
    baseline_modeling = load_baseline(folder)
    options_path, weights_path = random_bilm.ensure(args.config, args.cache_dir)
    converted = converted_folder(options_path, weights_path, args.cache_dir)
    load = {"int8_weights": True} if args.int8 else {}
    sides = {"baseline": baseline_modeling.ElmoModel.from_pretrained(converted, **load).eval(),
             "current": ElmoModel.from_pretrained(converted, **load).eval()}
    for model in sides.values():
        model.set_elmo_implementation("cpu")
    config = sides["current"].config
    tokenizer = ElmoTokenizer(max_characters_per_token=config.max_characters_per_token)
    inputs = [tokenizer(group, is_split_into_words=True, padding=True, return_tensors="pt")
              for group in workload.batches(sentences, args.batch_size)]
    n_words = sum(len(sentence) for sentence in sentences)

    words_per_s = {side: [] for side in sides}
    with torch.no_grad():
        # Also the warm-up: each side's first products are measured here.
        outputs = {side: [model(**batch, output_hidden_states=True).hidden_states for batch in inputs]
                   for side, model in sides.items()}
        max_diff = max((a - b).abs().max().item() for x, y in zip(outputs["baseline"], outputs["current"])
                       for a, b in zip(x, y))
        for round_index in range(args.rounds):
            order = list(sides) if round_index % 2 == 0 else list(reversed(sides))
            for side in order:
                seconds = 0.0
                for batch in inputs:
                    fastest = float("inf")
                    for _ in range(args.repeats):
                        start = time.perf_counter()
                        sides[side](**batch)
                        fastest = min(fastest, time.perf_counter() - start)
                    seconds += fastest
                words_per_s[side].append(round(n_words / seconds, 1))

    ratios = [round(c / b, 3) for c, b in zip(words_per_s["current"], words_per_s["baseline"])]
    with open(options_path, encoding="utf-8") as handle:
        architecture = random_bilm.architecture_name(json.load(handle))
    print(json.dumps({
        "baseline": origin,
        "config": architecture,
        "workload": source_name,
        **workload.describe(sentences, args.batch_size),
        "threads": args.threads,
        "rounds": args.rounds,
        "repeats": args.repeats,
        "int8_weights": args.int8,
        "int8_kernel": {side: int8_kernel(model) for side, model in sides.items()} if args.int8 else None,
        "words_per_s": words_per_s,
        "ratio_per_round": ratios,
        "ratio_median": round(statistics.median(ratios), 3),
        "max_abs_diff_current_vs_baseline": max_diff,
        "machine": bench_utils.machine_description("cpu"),
    }, ensure_ascii=False))


if __name__ == "__main__":
    main()
