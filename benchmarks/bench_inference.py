#!/usr/bin/env python
"""Inference benchmark of hf_elmo's ElmoModel on bilm-tf weights. Prints ONE JSON line.

  python benchmarks/bench_inference.py --options O.json --weights W.hdf5
      [--batch-size 32] [--n-sentences 64] [--threads 2] [--repeats 3] [--dtype fp32|bf16]
      [--cache-vocab] [--path fast|reference] [--wait-quiet SECONDS] [--load converted|hdf5]

Made to be read next to the AllenNLP peer (/work/shared/peers/allennlp/bench_peer.py): give it the
`{config}_options.json` / `{config}_random_weights.hdf5` that the peer writes, and both sides run the
same weights on the same workload (`workload_sha1` must match).

Loading (--load): by default the bilm-tf files are converted once, in a child process, into a Hugging Face
folder cached under --cache-dir (keyed by the files' paths, sizes and times), and the timed model comes from
`ElmoModel.from_pretrained` on it, the way users load ELMo. `--load hdf5` reads the .hdf5 in this process
instead (then h5py and its buffers count in the RSS, ~10 MiB more).

Workload: the peer's `make_workload` (an LCG, seed 42, 5-40 words a sentence from a fixed word list),
batched in order, no sorting. Char ids are made once up front (reported as `char_ids_s`).

Timing: eval() under torch.no_grad(). One untimed warm-up forward on batch 0, then --repeats timed
passes over all batches. tokens_per_s = words (no <S>/</S>, no padding) / the sum over batches of each
batch's fastest repeat. The char-CNN / LSTM split comes from forward hooks on `model.char_encoder` and
`model.bilstm`.

Peak RSS: after loading, the freed loading buffers are handed back to the OS (glibc malloc_trim) and VmHWM
is reset through /proc/self/clear_refs; VmHWM is read after the timed passes (the fidelity check below runs
after that, so it does not count). The weights themselves and the Python/torch/transformers runtime count.

Shared machine: --wait-quiet S waits (up to S seconds) before each timed pass until other processes use
less than 15% of the CPUs, and the load is recorded, as the peer does.

Fidelity: after timing, every batch is run once more through the timed path and through the reference
path (`use_fast_path = False`, fp32, no cache) of an fp32 model, and the largest absolute difference over
all output layers is reported (`max_abs_diff_vs_reference`); with --dtype bf16 this is the bf16 error.
"""

import argparse
import ctypes
import gc
import hashlib
import json
import os
import platform
import resource
import subprocess
import sys
import time

import torch


sys.path.append(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from hf_elmo.bilm_tf import config_from_options, read_options, read_weights  # noqa: E402
from hf_elmo.configuration_elmo import word_to_char_ids  # noqa: E402
from hf_elmo.modeling_elmo import ElmoModel  # noqa: E402


# The peer's workload, kept identical (its word list and LCG) so that workload_sha1 matches.
WORDS = ("the of and to a in that is was he for it with as his on be at by I this had not are but "
         "from or have an they which one you were her all she there would their we him been has when "
         "who will more no if out so said what up its about into than them can only other new some "
         "could time these two may then do first any my now such like our over man me even most made "
         "after also did many before must through back years where much your way well down should "
         "because each just those people Mr. how too little state good very make world still own see "
         "men work long get here between both life being under never day same another know while last "
         "might us great old year off come since against go came right used take three , . ; : ' \" ( ) "
         "-- 1984 3.14 U.S. New-York Prevention Argentinian seventh-seeded peacemaking unflattering "
         "bio-identical controversial Congestion Nalbandian Washington mildness outbreaks disambiguate "
         "internationalization représentation naïve café Zürich straße Ελληνικά русский 日本語 😀").split()


def make_workload(n_sentences: int, seed: int = 42) -> list[list[str]]:
    x = seed
    sentences = []
    for _ in range(n_sentences):
        x = (1103515245 * x + 12345) % (2**31)
        n = 5 + (x % 36)
        words = []
        for _ in range(n):
            x = (1103515245 * x + 12345) % (2**31)
            words.append(WORDS[x % len(WORDS)])
        sentences.append(words)
    return sentences


def char_ids(batch: list[list[str]], width: int) -> torch.Tensor:
    ids = torch.zeros(len(batch), max(len(s) for s in batch), width, dtype=torch.long)
    for row, sentence in enumerate(batch):
        ids[row, : len(sentence)] = torch.tensor([word_to_char_ids(w, width) for w in sentence])
    return ids


def vm(key: str) -> float | None:
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith(key + ":"):
                return int(line.split()[1]) / 1024.0  # MiB
    return None


def reset_hwm() -> bool:
    try:
        with open("/proc/self/clear_refs", "w") as f:
            f.write("5")
        return True
    except OSError:
        return False


def load_model(options: str, weights: str, dtype: torch.dtype) -> ElmoModel:
    config = config_from_options(read_options(options), source=options)
    with torch.device("meta"):  # no random initialisation: every weight comes from the file
        model = ElmoModel(config)
    state_dict = read_weights(weights, config)
    model.load_state_dict(state_dict, strict=True, assign=True)
    del state_dict
    return model.to(dtype).eval()


def converted_folder(options: str, weights: str, cache_dir: str) -> str:
    """The bilm-tf pair converted to a Hugging Face folder, once (in a child process: no h5py in this one)."""
    key = "|".join(f"{os.path.abspath(p)}:{os.stat(p).st_size}:{os.stat(p).st_mtime_ns}" for p in (options, weights))
    folder = os.path.join(cache_dir, hashlib.sha1(key.encode()).hexdigest()[:16])
    if not os.path.isfile(os.path.join(folder, "config.json")):
        repo = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
        env = {**os.environ, "PYTHONPATH": os.pathsep.join(filter(None, [repo, os.environ.get("PYTHONPATH")]))}
        command = [sys.executable, "-m", "hf_elmo.cli", "convert", "--options", options, "--weights", weights,
                   "--output", folder, "--overwrite", "--no-progress"]
        result = subprocess.run(command, env=env, capture_output=True, text=True)
        if result.returncode != 0:
            sys.exit(f"converting {weights} failed:\n{result.stderr[-3000:]}")
    return folder


def release_freed_memory():
    """Hand the heap memory freed after loading back to the OS (glibc keeps it), so it is not counted as in use."""
    gc.collect()
    try:
        ctypes.CDLL("libc.so.6").malloc_trim(0)
    except (OSError, AttributeError):
        pass


def cpu_busy_fraction(interval: float = 0.5) -> float:
    """Fraction of all CPUs busy over `interval` seconds (any process), from /proc/stat."""

    def sample():
        with open("/proc/stat") as f:
            values = [int(v) for v in f.readline().split()[1:]]
        return sum(values), values[3] + values[4]  # total, idle + iowait

    total0, idle0 = sample()
    time.sleep(interval)
    total1, idle1 = sample()
    return 1.0 - (idle1 - idle0) / max(1, total1 - total0)


def wait_quiet(timeout_s: float, threshold: float = 0.15) -> float:
    deadline = time.time() + timeout_s
    busy = cpu_busy_fraction()
    while busy > threshold and time.time() < deadline:
        busy = cpu_busy_fraction()
    return round(busy, 3)


def set_path(model: ElmoModel, path: str):
    model.char_encoder.use_fast_path = model.bilstm.use_fast_path = path == "fast"


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--options", required=True, help="bilm-tf options.json (e.g. the peer's {config}_options.json)")
    ap.add_argument("--weights", required=True, help="bilm-tf weights .hdf5 (e.g. {config}_random_weights.hdf5)")
    ap.add_argument("--batch-size", type=int, default=32)
    ap.add_argument("--n-sentences", type=int, default=64)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--repeats", type=int, default=3, help="timed passes over the workload")
    ap.add_argument("--dtype", choices=["fp32", "bf16"], default="fp32")
    ap.add_argument("--cache-vocab", action="store_true",
                    help="enable the token-vector cache and fill it with the workload's vocabulary before timing "
                         "(the counterpart of the peer's --mode cached)")
    ap.add_argument("--path", choices=["fast", "reference"], default="fast",
                    help="time the fast path (default) or the straightforward reference path")
    ap.add_argument("--load", choices=["converted", "hdf5"], default="converted",
                    help="converted (default): convert once in a child process and load the folder with "
                         "from_pretrained; hdf5: read the .hdf5 in this process")
    ap.add_argument("--cache-dir", default=os.path.join(os.path.expanduser("~"), ".cache", "hf_elmo_bench"),
                    help="where converted folders are kept (default ~/.cache/hf_elmo_bench)")
    ap.add_argument("--skip-check", action="store_true", help="skip the comparison with the reference path")
    ap.add_argument("--wait-quiet", type=float, default=0.0,
                    help="before each timed pass wait up to this many seconds for the machine to be idle")
    args = ap.parse_args()

    torch.set_num_threads(args.threads)
    dtype = {"fp32": torch.float32, "bf16": torch.bfloat16}[args.dtype]

    def load(dtype: torch.dtype) -> ElmoModel:
        if args.load == "hdf5":
            return load_model(args.options, args.weights, dtype)
        return ElmoModel.from_pretrained(folder, dtype=dtype).eval()

    folder = converted_folder(args.options, args.weights, args.cache_dir) if args.load == "converted" else None
    t0 = time.perf_counter()
    model = load(dtype)
    t_load = time.perf_counter() - t0
    set_path(model, args.path)
    config = model.config

    sentences = make_workload(args.n_sentences)
    sha = hashlib.sha1("\n".join(" ".join(s) for s in sentences).encode("utf-8")).hexdigest()
    batches = [sentences[i : i + args.batch_size] for i in range(0, len(sentences), args.batch_size)]
    n_words = sum(len(s) for s in sentences)
    t0 = time.perf_counter()
    inputs = [char_ids(b, config.max_characters_per_token) for b in batches]
    t_char_ids = time.perf_counter() - t0

    split = {"char_cnn": 0.0, "lstm": 0.0}
    starts = {}

    def timer(name):
        def pre(_module, _inputs):
            starts[name] = time.perf_counter()

        def post(_module, _inputs, _output):
            split[name] += time.perf_counter() - starts[name]

        return pre, post

    for name, module in (("char_cnn", model.char_encoder), ("lstm", model.bilstm)):
        pre, post = timer(name)
        module.register_forward_pre_hook(pre)
        module.register_forward_hook(post)

    release_freed_memory()
    rss_after_load = vm("VmRSS")
    hwm_reset = reset_hwm()
    with torch.no_grad():
        if args.cache_vocab:
            vocabulary = sorted({w for s in sentences for w in s})
            model.char_encoder.enable_token_cache(max_words=max(len(vocabulary), 1))
            model.char_encoder(char_ids([vocabulary], config.max_characters_per_token)[0])
        t0 = time.perf_counter()
        model(inputs[0])  # warm-up, untimed
        t_warm = time.perf_counter() - t0
        records = []  # records[r][i] = (wall, char_cnn, lstm) of repeat r, batch i
        quiet_log = []
        for _ in range(args.repeats):
            if args.wait_quiet > 0:
                quiet_log.append(wait_quiet(args.wait_quiet))
            row = []
            for batch in inputs:
                split["char_cnn"] = split["lstm"] = 0.0
                t0 = time.perf_counter()
                model(batch)
                row.append((time.perf_counter() - t0, split["char_cnn"], split["lstm"]))
            records.append(row)
    peak_hwm = vm("VmHWM")
    pass_times = [sum(b[0] for b in row) for row in records]
    best = [min((records[r][i] for r in range(len(records))), key=lambda b: b[0]) for i in range(len(inputs))]
    best_total = sum(b[0] for b in best)
    best_cnn = sum(b[1] for b in best)
    best_lstm = sum(b[2] for b in best)

    max_diff = None
    if not args.skip_check:
        # Outputs of the timed configuration vs the reference path of an fp32 model, on the same batches.
        reference = model if dtype == torch.float32 else load(torch.float32)
        max_diff = 0.0
        with torch.no_grad():
            for batch in inputs:
                fast = model(batch, output_hidden_states=True).hidden_states
                fast = [h.float() for h in fast]
                saved = (reference.char_encoder.use_fast_path, reference.bilstm.use_fast_path)
                set_path(reference, "reference")
                cache = reference.char_encoder.token_cache
                reference.char_encoder.token_cache = None
                slow = reference(batch, output_hidden_states=True).hidden_states
                reference.char_encoder.token_cache = cache
                reference.char_encoder.use_fast_path, reference.bilstm.use_fast_path = saved
                for a, b in zip(fast, slow):
                    max_diff = max(max_diff, (a - b).abs().max().item())

    name = f"{config.num_lstm_layers}x{config.lstm_dim}_{config.projection_dim}_{config.n_filters}cnn_{config.n_highway}xhighway"
    result = {
        "impl": "hf_elmo ElmoModel",
        "path": args.path,
        "load": args.load,
        "config": name,
        "mode": "cached" if args.cache_vocab else "chars",
        "dtype": args.dtype,
        "batch_size": args.batch_size,
        "n_sentences": args.n_sentences,
        "threads": args.threads,
        "n_batches": len(inputs),
        "n_words": n_words,
        "workload_sha1": sha,
        "params": sum(p.numel() for p in model.parameters()),
        "tokens_per_s": n_words / best_total,
        "tokens_per_s_note": "words / sum over batches of each batch's fastest timed repeat (warm-up excluded)",
        "tokens_per_s_best_pass": n_words / min(pass_times),
        "pass_s_all": pass_times,
        "best_batch_s": [b[0] for b in best],
        "warmup_batch_s": t_warm,
        "split_s_best": {"char_cnn": best_cnn, "lstm": best_lstm, "other": best_total - best_cnn - best_lstm},
        "split_frac_best": {
            "char_cnn": best_cnn / best_total,
            "lstm": best_lstm / best_total,
            "other": 1 - (best_cnn + best_lstm) / best_total,
        },
        "max_abs_diff_vs_reference": max_diff,
        "background_busy_before_passes": quiet_log,
        "loadavg_after": os.getloadavg(),
        "load_s": t_load,
        "char_ids_s": t_char_ids,
        "rss_after_load_mib": rss_after_load,
        "peak_rss_inference_mib": peak_hwm if hwm_reset else None,
        "peak_rss_process_mib": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024.0,
        "torch": torch.__version__,
        "python": platform.python_version(),
        "cpu": platform.processor() or platform.machine(),
    }
    print(json.dumps(result))


if __name__ == "__main__":
    main()
