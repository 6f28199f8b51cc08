"""The training loop of `hf-elmo pretrain`: Accelerate, bilm-tf's objective and recipe, checkpoints that resume
exactly. What the program does and its options are described in hf_elmo.pretraining_args (`hf-elmo pretrain
--help`), which holds the command line so that --help needs neither torch nor transformers.
"""

import dataclasses
import hashlib
import json
import logging
import math
import os
import pickle
import random
import re
import shutil
import sys
import time

import numpy as np
import torch

from .safe_output import OutputError, atomic_files_into, no_room_reported, remove_stale_file_staging, write_json_atomic


# Named explicitly: under `python -m hf_elmo.pretraining` __name__ is "__main__".
logger = logging.getLogger("hf_elmo.pretraining")

CHECKPOINT_PATTERN = re.compile(r"^checkpoint-(\d+)$")
# A checkpoint folder holds only data: the model as a Hugging Face folder (config.json, model.safetensors), the
# optimizer state as tensors and plain values (read back with `torch.load(weights_only=True)`), and JSON files
# for the rest. Nothing in it is ever unpickled, since checkpoints travel between machines and people.
OPTIMIZER_FILE = "optimizer.bin"
TRAINING_STATE_FILE = "training_state.json"
# Every logged metric, one JSON object a line ({"step": N, "train/loss": ..., ...}); a resumed run appends to it.
METRICS_FILE = "metrics.jsonl"
RNG_STATE_FILE = "rng_state_{rank}.json"
CHECKPOINT_FORMAT = "hf_elmo.pretraining checkpoint"
CHECKPOINT_VERSION = 1
# Written by Transformers or the run itself, not a property of the model.
CONFIG_KEYS_NOT_COMPARED = {"transformers_version", "_name_or_path", "architectures", "auto_map", "dtype", "torch_dtype"}
# Batches are padded to a multiple of this many words: a few shapes per run, for compiled code and the allocator.
LENGTH_BUCKET = 8


class TrainingDiverged(RuntimeError):
    """The loss or its gradient stopped being finite."""


class CheckpointError(ValueError):
    """A checkpoint that cannot be resumed by this run, with the reason."""


class DataPipelineError(RuntimeError):
    """The DataLoader workers stopped delivering batches."""


def _latest_intact(output_dir: str) -> str:
    """What `--resume` would continue from, in words, for error messages that stop a run."""
    checkpoint = latest_checkpoint(output_dir)
    if checkpoint is None:
        return "No checkpoint was written yet."
    return f"{checkpoint} is intact: --resume continues from it."


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
# Command line (the options themselves: hf_elmo.pretraining_args)
# ---------------------------------------------------------------------------------------------------------------
# The errors a run reports in one line (hf_elmo.cli's wrapper reports them; BilmTfFormatError, the corpus's
# CorpusError and OSErrors are reported there too).
RUN_ERRORS = (TrainingDiverged, CheckpointError, DataPipelineError)


def run(args) -> int:
    """
    Train with the parsed options (`pretraining_args.parse_args`). `hf-elmo pretrain` is the one way in: its error
    wrapper turns the failures into one line. A run that fails before its first checkpoint leaves nothing behind.
    """
    logging.basicConfig(format="%(asctime)s %(levelname)s %(name)s: %(message)s", level=logging.INFO)
    created = not os.path.lexists(args.output_dir)
    try:
        train(args)
    except OutputError as error:  # a write that failed (a full disk): say what --resume would take
        _remove_if_nothing_to_resume(args.output_dir, created)
        raise OutputError(f"{error} {_latest_intact(args.output_dir)}") from None
    except BaseException:
        _remove_if_nothing_to_resume(args.output_dir, created)
        raise
    return 0


def _remove_if_nothing_to_resume(output_dir: str, created: bool) -> None:
    if created and latest_checkpoint(output_dir) is None:
        # No stray vocab.txt or logs: the folder this run created goes.
        shutil.rmtree(output_dir, ignore_errors=True)


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
    from .pretraining_data import count_words
    from .safe_output import atomic_output_file
    from .vocabulary import build_vocab, write_vocab

    kept = os.path.join(args.output_dir, "vocab.txt")
    if args.resume and os.path.isfile(kept) and latest_checkpoint(args.output_dir):
        if args.vocab:
            from .tokenization_elmo import ElmoTokenizer

            if not os.path.isfile(args.vocab):
                raise FileNotFoundError(f"--vocab: {args.vocab} does not exist.")
            if ElmoTokenizer(vocab_file=args.vocab).word_vocab != ElmoTokenizer(vocab_file=kept).word_vocab:
                raise CheckpointError(
                    f"--resume: --vocab {args.vocab} is not the vocabulary of the run being resumed ({kept}); the "
                    "softmax rows would mean other words. Pass the original --vocab (or none)."
                )
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
            with atomic_output_file(kept) as partial:
                shutil.copyfile(source, partial)
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
        remove_stale_file_staging(args.output_dir)  # left by a run killed while saving its final model
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
    from accelerate.utils import DistributedType, ProjectConfiguration, gather_object, set_seed
    from tqdm.auto import tqdm

    from .threads import set_threads
    from .pretraining_data import (
        BatchEncoder,
        CorpusError,
        PretrainingBatches,
        SentenceBatchStream,
        WordSplitter,
        read_eval_sentences,
        resolve_shards,
    )
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
    if accelerator.distributed_type in (DistributedType.FSDP, DistributedType.DEEPSPEED, DistributedType.MEGATRON_LM):
        raise CheckpointError(
            f"{accelerator.distributed_type.value}: hf-elmo pretrain checkpoints hold the whole model and optimizer "
            "on every process (single process or data parallel, `accelerate launch --multi_gpu`); sharded training "
            "(FSDP, DeepSpeed) is not supported."
        )
    resume_from = prepare_output_dir(args, accelerator)
    set_seed(args.seed, device_specific=True)
    set_threads(args.threads)

    split_words = WordSplitter(args.pre_tokenizer)
    files = resolve_shards(args.train_files, split_words=split_words)
    base, encoder = load_encoder(args)  # first: a bad --init-from or --config stops the run before anything is written
    vocab_file = resolve_vocab(args, accelerator, split_words, files)
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
    batch_encoder = BatchEncoder.from_tokenizer(tokenizer, pad_to_multiple_of=LENGTH_BUCKET)

    eval_batches = []
    if args.eval_file:
        eval_files = resolve_shards(args.eval_file, what="--eval-file", split_words=split_words)
        if len(eval_files) != 1:
            raise CorpusError(f"--eval-file must name one file; {args.eval_file!r} matches {len(eval_files)}.")
        eval_sentences, empty = read_eval_sentences(
            eval_files[0], split_words, args.max_sentence_words, args.eval_max_sentences
        )
        if empty:
            logger.info("--eval-file: skipped %d empty line(s)", empty)
        eval_sentences.sort(key=len)
        chunks = [eval_sentences[i : i + args.eval_batch_size] for i in range(0, len(eval_sentences), args.eval_batch_size)]
        for chunk in chunks[accelerator.process_index :: accelerator.num_processes]:
            batch = batch_encoder(chunk)
            del batch["num_tokens"]
            eval_batches.append(batch)

    stream_settings = dict(
        files=files, split_words=split_words, batch_size=args.batch_size, seed=args.seed,
        rank=accelerator.process_index, world_size=accelerator.num_processes, shuffle_window=args.shuffle_window,
        max_words=args.max_sentence_words, group_by_length=not args.no_group_by_length,
    )
    # This one reads nothing: it holds the position of the batches the model has used (the DataLoader reads ahead).
    stream = SentenceBatchStream(**stream_settings)
    optimizer, scheduler = build_optimizer(args, model)
    progress = TrainingProgress()
    vocab_digest = _word_list_digest(tokenizer.word_vocab)
    checkpoint_state = None
    if resume_from:
        checkpoint_state = _read_checkpoint(resume_from, args, model, vocab_digest)
    model, optimizer = accelerator.prepare(model, optimizer)
    if resume_from:
        _load_optimizer(optimizer, resume_from)
        scheduler.load_state_dict(checkpoint_state["scheduler"])
        progress.load_state_dict(checkpoint_state["progress"])
        stream.load_state_dict(checkpoint_state["stream"])
        logger.info("Resumed from %s: step %d, epoch %d", resume_from, progress.step, stream.epoch)
        _apply_new_learning_rate(scheduler, args.learning_rate)
    elif main_process:
        write_json_atomic(
            os.path.join(args.output_dir, "training_args.json"),
            {**vars(args), "batching": "sentences", "num_processes": accelerator.num_processes},
        )
    accelerator.init_trackers("elmo-pretraining", config=tracker_config(args, accelerator))
    metrics_file = os.path.join(args.output_dir, METRICS_FILE)

    def log_metrics(values: dict) -> None:
        """To the trackers, and one JSON line in OUTPUT_DIR/metrics.jsonl (readable without any tracker)."""
        accelerator.log(values, step=progress.step)
        if main_process:
            with open(metrics_file, "a", encoding="utf-8") as handle:
                handle.write(json.dumps({"step": progress.step, **values}) + "\n")

    def evaluate() -> dict:
        scores = _evaluate(accelerator, model, eval_batches)
        log_metrics(scores)
        logger.info(
            "step %d: held-out perplexity forward %.2f, backward %.2f", progress.step,
            scores["eval/forward_perplexity"], scores["eval/backward_perplexity"],
        )
        return scores

    def save_checkpoint() -> str:
        training_state = {
            "format": CHECKPOINT_FORMAT, "version": CHECKPOINT_VERSION, "progress": progress.state_dict(),
            "stream": stream.state_dict(), "scheduler": scheduler.state_dict(), "optimizer": args.optimizer,
            "vocab_sha256": vocab_digest, "num_processes": accelerator.num_processes,
        }
        path = _save_checkpoint(accelerator, model, optimizer, args.output_dir, progress.step, args.save_total_limit,
                                training_state)
        logger.info("Saved checkpoint %s", path)
        return path

    scores = {}
    # Every process evaluates (a collective), also one whose share of the held-out batches is empty.
    evaluating = bool(args.eval_file)
    if evaluating and progress.step == 0:
        scores = evaluate()

    # The batches are built in worker processes, ahead of the model. The loader gets a generator of its own:
    # starting it would otherwise draw from the global generator, and a resumed run would draw different negatives.
    loader = torch.utils.data.DataLoader(
        PretrainingBatches(stream_settings, batch_encoder, start=stream.state_dict()), batch_size=None,
        num_workers=args.num_workers, prefetch_factor=4 if args.num_workers else None,
        timeout=args.data_timeout if args.num_workers else 0,
        pin_memory=accelerator.device.type == "cuda", generator=torch.Generator(),
    )
    batches = iter(loader)
    if checkpoint_state is not None:
        # Last, so that nothing between loading and the first batch draws from the restored generators.
        _set_rng_state(_read_json(os.path.join(resume_from, RNG_STATE_FILE.format(rank=accelerator.process_index))),
                       accelerator.device)

    def next_batch() -> tuple[dict, int]:
        try:
            item = next(batches)
        except RuntimeError as error:
            # A worker that cannot pass its batch through shared memory may neither deliver nor die.
            if "DataLoader timed out" not in str(error) and "exited unexpectedly" not in str(error):
                raise
            raise DataPipelineError(
                f"the {args.num_workers} DataLoader worker(s) delivered no batch "
                + (f"in {args.data_timeout:g} s" if "timed out" in str(error) else "(a worker died)")
                + ": a worker cannot hand its batches over through shared memory (a small /dev/shm, such as "
                "Docker's 64 MB default, or a file-size limit) or is stuck. Rerun with --num-workers 0, or give the "
                f"process more shared memory (docker run --shm-size 2g). {_latest_intact(args.output_dir)}"
            ) from None
        if "error" in item:
            raise CorpusError(item["error"])
        stream.set_position(item.pop("stream_position"))
        tokens = item.pop("num_tokens")
        return {key: value.to(accelerator.device, non_blocking=True) for key, value in item.items()}, tokens

    # Shown by the main process on a terminal (None: tqdm hides it when the output is not a TTY, or TQDM_DISABLE=1).
    bar = tqdm(
        total=args.max_steps, initial=progress.step, desc="pretraining", unit="step",
        disable=None if main_process else True,
    )
    model.train()
    # Losses stay on the device until a logging step: reading them every micro-batch would stall the device.
    window = torch.zeros(3, dtype=torch.float64, device=accelerator.device)  # loss, forward, backward
    window_batches, window_tokens = 0, 0
    window_start, last_epoch = time.perf_counter(), stream.epoch
    try:
        while progress.step < args.max_steps:
            micro_losses = []
            for _ in range(args.gradient_accumulation_steps):
                batch, tokens = next_batch()
                with accelerator.accumulate(model):
                    outputs = model(**batch)
                    # bilm-tf's gradient scale; the losses logged below stay the unscaled means.
                    accelerator.backward(outputs.loss * args.loss_scale)
                losses = torch.stack([outputs.loss, outputs.forward_loss, outputs.backward_loss]).detach().double()
                window += losses
                micro_losses.append(losses[0])
                window_batches, window_tokens = window_batches + 1, window_tokens + tokens
            assert accelerator.sync_gradients, "gradient accumulation went out of step"
            grad_norm = accelerator.clip_grad_norm_(model.parameters(), args.max_grad_norm or float("inf"))
            # One read per optimizer step (not per micro-batch): a non-finite update must be stopped before it is
            # applied, so that the checkpoint below holds the weights from before it (GradScaler reads too).
            grad_norm = float(grad_norm)
            if not math.isfinite(grad_norm):
                path = save_checkpoint()
                raise TrainingDiverged(
                    f"step {progress.step + 1}: the gradient norm is {grad_norm} (this process's micro-batch "
                    f"losses: {torch.stack(micro_losses).tolist()}); training stopped. {path} holds the model and "
                    "optimizer from before this step, with the data position after the offending batch(es): "
                    "--resume continues past them (with a new --learning-rate if given). If the weights had already "
                    "gone bad, resume from an earlier checkpoint (remove the later ones). Also try a lower "
                    "--max-grad-norm, or --mixed-precision no."
                )
            optimizer.step()
            scheduler.step()
            optimizer.zero_grad()
            progress.step += 1
            bar.update(1)

            if progress.step % args.logging_steps == 0 or progress.step % args.save_steps == 0 or (
                progress.step == args.max_steps
            ):
                counts = torch.tensor([window_batches, window_tokens], dtype=torch.float64, device=accelerator.device)
                totals = accelerator.reduce(torch.cat([window, counts]), reduction="sum").cpu()
                elapsed = time.perf_counter() - window_start
                progress.tokens += int(totals[4])
                n = float(totals[3])
                metrics = {
                    "train/loss": float(totals[0]) / n,
                    "train/forward_loss": float(totals[1]) / n,
                    "train/backward_loss": float(totals[2]) / n,
                    "train/learning_rate": scheduler.get_last_lr()[0],
                    "train/grad_norm": grad_norm,
                    "train/tokens_per_second": float(totals[4]) / elapsed,
                    "train/tokens_seen": progress.tokens,
                    "data/epoch": stream.epoch,
                    "data/empty_lines_skipped": stream.stats.empty_lines_skipped,
                    "data/long_lines_split": stream.stats.long_lines_split,
                }
                log_metrics(metrics)
                bar.set_postfix(loss=f"{metrics['train/loss']:.3f}", tok_s=f"{metrics['train/tokens_per_second']:.0f}")
                logger.info(
                    "step %d: loss %.4f (forward %.4f, backward %.4f), lr %.3g, grad norm %.3g, %.0f tokens/s",
                    progress.step, metrics["train/loss"], metrics["train/forward_loss"],
                    metrics["train/backward_loss"], metrics["train/learning_rate"], metrics["train/grad_norm"],
                    metrics["train/tokens_per_second"],
                )
                window.zero_()
                window_batches, window_tokens = 0, 0
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
    finally:
        del batches  # stops the workers
    bar.close()

    if evaluating and not scores:
        scores = evaluate()  # resumed at the very end
    _check_replicas_agree(accelerator, model, gather_object)
    unwrapped = accelerator.unwrap_model(model)
    state_dict = accelerator.get_state_dict(model)
    if main_process:
        _save_final(args.output_dir, unwrapped, state_dict, tokenizer,
                    {"step": progress.step, "tokens_seen": progress.tokens, **scores})
        logger.info("Saved the final model to %s", args.output_dir)
    accelerator.wait_for_everyone()
    accelerator.end_training()
    if torch.distributed.is_initialized():
        # Every process tears the process group down at the same point, before the DDP wrapper is freed: one whose
        # peers had already exited once waited forever in ProcessGroupGloo's destructor (a loaded 2-core machine).
        del model, optimizer, unwrapped
        accelerator.free_memory()
        torch.distributed.barrier()
        torch.distributed.destroy_process_group()
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


# ---------------------------------------------------------------------------------------------------------------
# Checkpoints: data only (safetensors, weights-only tensors, JSON); every file written whole or not at all
# ---------------------------------------------------------------------------------------------------------------
def _read_json(path: str) -> dict:
    try:
        with open(path, encoding="utf-8") as handle:
            return json.load(handle)
    except FileNotFoundError:
        raise CheckpointError(f"--resume: {path} is missing; the checkpoint is incomplete.") from None
    except (UnicodeDecodeError, json.JSONDecodeError) as error:
        raise CheckpointError(f"--resume: {path} is not valid JSON ({error}).") from None


def _word_list_digest(words: list[str]) -> str:
    return hashlib.sha256("\n".join(words).encode("utf-8", errors="surrogatepass")).hexdigest()


def _rng_state(device: torch.device) -> dict:
    """
    Every generator the training step may draw from, as JSON: the host's, and this process's GPU's when it trains
    on one (only its own: touching every visible GPU would open a CUDA context on each, or fail on a CPU run).
    """
    version, internal, gauss = random.getstate()
    kind, keys, pos, has_gauss, cached = np.random.get_state()
    state = {
        "python": [version, list(internal), gauss],
        "numpy": [kind, keys.tolist(), int(pos), int(has_gauss), float(cached)],
        "torch": torch.get_rng_state().numpy().tobytes().hex(),
    }
    if device.type == "cuda":
        state["cuda"] = torch.cuda.get_rng_state(device).numpy().tobytes().hex()
    return state


def _set_rng_state(state: dict, device: torch.device) -> None:
    try:
        version, internal, gauss = state["python"]
        random.setstate((version, tuple(internal), gauss))
        kind, keys, pos, has_gauss, cached = state["numpy"]
        np.random.set_state((kind, np.asarray(keys, dtype=np.uint32), pos, has_gauss, cached))
        torch.set_rng_state(torch.frombuffer(bytearray.fromhex(state["torch"]), dtype=torch.uint8))
        on_cuda = device.type == "cuda"
        if on_cuda and "cuda" in state:
            torch.cuda.set_rng_state(torch.frombuffer(bytearray.fromhex(state["cuda"]), dtype=torch.uint8), device)
        elif on_cuda or "cuda" in state:
            # Moving a run between a CPU and a GPU machine is allowed; it cannot repeat the original exactly.
            logger.warning("--resume: the checkpoint was written %s CUDA and this run has %s: the CUDA generator "
                           "starts afresh, so the run will not repeat an uninterrupted one exactly.",
                           "with" if "cuda" in state else "without", "it" if on_cuda else "none")
    except (KeyError, TypeError, ValueError, RuntimeError) as error:
        raise CheckpointError(f"--resume: the checkpoint's random generator state is not usable ({error}).") from None


def _read_checkpoint(checkpoint: str, args, model, vocab_digest: str) -> dict:
    """The checkpoint's training state, after checking that this run builds the same model; loads its weights."""
    from safetensors import SafetensorError
    from safetensors.torch import load_file

    from .configuration_elmo import ElmoConfig

    state_file = os.path.join(checkpoint, TRAINING_STATE_FILE)
    if not os.path.exists(state_file) and any(name.endswith(".pkl") for name in os.listdir(checkpoint)):
        raise CheckpointError(
            f"--resume: {checkpoint} was written by an earlier hf_elmo (Accelerate's pickle files, no "
            f"{TRAINING_STATE_FILE}); it is not loaded, since unpickling a file runs code from it. Start afresh in "
            "another --output-dir, or resume with the hf_elmo version that wrote it."
        )
    state = _read_json(state_file)
    if state.get("format") != CHECKPOINT_FORMAT or state.get("version") != CHECKPOINT_VERSION:
        raise CheckpointError(f"--resume: {state_file} is not a version {CHECKPOINT_VERSION} {CHECKPOINT_FORMAT}.")

    def comparable(config) -> dict:
        items = json.loads(config.to_json_string(use_diff=False))
        return {k: v for k, v in items.items() if k not in CONFIG_KEYS_NOT_COMPARED and not k.startswith("_")}

    try:
        saved = comparable(ElmoConfig.from_json_file(os.path.join(checkpoint, "config.json")))
    except (OSError, ValueError) as error:
        raise CheckpointError(f"--resume: {checkpoint}/config.json cannot be read ({error}).") from None
    current = comparable(model.config)
    changed = [key for key in sorted(set(saved) | set(current)) if saved.get(key) != current.get(key)]
    if changed:
        raise CheckpointError(
            f"--resume: {checkpoint} holds a model with "
            + ", ".join(f"{key}={saved.get(key)!r}" for key in changed)
            + "; this run would build one with "
            + ", ".join(f"{key}={current.get(key)!r}" for key in changed)
            + ". Resume with the options of the original run (--config or --init-from, --vocab, --dropout, "
            "--num-softmax-samples)."
        )
    if state["optimizer"] != args.optimizer:
        raise CheckpointError(
            f"--resume: {checkpoint} was trained with --optimizer {state['optimizer']}, this run asks for "
            f"{args.optimizer}; its optimizer state cannot be used. Resume with --optimizer {state['optimizer']}."
        )
    if state["vocab_sha256"] != vocab_digest:
        raise CheckpointError(
            f"--resume: the vocabulary ({os.path.join(args.output_dir, 'vocab.txt')}) is not the one {checkpoint} "
            "was trained with; the softmax rows would mean other words."
        )
    try:
        weights = load_file(os.path.join(checkpoint, "model.safetensors"))
    except (OSError, SafetensorError) as error:
        raise CheckpointError(f"--resume: {checkpoint}/model.safetensors cannot be read ({error}).") from None
    try:
        model.load_state_dict(weights, strict=True)
    except RuntimeError as error:
        raise CheckpointError(f"--resume: {checkpoint}/model.safetensors does not fit the model: "
                              f"{str(error).splitlines()[0]}") from None
    return state


def _load_optimizer(optimizer, checkpoint: str) -> None:
    path = os.path.join(checkpoint, OPTIMIZER_FILE)
    try:
        # Tensors and plain values only: a file that asks for anything else is refused, never executed.
        state = torch.load(path, map_location="cpu", weights_only=True)
    except FileNotFoundError:
        raise CheckpointError(f"--resume: {path} is missing; the checkpoint is incomplete.") from None
    except (pickle.UnpicklingError, RuntimeError, EOFError) as error:
        raise CheckpointError(
            f"--resume: {path} is not a plain tensor file ({str(error).splitlines()[0]}); refusing to load it."
        ) from None
    try:
        optimizer.load_state_dict(state)
    except (KeyError, ValueError, TypeError) as error:
        raise CheckpointError(f"--resume: {path} does not fit this optimizer ({error!r}).") from None


def _save_checkpoint(accelerator, model, optimizer, output_dir: str, step: int, keep: int, training_state: dict) -> str:
    """Write `checkpoint-STEP` into a staging folder renamed into place, so a killed save never looks complete."""
    final = os.path.join(output_dir, f"checkpoint-{step}")
    staging = final + ".partial"
    if accelerator.is_main_process:
        if os.path.exists(staging):
            shutil.rmtree(staging)
        os.makedirs(staging)
    accelerator.wait_for_everyone()
    state_dict = accelerator.get_state_dict(model)
    # A full disk shows as safetensors', torch's or our own error: one line, and no half checkpoint left.
    with no_room_reported(final, clean_up=lambda: shutil.rmtree(staging, ignore_errors=True)):
        if accelerator.is_main_process:
            # Data-parallel replicas hold the same model and optimizer state: one copy is written.
            accelerator.unwrap_model(model).save_pretrained(staging, state_dict=state_dict)
            torch.save(optimizer.state_dict(), os.path.join(staging, OPTIMIZER_FILE))
            write_json_atomic(os.path.join(staging, TRAINING_STATE_FILE), training_state, indent=1)
        # Generators differ between processes (seeded per process): each writes its own.
        rng_file = os.path.join(staging, RNG_STATE_FILE.format(rank=accelerator.process_index))
        write_json_atomic(rng_file, _rng_state(accelerator.device), indent=1)
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


def _save_final(output_dir: str, model, state_dict: dict, tokenizer, results: dict) -> None:
    """
    The final model, tokenizer and eval_results.json, each file moved into OUTPUT_DIR whole (`atomic_files_into`):
    a run killed while saving leaves no partial file there. The weights move after the config and before
    eval_results.json, so a folder with eval_results.json holds the whole model.
    """
    with atomic_files_into(output_dir, last=(".safetensors", ".safetensors.index.json", "eval_results.json")) as staging:
        model.save_pretrained(staging, state_dict=state_dict)
        tokenizer.save_pretrained(staging)
        write_json_atomic(os.path.join(staging, "eval_results.json"), results, indent=1)


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


if __name__ == "__main__":  # `python -m hf_elmo.pretraining`, an older way in: say where it went
    sys.exit("python -m hf_elmo.pretraining is gone: run `hf-elmo pretrain ARGS` (or `python -m hf_elmo.cli pretrain "
             "ARGS`, e.g. under accelerate launch).")
