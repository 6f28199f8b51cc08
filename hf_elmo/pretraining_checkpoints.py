"""The checkpoints of `hf-elmo pretrain`: what a run writes to resume exactly, and how it reads it back.

A checkpoint folder holds only data (safetensors, weights-only tensors, JSON), every file written whole or not at
all; one is never unpickled, since checkpoints travel between machines and people. The training loop
(`hf_elmo.pretraining`) decides when to save; this module decides what a checkpoint is.
"""

import glob
import hashlib
import json
import logging
import os
import pickle
import random
import re
import shutil

import numpy as np
import torch

from .cpu_tuning import keep_training_products_choice, training_products_choice
from .run_record import differences
from .safe_output import atomic_files_into, no_room_reported, remove_stale_file_staging, write_json_atomic


logger = logging.getLogger(__name__)

CHECKPOINT_PATTERN = re.compile(r"^checkpoint-(\d+)$")
# Beside the checkpoints: the run's options, written when it starts, and every logged metric, one JSON object a
# line ({"step": N, "train/loss": ..., ...}; a resumed run appends to it).
TRAINING_ARGS_FILE = "training_args.json"
METRICS_FILE = "metrics.jsonl"
# The model as a Hugging Face folder (config.json, model.safetensors), the optimizer state as tensors and plain
# values (read back with `torch.load(weights_only=True)`), and JSON files for the rest.
OPTIMIZER_FILE = "optimizer.bin"
TRAINING_STATE_FILE = "training_state.json"
RNG_STATE_FILE = "rng_state_{rank}.json"
CHECKPOINT_FORMAT = "hf_elmo.pretraining checkpoint"
CHECKPOINT_VERSION = 1
# Written by Transformers or the run itself, not a property of the model.
CONFIG_KEYS_NOT_COMPARED = {"transformers_version", "_name_or_path", "architectures", "auto_map", "dtype", "torch_dtype"}


class CheckpointError(ValueError):
    """A checkpoint that cannot be resumed by this run, with the reason."""


def latest_checkpoint(output_dir: str) -> str | None:
    """The complete checkpoint with the highest step (a `.partial` folder is an interrupted save and never used)."""
    if not os.path.isdir(output_dir):
        return None
    steps = [int(m.group(1)) for name in os.listdir(output_dir) if (m := CHECKPOINT_PATTERN.match(name))]
    return os.path.join(output_dir, f"checkpoint-{max(steps)}") if steps else None


def resume_hint(output_dir: str) -> str:
    """What `--resume` would continue from, in words, for error messages that stop a run."""
    checkpoint = latest_checkpoint(output_dir)
    if checkpoint is None:
        return "No checkpoint was written yet."
    return f"{checkpoint} is intact: --resume continues from it."


# Held by the main process of a run for its lifetime (fcntl.flock), so that two runs never write one folder.
LOCK_FILE = ".hf-elmo-pretrain.lock"
# What a run writes before its training_args.json: a folder holding only these (and the lock) is a start of ours
# that stopped early, and a new run may take it over.
EARLY_FILES = {LOCK_FILE, "vocab.txt", "logs"}


def output_dir_lock(output_dir: str):
    """The lock a run holds on its --output-dir for its lifetime (`safe_output.OutputLock`), kept inside the folder:
    a killed run's lock file is the mark of a start of ours (`EARLY_FILES`)."""
    from .safe_output import OutputLock

    return OutputLock(output_dir, os.path.join(output_dir, LOCK_FILE), "hf-elmo pretrain", "--output-dir")


def check_inputs_outside(args) -> None:
    """No output path may be an input: every input file or folder stays outside --output-dir (which is not the
    current folder either, nor a file). Called before anything is written."""
    from .safe_output import check_folder_or_absent, check_not_an_input

    check_folder_or_absent(args.output_dir, "--output-dir")

    inputs = [path for pattern in args.train_files or [] for path in (glob.glob(pattern) or [pattern])]
    local_dataset = args.dataset_name if args.dataset_name and os.path.isdir(args.dataset_name) else None
    inputs += [p for p in (args.eval_file, args.vocab, args.init_from, local_dataset) if p]
    check_not_an_input(os.path.abspath(args.output_dir), [os.path.abspath(p) for p in inputs])


def prepare_output_dir(args, accelerator, lock_existed: bool = False) -> str | None:
    """
    Returns the checkpoint to resume from, if any. A new run takes a new or empty folder, or one where a start of
    ours stopped before its first checkpoint (`EARLY_FILES`); --resume takes a folder holding a run of ours. A
    folder holding anything else is refused, untouched.
    """
    names = sorted(set(os.listdir(args.output_dir)) - {LOCK_FILE}) if os.path.isdir(args.output_dir) else []
    # A run of ours writes its options before anything else that outlives a kill, so they are its mark. A model
    # folder (config.json) or another trainer's checkpoint-N without them is someone else's: resuming "into" it
    # would overwrite that model with a new one.
    run = TRAINING_ARGS_FILE in names
    checkpoint = latest_checkpoint(args.output_dir) if run else None
    # An early start of ours (its lock file left by a kill) is taken over only if it holds nothing but what such a
    # start writes: anything else in the folder may be the user's.
    if names and not (run or lock_existed and set(names) <= EARLY_FILES):
        shown = ", ".join(names[:4]) + (f" and {len(names) - 4} more" if len(names) > 4 else "")
        model = " To train on from the model it holds, pass it as --init-from." if "config.json" in names else ""
        raise FileExistsError(
            f"{args.output_dir} is not empty and holds no hf-elmo pretrain run ({shown}); nothing was touched. "
            f"Choose a new or empty --output-dir.{model}"
        )
    if run and not args.resume:
        raise FileExistsError(
            f"{args.output_dir} already holds a run ({os.path.basename(checkpoint or TRAINING_ARGS_FILE)}); pass "
            "--resume to continue it, or choose another --output-dir."
        )
    if names and not run:
        logger.info("%s holds what a run that stopped before its first checkpoint wrote (%s); starting over",
                    args.output_dir, ", ".join(names))
    if args.resume and checkpoint is None:
        logger.warning("--resume: no checkpoint in %s yet, starting from step 0", args.output_dir)
    if accelerator.is_main_process:
        os.makedirs(args.output_dir, exist_ok=True)
        remove_stale_file_staging(args.output_dir)  # left by a run killed while saving its final model
    accelerator.wait_for_everyone()
    return checkpoint


def read_json(path: str) -> dict:
    try:
        with open(path, encoding="utf-8") as handle:
            return json.load(handle)
    except FileNotFoundError:
        raise CheckpointError(f"--resume: {path} is missing; the checkpoint is incomplete.") from None
    except (UnicodeDecodeError, json.JSONDecodeError) as error:
        raise CheckpointError(f"--resume: {path} is not valid JSON ({error}).") from None


def word_list_digest(words: list[str]) -> str:
    return hashlib.sha256("\n".join(words).encode("utf-8", errors="surrogatepass")).hexdigest()


def rng_state(device: torch.device) -> dict:
    """
    Every generator the training step may draw from, as JSON: the host's, and this process's GPU's when it trains
    on one (only its own: touching every visible GPU would open a CUDA context on each, or fail on a CPU run); and,
    where this process measured it, whether its training products run on oneDNN (`cpu_products`,
    `cpu_tuning.training_products_choice`): with the generators, what a resumed process needs to compute as this one.
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
    if (choice := training_products_choice()) is not None:
        state["cpu_products"] = choice
    return state


def set_rng_state(state: dict, device: torch.device, source: str) -> None:
    """Restore `rng_state`'s `state`, read from the file `source` (named where it is not usable)."""
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
        if "cpu_products" in state:
            keep_training_products_choice(state["cpu_products"])
    except (KeyError, TypeError, ValueError, RuntimeError) as error:
        raise CheckpointError(f"--resume: {source} is not usable ({error}).") from None


# The fields of training_state.json that a resumed run reads as counts, and the least value each may hold.
TRAINING_STATE_COUNTS = {
    "progress.step": 0, "progress.tokens": 0, "num_processes": 1, "scheduler.last_epoch": 0,
    "stream.groups_done": 0, **{f"stream.window_start.{k}": 0 for k in ("epoch", "shard", "offset", "line")},
    **{f"stream.stats.{k}": 0 for k in ("sentences", "words", "empty_lines_skipped", "long_lines_split")},
}
# Counts a checkpoint of an earlier version lacks (read as 0); checked where present.
TRAINING_STATE_COUNTS_ADDED = {"progress.sentences": 0, "stream.stats.records_without_text": 0}


def check_training_state(state: dict, state_file: str) -> None:
    """Every count a resumed run reads is a whole number in range, and the names are strings: a hand-edited or
    damaged file (a step of -3, 1e30 or "four") is one line naming the field, not a crash later."""
    absent = object()

    def field(path: str, default=absent):
        value = state
        for key in path.split("."):
            if not isinstance(value, dict) or key not in value:
                if default is not absent:
                    return default
                raise CheckpointError(f"--resume: {state_file} has no {path}; the checkpoint is damaged.")
            value = value[key]
        return value

    counts = [(path, least, field(path)) for path, least in TRAINING_STATE_COUNTS.items()]
    counts += [(path, least, field(path, least)) for path, least in TRAINING_STATE_COUNTS_ADDED.items()]
    for path, least, value in counts:
        if isinstance(value, bool) or not isinstance(value, int) or value < least:
            raise CheckpointError(f"--resume: {state_file}: {path} must be a whole number >= {least}, got "
                                  f"{value!r}; the checkpoint is damaged (resume from an earlier one, or start afresh).")
    for path in ("optimizer", "vocab_sha256"):
        if not isinstance(field(path), str):
            raise CheckpointError(f"--resume: {state_file}: {path} must be a string, got {field(path)!r}.")


def read_checkpoint(checkpoint: str, args, model, vocab_digest: str, data_record: dict) -> dict:
    """The checkpoint's training state, after checking that this run builds the same model from the same text
    (`data_record`: the training files' names, sizes and SHA-256, and how lines are split); loads its weights."""
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
    state = read_json(state_file)
    if not isinstance(state, dict) or state.get("format") != CHECKPOINT_FORMAT or state.get("version") != CHECKPOINT_VERSION:
        raise CheckpointError(f"--resume: {state_file} is not a version {CHECKPOINT_VERSION} {CHECKPOINT_FORMAT}.")
    check_training_state(state, state_file)

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
    if not isinstance(state.get("data"), dict):
        raise CheckpointError(
            f"--resume: {state_file} does not record the training files it was trained on (written by an earlier "
            "hf_elmo), so it cannot show that this run's files are the same. Start afresh in another --output-dir."
        )
    changed = differences(state["data"], data_record)
    if changed:
        raise CheckpointError(
            f"--resume: {checkpoint} was trained on other text than this run would read ({'; '.join(changed)}): "
            "its position in the data would point into other lines. Resume with the original --train-files (or "
            "--dataset-name) and --pre-tokenizer, or start afresh in another --output-dir."
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


def load_optimizer(optimizer, checkpoint: str) -> None:
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


def save_checkpoint(
    accelerator, model, tokenizer, optimizer, output_dir: str, step: int, keep: int, training_state: dict
) -> str:
    """
    Write `checkpoint-STEP` into a staging folder renamed into place, so a killed save never looks complete. Beside
    what resuming reads, it holds the run's tokenizer (its vocab.txt), so that a checkpoint is a whole model folder
    that loads, publishes or starts another run as the final one does.
    """
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
            # Data-parallel replicas hold the same model and optimizer state: one copy is written. The tokenizer
            # first, or the model would save a default one without the word vocabulary.
            tokenizer.save_pretrained(staging)
            accelerator.unwrap_model(model).save_pretrained(staging, state_dict=state_dict)
            torch.save(optimizer.state_dict(), os.path.join(staging, OPTIMIZER_FILE))
            write_json_atomic(os.path.join(staging, TRAINING_STATE_FILE), training_state, indent=1)
        # Generators differ between processes (seeded per process): each writes its own.
        rng_file = os.path.join(staging, RNG_STATE_FILE.format(rank=accelerator.process_index))
        write_json_atomic(rng_file, rng_state(accelerator.device), indent=1)
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


def save_final(output_dir: str, model, state_dict: dict, tokenizer, results: dict) -> None:
    """
    The final model, tokenizer and eval_results.json, each file moved into OUTPUT_DIR whole (`atomic_files_into`):
    a run killed while saving leaves no partial file there. The weights move after the config and before
    eval_results.json, so a folder with eval_results.json holds the whole model.
    """
    with atomic_files_into(output_dir, last=(".safetensors", ".safetensors.index.json", "eval_results.json")) as staging:
        model.save_pretrained(staging, state_dict=state_dict)
        tokenizer.save_pretrained(staging)
        write_json_atomic(os.path.join(staging, "eval_results.json"), results, indent=1)
