#!/usr/bin/env python
"""What a CPU can tell about the "cuda" implementation's work on a GPU, before a GPU is lent (issue 44).

Two measures, ONE JSON line:

- `step_ops`: the operators that one captured training step dispatches (`CapturedTrainingStep` without whole
  compilation: the two functions a GPU records as CUDA graphs, called as they are), counted by a dispatch mode,
  with each of the recurrence's fused element-wise kernels counted once: a proxy for the kernels a recorded step
  replays. Views, allocations and operators with empty results are left out (no kernel). By phase (the forward by
  part of the model: the char CNN, the biLSTM, the softmax where it runs as a module, the rest; the backward,
  storing the gradient, the update), with each phase's most frequent operators.
- `packed_host`: the host's time per layer-step (both directions advance together) of packed inference, the
  "cuda" implementation without autograd, its element-wise kernels compiled for the CPU by `--backend` (inductor,
  as on a GPU host: Dynamo's guards, inductor's wrappers). The model's widths are cut to 8, so that the arithmetic
  is negligible and what is timed is what the host spends per step whatever the device does. Real text, batches
  in file order; the fastest of `--repeats` passes. Measured before `step_ops`, and `step_calls_compiled` says
  which share of the kernel's calls ran compiled (1.0): once Dynamo has met a kernel under `step_ops`' dispatch
  mode, that kernel runs its Python as it is for the rest of the process.

Examples:
  python benchmarks/gpu_proxies.py                    # small at 128 x 24 words; 4 batches of 256 Wikipedia sentences
  python benchmarks/gpu_proxies.py --config original --backend inductor
"""

import argparse
import collections
import json
import os
import sys
import time

import torch
from torch.utils._python_dispatch import TorchDispatchMode


HERE = os.path.dirname(os.path.abspath(__file__))
REPO = os.path.dirname(HERE)
for _path in (HERE, REPO):
    if _path not in sys.path:
        sys.path.insert(0, _path)

import bench_utils  # noqa: E402
import workload  # noqa: E402

from hf_elmo import ElmoConfig, ElmoForPreTraining, ElmoModel, ElmoTokenizer, elmo_ops  # noqa: E402
from hf_elmo.captured_step import CapturedTrainingStep  # noqa: E402
from hf_elmo.pretraining import COMPILED_LENGTH_BUCKET  # noqa: E402
from hf_elmo.pretraining_data import BatchEncoder  # noqa: E402


# The recurrence's element-wise kernels, one compiled kernel each on a GPU.
FUSED_KERNELS = ("_step_forward", "_projection_forward", "_projection_backward", "_step_backward", "_hidden_gradient",
                 "_hidden_and_projection_backward")
# Operators that launch no kernel.
NO_KERNEL = ("detach.default", "empty.memory_format", "empty_strided.default", "_unsafe_view.default",
             "lift_fresh.default")
# `packed_host`'s biLM: the tiny one, narrower still, so that the arithmetic is negligible beside the host's work.
HOST_ONLY_BILM = {**bench_utils.TINY_BILM, "lstm_dim": 8, "projection_dim": 4}


class OperatorCount(TorchDispatchMode):
    """Counts the operators dispatched under it by (phase, part) and by (phase, operator); `fused` calls count one."""

    def __init__(self):
        super().__init__()
        self.phase, self.parts, self.inside = "forward", [], 0
        self.by_part, self.by_operator = collections.Counter(), collections.Counter()

    def record(self, name: str) -> None:
        part = self.parts[-1] if self.phase == "forward" and self.parts else ""
        self.by_part[(self.phase, part)] += 1
        self.by_operator[(self.phase, name)] += 1

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        tensors = [t for t in (out if isinstance(out, (tuple, list)) else [out]) if isinstance(t, torch.Tensor)]
        # A GPU launches nothing for an empty result (the recurrence's copies of the rows that finished at a step).
        if not self.inside and not func.is_view and func.__name__ not in NO_KERNEL and any(t.numel() for t in tensors):
            self.record(func.__name__)
        return out

    def fused(self, name: str, function):
        def counted(*args):
            if not self.inside:
                self.record(name)
            self.inside += 1
            try:
                return function(*args)
            finally:
                self.inside -= 1

        return counted


def step_ops(args) -> dict:
    words = [f"w{i}" for i in range(args.vocab_size - 3)]
    vocab = ["<S>", "</S>", "<UNK>", *words]
    torch.manual_seed(0)
    widths = bench_utils.TINY_BILM if args.config == "tiny" else ElmoConfig.from_preset(args.config).to_dict()
    config = ElmoConfig(**{**widths, "vocab_size": len(vocab), "num_softmax_samples": args.negatives,
                           "elmo_implementation": "cuda"})
    model = ElmoForPreTraining(config).train()
    model.softmax.sparse = False
    optimizer = torch.optim.Adagrad(model.parameters(), lr=0.2, initial_accumulator_value=1.0)
    step = CapturedTrainingStep(model, optimizer, loss_scale=20.0, max_grad_norm=10.0,
                                largest_batch=(args.rows, args.words + 2 + COMPILED_LENGTH_BUCKET),
                                autocast_dtype=torch.bfloat16, backend=None)
    generator = torch.Generator().manual_seed(1)
    lengths = torch.randint(max(1, args.words // 3), args.words + 1, (args.rows,), generator=generator)
    sentences = [[words[int(i)] for i in torch.randint(0, len(words), (int(n),), generator=generator)]
                 for n in lengths]
    batch = BatchEncoder(vocab, pad_to_multiple_of=COMPILED_LENGTH_BUCKET, pad_rows_to=args.rows)(sentences)
    del batch["num_tokens"]
    step.accumulate(batch)  # the kernels traced once
    step.update()

    count = OperatorCount()
    for name in ("elmo.char_encoder", "elmo.bilstm", "softmax"):
        module = model.get_submodule(name)
        module.register_forward_pre_hook(lambda *_, name=name: count.parts.append(name))
        module.register_forward_hook(lambda *_: count.parts.pop() and None)
    gradient = torch.autograd.grad

    def timed_gradient(*grad_args, **grad_kwargs):
        count.phase = "backward"
        try:
            return gradient(*grad_args, **grad_kwargs)
        finally:
            count.phase = "store"

    originals = {name: getattr(elmo_ops, name) for name in FUSED_KERNELS}
    try:
        torch.autograd.grad = timed_gradient
        for name, function in originals.items():
            setattr(elmo_ops, name, count.fused(name, function))
        with count:
            step.accumulate(batch)
            count.phase = "update"
            step.update()
    finally:
        torch.autograd.grad = gradient
        for name, function in originals.items():
            setattr(elmo_ops, name, function)
    by_phase = collections.Counter()
    for (phase, _), n in count.by_part.items():
        by_phase[phase] += n
    top = {phase: dict(collections.Counter({name: n for (p, name), n in count.by_operator.items() if p == phase})
                       .most_common(args.top)) for phase in by_phase}
    return {"rows": args.rows, "words_padded": int(batch["input_ids"].shape[1]), "total": sum(by_phase.values()),
            "by_phase": dict(by_phase),
            "forward_by_part": {part or "rest": n for (phase, part), n in count.by_part.items() if phase == "forward"},
            "top_by_phase": top, "parameters": len(step.params)}


def counting_backend(backend: str, counter: collections.Counter):
    """torch.compile's `backend`, with each call of a graph it compiled counted in `counter["compiled_calls"]`:
    `packed_host` checks by it that its kernels ran compiled (a kernel that Dynamo once met under a dispatch mode,
    as `step_ops` runs it, runs its Python as it is from then on, so it measures after nothing else)."""
    compile_graph = torch._dynamo.lookup_backend(backend)

    def compile_counted(graph, example_inputs):
        run = compile_graph(graph, example_inputs)

        def counted(*graph_args):
            counter["compiled_calls"] += 1
            return run(*graph_args)

        return counted

    return compile_counted


def packed_host(args, sentences) -> dict:
    torch.manual_seed(0)
    model = ElmoModel(ElmoConfig(**HOST_ONLY_BILM, elmo_implementation="cuda")).eval()
    tokenizer = ElmoTokenizer()
    batches = [tokenizer(group, is_split_into_words=True, padding=True, return_tensors="pt")
               for group in workload.batches(sentences, args.batch_size)]
    calls, call_s, spent = collections.Counter(), collections.Counter(), {"bilstm": 0.0}
    # (The projection's clip, as packed rows run it: `_clipped_into`, straight into the outputs, since 2026-11-29;
    # `_projection_output`, called as it is, from ef85abb; earlier revisions, measured with a copy of this script,
    # have only the compiled `_projection_forward`.)
    names = ("_step_forward", "_projection_forward", "_projection_output", "_clipped_into")
    originals = {name: getattr(elmo_ops, name) for name in names if hasattr(elmo_ops, name)}

    def timed(name, function):
        def run(*call_args):
            began = time.perf_counter()
            try:
                return function(*call_args)
            finally:
                call_s[name] += time.perf_counter() - began
                calls[name] += 1

        return run

    model.bilstm.register_forward_pre_hook(lambda *_: spent.__setitem__("began", time.perf_counter()))
    model.bilstm.register_forward_hook(
        lambda *_: spent.__setitem__("bilstm", spent["bilstm"] + time.perf_counter() - spent["began"]))
    passes = []
    backend, elmo_ops.COMPILE_BACKEND = elmo_ops.COMPILE_BACKEND, counting_backend(args.backend, calls)
    try:
        for name, function in originals.items():
            setattr(elmo_ops, name, timed(name, function))
        with torch.no_grad():
            for batch in batches:  # compiles the kernels
                model(**batch)
            for _ in range(args.repeats):
                calls.clear()
                call_s.clear()
                spent["bilstm"] = 0.0
                for batch in batches:
                    model(**batch)
                passes.append((spent["bilstm"], dict(call_s), calls["_step_forward"], calls["compiled_calls"]))
    finally:
        elmo_ops.COMPILE_BACKEND = backend
        for name, function in originals.items():
            setattr(elmo_ops, name, function)
    bilstm_s, calls_s, layer_steps, compiled_calls = min(passes, key=lambda p: p[0])
    per_step = lambda seconds: round(seconds / layer_steps * 1e6, 1)  # noqa: E731
    return {"backend": args.backend, "batches": len(batches),
            "layer_steps_per_batch": round(layer_steps / len(batches), 1),
            "bilstm_us_per_layer_step": per_step(bilstm_s),
            # Packed inference compiles one kernel, `_step_forward`: every call of it should have run a graph.
            "step_calls_compiled": round(compiled_calls / layer_steps, 3),
            "calls_us_per_layer_step": {name: per_step(seconds) for name, seconds in calls_s.items()}}


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                     formatter_class=argparse.RawDescriptionHelpFormatter, epilog=__doc__)
    step = parser.add_argument_group("step_ops: one captured training step")
    step.add_argument("--config", choices=["tiny", "small", "original"], default="small",
                      help="the biLM's widths: a tiny one, or a published shape (default small)")
    step.add_argument("--rows", type=int, default=128, help="sentences in the step (default 128)")
    step.add_argument("--words", type=int, default=24, help="the longest sentence, in words (default 24)")
    step.add_argument("--vocab-size", type=int, default=15719, help="softmax rows (default 15719)")
    step.add_argument("--negatives", type=int, default=8192, help="sampled negatives (default 8192)")
    step.add_argument("--top", type=int, default=8, help="operators listed per phase (default 8)")
    host = parser.add_argument_group("packed_host: packed inference's host time per step")
    host.add_argument("--backend", choices=["inductor", "eager"], default="inductor",
                      help="torch.compile backend of the element-wise kernels (default inductor, as on a GPU)")
    workload.add_workload_arguments(parser)
    parser.set_defaults(n_sentences=1024, batch_size=256)
    workload.add_timing_arguments(parser, repeats=3)
    parser.set_defaults(threads=1)
    args = parser.parse_args()
    sentences, source = workload.sentences_from_args(parser, args)
    torch.set_num_threads(args.threads)
    # The kernels a GPU compiles, compiled (or traced, "eager") here.
    elmo_ops.COMPILED_DEVICE_TYPES, elmo_ops.COMPILE_BACKEND = ("cpu",), args.backend
    host = packed_host(args, sentences)  # first: after `step_ops` its kernel would run uncompiled
    result = {"benchmark": "gpu_proxies", "config": args.config, "workload": source,
              "step_ops": step_ops(args), "packed_host": host, "machine": bench_utils.machine_description("cpu")}
    print(json.dumps(result, ensure_ascii=False))


if __name__ == "__main__":
    main()
