#!/usr/bin/env python
"""Pretraining throughput of ELMo on real running text, and of its data pipeline alone. Prints one JSON line
per vocabulary size.

    python benchmarks/bench_pretrain.py [--device cpu|cuda] [--config small|original|recipe|FILE] [--text FILE]
        [--batch-size 128] [--mixed-precision bf16|no] [--steps 10] [--num-workers 2] [--vocab-size N [N ...]]
        [--training-step auto|captured|eager] [--peer bilm-tf]

The timed step is `hf-elmo pretrain`'s own: a `PretrainingRun` (bilm-tf's recipe: sampled softmax with 8192
log-uniform negatives, Adagrad lr 0.2 with sparse softmax gradients, gradient x 20, global-norm clipping at 10,
dropout 0.1) and its `optimizer_step`, with its length buckets, DataLoader workers and one read of the gradient
norm per step, on the published shapes (`small` 2x1024_128_2048cnn_1xhighway, `original`
2x4096_512_2048cnn_2xhighway), with a vocabulary counted from the text; `--vocab-size N` pads it with stand-in
words to N (793471 for bilm-tf's 1B Word softmax); `--vocab-size text 793471` measures both, one after the other in
one process (the second without the imports and the compiling). The text (default: the Wikipedia sample of
`hf_elmo.testing_utils`, 4000 sentences, fetched once with pip) goes through the same stream and DataLoader
workers as in training. Tokens are what the LMs predict: words + one `</S>` per sentence.

- `tokens_per_s`: `--steps` optimizer steps after `--warmup-steps`, timed end to end (data included). With the
  captured step (`--training-step`, `hf-elmo pretrain`'s: auto is captured on a GPU), a step that met a new length
  bucket compiled its graph: such steps are left out of the figure and counted in `steps_that_compiled` and
  `compile_s`, and `graphs` says how many the run holds.
- `split_s_per_step`: a separate profiling pass of the same `optimizer_step`, with hooks that synchronise at each
  section's edges (so its total is a little slower than the timed pass): data (waiting for the next batch and
  copying it to the device), char CNN, biLSTM and softmax (forward + backward each; the softmax part is everything
  after the biLSTM, loss included), optimizer (clipping and the update). The captured step's graphs have no edges
  inside: its split is data, `accumulate` (forward and backward) and `update` (clipping and Adagrad).
- `pipeline_tokens_per_s`: the data pipeline alone (read, split, shuffle, encode, nothing else), in the training
  process (`workers_0`) and with `--num-workers` workers, and its ratio to `tokens_per_s`.
- `cpu_products`: on a CPU, where the step's large fp32 products ran: `onednn` where this process measured oneDNN
  clearly faster than the BLAS (`hf_elmo.cpu_tuning.onednn_trains`), else `blas`.
- `peak_memory_mib`: peak GPU memory allocated (cuda) or the process's peak RSS (cpu, VmHWM, which includes the
  Python/torch runtime).

`--peer bilm-tf` first runs `bilm_tf_peer.py`: allenai's bilm-tf training, in a venv of its own, on the same
config, the same words (split as here, one sentence per line), the same vocabulary and batch size; the line gets
its figures under `peer` and `ratio_to_peer` (ours / bilm-tf's tokens per second). bilm-tf reads windows of 20
tokens across sentence boundaries and predicts `<S>` too, one more position per sentence than counted here (about
3% on 30-word sentences).

`--pipeline-only` prints the pipeline figures without building a model, with `encode_tokens_per_s`: encoding alone
(sentences already split) by the tokenizer row by row (the old `make_batch`) and by `BatchEncoder`.
"""

import argparse
import atexit
import gc
import json
import os
import shutil
import subprocess
import sys
import tempfile
import time

STARTED = time.perf_counter()  # before torch and hf_elmo are imported: `phases_s` counts their import

import torch


REPO_ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, REPO_ROOT)

import bench_utils  # noqa: E402  (run as a script: its folder is on sys.path)

from hf_elmo import cpu_tuning  # noqa: E402
from hf_elmo.configuration_elmo import implementation_name  # noqa: E402
from hf_elmo.elmo_presets import CPU_PRETRAINING_CONFIG  # noqa: E402
from hf_elmo.pretraining import LossWindow, PretrainingRun  # noqa: E402
from hf_elmo.pretraining_args import parse_args as parse_pretraining_args  # noqa: E402
from hf_elmo.pretraining_data import (  # noqa: E402
    BatchEncoder,
    PretrainingBatches,
    WordSplitter,
    count_words,
    resolve_shards,
)
from hf_elmo.testing_utils import cpu_model, english_text_sample  # noqa: E402
from hf_elmo.tokenization_elmo import ElmoTokenizer  # noqa: E402
from hf_elmo.pretraining_data import build_vocab  # noqa: E402
from hf_elmo.tokenization_elmo import write_vocab  # noqa: E402


def loader(settings: dict, encoder: BatchEncoder, num_workers: int, pin: bool):
    return torch.utils.data.DataLoader(
        PretrainingBatches(settings, encoder), batch_size=None, num_workers=num_workers,
        prefetch_factor=4 if num_workers else None, pin_memory=pin, generator=torch.Generator(),
    )


def pipeline_rate(settings: dict, encoder: BatchEncoder, num_workers: int, epochs: int) -> float:
    """Tokens per second the pipeline delivers over whole epochs of the text, worker start-up included."""
    start, tokens = time.perf_counter(), 0
    iterator = iter(loader(settings, encoder, num_workers, pin=False))
    while True:
        batch = next(iterator)
        if "error" in batch:
            raise SystemExit(batch["error"])
        if batch["stream_position"]["window_start"]["epoch"] >= epochs:
            break
        tokens += batch["num_tokens"]
    elapsed = time.perf_counter() - start
    del iterator
    return tokens / elapsed


def encode_rates(tokenizer, encoder: BatchEncoder, settings: dict, batches: int = 20) -> dict:
    """Encoding alone (sentences already split): the tokenizer, row by row (what make_batch did), vs BatchEncoder."""
    from hf_elmo.pretraining_data import SentenceBatchStream

    stream = SentenceBatchStream(**settings)
    sentences = [stream.next_batch() for _ in range(batches)]
    tokens = sum(len(s) + 1 for batch in sentences for s in batch)

    def by_tokenizer(batch):
        encoded = tokenizer(batch, is_split_into_words=True, padding=True, return_tensors="pt")
        labels = torch.full(encoded["attention_mask"].shape, -100, dtype=torch.long)
        for row, words in enumerate(batch):
            labels[row, : len(words)] = torch.tensor(tokenizer.words_to_indices(words), dtype=torch.long)

    rates = {}
    for name, encode in (("tokenizer", by_tokenizer), ("batch_encoder", encoder)):
        start = time.perf_counter()
        for batch in sentences:
            encode(batch)
        rates[name] = round(tokens / (time.perf_counter() - start))
    return rates


def pretraining_run(args, text: str, vocab_words: list[str], workdir: str):
    """`hf-elmo pretrain`'s own `PretrainingRun` on `text` with bilm-tf's recipe (Adagrad 0.2, 8192 negatives,
    dropout 0.1, clipping at 10, gradient x 20), writing nothing but into `workdir`."""
    vocab_file = write_vocab(vocab_words, os.path.join(workdir, "bench-vocab.txt"))
    argv = [
        "--train-files", text, "--vocab", vocab_file, "--config", args.config,
        "--output-dir", os.path.join(workdir, "run"), "--max-steps", str(10**9), "--batch-size", str(args.batch_size),
        "--num-workers", str(args.num_workers), "--mixed-precision", args.mixed_precision, "--seed", "0",
        "--report-to", "none", "--logging-steps", str(10**9), "--save-steps", str(10**9),
        "--training-step", args.training_step, "--compile-backend", args.compile_backend,
        "--max-sentence-words", str(args.max_sentence_words),
    ]
    if args.threads:
        argv += ["--threads", str(args.threads)]
    return PretrainingRun(parse_pretraining_args(argv))


def operator_profile(run, window, steps: int, top: int, sync) -> dict:
    """
    `steps` more optimizer steps under torch.profiler (`bench_utils.profile_calls`): the `top` operators by self time
    per step (`top_ops_per_step`; on a GPU the kernels by GPU time, those replayed inside a CUDA graph included) and,
    on a GPU, the kernels run and launched per step, their GPU time and the fraction of the wall time the GPU was
    busy. The 2026-11-27 H200 report measured the recorded step's busy fraction in fp32 only; this is the same
    figure for the step and the text of a pretraining run.
    """
    return bench_utils.profile_calls(lambda _: run.optimizer_step(window), steps, run.accelerator.device.type == "cuda",
                                     sync, top=top, per="step")


def run_peer(args, files: list[str], splitter, vocab_words: list[str], workdir: str) -> dict:
    """bilm-tf's training on the same words (split as ours are, one sentence per line), vocabulary, config and batch
    size: `bilm_tf_peer.py`'s JSON line."""
    words_file = os.path.join(workdir, "words.txt")
    with open(words_file, "w", encoding="utf-8") as out:
        for name in files:
            with open(name, encoding="utf-8") as handle:
                for line in handle:
                    words = splitter(line)
                    if words:
                        out.write(" ".join(words) + "\n")
    vocab_file = write_vocab(vocab_words, os.path.join(workdir, "peer-vocab.txt"))
    command = [sys.executable, os.path.join(REPO_ROOT, "benchmarks", "bilm_tf_peer.py"), "--config", args.config,
               "--text", words_file, "--vocab", vocab_file, "--batch-size", str(args.batch_size),
               "--steps", str(args.peer_steps), "--warmup-steps", str(args.peer_warmup_steps)]
    child = subprocess.run(command, capture_output=True, text=True)
    lines = [line for line in child.stdout.splitlines() if line.startswith("{")]
    if child.returncode != 0 or not lines:
        raise SystemExit(child.stderr.strip().splitlines()[-1] if child.stderr.strip() else "bilm_tf_peer failed")
    return json.loads(lines[-1])


class CapturedSections:
    """The captured step's sections, each edge marked after a synchronisation: data (the run's `next_batch`), the
    `accumulate` graph (forward and backward) and the `update` graph (clipping and Adagrad)."""

    implementation = "cuda"  # what ElmoBiLstm runs inside torch.compile, on any device

    def __init__(self, run, sync, device):
        self.totals = dict.fromkeys(("data", "accumulate", "update"), 0.0)
        for owner, name, section in ((run, "next_batch", "data"), (run.captured_step, "accumulate", "accumulate"),
                                     (run.captured_step, "update", "update")):
            setattr(owner, name, self._timed(getattr(owner, name), section, sync))

    def _timed(self, function, section, sync):
        def timed(*args):
            sync()
            start = time.perf_counter()
            result = function(*args)
            sync()
            self.totals[section] += time.perf_counter() - start
            return result

        return timed

    def split(self) -> dict:
        """The seconds per section since the last call."""
        split, self.totals = self.totals, dict.fromkeys(self.totals, 0.0)
        return split


class Sections:
    """
    Wall-clock time of a `PretrainingRun.optimizer_step`'s sections, each edge marked after a synchronisation:
    waiting for the batch and copying it (the run's `next_batch`), the char CNN and the biLSTM forward (hooks on
    the modules, which compute with the chosen implementation inside their own forward) and backward (gradient
    hooks), the softmax and loss (the rest of the model's forward and the start of the backward), and the optimizer
    (clipping and the update: from the char embeddings' gradient, the last one computed, to the end of the step).
    """

    def __init__(self, run, sync, device):
        self.sync, self.marks = sync, {}
        model = run.accelerator.unwrap_model(run.model)
        self.implementation = implementation_name(model.config.elmo_implementation, torch.device(device))
        model.register_forward_hook(lambda module, args, output: self.mark("forward_end"))
        model.elmo.char_encoder.register_forward_pre_hook(lambda module, args: self.mark("cnn_start"))
        model.elmo.char_encoder.register_forward_hook(self._after_char_encoder)
        model.elmo.bilstm.register_forward_pre_hook(self._before_bilstm)
        model.elmo.bilstm.register_forward_hook(self._after_bilstm)
        model.get_input_embeddings().weight.register_post_accumulate_grad_hook(lambda p: self.mark("backward_end"))
        optimizer = getattr(run.optimizer, "optimizer", run.optimizer)  # under Accelerate's wrapper
        optimizer.register_step_post_hook(lambda *_: self.mark("update_end"))
        next_batch = run.next_batch

        def timed_next_batch():
            self.mark("data_start")
            batch = next_batch()
            self.mark("data_end")
            return batch

        run.next_batch = timed_next_batch

    def split(self) -> dict:
        """The last step's seconds per section."""
        m = self.marks
        backward_end = m["backward_end"]
        return {
            "data": m["data_end"] - m["data_start"],
            "char_cnn": (m["cnn_end"] - m["cnn_start"]) + (backward_end - m.get("cnn_backward_start", backward_end)),
            "bilstm": (m["bilstm_end"] - m["bilstm_start"]) + (
                m.get("bilstm_backward_end", backward_end) - m.get("bilstm_backward_start", backward_end)),
            "softmax": (m["forward_end"] - m["bilstm_end"]) + (
                m.get("bilstm_backward_start", backward_end) - m["forward_end"]),
            "optimizer": m["update_end"] - backward_end,
        }

    def mark(self, name):
        self.sync()
        self.marks[name] = time.perf_counter()

    @staticmethod
    def _first_grad_tensor(value):
        if isinstance(value, torch.Tensor):
            return value if value.requires_grad else None
        if isinstance(value, (tuple, list)):
            for item in value:
                found = Sections._first_grad_tensor(item)
                if found is not None:
                    return found
        if hasattr(value, "values"):
            return Sections._first_grad_tensor(list(value.values()))
        return None

    def _hook_backward(self, value, name):
        # A gradient hook on a tensor marks when the backward pass reaches it; it changes nothing in the graph.
        tensor = self._first_grad_tensor(value)
        if tensor is not None:
            tensor.register_hook(lambda grad: self.mark(name))

    def _after_char_encoder(self, module, args, output):
        self.mark("cnn_end")
        self._hook_backward(output, "cnn_backward_start")

    def _before_bilstm(self, module, args):
        self.mark("bilstm_start")
        self._hook_backward(args, "bilstm_backward_end")

    def _after_bilstm(self, module, args, output):
        self.mark("bilstm_end")
        self._hook_backward(output, "bilstm_backward_start")


def main():
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--device", choices=("cpu", "cuda"), default="cpu")
    parser.add_argument("--config", default="small",
                        help="the biLM: small, original, recipe (the 5.2M-parameter biLM of the pretraining issues, "
                             "hf_elmo.elmo_presets.CPU_PRETRAINING_CONFIG), or a config.json / bilm-tf options.json "
                             "(default: %(default)s)")
    parser.add_argument("--peer", choices=("bilm-tf",), default=None,
                        help="also time bilm-tf's own training (bilm_tf_peer.py, in a venv of its own) on the same "
                             "config, words, vocabulary and batch size, first, and report the ratio")
    parser.add_argument("--peer-steps", type=int, default=100, help="the peer's timed batches (default: %(default)s)")
    parser.add_argument("--peer-warmup-steps", type=int, default=20,
                        help="the peer's untimed first batches (default: %(default)s)")
    parser.add_argument("--text", default=None, help="one sentence per line (default: the testing_utils sample)")
    parser.add_argument("--batch-size", type=int, default=128, help="sentences per step (default: %(default)s)")
    parser.add_argument("--mixed-precision", choices=("bf16", "no"), default="no")
    parser.add_argument("--training-step", choices=("auto", "captured", "eager"), default="auto",
                        help="hf-elmo pretrain's --training-step (default: %(default)s: captured on a GPU)")
    parser.add_argument("--compile-backend", choices=("none", "inductor", "aot_eager"), default="none",
                        help="hf-elmo pretrain's --compile-backend for the captured step (default: %(default)s)")
    parser.add_argument("--max-sentence-words", type=int, default=100,
                        help="lines are cut into pieces of at most this many words, as hf-elmo pretrain's option "
                        "(default: %(default)s); fewer lengths are fewer graphs for the captured step to compile")
    parser.add_argument("--steps", type=int, default=10, help="timed optimizer steps (default: %(default)s)")
    parser.add_argument("--warmup-steps", type=int, default=2)
    parser.add_argument("--profile-steps", type=int, default=3, help="steps of the profiling pass")
    parser.add_argument("--top-ops", type=int, default=0, metavar="N",
                        help="also profile --profile-steps more steps with torch.profiler and report the N operators "
                             "taking the most self time (on a GPU: kernels by GPU time, with kernels run and launched "
                             "per step, their GPU time and the GPU's busy fraction, profiled and over the timed steps' "
                             "wall; default: none)")
    parser.add_argument("--num-workers", type=int, default=2, help="DataLoader workers (default: %(default)s)")
    parser.add_argument("--pipeline-epochs", type=int, default=3,
                        help="epochs of the text read by the pipeline-only measure (default: %(default)s)")
    parser.add_argument("--pipeline-only", action="store_true", help="measure the data pipeline alone, no model")
    parser.add_argument("--threads", type=int, default=None, help="torch threads on cpu (default: torch's)")
    parser.add_argument("--vocab-size", type=vocabulary_size, nargs="+", default=["text"], metavar="N",
                        help="pad the text's vocabulary with stand-in words to N (793471: bilm-tf's 1B Word softmax); "
                             "several sizes (`text`: the text's own) are measured one after the other in this "
                             "process, a JSON line each (default: text)")
    args = parser.parse_args()
    if args.peer and len(args.vocab_size) > 1:
        parser.error("--peer measures one vocabulary size: give --vocab-size one N")
    if args.device == "cuda" and not torch.cuda.is_available():
        raise SystemExit("--device cuda: no CUDA device is available")
    if args.threads:
        torch.set_num_threads(args.threads)
    if args.device == "cpu":
        os.environ["ACCELERATE_USE_CPU"] = "1"  # PretrainingRun's Accelerator stays on the CPU

    phases = Phases()
    phases("imports")
    config_dir = tempfile.mkdtemp(prefix="bench_pretrain-")  # the recipe's config.json and the peer's files
    atexit.register(shutil.rmtree, config_dir, True)
    if args.config == "recipe":
        args.config = os.path.join(config_dir, "config.json")
        with open(args.config, "w", encoding="utf-8") as handle:
            json.dump(CPU_PRETRAINING_CONFIG, handle)
    text = args.text or str(english_text_sample())
    splitter = WordSplitter("ptb")
    files = resolve_shards([text], what="--text", split_words=splitter)
    text_words = build_vocab(count_words(files, splitter)[0])
    for size in args.vocab_size:
        if size != "text" and size < len(text_words):
            parser.error(f"--vocab-size {size} is below the text's own vocabulary ({len(text_words)})")
    # One process for several sizes: the later ones skip the imports and find the recurrence's kernels compiled
    # (about 12 s and 10-20 s of a run on the H100 report), which is what lets gpu_report.py measure `original` at
    # both of issue 44's vocabularies inside its 6 minutes.
    for size in args.vocab_size:
        # Words no sentence holds: the softmax has the size of a large vocabulary, the text stays real.
        padding = [] if size == "text" else [f"<stand-in-{i}>" for i in range(size - len(text_words))]
        line = measure(args, text, files, splitter, text_words + padding, config_dir, phases)
        print(json.dumps(line), flush=True)
        phases.reset()
        gc.collect()  # the run's model, optimizer state and CUDA graphs, before the next size's
        if torch.cuda.is_available():
            torch.cuda.empty_cache()


def vocabulary_size(value: str):
    """`--vocab-size`'s values: `text` or a number of words."""
    return value if value == "text" else int(value)


class Phases:
    """Where a measurement's wall time goes besides the timed steps (the 2026-11-27 H200 report spent about 40 s a
    run for under a second of timed steps): each phase's seconds, in order. Called with a phase's name as it ends."""

    def __init__(self):
        self.seconds, self.last = {}, STARTED

    def __call__(self, name: str) -> None:
        now = time.perf_counter()
        self.seconds[name], self.last = round(now - self.last, 2), now

    def reset(self):
        self.seconds = {}


def measure(args, text: str, files: list[str], splitter, vocab_words: list[str], config_dir: str, phase) -> dict:
    """One vocabulary's figures: the pipeline's rate and, unless `--pipeline-only`, the training step's (the JSON
    line's fields)."""
    with tempfile.TemporaryDirectory() as workdir:
        vocab_file = write_vocab(vocab_words, os.path.join(workdir, "vocab.txt"))
        tokenizer = ElmoTokenizer(vocab_file=vocab_file)
    encoder = BatchEncoder.from_tokenizer(tokenizer)
    settings = dict(shards=files, split_words=splitter, batch_size=args.batch_size, seed=0, shuffle_window=100_000,
                    max_words=args.max_sentence_words)

    phase("vocabulary")
    pipeline = {"workers_0": pipeline_rate(settings, encoder, 0, args.pipeline_epochs)}
    if args.num_workers:
        pipeline[f"workers_{args.num_workers}"] = pipeline_rate(settings, encoder, args.num_workers,
                                                               args.pipeline_epochs)
    phase("pipeline")
    common = {
        "cpu": cpu_model(), "cpu_count": os.cpu_count(), "torch": torch.__version__, "text": os.path.basename(text),
        "vocab_size": tokenizer.word_vocab_size, "batch_size": args.batch_size, "num_workers": args.num_workers,
        "pipeline_tokens_per_s": {k: round(v) for k, v in pipeline.items()},
    }
    peer = run_peer(args, files, splitter, vocab_words, config_dir) if args.peer and not args.pipeline_only else None
    if args.pipeline_only:
        return {
            "benchmark": "pretrain_pipeline", **common,
            "encode_tokens_per_s": encode_rates(tokenizer, encoder, settings),
            "load_average_1min": round(os.getloadavg()[0], 2),
        }

    with tempfile.TemporaryDirectory() as workdir:
        run = pretraining_run(args, text, vocab_words, workdir)
        accelerator, device = run.accelerator, run.accelerator.device
        sync = torch.cuda.synchronize if device.type == "cuda" else (lambda: None)
        run.start_batches()
        run.model.train()
        window = LossWindow(device)
        phase("model")
        # The timed steps are hf-elmo pretrain's own: PretrainingRun.optimizer_step (its batches, length buckets,
        # loss scale, clipping and the one read of the gradient norm per step).
        for index in range(args.warmup_steps):
            run.optimizer_step(window)
            if index == 0:
                sync()
                phase("first_step")  # on a GPU the recording of its graphs, and the recurrence's kernels compiled
        sync()
        phase("warmup")
        if device.type == "cuda":
            torch.cuda.reset_peak_memory_stats()
        # Each step timed alone: one that compiled a graph (a new length bucket, captured step) is counted apart.
        graphs = torch._dynamo.utils.counters["stats"]
        graphs_before = graphs["unique_graphs"]  # those of the sizes measured before this one in this process
        elapsed = tokens = compile_s = steps_that_compiled = 0
        for _ in range(args.steps):
            window = LossWindow(device)
            before, start = graphs["unique_graphs"], time.perf_counter()
            run.optimizer_step(window)
            sync()
            seconds = time.perf_counter() - start
            if graphs["unique_graphs"] != before:
                compile_s, steps_that_compiled = compile_s + seconds, steps_that_compiled + 1
            else:
                elapsed, tokens = elapsed + seconds, tokens + window.tokens
        tokens_per_s = tokens / elapsed if elapsed else None
        phase("timed")
        peak = torch.cuda.max_memory_allocated() / 2**20 if device.type == "cuda" else bench_utils.proc_status_mib("VmHWM")

        # Profiling pass: the same optimizer_step, its sections marked by hooks that synchronise at each edge.
        sections = (CapturedSections if run.captured_step else Sections)(run, sync, args.device)
        split = {}
        for _ in range(args.profile_steps):
            run.optimizer_step(window)
            for name, seconds in sections.split().items():
                split[name] = split.get(name, 0.0) + seconds
        top_ops = operator_profile(run, window, args.profile_steps, args.top_ops, sync) if args.top_ops else None
        if top_ops and top_ops["device_s_per_step"] is not None and elapsed:
            # The profiled steps' GPU time over the timed steps' wall: the profiler and the sections' synchronisations
            # stretch the host's time, not the kernels' (the H100 run of 2026-11-28: 0.37-0.42 profiled, 0.67 for
            # the recorded step's own replay).
            top_ops["gpu_busy_fraction_timed"] = bench_utils.timed_busy_fraction(
                top_ops, "step", args.steps - steps_that_compiled, elapsed)
        phase("profile")
        sparse_softmax = bool(accelerator.unwrap_model(run.model).softmax.sparse)
        run.batches = None  # stops the workers
        del run

    return {
        "benchmark": "pretrain",
        "config": args.config,
        "device": args.device,
        "device_name": torch.cuda.get_device_name(device) if device.type == "cuda" else cpu_model(),
        "torch_threads": torch.get_num_threads(),
        "mixed_precision": args.mixed_precision,
        "training_step": "captured" if isinstance(sections, CapturedSections) else "eager",
        "elmo_implementation": sections.implementation,
        "softmax_negatives": 8192,
        "softmax_gradient": "sparse" if sparse_softmax else "dense",
        # Where a CPU step's large fp32 products ran: oneDNN where this process measured it faster (cpu_tuning).
        "cpu_products": ("onednn" if cpu_tuning.onednn_trains(torch.empty(0)) else "blas") if device.type == "cpu"
        else None,
        "steps": args.steps,
        "max_sentence_words": args.max_sentence_words,
        **common,
        "tokens_per_s": None if tokens_per_s is None else round(tokens_per_s, 1),
        "tokens_per_step": round(tokens / (args.steps - steps_that_compiled), 1) if tokens else None,
        "steps_that_compiled": steps_that_compiled,
        "compile_s": round(compile_s, 1),
        "graphs": graphs["unique_graphs"] - graphs_before,
        "peak_memory_mib": None if peak is None else round(peak, 1),
        "peak_memory_kind": "cuda_max_allocated" if device.type == "cuda" else "rss_vmhwm",
        "split_s_per_step": {k: round(v / args.profile_steps, 4) for k, v in split.items()},
        "pipeline_vs_training": round(max(pipeline.values()) / tokens_per_s, 1) if tokens_per_s else None,
        **({} if top_ops is None else top_ops),
        "phases_s": phase.seconds,
        "wall_s": round(sum(phase.seconds.values()), 1),  # this line's: since the process began or the last line
        **({} if peer is None else {
            "peer": peer,
            "ratio_to_peer": (round(tokens_per_s / peer["tokens_per_s"], 2)
                              if "tokens_per_s" in peer and tokens_per_s else None),
        }),
        "load_average_1min": round(os.getloadavg()[0], 2),
    }


if __name__ == "__main__":
    main()
