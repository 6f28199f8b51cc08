"""Pretrain (or adapt) an ELMo biLM with Accelerate: one CPU, many GPUs, resumable.

    hf-elmo-pretrain --train-files 'corpus/train-*.txt' --eval-file corpus/heldout.txt --build-vocab --min-count 3 \\
        --config small --batch-size 64 --max-steps 100000 --output-dir elmo-news

    accelerate launch --multi_gpu --num_processes 8 --mixed_precision bf16 -m hf_elmo.pretraining ...same options...

The corpus is plain text, one sentence per line, in any number of shards (globs). It is streamed, so it may be
larger than memory. Batches are whole sentences, each read from a zero LSTM state (see hf_elmo.pretraining_data for
why this and not bilm-tf's stateful 20-token windows). The objective is bilm-tf's: forward and backward LM losses
over a frequency-sorted word vocabulary, one softmax shared by both directions, a sampled softmax with 8192
log-uniform negatives in training, the full softmax for evaluation, Adagrad (lr 0.2, initial accumulator 1.0) and
global-norm clipping at 10 by default.

OUTPUT_DIR ends up holding the final model (`AutoModel.from_pretrained(OUTPUT_DIR)` gives the biLM,
`AutoModelForPreTraining` the biLM with its softmax), the tokenizer with the vocabulary (vocab.txt, bilm-tf's
format), `checkpoint-STEP/` folders (`--resume` continues from the latest one exactly as if never stopped), TensorBoard
logs under logs/, training_args.json and eval_results.json. Export the biLM for bilm-tf with
conversion/convert_hf_to_bilm_tf.py.
"""

import argparse
import dataclasses
import hashlib
import json
import logging
import math
import os
import re
import shutil
import sys
import time

import torch


# Named explicitly: under `python -m hf_elmo.pretraining` __name__ is "__main__".
logger = logging.getLogger("hf_elmo.pretraining")

CHECKPOINT_PATTERN = re.compile(r"^checkpoint-(\d+)$")
DEFAULT_LEARNING_RATES = {"adagrad": 0.2, "adamw": 1e-3}
# Transformers' schedules that need nothing but the warm-up and total steps.
LR_SCHEDULERS = ("constant", "constant_with_warmup", "linear", "cosine", "polynomial", "inverse_sqrt")


class TrainingDiverged(RuntimeError):
    """The loss or its gradient stopped being finite."""


@dataclasses.dataclass
class TrainingProgress:
    """What a checkpoint needs besides model, optimizer, scheduler, RNG and data position."""

    step: int = 0
    tokens: int = 0  # predictions per direction, all processes: words + one </S> per sentence

    def state_dict(self) -> dict:
        return dataclasses.asdict(self)

    def load_state_dict(self, state: dict) -> None:
        for key, value in state.items():
            setattr(self, key, value)


# ---------------------------------------------------------------------------------------------------------------
# Command line
# ---------------------------------------------------------------------------------------------------------------
def build_parser() -> argparse.ArgumentParser:
    from .configuration_elmo import ELMO_PRESETS

    parser = argparse.ArgumentParser(
        prog="hf-elmo-pretrain", description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    data = parser.add_argument_group("data")
    data.add_argument("--train-files", nargs="+", required=True, metavar="GLOB",
                      help="training text: one sentence per line, UTF-8; one or more files or glob patterns (quote "
                      "them), read as shards in a new shuffled order every epoch.")
    data.add_argument("--eval-file", default=None,
                      help="held-out text (same format) for forward/backward perplexity with the full softmax.")
    data.add_argument("--pre-tokenizer", choices=("ptb", "bert", "whitespace"), default="ptb",
                      help="how lines are split into words, saved with the tokenizer so that later use splits text "
                      "the same way (default: %(default)s; 'whitespace' for text that is already tokenised).")
    data.add_argument("--max-sentence-words", type=int, default=100,
                      help="lines with more words are cut into pieces of at most this many (default: %(default)s).")
    data.add_argument("--shuffle-window", type=int, default=100_000,
                      help="sentences read and shuffled together; the memory held by the data stream "
                      "(default: %(default)s).")
    data.add_argument("--no-group-by-length", action="store_true",
                      help="do not batch sentences of similar length together inside a shuffle window (grouping "
                      "saves padding; batches are still shuffled).")

    vocab = parser.add_argument_group("word vocabulary (the softmax targets)")
    vocab.add_argument("--vocab", default=None,
                       help="bilm-tf vocabulary file: one word per line, <S> </S> <UNK> first, most frequent first.")
    vocab.add_argument("--build-vocab", action="store_true",
                       help="count the words of --train-files and write OUTPUT_DIR/vocab.txt (bilm-tf's format).")
    vocab.add_argument("--min-count", type=int, default=1,
                       help="with --build-vocab: keep words seen at least this often (default: %(default)s).")
    vocab.add_argument("--max-vocab-size", type=int, default=None,
                       help="with --build-vocab: keep at most this many entries, <S> </S> <UNK> included.")

    model = parser.add_argument_group("model")
    source = model.add_mutually_exclusive_group(required=True)
    source.add_argument("--config", default=None,
                        help=f"a new model: a preset ({', '.join(sorted(ELMO_PRESETS))}), a config.json, a model "
                        "folder (its config only) or a bilm-tf options.json.")
    source.add_argument("--init-from", default=None, metavar="FOLDER",
                        help="start from this model's biLM (a converted bilm-tf model or any hf_elmo folder; domain "
                        "adaptation) with a fresh softmax. Its vocab.txt is used if no --vocab/--build-vocab.")
    model.add_argument("--num-softmax-samples", type=int, default=8192,
                       help="negatives of the sampled softmax in training; 0 = full softmax (the full softmax is also "
                       "used when the vocabulary is not larger; default: %(default)s).")
    model.add_argument("--dropout", type=float, default=0.1,
                       help="dropout on the top biLM layer before the softmax (default: %(default)s).")

    train = parser.add_argument_group("training")
    train.add_argument("--output-dir", required=True,
                       help="where the final model, checkpoints, logs and vocab.txt go; must be new unless --resume.")
    train.add_argument("--resume", action="store_true",
                       help="continue from the latest checkpoint in OUTPUT_DIR (start afresh if there is none); the "
                       "other options must be the ones of the original run.")
    train.add_argument("--max-steps", type=int, required=True, help="optimizer steps to train for, in total.")
    train.add_argument("--batch-size", type=int, default=64,
                       help="sentences per batch per process (default: %(default)s).")
    train.add_argument("--gradient-accumulation-steps", type=int, default=1,
                       help="batches per process summed into one optimizer step (default: %(default)s).")
    train.add_argument("--optimizer", choices=("adagrad", "adamw"), default="adagrad",
                       help="adagrad as bilm-tf (default), or adamw.")
    train.add_argument("--learning-rate", type=float, default=None,
                       help="default: 0.2 for adagrad (bilm-tf), 1e-3 for adamw.")
    train.add_argument("--adagrad-initial-accumulator", type=float, default=1.0,
                       help="Adagrad's initial accumulator value (default: %(default)s, as bilm-tf).")
    train.add_argument("--weight-decay", type=float, default=0.0, help="adamw only (default: %(default)s).")
    train.add_argument("--lr-scheduler", choices=LR_SCHEDULERS, default="constant",
                       help="learning-rate schedule over --max-steps (default: %(default)s, as bilm-tf).")
    train.add_argument("--warmup-steps", type=int, default=0,
                       help="steps of linear learning-rate warm-up for the *_with_warmup, linear, cosine, ... "
                       "schedules (default: %(default)s).")
    train.add_argument("--max-grad-norm", type=float, default=10.0,
                       help="clip the global gradient norm to this (default: %(default)s, as bilm-tf; 0 = off).")
    train.add_argument("--mixed-precision", choices=("no", "bf16", "fp16"), default=None,
                       help="default: what `accelerate launch`/`accelerate config` says, else no.")
    train.add_argument("--seed", type=int, default=42,
                       help="seeds initialisation, data order, dropout and negatives (default: %(default)s).")

    report = parser.add_argument_group("logging, evaluation, checkpoints")
    report.add_argument("--logging-steps", type=int, default=50,
                        help="log losses, learning rate, gradient norm and tokens/s every this many steps.")
    report.add_argument("--eval-steps", type=int, default=1000,
                        help="evaluate on --eval-file every this many steps, and at the start and end.")
    report.add_argument("--eval-batch-size", type=int, default=64, help="sentences per evaluation batch.")
    report.add_argument("--eval-max-sentences", type=int, default=None,
                        help="evaluate on the first this many sentences of --eval-file only.")
    report.add_argument("--save-steps", type=int, default=1000, help="write a checkpoint every this many steps.")
    report.add_argument("--save-total-limit", type=int, default=2,
                        help="keep this many most recent checkpoints (default: %(default)s).")
    report.add_argument("--report-to", default="tensorboard",
                        help="Accelerate tracker(s) for the metrics: tensorboard (default), wandb, ..., all, none.")
    return parser


def check_args(args, parser) -> None:
    for name in ("max_steps", "batch_size", "gradient_accumulation_steps", "logging_steps", "eval_steps",
                 "save_steps", "eval_batch_size", "max_sentence_words", "shuffle_window", "save_total_limit",
                 "min_count"):
        if getattr(args, name) < 1:
            parser.error(f"--{name.replace('_', '-')} must be >= 1, got {getattr(args, name)}")
    if args.vocab and args.build_vocab:
        parser.error("--vocab and --build-vocab are exclusive: use a vocabulary file, or build one")
    if args.num_softmax_samples < 0 or args.warmup_steps < 0 or args.max_grad_norm < 0:
        parser.error("--num-softmax-samples, --warmup-steps and --max-grad-norm must be >= 0")
    if not 0 <= args.dropout < 1:
        parser.error(f"--dropout must be in [0, 1), got {args.dropout}")
    if args.learning_rate is None:
        args.learning_rate = DEFAULT_LEARNING_RATES[args.optimizer]
    if args.report_to == "tensorboard":
        from accelerate.utils import is_tensorboard_available

        if not is_tensorboard_available():
            parser.error("--report-to tensorboard needs the tensorboard package: pip install tensorboard "
                         "(or hf-elmo[pretraining]); or pass --report-to none")


def main(argv=None) -> int:
    """Entry point of `hf-elmo-pretrain`, `hf-elmo pretrain` and `python -m hf_elmo.pretraining`."""
    parser = build_parser()
    args = parser.parse_args(argv)
    check_args(args, parser)
    logging.basicConfig(format="%(asctime)s %(levelname)s %(name)s: %(message)s", level=logging.INFO)
    from .bilm_tf import BilmTfFormatError
    from .pretraining_data import CorpusError

    try:
        train(args)
    except (CorpusError, BilmTfFormatError, FileNotFoundError, FileExistsError, TrainingDiverged) as error:
        logger.error("%s", error)
        return 1
    return 0


# ---------------------------------------------------------------------------------------------------------------
# Setup
# ---------------------------------------------------------------------------------------------------------------
def latest_checkpoint(output_dir: str) -> str | None:
    """The complete checkpoint with the highest step (a `.partial` folder is an interrupted save and never used)."""
    if not os.path.isdir(output_dir):
        return None
    steps = [int(m.group(1)) for name in os.listdir(output_dir) if (m := CHECKPOINT_PATTERN.match(name))]
    return os.path.join(output_dir, f"checkpoint-{max(steps)}") if steps else None


def load_config(source: str):
    from . import bilm_tf
    from .configuration_elmo import ELMO_PRESETS, ElmoConfig

    if source in ELMO_PRESETS:
        return ElmoConfig.from_preset(source)
    path = os.path.join(source, "config.json") if os.path.isdir(source) else source
    if not os.path.isfile(path):
        raise FileNotFoundError(f"--config: {source!r} is neither a preset ({sorted(ELMO_PRESETS)}) nor a config file.")
    options = bilm_tf.read_options(path)
    if "char_cnn" in options:  # a bilm-tf options.json
        return bilm_tf.config_from_options(options, source=path)
    return ElmoConfig.from_json_file(path)


def resolve_vocab(args, accelerator, split_words, files) -> str:
    """The vocabulary file of this run, always kept as OUTPUT_DIR/vocab.txt so that `--resume` finds it."""
    from .pretraining_data import build_vocab, count_words, write_vocab

    kept = os.path.join(args.output_dir, "vocab.txt")
    if args.resume and os.path.isfile(kept) and latest_checkpoint(args.output_dir):
        return kept
    if args.vocab:
        if not os.path.isfile(args.vocab):
            raise FileNotFoundError(f"--vocab: {args.vocab} does not exist.")
        source = args.vocab
    elif args.build_vocab:
        source = None
    elif args.init_from and os.path.isfile(os.path.join(args.init_from, "vocab.txt")):
        source = os.path.join(args.init_from, "vocab.txt")
    else:
        raise FileNotFoundError(
            "no word vocabulary: pass --vocab FILE (bilm-tf format: one word per line, <S> </S> <UNK> first, most "
            "frequent first) or --build-vocab to count the words of --train-files"
            + (f" ({args.init_from} has no vocab.txt)." if args.init_from else ".")
        )
    if accelerator.is_main_process:
        if source is None:
            logger.info("Counting the words of %d training file(s) for the vocabulary", len(files))
            counts = count_words(files, split_words)
            words = build_vocab(counts, min_count=args.min_count, max_size=args.max_vocab_size)
            write_vocab(words, kept)
            logger.info("Wrote %s: %d entries (%d distinct words in the corpus)", kept, len(words), len(counts))
        elif os.path.abspath(source) != os.path.abspath(kept):
            shutil.copyfile(source, kept)
    accelerator.wait_for_everyone()
    return kept


def load_encoder(args):
    """The architecture (a config dict) of the model to train, and the biLM to start from with --init-from."""
    from .modeling_elmo import ElmoModel

    encoder = None
    if args.init_from:
        if not os.path.isfile(os.path.join(args.init_from, "config.json")):
            raise FileNotFoundError(f"--init-from: {args.init_from} is not a saved model folder (no config.json).")
        encoder = ElmoModel.from_pretrained(args.init_from)
        base = encoder.config.to_dict()
    else:
        base = load_config(args.config).to_dict()
    for key in ("architectures", "auto_map", "transformers_version", "_name_or_path", "model_type"):
        base.pop(key, None)
    return base, encoder


def build_model(args, base: dict, encoder, tokenizer):
    from .configuration_elmo import ElmoConfig
    from .modeling_elmo import ElmoForPreTraining

    config = ElmoConfig(
        **{
            **base,
            "vocab_size": tokenizer.word_vocab_size,
            "bos_word_id": tokenizer.bos_word_index,
            "eos_word_id": tokenizer.eos_word_index,
            "num_softmax_samples": args.num_softmax_samples,
            "lm_dropout": args.dropout,
        }
    )
    model = ElmoForPreTraining(config)
    if encoder is not None:
        model.elmo.load_state_dict(encoder.state_dict())
        logger.info("Initialised the biLM from %s; the softmax is new", args.init_from)
    return model


def build_optimizer(args, model):
    from transformers import get_scheduler

    if args.optimizer == "adagrad":
        optimizer = torch.optim.Adagrad(
            model.parameters(), lr=args.learning_rate, initial_accumulator_value=args.adagrad_initial_accumulator
        )
    else:
        optimizer = torch.optim.AdamW(model.parameters(), lr=args.learning_rate, weight_decay=args.weight_decay)
    scheduler = get_scheduler(
        args.lr_scheduler, optimizer, num_warmup_steps=args.warmup_steps, num_training_steps=args.max_steps
    )
    return optimizer, scheduler


def prepare_output_dir(args, accelerator) -> str | None:
    """Returns the checkpoint to resume from, if any; refuses to train over an earlier run unless resuming."""
    checkpoint = latest_checkpoint(args.output_dir)
    earlier = [name for name in ("training_args.json", "config.json") if os.path.exists(os.path.join(args.output_dir, name))]
    if (checkpoint or earlier) and not args.resume:
        raise FileExistsError(
            f"{args.output_dir} already holds a run ({os.path.basename(checkpoint or earlier[0])}); pass --resume to "
            "continue it, or choose another --output-dir."
        )
    if args.resume and checkpoint is None:
        logger.warning("--resume: no checkpoint in %s yet, starting from step 0", args.output_dir)
    if accelerator.is_main_process:
        os.makedirs(args.output_dir, exist_ok=True)
    accelerator.wait_for_everyone()
    return checkpoint


def tracker_config(args, accelerator) -> dict:
    values = {**vars(args), "num_processes": accelerator.num_processes, "batching": "sentences"}
    return {k: v if isinstance(v, (int, float, str, bool)) else json.dumps(v) for k, v in values.items()}


# ---------------------------------------------------------------------------------------------------------------
# Training
# ---------------------------------------------------------------------------------------------------------------
def train(args) -> dict:
    from accelerate import Accelerator
    from accelerate.utils import ProjectConfiguration, gather_object, set_seed
    from tqdm.auto import tqdm

    from .pretraining_data import CorpusError, SentenceBatchStream, read_eval_sentences, resolve_shards
    from .tokenization_elmo import ElmoTokenizer

    accelerator = Accelerator(
        mixed_precision=args.mixed_precision,
        gradient_accumulation_steps=args.gradient_accumulation_steps,
        log_with=None if args.report_to == "none" else args.report_to,
        project_config=ProjectConfiguration(
            project_dir=args.output_dir, logging_dir=os.path.join(args.output_dir, "logs")
        ),
    )
    main_process = accelerator.is_main_process
    if not main_process:  # one process reports progress; warnings and errors still come from all
        logging.getLogger("hf_elmo").setLevel(logging.WARNING)
    logger.info(
        "World size %d (%s), device %s, mixed precision %s", accelerator.num_processes,
        accelerator.distributed_type.value, accelerator.device, accelerator.mixed_precision,
    )
    resume_from = prepare_output_dir(args, accelerator)
    set_seed(args.seed, device_specific=True)

    files = resolve_shards(args.train_files)
    splitter = ElmoTokenizer(pre_tokenizer=args.pre_tokenizer)
    split_words = splitter.tokenize
    vocab_file = resolve_vocab(args, accelerator, split_words, files)
    base, encoder = load_encoder(args)
    tokenizer = ElmoTokenizer(
        vocab_file=vocab_file, pre_tokenizer=args.pre_tokenizer,
        max_characters_per_token=base["max_characters_per_token"],
    )
    model = build_model(args, base, encoder, tokenizer)
    del encoder
    sampled = model.config.num_softmax_samples and model.config.num_softmax_samples < model.config.vocab_size
    logger.info(
        "Model: %d parameters, vocabulary %d words, %s softmax in training; %d training file(s)",
        model.num_parameters(), model.config.vocab_size,
        f"sampled ({model.config.num_softmax_samples} negatives)" if sampled else "full", len(files),
    )

    eval_batches = []
    if args.eval_file:
        from .pretraining_data import make_batch

        eval_files = resolve_shards(args.eval_file, what="--eval-file")
        if len(eval_files) != 1:
            raise CorpusError(f"--eval-file must name one file; {args.eval_file!r} matches {len(eval_files)}.")
        eval_sentences, empty = read_eval_sentences(
            eval_files[0], split_words, args.max_sentence_words, args.eval_max_sentences
        )
        if empty:
            logger.info("--eval-file: skipped %d empty line(s)", empty)
        eval_sentences.sort(key=len)
        chunks = [eval_sentences[i : i + args.eval_batch_size] for i in range(0, len(eval_sentences), args.eval_batch_size)]
        eval_batches = [make_batch(tokenizer, chunk) for chunk in chunks[accelerator.process_index :: accelerator.num_processes]]

    stream = SentenceBatchStream(
        files, split_words, args.batch_size, args.seed, rank=accelerator.process_index,
        world_size=accelerator.num_processes, shuffle_window=args.shuffle_window, max_words=args.max_sentence_words,
        group_by_length=not args.no_group_by_length,
    )
    optimizer, scheduler = build_optimizer(args, model)
    model, optimizer = accelerator.prepare(model, optimizer)
    progress = TrainingProgress()
    # The learning-rate schedule is stepped by hand once per optimizer step (Accelerate would step it once per
    # process), so it is checkpointed as a plain object.
    for state_object in (stream, scheduler, progress):
        accelerator.register_for_checkpointing(state_object)
    if resume_from:
        accelerator.load_state(resume_from)
        logger.info("Resumed from %s: step %d, epoch %d", resume_from, progress.step, stream.epoch)
        _apply_new_learning_rate(scheduler, args.learning_rate)
    elif main_process:
        with open(os.path.join(args.output_dir, "training_args.json"), "w", encoding="utf-8") as f:
            json.dump({**vars(args), "batching": "sentences", "num_processes": accelerator.num_processes}, f, indent=2)
    accelerator.init_trackers("elmo-pretraining", config=tracker_config(args, accelerator))

    def evaluate() -> dict:
        scores = _evaluate(accelerator, model, eval_batches)
        accelerator.log(scores, step=progress.step)
        logger.info(
            "step %d: held-out perplexity forward %.2f, backward %.2f", progress.step,
            scores["eval/forward_perplexity"], scores["eval/backward_perplexity"],
        )
        return scores

    def save_checkpoint() -> str:
        path = _save_checkpoint(accelerator, args.output_dir, progress.step, args.save_total_limit)
        logger.info("Saved checkpoint %s", path)
        return path

    scores = {}
    # Every process evaluates (a collective), also one whose share of the held-out batches is empty.
    evaluating = bool(args.eval_file)
    if evaluating and progress.step == 0:
        scores = evaluate()

    # Shown by the main process on a terminal (None: tqdm hides it when the output is not a TTY, or TQDM_DISABLE=1).
    bar = tqdm(
        total=args.max_steps, initial=progress.step, desc="pretraining", unit="step",
        disable=None if main_process else True,
    )
    model.train()
    window = torch.zeros(5, dtype=torch.float64)  # loss, forward, backward, micro-batches, tokens
    window_start, last_epoch = time.perf_counter(), stream.epoch
    while progress.step < args.max_steps:
        micro_losses = []
        for _ in range(args.gradient_accumulation_steps):
            batch = _make_device_batch(tokenizer, stream.next_batch(), accelerator.device)
            with accelerator.accumulate(model):
                outputs = model(**batch)
                accelerator.backward(outputs.loss)
            tokens = int(batch["attention_mask"].sum()) + batch["attention_mask"].shape[0]
            losses = torch.stack([outputs.loss, outputs.forward_loss, outputs.backward_loss]).detach().double().cpu()
            micro_losses.append(float(losses[0]))
            window += torch.cat([losses, torch.tensor([1.0, tokens], dtype=torch.float64)])
        assert accelerator.sync_gradients, "gradient accumulation went out of step"
        grad_norm = accelerator.clip_grad_norm_(model.parameters(), args.max_grad_norm or float("inf"))
        if not math.isfinite(float(grad_norm)):
            path = save_checkpoint()
            raise TrainingDiverged(
                f"step {progress.step + 1}: the gradient norm is {float(grad_norm)} (this process's micro-batch losses: "
                f"{micro_losses}); training stopped. {path} holds the model and optimizer from before this step, with "
                "the data position after the offending batch(es): --resume continues past them (with a new "
                "--learning-rate if given). If the weights had already gone bad, resume from an earlier checkpoint "
                "(remove the later ones). Also try a lower --max-grad-norm, or --mixed-precision no."
            )
        optimizer.step()
        scheduler.step()
        optimizer.zero_grad()
        progress.step += 1
        bar.update(1)

        if progress.step % args.logging_steps == 0 or progress.step % args.save_steps == 0 or (
            progress.step == args.max_steps
        ):
            totals = accelerator.reduce(window.to(accelerator.device), reduction="sum").cpu()
            elapsed = time.perf_counter() - window_start
            progress.tokens += int(totals[4])
            n = float(totals[3])
            metrics = {
                "train/loss": float(totals[0]) / n,
                "train/forward_loss": float(totals[1]) / n,
                "train/backward_loss": float(totals[2]) / n,
                "train/learning_rate": scheduler.get_last_lr()[0],
                "train/grad_norm": float(grad_norm),
                "train/tokens_per_second": float(totals[4]) / elapsed,
                "train/tokens_seen": progress.tokens,
                "data/epoch": stream.epoch,
                "data/empty_lines_skipped": stream.stats.empty_lines_skipped,
                "data/long_lines_split": stream.stats.long_lines_split,
            }
            accelerator.log(metrics, step=progress.step)
            bar.set_postfix(loss=f"{metrics['train/loss']:.3f}", tok_s=f"{metrics['train/tokens_per_second']:.0f}")
            logger.info(
                "step %d: loss %.4f (forward %.4f, backward %.4f), lr %.3g, grad norm %.3g, %.0f tokens/s",
                progress.step, metrics["train/loss"], metrics["train/forward_loss"], metrics["train/backward_loss"],
                metrics["train/learning_rate"], metrics["train/grad_norm"], metrics["train/tokens_per_second"],
            )
            window.zero_()
            window_start = time.perf_counter()
        if stream.epoch != last_epoch:
            logger.info(
                "Finished epoch %d: %d sentences so far; skipped %d empty line(s), cut %d line(s) longer than %d "
                "words", last_epoch, stream.stats.sentences, stream.stats.empty_lines_skipped,
                stream.stats.long_lines_split, args.max_sentence_words,
            )
            last_epoch = stream.epoch
        if evaluating and (progress.step % args.eval_steps == 0 or progress.step == args.max_steps):
            scores = evaluate()
        if progress.step % args.save_steps == 0 or progress.step == args.max_steps:
            save_checkpoint()  # also at the end, so that a finished run can be extended with --resume
    bar.close()

    if evaluating and not scores:
        scores = evaluate()  # resumed at the very end
    _check_replicas_agree(accelerator, model, gather_object)
    unwrapped = accelerator.unwrap_model(model)
    state_dict = accelerator.get_state_dict(model)
    if main_process:
        unwrapped.save_pretrained(args.output_dir, state_dict=state_dict, save_function=accelerator.save)
        tokenizer.save_pretrained(args.output_dir)
        with open(os.path.join(args.output_dir, "eval_results.json"), "w", encoding="utf-8") as f:
            json.dump({"step": progress.step, "tokens_seen": progress.tokens, **scores}, f, indent=2)
        logger.info("Saved the final model to %s", args.output_dir)
    accelerator.wait_for_everyone()
    accelerator.end_training()
    return scores


def _apply_new_learning_rate(scheduler, learning_rate: float) -> None:
    """The checkpoint restores the learning rate it was saved with; a different --learning-rate on resume wins (how
    a diverged run is continued)."""
    if all(base == learning_rate for base in scheduler.base_lrs):
        return
    logger.warning("--learning-rate %g replaces the checkpoint's %g", learning_rate, scheduler.base_lrs[0])
    scheduler.base_lrs = [learning_rate] * len(scheduler.base_lrs)
    for group, factor in zip(scheduler.optimizer.param_groups, scheduler.lr_lambdas):
        group["initial_lr"] = learning_rate
        group["lr"] = learning_rate * factor(scheduler.last_epoch)
    scheduler._last_lr = [group["lr"] for group in scheduler.optimizer.param_groups]


def _make_device_batch(tokenizer, sentences, device) -> dict:
    from .pretraining_data import make_batch

    return {key: value.to(device) for key, value in make_batch(tokenizer, sentences).items()}


def _evaluate(accelerator, model, eval_batches) -> dict:
    """Full-softmax forward/backward perplexity over the held-out batches (each process has its share)."""
    unwrapped = accelerator.unwrap_model(model)
    was_training = unwrapped.training
    unwrapped.eval()
    sums = torch.zeros(3, dtype=torch.float64, device=accelerator.device)  # forward nll, backward nll, predictions
    with torch.no_grad(), accelerator.autocast():
        for batch in eval_batches:
            outputs = unwrapped(**{key: value.to(accelerator.device) for key, value in batch.items()})
            n = outputs.num_predictions.double()
            sums += torch.stack([outputs.forward_loss.double() * n, outputs.backward_loss.double() * n, n])
    unwrapped.train(was_training)
    forward, backward, count = accelerator.reduce(sums, reduction="sum").tolist()
    return {
        "eval/forward_perplexity": math.exp(forward / count),
        "eval/backward_perplexity": math.exp(backward / count),
        "eval/perplexity": math.exp((forward + backward) / (2 * count)),
        "eval/forward_loss": forward / count,
        "eval/backward_loss": backward / count,
    }


def _save_checkpoint(accelerator, output_dir: str, step: int, keep: int) -> str:
    """`accelerator.save_state` into a staging folder renamed into place, so a killed save never looks complete."""
    final = os.path.join(output_dir, f"checkpoint-{step}")
    staging = final + ".partial"
    if accelerator.is_main_process and os.path.exists(staging):
        shutil.rmtree(staging)
    accelerator.wait_for_everyone()
    accelerator.save_state(staging)
    accelerator.wait_for_everyone()
    if accelerator.is_main_process:
        if os.path.exists(final):
            shutil.rmtree(final)
        os.replace(staging, final)
        steps = sorted(int(m.group(1)) for name in os.listdir(output_dir) if (m := CHECKPOINT_PATTERN.match(name)))
        for old in steps[:-keep]:
            shutil.rmtree(os.path.join(output_dir, f"checkpoint-{old}"), ignore_errors=True)
    accelerator.wait_for_everyone()
    return final


def _check_replicas_agree(accelerator, model, gather_object) -> None:
    """Data-parallel replicas must end with bit-identical weights; a mismatch means the run is broken."""
    from accelerate.utils import DistributedType

    if accelerator.distributed_type not in (DistributedType.NO, DistributedType.MULTI_CPU, DistributedType.MULTI_GPU):
        return  # sharded (FSDP/DeepSpeed): no process holds all the weights
    digest = hashlib.sha256()
    for name, tensor in sorted(accelerator.unwrap_model(model).state_dict().items()):
        digest.update(name.encode())
        digest.update(tensor.detach().float().cpu().numpy().tobytes())
    digests = gather_object([digest.hexdigest()])
    if len(set(digests)) != 1:
        raise RuntimeError(f"the {len(digests)} processes ended with different weights (sha256 {digests}).")
    logger.info("Weights identical on all %d process(es) (sha256 %s)", len(digests), digests[0][:16])


if __name__ == "__main__":
    sys.exit(main())
