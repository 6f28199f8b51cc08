#!/usr/bin/env python
"""Pretraining throughput of the "small" ELMo (2x1024_128_2048cnn_1xhighway) on CPU: 1 process vs 2 processes.

    python benchmarks/bench_pretrain.py [--steps 24] [--window 6] [--batch-size 16]

Each setting is a real `hf-elmo-pretrain` run on real English (the Wikipedia sample of hf_elmo.testing_utils, fetched
once with pip) with bilm-tf's recipe (sampled softmax with 8192 negatives, Adagrad, clipping), the 2-process one
through `accelerate launch --multi_gpu` on CPU (gloo). Tokens are what the LMs predict (words + one </S> per
sentence), summed over processes; the first logging window (warm-up) is left out. Prints one JSON line.
"""

import argparse
import json
import os
import platform
import re
import socket
import subprocess
import sys
import tempfile

import torch


REPO_ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, REPO_ROOT)

from hf_elmo.testing_utils import english_text_sample  # noqa: E402


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def run(processes: int, args, corpus: str, workdir: str) -> dict:
    output = os.path.join(workdir, f"run-{processes}")
    train = [
        "-m", "hf_elmo.pretraining", "--train-files", corpus, "--build-vocab", "--config", "small",
        "--batch-size", str(args.batch_size), "--max-steps", str(args.steps), "--logging-steps", str(args.window),
        "--save-steps", str(10 * args.steps), "--report-to", "none", "--output-dir", output,
        # Random lengths in every batch, so that every window costs about the same (grouping by length makes
        # some windows all-short and others all-long).
        "--no-group-by-length",
    ]
    # Both settings use all the cores: one process with every core as a thread, or one thread per process.
    threads = max(1, os.cpu_count() // processes)
    env = {**os.environ, "PYTHONPATH": REPO_ROOT, "TQDM_DISABLE": "1", "HF_HUB_OFFLINE": "1",
           "OMP_NUM_THREADS": str(threads)}
    if processes == 1:
        command = [sys.executable, *train]
    else:
        env.update(ACCELERATE_USE_CPU="1")
        command = [sys.executable, "-m", "accelerate.commands.accelerate_cli", "launch", "--multi_gpu",
                   "--num_processes", str(processes), "--num_machines", "1", "--main_process_port", str(free_port()),
                   "--dynamo_backend", "no", "--mixed_precision", "no", *train]
    result = subprocess.run(command, capture_output=True, text=True, env=env)
    log = result.stdout + result.stderr
    if result.returncode != 0:
        raise SystemExit(f"{processes}-process run failed:\n{log[-4000:]}")
    world = re.search(r"World size (\d+)", log)
    rates = [float(r) for r in re.findall(r"step \d+: loss .* ([\d.]+) tokens/s", log)]
    if int(world.group(1)) != processes or len(rates) < 2:
        raise SystemExit(f"unexpected log of the {processes}-process run:\n{log[-4000:]}")
    measured = rates[1:]  # the first window includes start-up
    return {"threads_per_process": threads, "tokens_per_second": round(sum(measured) / len(measured), 1),
            "windows": [round(r, 1) for r in measured]}


def main():
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--steps", type=int, default=24, help="optimizer steps per run (default: %(default)s)")
    parser.add_argument("--window", type=int, default=6, help="steps per throughput window (default: %(default)s)")
    parser.add_argument("--batch-size", type=int, default=16, help="sentences per process per step")
    args = parser.parse_args()
    corpus = str(english_text_sample())
    load_before = os.getloadavg()[0]  # other work on the machine skews CPU timings; say how busy it was
    with tempfile.TemporaryDirectory() as workdir:
        results = {str(n): run(n, args, corpus, workdir) for n in (1, 2)}
        vocab_size = sum(1 for _ in open(os.path.join(workdir, "run-1", "vocab.txt"), encoding="utf-8"))
    print(json.dumps({
        "benchmark": "pretrain",
        "config": "small",
        "device": "cpu",
        "cpu_count": os.cpu_count(),
        "torch": torch.__version__,
        "platform": platform.machine(),
        "vocab_size": vocab_size,
        "softmax_negatives": 8192,
        "batch_size_per_process": args.batch_size,
        "steps": args.steps,
        "processes": results,
        "speedup_2_vs_1": round(results["2"]["tokens_per_second"] / results["1"]["tokens_per_second"], 3),
        "load_average_1min": [round(load_before, 2), round(os.getloadavg()[0], 2)],
    }))


if __name__ == "__main__":
    main()
