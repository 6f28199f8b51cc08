#!/usr/bin/env python
"""Compare the "cpu" implementation (hf_elmo/elmo_cpu.py) of this checkout with an earlier one, in ONE process.

Why in one process: on a shared or virtual machine a process's speed moves by 10-30% from one run to the next with
the same code (benchmarks/README.md), more than most changes to elmo_cpu.py are worth. Here both versions run on
the same model, the same batches and the same warm process, alternating round by round (A B, B A, ...), so the
machine's drift falls on both alike, and the ratio of each round says what the change did.

How: the baseline's elmo_cpu.py (`git show REV:hf_elmo/elmo_cpu.py`, or --baseline-file) is loaded as a module of
this checkout's hf_elmo package (so its relative imports read this checkout's other modules: a baseline that needs
names they no longer have fails at load, with the import error), and the model's "cpu" implementation is switched
between the two for each timed pass. Only elmo_cpu.py is compared; the rest of the model is this checkout's.

What it prints, ONE JSON line: words per second per side and round (words / the sum over batches of each batch's
fastest of --repeats passes), the ratio current/baseline per round and its median, the largest difference between
the two sides' outputs over every layer of every batch, the workload and the machine.

Examples:
  python benchmarks/ab_cpu_implementation.py --baseline HEAD~1 --config small --rounds 10
  python benchmarks/ab_cpu_implementation.py --baseline-file /tmp/elmo_cpu_old.py --config original --rounds 4
"""

import argparse
import dataclasses
import json
import os
import statistics
import subprocess
import sys
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
from bench_inference import converted_folder  # noqa: E402

from hf_elmo import ElmoModel, ElmoTokenizer  # noqa: E402
from hf_elmo import modeling_elmo  # noqa: E402


BASELINE_MODULE = "hf_elmo._elmo_cpu_baseline"


def baseline_source(revision: str | None, path: str | None) -> tuple[str, str]:
    """The baseline elmo_cpu.py's text and a description of where it came from."""
    if path is not None:
        with open(path, encoding="utf-8") as handle:
            return handle.read(), os.path.abspath(path)
    try:
        done = subprocess.run(["git", "-C", REPO, "show", f"{revision}:hf_elmo/elmo_cpu.py"], capture_output=True,
                              text=True)
    except FileNotFoundError:
        sys.exit("ab_cpu_implementation: --baseline needs git; give the file with --baseline-file instead")
    if done.returncode != 0:
        sys.exit(f"ab_cpu_implementation: cannot read hf_elmo/elmo_cpu.py at {revision!r}: {done.stderr.strip()}")
    sha = subprocess.run(["git", "-C", REPO, "rev-parse", revision], capture_output=True, text=True).stdout.strip()
    return done.stdout, f"{revision} ({sha})"


def load_baseline(source: str, origin: str) -> modeling_elmo.ElmoImplementation:
    """The baseline's token_vectors and bilstm as an implementation of this checkout's model."""
    module = types.ModuleType(BASELINE_MODULE)
    module.__package__ = "hf_elmo"  # its relative imports read this checkout's modules
    sys.modules[BASELINE_MODULE] = module
    exec(compile(source, f"elmo_cpu.py at {origin}", "exec"), module.__dict__)
    current = modeling_elmo.ELMO_IMPLEMENTATIONS["cpu"]
    return dataclasses.replace(current, token_vectors=module.token_vectors, bilstm=module.bilstm)


def main(argv: list[str] | None = None):
    parser = argparse.ArgumentParser(
        description="Time this checkout's hf_elmo/elmo_cpu.py against an earlier one, alternating in one process; "
                    "prints one JSON line.",
        formatter_class=argparse.RawDescriptionHelpFormatter, epilog="Examples:" + __doc__.split("Examples:")[1])
    baseline = parser.add_mutually_exclusive_group(required=True)
    baseline.add_argument("--baseline", metavar="REV", help="a git revision of this repository (e.g. HEAD~1, main)")
    baseline.add_argument("--baseline-file", metavar="PATH", help="an elmo_cpu.py file instead of a revision")
    parser.add_argument("--config", choices=sorted(random_bilm.CONFIGS), default="small",
                        help="random weights of this published shape (default small)")
    parser.add_argument("--cache-dir", default=random_bilm.default_dir(),
                        help="random weights and converted folders (default $HF_ELMO_BENCH_CACHE or "
                             "~/.cache/hf_elmo_bench)")
    parser.add_argument("--text", metavar="FILE", help="one sentence per line (default: the Wikipedia sample)")
    parser.add_argument("--n-sentences", type=int, default=64, help="sentences to time (default 64)")
    parser.add_argument("--batch-size", type=int, default=32, help="sentences per batch (default 32)")
    parser.add_argument("--threads", type=int, default=2, help="torch.set_num_threads (default 2)")
    parser.add_argument("--rounds", type=int, default=6, help="rounds, each timing both sides (default 6)")
    parser.add_argument("--repeats", type=int, default=3, help="passes per batch and side in a round (default 3)")
    args = parser.parse_args(argv)
    if args.rounds < 1 or args.repeats < 1:
        parser.error("--rounds and --repeats must be at least 1")

    torch.set_num_threads(args.threads)
    source, origin = baseline_source(args.baseline, args.baseline_file)
    sides = {"baseline": load_baseline(source, origin), "current": modeling_elmo.ELMO_IMPLEMENTATIONS["cpu"]}

    options_path, weights_path = random_bilm.ensure(args.config, args.cache_dir)
    model = ElmoModel.from_pretrained(converted_folder(options_path, weights_path, args.cache_dir)).eval()
    model.set_elmo_implementation("cpu")
    sentences, source_name = workload.text_sentences(args.text, args.n_sentences)
    tokenizer = ElmoTokenizer(max_characters_per_token=model.config.max_characters_per_token)
    inputs = [tokenizer(group, is_split_into_words=True, padding=True, return_tensors="pt")
              for group in workload.batches(sentences, args.batch_size)]
    n_words = sum(len(sentence) for sentence in sentences)

    def use(side: str):
        modeling_elmo.ELMO_IMPLEMENTATIONS["cpu"] = sides[side]

    words_per_s = {side: [] for side in sides}
    try:
        with torch.no_grad():
            outputs = {}
            for side in sides:  # also the warm-up: each side's first products are measured here
                use(side)
                outputs[side] = [model(**batch, output_hidden_states=True).hidden_states for batch in inputs]
            max_diff = max((a - b).abs().max().item() for x, y in zip(outputs["baseline"], outputs["current"])
                           for a, b in zip(x, y))
            for round_index in range(args.rounds):
                order = list(sides) if round_index % 2 == 0 else list(reversed(sides))
                for side in order:
                    use(side)
                    seconds = 0.0
                    for batch in inputs:
                        fastest = float("inf")
                        for _ in range(args.repeats):
                            start = time.perf_counter()
                            model(**batch)
                            fastest = min(fastest, time.perf_counter() - start)
                        seconds += fastest
                    words_per_s[side].append(round(n_words / seconds, 1))
    finally:
        use("current")

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
        "words_per_s": words_per_s,
        "ratio_per_round": ratios,
        "ratio_median": round(statistics.median(ratios), 3),
        "max_abs_diff_current_vs_baseline": max_diff,
        "machine": bench_utils.machine_description("cpu"),
    }, ensure_ascii=False))


if __name__ == "__main__":
    main()
