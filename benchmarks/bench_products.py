"""Time the products of one CPU recurrence step, per column count, each way hf_elmo runs or weighed; one JSON line.

Each LSTM step of `hf_elmo.elmo_cpu` multiplies two weights by one column per sentence still being read: the
recurrent weight `(4 * lstm_dim, projection_dim)` and the projection `(projection_dim, lstm_dim)`. The batch's
tail has few columns, and how fast each library does those is what `few_column_matmul` and `step_columns` measure
at run time. This script prints the whole table for a config's shapes, on random weights:

- `mm`: `torch.mm(weight, states)`, the plain product (MKL or OpenBLAS, whichever torch was built with);
- `blocked`: the same as one batched product over `row_blocks(weight)` row blocks (`few_column_matmul`'s second
  choice);
- `onednn`: oneDNN's fp32 linear (`torch.ops.mkldnn._linear_pointwise`) on the weight as it is, as
  `few_column_matmul`'s third choice runs it (`cpu_tuning.onednn_product`: the weight as the linear's input, the
  columns, rounded up by `product_columns`, as its weight);
- `onednn_prepacked`: the same on a copy of the weight reordered once into oneDNN's blocked layout
  (`torch.ops.mkldnn._reorder_linear_weight`): `prepacked_extra_mib` says what those copies would add for the
  whole model (both directions, every layer);
- `int8_pack` and `int8_bf16_dot`: the weight as int8 (`hf_elmo.int8_weights.Int8Linear`), multiplied as the
  int8 model's recurrence multiplies it on each kernel ("int8-pack": torch's int8 weight-only kernel;
  "bf16-dot": widened to bf16 once, `RecurrenceProducts`, oneDNN's bf16 matmul). Their `max_abs_diff_vs_mm` is
  the int8 rounding (about 1e-2 of the largest output), not an error of the way.

Microseconds, best of `--repeats` interleaved runs; each way's result is checked against `mm` first
(`max_abs_diff_vs_mm`, relative to the largest output). `peak_growth_mib`: how far each way's first product (on the most
columns, before any timing) raises the process's peak RSS above what it held before: the scratch memory a library
allocates, and may keep, for that shape (Linux only, else null). oneDNN is reported as null where torch was built
without it. The prepacked way is not used by hf_elmo: see benchmarks/README.md ("oneDNN").

    python benchmarks/bench_products.py --config original
    python benchmarks/bench_products.py --config small --threads 1 --columns 1 2 16 32
"""

from __future__ import annotations

import argparse
import json
import time

import torch

import bench_utils
import random_bilm
import workload
from hf_elmo.cpu_tuning import has_onednn_linear, onednn_product, row_blocks
from hf_elmo.int8_weights import Int8Linear, RecurrenceProducts


def parse_args(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                     formatter_class=argparse.RawDescriptionHelpFormatter, epilog=__doc__)
    random_bilm.add_weights_arguments(parser, default="original", cache_dir=False)
    parser.add_argument("--columns", type=int, nargs="+", default=[1, 2, 3, 4, 8, 11, 12, 15, 16, 24, 32],
                        help=f"column counts (sentences still being read) to time, at most {MAX_COLUMNS}")
    workload.add_timing_arguments(parser, repeats=7)
    args = parser.parse_args(argv)
    if max(args.columns) > MAX_COLUMNS or min(args.columns) < 1:
        parser.error(f"--columns: each count must be 1 to {MAX_COLUMNS}")
    return args


# The most columns the int8 ways are prepared for (the recurrence prepares for its batch size).
MAX_COLUMNS = 256


def product_ways(weight: torch.Tensor) -> dict:
    """name -> function(states (in, columns)) -> (out, columns) for the available ways."""
    blocks = row_blocks(weight)
    ways = {
        "mm": lambda states: torch.mm(weight, states),
        "blocked": lambda states: torch.bmm(
            weight.view(blocks, -1, weight.shape[1]), states.expand(blocks, *states.shape)
        ).view(-1, states.shape[1]),
    }
    if has_onednn_linear(weight):
        prepacked = torch.ops.mkldnn._reorder_linear_weight(weight, None)
        ways["onednn"] = lambda states: onednn_product(weight, states)
        ways["onednn_prepacked"] = lambda states: torch.ops.mkldnn._linear_pointwise(
            states.t(), prepacked, None, "none", [], "").t()
    linear = torch.nn.Linear(weight.shape[1], weight.shape[0], bias=False)
    linear.weight.data = weight
    for way, kernel in (("int8_pack", "int8-pack"), ("int8_bf16_dot", "bf16-dot")):
        int8 = Int8Linear.from_linear(linear)
        int8.kernel = kernel
        if kernel == "int8-pack":
            ways[way] = int8.columns_product
        else:
            buffers = {}

            def buffer(name, numel, dtype, zeroed=False):
                return buffers.setdefault(name, torch.zeros(numel, dtype=dtype))

            prepared = RecurrenceProducts(int8, MAX_COLUMNS, buffer)
            ways[way] = lambda states, prepared=prepared: prepared.columns_product(
                states, states.new_empty(weight.shape[0], states.shape[1]))
    return ways


def time_weight(weight: torch.Tensor, columns: list[int], repeats: int) -> dict:
    ways = product_ways(weight)
    # Before anything else: a library's first product allocates (and may keep) its scratch memory.
    growth = {name: peak_growth_mib(way, torch.randn(weight.shape[1], max(columns))) for name, way in ways.items()}
    table = {name: {} for name in ways}
    max_diff = dict.fromkeys(ways, 0.0)
    for count in columns:
        states = torch.randn(weight.shape[1], count)
        expected = ways["mm"](states)
        scale = expected.abs().max().item()
        for name, way in ways.items():
            max_diff[name] = max(max_diff[name], (way(states) - expected).abs().max().item() / scale)
        best = dict.fromkeys(ways, float("inf"))
        for _ in range(repeats):
            for name, way in ways.items():
                start = time.perf_counter()
                way(states)
                best[name] = min(best[name], time.perf_counter() - start)
        for name in ways:
            table[name][str(count)] = round(best[name] * 1e6, 1)
    for name in ("onednn", "onednn_prepacked"):
        for values in (table, max_diff, growth):
            values.setdefault(name, None)
    return {"us": table, "max_abs_diff_vs_mm": max_diff, "peak_growth_mib": growth}


def peak_growth_mib(way, states: torch.Tensor) -> float | None:
    bench_utils.release_freed_memory()
    before = bench_utils.proc_status_mib("VmRSS")
    if before is None or not bench_utils.reset_peak_rss():
        return None
    way(states)
    return round(bench_utils.proc_status_mib("VmHWM") - before, 1)


def main(argv=None):
    args = parse_args(argv)
    torch.set_num_threads(args.threads)
    torch.manual_seed(0)
    lstm = random_bilm.CONFIGS[args.config]["lstm"]
    cell, proj = lstm["dim"], lstm["projection_dim"]
    shapes = {"recurrent": (4 * cell, proj), "projection": (proj, cell)}
    with torch.no_grad():
        products = {name: {"shape": list(shape), **time_weight(torch.randn(*shape) * 0.05, args.columns, args.repeats)}
                    for name, shape in shapes.items()}
    weights_per_model = 2 * lstm["n_layers"]  # both directions, every layer
    extra = weights_per_model * sum(rows * cols for rows, cols in shapes.values()) * 4 / 2**20
    print(json.dumps({
        "config": random_bilm.architecture_name(random_bilm.CONFIGS[args.config]),
        "threads": args.threads, "repeats": args.repeats, "columns": args.columns, "products": products,
        "prepacked_extra_mib": round(extra, 1) if torch.backends.mkldnn.is_available() else None,
        "machine": bench_utils.machine_description("cpu"),
    }))


if __name__ == "__main__":
    main()
