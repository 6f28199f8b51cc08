#!/usr/bin/env python
"""hf_elmo against AllenNLP 0.9.0's ELMo, on the same weights and the same words, in one run.

For each config (default: small and original), for each of --rounds rounds, it runs two child processes, one
after the other: benchmarks/allennlp_peer.py (AllenNLP's `_ElmoBiLm`, loaded from its wheel; see that file)
and benchmarks/bench_inference.py (hf_elmo's ElmoModel). The order alternates between rounds (peer first in
round 1, hf_elmo first in round 2, ...), so neither side always runs on a machine the other has just warmed or
slowed. Separate processes keep each side's memory figures its own.

Both sides get:
  - the same weights: random weights of the published shape in bilm-tf's hdf5 layout (random_bilm.py); AllenNLP
    loads the file with its own loaders, hf_elmo converts it;
  - the same words: the workload is built once here (real running text by default: the Wikipedia sample of
    hf_elmo.testing_utils, split into words by ElmoTokenizer's "ptb" pre-tokenizer; or --text FILE; or
    --synthetic) and written to a words file that both sides read (workload_sha1 must agree);
  - the same timing code (bench_utils.py): fp32 by default, --threads 2, batches of 32 sentences in order,
    --repeats 5 passes, each batch counted at its fastest pass.
They differ in one thing by default: AllenNLP's biLM returns every layer, hf_elmo's timed passes its top layer
(AutoModel's default output, two layers' tensors fewer at the peak); --all-layers makes them return the same.
The first batch's outputs of both sides are compared (max_abs_diff_vs_allennlp, every layer; AllenNLP's LSTM
state is reset first): it shows that both computed the same function.

Output: each child's full JSON line goes to stderr as it finishes (and to --runs FILE if given); stdout gets
ONE JSON line: per config the tokens/s of each side in each round, the ratio per round, the ratio of the
medians and the smallest ratio, each side's largest peak RSS, the split of time, distinct words per batch,
the CPU model with its vector extensions and the BLAS, the date (UTC) and the machine's load; with --top-ops N,
hf_elmo's first run profiled (`hf_elmo_profile`: on a GPU, whether the GPU or the host sets its pace).

The AllenNLP side needs nothing besides this project's requirements: it fetches the allennlp 0.9.0 wheel with pip
on first use (or give --wheel). Timings are only comparable within one run: other processes on the machine move
both sides' figures. On a host shared with other busy processes, two OpenMP threads that spin while waiting for a
preempted partner can make either side several times slower; `OMP_WAIT_POLICY=PASSIVE python
benchmarks/side_by_side.py ...` (both children inherit it, and the JSON lines record it) keeps that from
dominating. cpu_over_wall near the thread count means a quiet host.

Examples:
  python benchmarks/side_by_side.py                                # small and original, real text, 3 rounds
  python benchmarks/side_by_side.py --configs original --rounds 5 --runs /tmp/runs.jsonl
  python benchmarks/side_by_side.py --synthetic                    # the earlier 200-word-list workload
  python benchmarks/side_by_side.py --dtype bf16                   # hf_elmo in bf16 (AllenNLP stays fp32)
  python benchmarks/side_by_side.py --int8                         # and hf_elmo with int8 weights, a third side
  python benchmarks/side_by_side.py --all-layers                   # hf_elmo returns every layer, as AllenNLP does
  python benchmarks/side_by_side.py --device cuda --batch-size 256  # both on one GPU (AllenNLP in fp32)
"""

import argparse
import atexit
import json
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time


HERE = os.path.dirname(os.path.abspath(__file__))
REPO = os.path.dirname(HERE)
for _path in (HERE, REPO):
    if _path not in sys.path:
        sys.path.insert(0, _path)

import bench_utils  # noqa: E402
import random_bilm  # noqa: E402
import workload  # noqa: E402


def run_json(command: list[str], log) -> dict:
    """Run one benchmark child; its last stdout line is its JSON result."""
    done = subprocess.run(command, capture_output=True, text=True)
    lines = [line for line in done.stdout.splitlines() if line.startswith("{")]
    if done.returncode != 0 or not lines:
        message = done.stderr.strip().splitlines()
        # A child that explains itself in one line (a missing package, no wheel) is quoted as it is.
        detail = message[-1] if message and done.stderr.count("\n") <= 1 else done.stderr[-3000:]
        sys.exit(f"side_by_side: {os.path.basename(command[1])} failed (exit {done.returncode}): {detail}")
    print(lines[-1], file=sys.stderr, flush=True)
    if log:
        log.write(lines[-1] + "\n")
        log.flush()
    return json.loads(lines[-1])


def max_layer_difference(peer_file: str, ours_file: str) -> float:
    import torch

    peer, ours = torch.load(peer_file), torch.load(ours_file)
    if peer["workload_sha1"] != ours["workload_sha1"] or len(peer["layers"]) != len(ours["layers"]):
        raise SystemExit("side_by_side: the two sides' first batches differ in words or layers")
    return max((a.float() - b.float()).abs().max().item() for a, b in zip(peer["layers"], ours["layers"]))


def main():
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--configs", nargs="+", default=["small", "original"], choices=sorted(random_bilm.CONFIGS),
                        help="shapes to compare (default: small original)")
    workload.add_workload_arguments(parser)
    workload.add_timing_arguments(parser, repeats=5, wait_quiet=10.0)
    parser.add_argument("--rounds", type=int, default=3, help="runs of each side per config, alternating (default 3)")
    parser.add_argument("--device", choices=["cpu", "cuda"], default="cpu", help="both sides' device (default cpu)")
    parser.add_argument("--dtype", choices=["fp32", "bf16"], default="fp32", help="hf_elmo's dtype (AllenNLP: fp32)")
    parser.add_argument("--implementation", default="auto", help="hf_elmo's --implementation (default auto)")
    parser.add_argument("--int8", action="store_true",
                        help="also run hf_elmo with int8 weights (bench_inference.py --int8) as a third side, in the "
                             "same rounds: its speed, memory and largest difference from the fp32 model")
    parser.add_argument("--all-layers", action="store_true",
                        help="hf_elmo returns every layer, as AllenNLP's _ElmoBiLm always does (bench_inference.py "
                             "--all-layers); default: its top layer, AutoModel's default output")
    parser.add_argument("--wheel", help="a local allennlp-0.9.0-py3-none-any.whl (default: fetched with pip)")
    parser.add_argument("--cache-dir", default=random_bilm.default_dir(),
                        help="random weights, converted folders, workload files (default $HF_ELMO_BENCH_CACHE or "
                             "~/.cache/hf_elmo_bench)")
    parser.add_argument("--top-ops", type=int, default=0, metavar="N",
                        help="hf_elmo's first run also profiles one pass (bench_inference.py --top-ops N): its N top "
                             "operators and, on a GPU, its kernels and busy fraction, as `hf_elmo_profile`")
    parser.add_argument("--runs", metavar="FILE", help="also append every child's JSON line to FILE")
    args = parser.parse_args()
    sentences, source_name = workload.sentences_from_args(parser, args)
    os.makedirs(args.cache_dir, exist_ok=True)
    words_file = os.path.join(args.cache_dir, f"workload-{workload.digest(sentences)[:16]}.txt")
    workload.write_words(sentences, words_file)
    described = workload.describe(sentences, args.batch_size)

    common = ["--batch-size", str(args.batch_size), "--threads", str(args.threads), "--repeats", str(args.repeats),
              "--wait-quiet", str(args.wait_quiet), "--device", args.device]
    log = open(args.runs, "a", encoding="utf-8") if args.runs else None
    summary = {
        "date_utc": time.strftime("%Y-%m-%d %H:%M", time.gmtime()),
        "workload": source_name,
        "n_sentences": described["n_sentences"],
        "n_words": described["n_words"],
        "distinct_words_per_batch": described["distinct_words_per_batch"],
        "workload_sha1": described["workload_sha1"],
        "batch_size": args.batch_size,
        "threads": args.threads,
        "repeats": args.repeats,
        "rounds": args.rounds,
        "device": args.device,
        "dtype_hf_elmo": args.dtype,
        "layers": {"hf_elmo": "all" if args.all_layers else "top", "allennlp": "all"},
        "configs": {},
    }
    scratch = tempfile.mkdtemp(prefix="side_by_side-")  # each side's first batch, compared at the end
    atexit.register(shutil.rmtree, scratch, True)
    for config in args.configs:
        options, weights = random_bilm.ensure(config, args.cache_dir)
        paths = ["--options", options, "--weights", weights]
        peer_out, ours_out = os.path.join(scratch, f"{config}-peer.pt"), os.path.join(scratch, f"{config}-ours.pt")
        peer_command = [sys.executable, os.path.join(HERE, "allennlp_peer.py"), *paths, "--words", words_file,
                        *common, *(["--wheel", args.wheel] if args.wheel else [])]
        ours_command = [sys.executable, os.path.join(HERE, "bench_inference.py"), *paths, "--text", words_file,
                        "--pretokenized", "--n-sentences", str(len(sentences)), "--dtype", args.dtype,
                        "--implementation", args.implementation, "--cache-dir", args.cache_dir, *common,
                        *(["--all-layers"] if args.all_layers else [])]
        commands = {"peer": peer_command, "ours": ours_command}
        if args.int8:
            commands["int8"] = ours_command + ["--int8"]
        runs = {side: [] for side in commands}
        peers, ours, int8 = runs["peer"], runs["ours"], runs.get("int8", [])
        for round_index in range(args.rounds):
            first = round_index == 0
            # Each round starts with the next side, so that no side always runs first.
            sides = list(commands)
            order = sides[round_index % len(sides):] + sides[: round_index % len(sides)]
            for side in order:
                saved = {"peer": peer_out, "ours": ours_out}.get(side) if first else None
                profiled = first and side == "ours" and args.top_ops
                runs[side].append(run_json(commands[side] + (["--save-first-batch", saved] if saved else [])
                                           + (["--top-ops", str(args.top_ops)] if profiled else []), log))
            if len({runs[side][-1]["workload_sha1"] for side in sides}) != 1:
                sys.exit(f"side_by_side: the sides read different words "
                         f"({[runs[side][-1]['workload_sha1'] for side in sides]})")
        ours_speed = [o["tokens_per_s"] for o in ours]
        peer_speed = [p["tokens_per_s"] for p in peers]
        ratios = [o / p for o, p in zip(ours_speed, peer_speed)]
        summary["configs"][config] = {
            "architecture": ours[0]["config"],
            "tokens_per_s": {"hf_elmo": ours_speed, "allennlp": peer_speed},
            "ratio_per_round": [round(r, 2) for r in ratios],
            "ratio_of_medians": round(statistics.median(ours_speed) / statistics.median(peer_speed), 2),
            "ratio_min": round(min(ratios), 2),
            "peak_rss_mib_max": {"hf_elmo": max(o["peak_rss_mib"] or 0 for o in ours),
                                 "allennlp": max(p["peak_rss_mib"] or 0 for p in peers)},
            "split_s_first_round": {"hf_elmo": ours[0]["split_s"], "allennlp": peers[0]["split_s"]},
            **({"peak_gpu_memory_mib_max": {"hf_elmo": max(o["peak_gpu_memory_mib"] for o in ours),
                                            "allennlp": max(p["peak_gpu_memory_mib"] for p in peers)}}
               if args.device == "cuda" else {}),
            **({"hf_elmo_profile": {key: ours[0][key] for key in (*bench_utils.profile_keys("batch"),
                                                                  "gpu_busy_fraction_timed") if key in ours[0]}}
               if args.top_ops else {}),
            "max_abs_diff_vs_reference": max(o["max_abs_diff_vs_reference"] or 0 for o in ours),
            "max_abs_diff_vs_allennlp": max_layer_difference(peer_out, ours_out),
            "cpu_over_wall_median": {"hf_elmo": statistics.median(x for o in ours for x in o["cpu_over_wall"]),
                                     "allennlp": statistics.median(x for p in peers for x in p["cpu_over_wall"])},
            "busy_before_passes": {"hf_elmo": [o["busy_before_passes"] for o in ours],
                                   "allennlp": [p["busy_before_passes"] for p in peers]},
        }
        if int8:
            int8_speed = [run["tokens_per_s"] for run in int8]
            summary["configs"][config]["int8"] = {
                "tokens_per_s": int8_speed,
                "ratio_to_fp32_per_round": [round(i / o, 2) for i, o in zip(int8_speed, ours_speed)],
                "ratio_to_fp32_of_medians": round(statistics.median(int8_speed) / statistics.median(ours_speed), 2),
                "ratio_to_allennlp_of_medians": round(statistics.median(int8_speed) / statistics.median(peer_speed),
                                                      2),
                "peak_rss_mib_max": max(run["peak_rss_mib"] or 0 for run in int8),
                "rss_after_load_mib_max": max(run["rss_after_load_mib"] for run in int8),
                "split_s_first_round": int8[0]["split_s"],
                # Every layer of every batch against the fp32 model's reference implementation.
                "max_abs_diff_vs_fp32": max(run["max_abs_diff_vs_reference"] for run in int8),
            }
    machine = ours[0]["machine"]
    summary["cpu"] = machine["cpu"]
    summary["blas"] = {k: machine["blas"][k] for k in ("blas", "cpu_capability", "mkldnn_available")}
    summary["torch"] = machine["torch"]
    summary["env"] = machine["env"]
    summary["loadavg_end"] = [round(x, 2) for x in os.getloadavg()]
    print(json.dumps(summary, ensure_ascii=False), flush=True)


if __name__ == "__main__":
    main()
