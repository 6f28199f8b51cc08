#!/usr/bin/env python
"""Run the AllenNLP peer and hf_elmo on the same weights and workload, one after the other, per config.

  python benchmarks/side_by_side.py [--configs small original] [--mode chars|cached] [--dtype fp32|bf16]
                                    [--peer-bench PATH] [--peer-python PYTHON] [--wait-quiet 60]
                                    [--repeats 3] [--batch-size 32] [--threads 2]

For each config: the peer's bench_peer.py runs first (it writes random weights of the published shapes to
$ELMO_PEER_DIR/weights/{config}_random_weights.hdf5 with {config}_options.json), then
benchmarks/bench_inference.py runs on those same two files. Prints the peer's JSON line, ours, and a summary
line with the ratios; all JSON. Build the peer once first (see benchmarks/README.md). --mode cached runs the
peer with its vocabulary cache and us with --cache-vocab; --dtype applies to our side only (the peer is fp32).
"""

import argparse
import json
import os
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
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--mode", choices=["chars", "cached"], default="chars")
    ap.add_argument("--dtype", choices=["fp32", "bf16"], default="fp32", help="our side's dtype")
    ap.add_argument("--wait-quiet", type=float, default=60.0,
                    help="each side waits up to this many seconds before each timed pass for an idle machine")
    args = ap.parse_args()

    common = ["--batch-size", str(args.batch_size), "--n-sentences", str(args.n_sentences),
              "--threads", str(args.threads), "--repeats", str(args.repeats), "--wait-quiet", str(args.wait_quiet)]
    summary = {"date": time.strftime("%Y-%m-%d %H:%M:%S %Z"), "mode": args.mode, "dtype": args.dtype, "configs": {}}
    for config in args.configs:
        peer = run_json([args.peer_python, args.peer_bench, "--config", config, "--mode", args.mode, *common])
        print(json.dumps(peer), flush=True)
        weights_dir = os.path.join(PEER_DIR, "weights")
        ours = run_json([sys.executable, os.path.join(HERE, "bench_inference.py"),
                         "--options", os.path.join(weights_dir, f"{config}_options.json"),
                         "--weights", os.path.join(weights_dir, f"{config}_random_weights.hdf5"),
                         "--dtype", args.dtype, *(["--cache-vocab"] if args.mode == "cached" else []), *common])
        print(json.dumps(ours), flush=True)
        if ours["workload_sha1"] != peer["workload_sha1"]:
            sys.exit(f"workloads differ: ours {ours['workload_sha1']}, peer {peer['workload_sha1']}")
        summary["configs"][config] = {
            "tokens_per_s": {"hf_elmo": round(ours["tokens_per_s"], 1), "peer": round(peer["tokens_per_s"], 1)},
            "speedup": round(ours["tokens_per_s"] / peer["tokens_per_s"], 2),
            "peak_rss_inference_mib": {"hf_elmo": round(ours["peak_rss_inference_mib"], 1),
                                       "peer": round(peer["peak_rss_inference_mib"], 1)},
            "max_abs_diff_vs_reference": ours["max_abs_diff_vs_reference"],
        }
    print(json.dumps(summary), flush=True)


if __name__ == "__main__":
    main()
