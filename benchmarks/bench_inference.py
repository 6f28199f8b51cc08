#!/usr/bin/env python
"""Time hf_elmo's ElmoModel on a workload of sentences and print ONE JSON line.

What it runs:
  - Weights: random weights of a published shape (--config small|medium|original, or tiny for smoke tests),
    written once in bilm-tf's hdf5 layout by random_bilm.py (speed depends on shapes, not values), or any
    bilm-tf pair (--options/--weights). By default the pair is converted once, in a child process, into a
    Hugging Face folder under --cache-dir, and timed after `ElmoModel.from_pretrained`, the way users load
    ELMo (--load hdf5 reads the .hdf5 in this process instead; h5py then counts in the memory figures).
  - Text: real running text by default, the Wikipedia sample of hf_elmo.testing_utils (4000 sentences,
    fetched once with pip from the gensim 4.4.0 wheel), or --text FILE (one sentence per line). Lines are
    split into words by ElmoTokenizer's "ptb" pre-tokenizer, or on spaces with --pretokenized.
    --n-sentences of them are taken, evenly spaced over the file, and batched in file order (no sorting).
    --synthetic instead draws words from the earlier ~200-word list (for comparison with old figures; its
    words repeat far more than real text's).

How it times (bench_utils.py, the same code the AllenNLP peer uses):
  eval, torch.no_grad; char ids are made up front (char_ids_s); one untimed warm-up batch; then --repeats
  passes over all batches, each returning the top layer (AutoModel's default; --all-layers: every layer, as
  AllenNLP's _ElmoBiLm does). tokens_per_s = words (no <S>/</S>, no padding) / the sum over batches of each
  batch's fastest pass. split_s: time in the char CNN and the biLSTM (the chosen implementation's two
  functions, or the forward of model.char_encoder and model.bilstm in older models; on cuda the timers
  synchronize the device, which costs a little).

What it reports, beside the speed: words and distinct words per batch (per-distinct-word shortcuts pay more
when words repeat); peak RSS (cpu: VmHWM, restarted after loading, once the freed loading buffers are given
back to the OS) or peak GPU memory (cuda: torch.cuda.max_memory_allocated after loading, weights included);
the CPU model and its vector extensions (AVX2, AVX-512, avx512_bf16, AMX), the BLAS and oneDNN torch was
built with, the GPU name on cuda, and versions. max_abs_diff_vs_reference: after timing, every batch is run
again through the timed setup and through the "reference" implementation of an fp32 model on the same
device, and the largest difference over all output layers is given (with --dtype bf16: the bf16 error).
With --top-ops N, one more pass after timing runs under torch.profiler (bench_utils.profile_calls): per batch
the N operators with the most self time and, on a GPU, the kernels run and launched, their GPU time and the
GPU's busy fraction; gpu_busy_fraction_timed puts that GPU time over the timed passes' fastest batches, which
the profiler did not slow: far below 1, the host's launches set the pace, not the GPU.

--implementation picks the model's implementation: passed to model.set_elmo_implementation() where the model
has that method ("auto" passes None: the model's own choice). Older models without it have two paths:
"reference" sets use_fast_path = False, "cpu" and "auto" keep the fast path, "cuda" is refused.

Examples:
  python benchmarks/bench_inference.py --config original                 # real text, cpu, fp32, 2 threads
  python benchmarks/bench_inference.py --config small --synthetic --repeats 3
  python benchmarks/bench_inference.py --config original --dtype bf16 --text my_sentences.txt
  python benchmarks/bench_inference.py --device cuda --config original --batch-size 256 --n-sentences 1024
"""

import argparse
import hashlib
import json
import os
import subprocess
import sys
import time

import torch


HERE = os.path.dirname(os.path.abspath(__file__))
REPO = os.path.dirname(HERE)
for _path in (HERE, REPO):
    if _path not in sys.path:
        sys.path.insert(0, _path)

import bench_utils  # noqa: E402
import random_bilm  # noqa: E402
import workload  # noqa: E402

from hf_elmo.bilm_tf import config_from_options, read_options, read_weights  # noqa: E402
from hf_elmo.modeling_elmo import ElmoModel  # noqa: E402
from hf_elmo.safe_output import fill_cache_once  # noqa: E402
from hf_elmo.tokenization_elmo import ElmoTokenizer  # noqa: E402


IMPLEMENTATIONS = ("auto", "reference", "cpu", "cuda")


def converted_folder(options: str, weights: str, cache_dir: str) -> str:
    """The bilm-tf pair as a Hugging Face folder, converted once in a child process (so no h5py in this one)."""
    key = "|".join(f"{os.path.abspath(p)}:{os.stat(p).st_size}:{os.stat(p).st_mtime_ns}" for p in (options, weights))
    folder = os.path.join(cache_dir, "converted", hashlib.sha1(key.encode()).hexdigest()[:16])

    def convert():
        env = {**os.environ, "PYTHONPATH": os.pathsep.join(filter(None, [REPO, os.environ.get("PYTHONPATH")]))}
        command = [sys.executable, "-m", "hf_elmo.cli", "convert", "--options", options, "--weights", weights,
                   "--output", folder, "--overwrite", "--no-progress"]
        done = subprocess.run(command, env=env, capture_output=True, text=True)
        if done.returncode != 0:
            sys.exit(f"bench_inference: converting {weights} failed:\n{done.stderr[-3000:]}")

    # One conversion at a time: a second benchmark converting the same pair waits, then finds the folder.
    fill_cache_once(cache_dir, lambda: os.path.isfile(os.path.join(folder, "config.json")), convert)
    return folder


def load_from_hdf5(options: str, weights: str, dtype: torch.dtype) -> ElmoModel:
    config = config_from_options(read_options(options), source=options)
    with torch.device("meta"):  # no random initialisation: every weight comes from the file
        model = ElmoModel(config)
    model.load_state_dict(read_weights(weights, config), strict=True, assign=True)
    return model.to(dtype).eval()


def int8_kernel(model) -> str | None:
    """The kernel a model's int8 maps multiply on (the `kernel` of its first one; None without int8 weights): measured
    faster when the model was quantized, or HF_ELMO_INT8_KERNEL. By attribute, so that a copy of an older hf_elmo's
    model (ab_cpu_implementation.py's baseline) answers too."""
    return next((module.kernel for module in model.modules() if hasattr(module, "weight_int8")), None)


def select_implementation(model: ElmoModel, name: str) -> str:
    """Apply --implementation; returns how it was applied."""
    if hasattr(model, "set_elmo_implementation"):
        model.set_elmo_implementation(None if name == "auto" else name)
        return "set_elmo_implementation"
    if name == "cuda":
        sys.exit("bench_inference: this hf_elmo has no implementation switch yet (no set_elmo_implementation), "
                 "so no 'cuda' implementation; use --implementation auto, cpu or reference")
    model.char_encoder.use_fast_path = model.bilstm.use_fast_path = name != "reference"
    return "use_fast_path"


def watch_parts(model: ElmoModel, parts: bench_utils.PartTimer):
    """
    Count the time of the char CNN and the biLSTM with forward hooks on the two modules, which compute with the
    chosen implementation inside their own forward. Revisions where `ElmoModel` called the implementation's
    functions itself (the table `ELMO_IMPLEMENTATIONS` in `modeling_elmo`, modules without a `config`) get those
    functions wrapped instead.
    """
    import dataclasses

    table = getattr(sys.modules[type(model).__module__], "ELMO_IMPLEMENTATIONS", None)
    if table is None or hasattr(model.char_encoder, "config"):
        parts.watch("char_cnn", model.char_encoder)
        parts.watch("lstm", model.bilstm)
        return
    for name, implementation in list(table.items()):
        table[name] = dataclasses.replace(implementation,
                                          token_vectors=parts.wrap("char_cnn", implementation.token_vectors),
                                          bilstm=parts.wrap("lstm", implementation.bilstm))


def main():
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    weights = parser.add_argument_group("weights")
    weights.add_argument("--options", help="a bilm-tf options.json instead of --config (with --weights)")
    weights.add_argument("--weights", help="a bilm-tf weights .hdf5 instead of --config (with --options)")
    weights.add_argument("--load", choices=["converted", "hdf5"], default="converted",
                         help="converted (default): convert once, time the from_pretrained model; hdf5: read the "
                              ".hdf5 in this process")
    random_bilm.add_weights_arguments(weights)
    workload.add_workload_arguments(parser)
    run = parser.add_argument_group("run")
    run.add_argument("--device", choices=["cpu", "cuda"], default="cpu")
    run.add_argument("--dtype", choices=["fp32", "bf16"], default="fp32", help="the weights' and activations' dtype")
    run.add_argument("--int8", action="store_true",
                     help="int8 weights (from_pretrained(..., int8_weights=True); CPU, fp32 activations rounded to bf16 "
                          "in the products); max_abs_diff_vs_reference is then against the fp32 model")
    run.add_argument("--implementation", choices=IMPLEMENTATIONS, default="auto",
                     help="which implementation of the model runs (see above; default auto)")
    run.add_argument("--cache-vocab", action="store_true",
                     help="turn on the model's token-vector cache, filled with the workload's words before timing")
    run.add_argument("--all-layers", action="store_true",
                     help="time every layer (output_hidden_states=True), the output AllenNLP's _ElmoBiLm always "
                          "gives; default: the top layer, AutoModel's default output")
    run.add_argument("--skip-check", action="store_true", help="skip the comparison with the reference implementation")
    run.add_argument("--top-ops", type=int, default=0, metavar="N",
                     help="after timing, one more pass under torch.profiler: the N operators taking the most self time "
                          "per batch (on a GPU: kernels by GPU time, with kernels run and launched per batch, their "
                          "GPU time, and the GPU's busy fraction, profiled and over the timed passes' fastest "
                          "batches: far below 1, the host sets the pace; default: none)")
    run.add_argument("--save-first-batch", metavar="PATH",
                     help="also save every layer's word vectors for batch 0 with torch.save (to compare with the peer)")
    workload.add_timing_arguments(parser, repeats=5, wait_quiet=0.0)
    args = parser.parse_args()
    if bool(args.options) != bool(args.weights):
        parser.error("--options and --weights go together")
    sentences, source_name = workload.sentences_from_args(parser, args)
    if args.device == "cuda" and not torch.cuda.is_available():
        sys.exit("bench_inference: --device cuda, but torch sees no CUDA device")

    torch.set_num_threads(args.threads)
    device = torch.device(args.device)
    dtype = {"fp32": torch.float32, "bf16": torch.bfloat16}[args.dtype]
    cuda = device.type == "cuda"
    synchronize = torch.cuda.synchronize if cuda else None

    if args.options:
        options_path, weights_path = args.options, args.weights
    else:
        options_path, weights_path = random_bilm.ensure(args.config, args.cache_dir)
    folder = converted_folder(options_path, weights_path, args.cache_dir) if args.load == "converted" else None

    if args.int8 and (args.device != "cpu" or args.dtype != "fp32" or folder is None):
        parser.error("--int8 goes with --device cpu, --dtype fp32 and --load converted")

    def load(dtype: torch.dtype, int8: bool = False) -> ElmoModel:
        if folder is None:
            model = load_from_hdf5(options_path, weights_path, dtype)
        else:
            model = ElmoModel.from_pretrained(folder, dtype=dtype, int8_weights=int8)
        return model.to(device).eval()

    groups = workload.batches(sentences, args.batch_size)

    start = time.perf_counter()
    model = load(dtype, args.int8)
    load_s = time.perf_counter() - start
    via = select_implementation(model, args.implementation)
    config = model.config

    tokenizer = ElmoTokenizer(max_characters_per_token=config.max_characters_per_token)
    start = time.perf_counter()
    inputs = []
    for group in groups:
        encoded = tokenizer(group, is_split_into_words=True, padding=True, return_tensors="pt")
        inputs.append((encoded["input_ids"].to(device), encoded["attention_mask"].to(device)))
    char_ids_s = time.perf_counter() - start

    parts = bench_utils.PartTimer(synchronize)
    watch_parts(model, parts)

    bench_utils.release_freed_memory()
    rss_after_load = bench_utils.proc_status_mib("VmRSS")
    peak_restarted = bench_utils.reset_peak_rss()
    if cuda:
        torch.cuda.reset_peak_memory_stats()
    with torch.no_grad():
        if args.cache_vocab:
            vocabulary = sorted({w for s in sentences for w in s})
            model.char_encoder.enable_token_cache(max_words=max(len(vocabulary), 1))
            ids = tokenizer([vocabulary], is_split_into_words=True, return_tensors="pt")["input_ids"][0]
            model.char_encoder(ids.to(device))

        def run_batch(i):
            return model(input_ids=inputs[i][0], attention_mask=inputs[i][1], output_hidden_states=args.all_layers)

        timing = bench_utils.time_passes(run_batch, len(inputs), args.repeats, parts,
                                         wait_quiet_s=args.wait_quiet, synchronize=synchronize)
    speed = bench_utils.summarize(timing, sum(len(s) for s in sentences))
    peak_rss = bench_utils.proc_status_mib("VmHWM") if peak_restarted else None
    memory = {"rss_after_load_mib": rss_after_load, "peak_rss_mib": peak_rss}
    if cuda:
        memory.update(bench_utils.gpu_memory_peaks())
    profile = {}
    if args.top_ops:  # after the memory figures: the profiler holds its own
        with torch.no_grad():
            profile = bench_utils.profile_calls(run_batch, len(inputs), cuda, synchronize, top=args.top_ops,
                                                per="batch")
        if cuda:
            profile["gpu_busy_fraction_timed"] = bench_utils.timed_busy_fraction(
                profile, "batch", len(inputs), sum(speed["fastest_batch_s"]))

    with torch.no_grad():
        if args.save_first_batch:
            hidden = model(input_ids=inputs[0][0], attention_mask=inputs[0][1], output_hidden_states=True).hidden_states
            torch.save({"layers": [h.float().cpu() for h in hidden], "workload_sha1": workload.digest(sentences)},
                       args.save_first_batch)
        max_diff = None
        if not args.skip_check:
            timed = [[h.float() for h in model(input_ids=ids, attention_mask=mask, output_hidden_states=True).hidden_states]
                     for ids, mask in inputs]
            reference = model if dtype == torch.float32 and not args.int8 else load(torch.float32)
            select_implementation(reference, "reference")
            cache, reference.char_encoder.token_cache = reference.char_encoder.token_cache, None
            max_diff = 0.0
            for (ids, mask), outputs in zip(inputs, timed):
                expected = reference(input_ids=ids, attention_mask=mask, output_hidden_states=True).hidden_states
                for a, b in zip(outputs, expected):
                    max_diff = max(max_diff, (a - b.float()).abs().max().item())
            reference.char_encoder.token_cache = cache

    with open(options_path, encoding="utf-8") as handle:
        architecture = random_bilm.architecture_name(json.load(handle))
    result = {
        "impl": "hf_elmo ElmoModel",
        "implementation": args.implementation,
        "implementation_via": via,
        "config": architecture,
        "weights": os.path.basename(weights_path),
        "load": args.load,
        "workload": source_name,
        **workload.describe(sentences, args.batch_size),
        "batch_size": args.batch_size,
        "threads": args.threads,
        "repeats": args.repeats,
        "dtype": args.dtype,
        "int8_weights": args.int8,
        "int8_kernel": int8_kernel(model),
        "device": args.device,
        "token_cache": args.cache_vocab,
        "layers": "all" if args.all_layers else "top",
        **speed,
        "max_abs_diff_vs_reference": max_diff,
        **profile,
        "params": sum(p.numel() for p in model.parameters()),
        "load_s": round(load_s, 3),
        "char_ids_s": round(char_ids_s, 3),
        **memory,
        "peak_rss_process_mib": bench_utils.process_peak_rss_mib(),
        "loadavg_after": os.getloadavg(),
        "machine": bench_utils.machine_description(args.device),
    }
    print(json.dumps(result, ensure_ascii=False))


if __name__ == "__main__":
    main()
