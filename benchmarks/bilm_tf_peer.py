#!/usr/bin/env python
"""bilm-tf's own pretraining, timed: the peer of `bench_pretrain.py --peer bilm-tf`. Prints one JSON line.

    python benchmarks/bilm_tf_peer.py --config CONFIG --text WORDS_FILE --vocab VOCAB_FILE [--batch-size 64]
        [--steps 100] [--warmup-steps 20]

It runs allenai's bilm-tf (`bilm==0.1.post5` on PyPI) as it is: its `train()`, its data reader and its graph,
under TensorFlow 2.21 (`tensorflow-cpu`) through `tf.compat.v1` with v2 behaviour disabled, on the biLM of
`--config` (anything `hf-elmo pretrain --config` takes: a preset, a config.json, an options.json) with bilm-tf's
recipe: Adagrad 0.2, 8192 sampled negatives, dropout 0.1, global-norm clipping at 10, batches of `--batch-size`
windows of 20 tokens.

TensorFlow and bilm are never dependencies of hf_elmo: on first use this script makes a venv of its own under
`$HF_ELMO_BENCH_CACHE/bilm-tf-venv` (default `~/.cache/hf_elmo_bench`), installs `tensorflow-cpu==2.21.0`,
`tf_keras==2.21.0`, `bilm==0.1.post5` and h5py into it with pip, and runs itself there. bilm-tf imports
`tensorflow` and calls its 1.x API; it sees `tensorflow.compat.v1` because the runner puts that module in
`sys.modules["tensorflow"]` before importing `bilm` (no installed file is edited). Where the venv cannot be
made (no network, no wheel for this Python), the line says `skipped` and why, and the exit status is 0.

Tokens are what bilm-tf predicts per direction: `batch_size * 20` per batch (its windows run across sentence
boundaries, and it predicts `<S>` and `</S>` too). `tokens_per_s` counts the `--steps` batches after
`--warmup-steps`, from the end of the last warm-up batch to the end of the last timed one (each batch's
`Session.run` is timed; the graph's construction and the checkpoint written at the end are not).
"""

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time


HERE = os.path.dirname(os.path.abspath(__file__))
REPO = os.path.dirname(HERE)
REQUIREMENTS = ["tensorflow-cpu==2.21.0", "tf_keras==2.21.0", "bilm==0.1.post5", "h5py"]
UNROLL_STEPS = 20  # bilm-tf's window length in training
# bilm-tf trains with 261 characters (its byte ids, the 5 specials and padding); the 262nd row is added at export.
TRAINING_CHARACTERS = 261


def venv_dir() -> str:
    cache = os.environ.get("HF_ELMO_BENCH_CACHE", os.path.join(os.path.expanduser("~"), ".cache", "hf_elmo_bench"))
    return os.path.join(cache, "bilm-tf-venv")


def ensure_venv() -> tuple[str | None, str | None]:
    """The peer venv's python, made on first use; or (None, why it could not be made)."""
    folder = venv_dir()
    python = os.path.join(folder, "bin", "python")
    marker = os.path.join(folder, "hf_elmo_peer_ready.json")
    if os.path.exists(marker):
        return python, None
    try:
        subprocess.run([sys.executable, "-m", "venv", folder], check=True, capture_output=True, text=True)
        subprocess.run([python, "-m", "pip", "install", "-q", *REQUIREMENTS], check=True, capture_output=True,
                       text=True)
    except subprocess.CalledProcessError as error:
        last = (error.stderr or error.stdout or "").strip().splitlines()
        return None, f"could not install {' '.join(REQUIREMENTS)} into {folder}: {last[-1] if last else error}"
    with open(marker, "w", encoding="utf-8") as handle:
        json.dump({"requirements": REQUIREMENTS}, handle)
    return python, None


def bilm_tf_options(config_source: str, batch_size: int, vocab_size: int, batches: int) -> dict:
    """bilm-tf's training options for the biLM of `config_source`, with the recipe of its `train_elmo.py`."""
    sys.path.insert(0, REPO)
    from hf_elmo.bilm_tf import options_from_config
    from hf_elmo.pretraining import load_config

    options = options_from_config(load_config(config_source))
    options["char_cnn"]["n_characters"] = TRAINING_CHARACTERS
    options.update({
        "bidirectional": True, "dropout": 0.1, "all_clip_norm_val": 10.0, "n_epochs": 1,
        "n_train_tokens": batches * batch_size * UNROLL_STEPS, "batch_size": batch_size,
        "n_tokens_vocab": vocab_size, "unroll_steps": UNROLL_STEPS, "n_negative_samples_batch": 8192,
    })
    return options


def train_and_time(options: dict, text: str, vocab_file: str, warmup_steps: int) -> dict:
    """Inside the peer venv: bilm-tf's train() on `text`, each batch's Session.run timed."""
    os.environ.setdefault("TF_USE_LEGACY_KERAS", "1")
    os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")
    import tensorflow.compat.v1 as tf

    tf.disable_v2_behavior()
    sys.modules["tensorflow"] = tf  # bilm-tf's `import tensorflow as tf` gets the 1.x API
    from bilm.data import BidirectionalLMDataset
    from bilm.training import load_vocab, train

    ends = []
    session_run = tf.Session.run

    def timed_run(session, fetches, *args, **kwargs):
        result = session_run(session, fetches, *args, **kwargs)
        # A training batch fetches the train op first; the initial-state and init runs do not.
        if isinstance(fetches, list) and fetches and isinstance(fetches[0], tf.Operation):
            ends.append(time.perf_counter())
        return result

    tf.Session.run = timed_run
    vocab = load_vocab(vocab_file, options["char_cnn"]["max_characters_per_token"])
    data = BidirectionalLMDataset(text, vocab, test=False, shuffle_on_load=True)
    with tempfile.TemporaryDirectory() as save_dir:
        start = time.perf_counter()
        train(options, data, 1, save_dir, save_dir)
        total = time.perf_counter() - start
    timed = len(ends) - warmup_steps
    seconds = ends[-1] - ends[warmup_steps - 1]
    tokens = timed * options["batch_size"] * options["unroll_steps"]
    return {
        "tokens_per_s": round(tokens / seconds, 1),
        "timed_batches": timed,
        "tokens_per_batch": options["batch_size"] * options["unroll_steps"],
        "seconds_per_batch": round(seconds / timed, 4),
        "first_batch_s": round(ends[0] - start, 2),
        "total_s": round(total, 1),
        "tensorflow": tf.__version__ if hasattr(tf, "__version__") else None,
    }


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--config", default="small",
                        help="the biLM: a preset, a config.json or an options.json (default: %(default)s)")
    parser.add_argument("--text", required=True, help="training text: one sentence per line, words split by spaces")
    parser.add_argument("--vocab", required=True, help="vocabulary file, one word per line with <S> </S> <UNK>")
    parser.add_argument("--batch-size", type=int, default=64, help="windows per batch (default: %(default)s)")
    parser.add_argument("--steps", type=int, default=100, help="timed batches (default: %(default)s)")
    parser.add_argument("--warmup-steps", type=int, default=20, help="untimed first batches (default: %(default)s)")
    parser.add_argument("--inside", metavar="OPTIONS_JSON", help=argparse.SUPPRESS)  # the run in the peer venv
    args = parser.parse_args(argv)
    if args.warmup_steps < 1 or args.steps < 1:
        parser.error("--steps and --warmup-steps must be at least 1")

    if args.inside:
        with open(args.inside, encoding="utf-8") as handle:
            options = json.load(handle)
        print(json.dumps(train_and_time(options, args.text, args.vocab, args.warmup_steps)), flush=True)
        return 0

    with open(args.vocab, encoding="utf-8") as handle:
        vocab_size = sum(1 for line in handle if line.strip())
    options = bilm_tf_options(args.config, args.batch_size, vocab_size, args.warmup_steps + args.steps)
    result = {"impl": "bilm-tf (bilm 0.1.post5)", "config": args.config, "batch_size": args.batch_size,
              "unroll_steps": UNROLL_STEPS, "vocab_size": vocab_size, "softmax_negatives": 8192,
              "threads": "tensorflow's default (all cores)"}
    python, why = ensure_venv()
    if python is None:
        print(json.dumps({**result, "skipped": why}), flush=True)
        return 0
    with tempfile.TemporaryDirectory() as scratch:
        options_file = os.path.join(scratch, "options.json")
        with open(options_file, "w", encoding="utf-8") as handle:
            json.dump(options, handle)
        child = subprocess.run(
            [python, os.path.abspath(__file__), "--inside", options_file, "--text", args.text, "--vocab", args.vocab,
             "--warmup-steps", str(args.warmup_steps), "--steps", str(args.steps)],
            capture_output=True, text=True,
        )
    lines = [line for line in child.stdout.splitlines() if line.startswith("{")]
    if child.returncode != 0 or not lines:
        tail = (child.stderr.strip().splitlines() or ["no output"])[-1]
        sys.exit(f"bilm_tf_peer: bilm-tf's training failed (exit {child.returncode}): {tail}")
    print(json.dumps({**result, **json.loads(lines[-1])}), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
