#!/usr/bin/env python
"""Run the AllenNLP peer and hf_elmo on the same weights and workload, one after the other, per config.

  python benchmarks/side_by_side.py [--configs small original] [--mode chars|cached] [--dtype fp32|bf16]
                                    [--peer-bench PATH] [--peer-python PYTHON] [--wait-quiet 60]
                                    [--repeats 5] [--batch-size 32] [--threads 2] [--rounds 1]

For each config: the peer's bench_peer.py runs first (it writes random weights of the published shapes to
$ELMO_PEER_DIR/weights/{config}_random_weights.hdf5 with {config}_options.json), then
benchmarks/bench_inference.py runs on those same two files. Prints the peer's JSON line, ours, and a summary
line with the ratios; all JSON. Build the peer once first (see benchmarks/README.md). --mode cached runs the
peer with its vocabulary cache and us with --cache-vocab; --dtype applies to our side only (the peer is fp32).

--rounds N alternates the two sides N times per config (peer, ours, peer, ours, ...). On a shared machine
either side's figure moves by 10-15% between runs; the summary then gives each round's ratio, the ratio of
the two medians and the smallest round ratio, and each side's largest peak RSS. Both sides time 5 passes by
default (the peer's own default is 3): each batch counts its fastest pass, and with 3 a single slow stretch of
the host (our side shares a 480 MB L3 with other VMs) can spoil a batch in every pass.
"""

import argparse
import json
import os
import statistics
import subprocess
import sys
import time


HERE = os.path.dirname(os.path.abspath(__file__))
PEER_DIR = os.environ.get("ELMO_PEER_DIR", os.path.join(os.path.expanduser("~"), ".cache", "elmo_peer"))


def run_json(command: list[str]) -> dict:
    result = subprocess.run(command, capture_output=True, text=True)
    lines = [line for line in result.stdout.splitlines() if line.startswith("{")]
    if result.returncode != 0 or not lines:
        sys.exit(f"{' '.join(command)} failed (exit {result.returncode}):\n{result.stderr[-3000:]}")
    return json.loads(lines[-1])


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--configs", nargs="+", default=["small", "original"], choices=["small", "medium", "original"])
    ap.add_argument("--peer-bench", default=os.environ.get("ELMO_PEER_BENCH", "/work/shared/peers/allennlp/bench_peer.py"),
                    help="the peer's bench_peer.py (env ELMO_PEER_BENCH)")
    ap.add_argument("--peer-python", default=sys.executable, help="python that runs the peer (default: this one)")
    ap.add_argument("--batch-size", type=int, default=32)
    ap.add_argument("--n-sentences", type=int, default=64)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--repeats", type=int, default=5,
                    help="timed passes per run, for both sides (each batch counts its fastest pass)")
    ap.add_argument("--mode", choices=["chars", "cached"], default="chars")
    ap.add_argument("--dtype", choices=["fp32", "bf16"], default="fp32", help="our side's dtype")
    ap.add_argument("--rounds", type=int, default=1, help="alternate the two sides this many times per config")
    ap.add_argument("--wait-quiet", type=float, default=60.0,
                    help="each side waits up to this many seconds before each timed pass for an idle machine")
    args = ap.parse_args()

    common = ["--batch-size", str(args.batch_size), "--n-sentences", str(args.n_sentences),
              "--threads", str(args.threads), "--repeats", str(args.repeats), "--wait-quiet", str(args.wait_quiet)]
    summary = {"date": time.strftime("%Y-%m-%d %H:%M:%S %Z"), "mode": args.mode, "dtype": args.dtype, "configs": {}}
    for config in args.configs:
        weights_dir = os.path.join(PEER_DIR, "weights")
        peers, ours = [], []
        for _ in range(args.rounds):
            peers.append(run_json([args.peer_python, args.peer_bench, "--config", config, "--mode", args.mode, *common]))
            print(json.dumps(peers[-1]), flush=True)
            ours.append(run_json([sys.executable, os.path.join(HERE, "bench_inference.py"),
                                  "--options", os.path.join(weights_dir, f"{config}_options.json"),
                                  "--weights", os.path.join(weights_dir, f"{config}_random_weights.hdf5"),
                                  "--dtype", args.dtype, *(["--cache-vocab"] if args.mode == "cached" else []),
                                  *common]))
            print(json.dumps(ours[-1]), flush=True)
            if ours[-1]["workload_sha1"] != peers[-1]["workload_sha1"]:
                sys.exit(f"workloads differ: ours {ours[-1]['workload_sha1']}, peer {peers[-1]['workload_sha1']}")
        ours_speed = [o["tokens_per_s"] for o in ours]
        peer_speed = [p["tokens_per_s"] for p in peers]
        ratios = [o / p for o, p in zip(ours_speed, peer_speed)]
        summary["configs"][config] = {
            "tokens_per_s_median": {"hf_elmo": round(statistics.median(ours_speed), 1),
                                    "peer": round(statistics.median(peer_speed), 1)},
            "speedup_of_medians": round(statistics.median(ours_speed) / statistics.median(peer_speed), 2),
            "speedup_per_round": [round(r, 2) for r in ratios],
            "speedup_min": round(min(ratios), 2),
            "peak_rss_inference_mib_max": {"hf_elmo": round(max(o["peak_rss_inference_mib"] for o in ours), 1),
                                           "peer": round(max(p["peak_rss_inference_mib"] for p in peers), 1)},
            "max_abs_diff_vs_reference": max(o["max_abs_diff_vs_reference"] for o in ours),
        }
    print(json.dumps(summary), flush=True)


if __name__ == "__main__":
    main()
