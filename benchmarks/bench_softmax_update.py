#!/usr/bin/env python
"""The softmax's part of a pretraining step with dense against sparse gradients, at a large vocabulary. One JSON line.

    python benchmarks/bench_softmax_update.py [--vocab-size 793471] [--hidden-size 512] [--rows 5632]
        [--samples 8192] [--steps 5] [--device cpu|cuda] [--threads 2]

bilm-tf's 1B Word Benchmark vocabulary (793,471 words) makes the softmax 793k x 512: 1.6 GB in fp32, as large
again for its gradient and for Adagrad's accumulator. A step of the sampled softmax uses only the rows of its
targets and negatives. With dense gradients (`ElmoSoftmax.sparse` off) the gradient, the global-norm clipping
and Adagrad still touch every row; with sparse ones (what `hf-elmo pretrain` uses with Adagrad) only the rows
used. Both give the same weights (tests/test_pretraining.py).

What is timed is the softmax's part of `hf-elmo pretrain`'s step, with its functions: the sampled-softmax
losses of `--rows` positions (128 sentences x 22 positions x 2 directions by default) with `--samples`
negatives, forward and backward (`backward_s`), `pretraining.clip_gradient_norm` (`clip_s`), Adagrad's update
(`update_s`) and `zero_grad` (`zero_grad_s`). Each side runs in a process of its own, so that its peak RSS
(`peak_rss_mib`, or peak GPU memory on cuda) is its own; the steps after the first are timed, median reported.
The hidden states are random: the cost does not depend on their values.
"""

import argparse
import json
import os
import statistics
import subprocess
import sys
import time


REPO_ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
BILM_TF_1B_WORD_VOCAB = 793471


def parse_args(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--vocab-size", type=int, default=BILM_TF_1B_WORD_VOCAB,
                        help=f"softmax rows (default {BILM_TF_1B_WORD_VOCAB}, bilm-tf's 1B Word vocabulary)")
    parser.add_argument("--hidden-size", type=int, default=512, help="projection_dim (default 512, original)")
    parser.add_argument("--rows", type=int, default=5632, help="positions scored per step (default 128 x 22 x 2)")
    parser.add_argument("--samples", type=int, default=8192, help="sampled negatives (default 8192, bilm-tf)")
    parser.add_argument("--steps", type=int, default=5, help="steps per side; the first is not timed (default 5)")
    parser.add_argument("--device", choices=("cpu", "cuda"), default="cpu")
    parser.add_argument("--threads", type=int, default=2, help="torch CPU threads (default 2)")
    parser.add_argument("--side", choices=("dense", "sparse"), help=argparse.SUPPRESS)  # one side, in a child
    args = parser.parse_args(argv)
    if args.steps < 2:
        parser.error("--steps must be at least 2 (the first step is not timed)")
    if not 0 < args.samples < args.vocab_size:
        parser.error("--samples must be between 1 and --vocab-size - 1")
    return args


def measure_side(args) -> dict:
    """One side's step, timed part by part (run in its own process)."""
    import torch

    sys.path.insert(0, REPO_ROOT)
    sys.path.insert(0, os.path.join(REPO_ROOT, "benchmarks"))
    from bench_utils import process_peak_rss_mib

    from hf_elmo.configuration_elmo import ElmoConfig
    from hf_elmo.log_uniform_sampler import sample_log_uniform_candidates
    from hf_elmo.modeling_elmo import ElmoForPreTraining
    from hf_elmo.pretraining import clip_gradient_norm

    torch.set_num_threads(args.threads)
    torch.manual_seed(0)
    device = torch.device(args.device)
    # A biLM as small as can be: the softmax is what is measured.
    config = ElmoConfig(char_filters=[[1, 4]], n_highway=0, char_embedding_dim=4, lstm_dim=args.hidden_size,
                        projection_dim=args.hidden_size, num_lstm_layers=1, vocab_size=args.vocab_size,
                        num_softmax_samples=args.samples)
    model = ElmoForPreTraining(config).to(device).train()
    model.softmax.sparse = args.side == "sparse"
    optimizer = torch.optim.Adagrad(model.parameters(), lr=0.2, initial_accumulator_value=1.0)
    synchronize = torch.cuda.synchronize if device.type == "cuda" else (lambda: None)
    # Targets as a corpus has them: Zipfian, like the negatives.
    targets = sample_log_uniform_candidates(args.rows, args.vocab_size, device=device)[0]
    times = {"backward_s": [], "clip_s": [], "update_s": [], "zero_grad_s": []}
    rows_updated = None
    for step in range(args.steps):
        hidden = torch.randn(args.rows, args.hidden_size, device=device, requires_grad=True)
        marks = []
        synchronize()
        marks.append(time.perf_counter())
        loss = model._sampled_softmax_losses(hidden, targets[torch.randperm(args.rows, device=device)]).mean()
        (loss * 20).backward()
        synchronize()
        marks.append(time.perf_counter())
        clip_gradient_norm(model.parameters(), 10.0)
        synchronize()
        marks.append(time.perf_counter())
        if rows_updated is None:
            grad = model.softmax.weight.grad
            rows_updated = int(grad.coalesce()._indices().shape[1]) if grad.is_sparse else int(grad.any(1).sum())
        optimizer.step()
        synchronize()
        marks.append(time.perf_counter())
        optimizer.zero_grad()
        synchronize()
        marks.append(time.perf_counter())
        if step:
            for name, start, end in zip(times, marks, marks[1:]):
                times[name].append(end - start)
    result = {name: round(statistics.median(values), 4) for name, values in times.items()}
    result["step_s"] = round(sum(result.values()), 4)
    result["softmax_rows_with_gradient"] = rows_updated
    if device.type == "cuda":
        result["peak_gpu_memory_mib"] = round(torch.cuda.max_memory_allocated() / 2**20)
    result["peak_rss_mib"] = round(process_peak_rss_mib())
    return result


def main(argv=None) -> int:
    args = parse_args(argv)
    if args.side:
        print(json.dumps(measure_side(args)))
        return 0
    sys.path.insert(0, os.path.join(REPO_ROOT, "benchmarks"))
    from bench_utils import machine_description

    sides = {}
    for side in ("dense", "sparse"):
        command = [sys.executable, os.path.abspath(__file__), *(argv if argv is not None else sys.argv[1:]),
                   "--side", side]
        done = subprocess.run(command, capture_output=True, text=True)
        if done.returncode:
            sys.stderr.write(done.stderr)
            print(f"error: the {side} side failed (exit {done.returncode}); its error is above.", file=sys.stderr)
            return 1
        sides[side] = json.loads(done.stdout.strip().splitlines()[-1])
    dense, sparse = sides["dense"], sides["sparse"]
    report = {
        "benchmark": "softmax_update",
        "vocab_size": args.vocab_size, "hidden_size": args.hidden_size, "rows": args.rows, "samples": args.samples,
        "timed_steps": args.steps - 1, "device": args.device, **sides,
        "step_speedup": round(dense["step_s"] / sparse["step_s"], 1),
        "peak_rss_saved_mib": dense["peak_rss_mib"] - sparse["peak_rss_mib"],
        "machine": machine_description(args.device),
    }
    print(json.dumps(report))
    return 0


if __name__ == "__main__":
    sys.exit(main())
