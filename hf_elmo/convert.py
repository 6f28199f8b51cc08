"""bilm-tf files -> a Hugging Face folder (and back), written atomically: a failed run leaves nothing behind."""

import json
import logging
import os
import shutil

import torch

from . import bilm_tf
from .configuration_elmo import ElmoConfig
from .model_source import resolve_model
from .modeling_elmo import ElmoModel
from .pretraining_checkpoints import CHECKPOINT_PATTERN, TRAINING_ARGS_FILE
from .run_record import sha256_of
from .safe_output import OutputError, atomic_output_dir, check_replaceable_dir
from .tokenization_elmo import ElmoTokenizer


logger = logging.getLogger(__name__)

# Beside checkpoint-N folders, what marks a folder as a training run's (hf-elmo pretrain's options, a Trainer's).
TRAINING_RUN_FILES = (TRAINING_ARGS_FILE, "training_args.bin", "trainer_state.json")


def check_output_dir(output_dir: str, overwrite: bool, inputs: list[str]) -> None:
    """
    `check_replaceable_dir`, and --overwrite never replaces a training run's folder: a converted model or an export
    comes back by converting again, days of checkpoints do not (an ELMo model folder that is also a pretraining
    run's output would otherwise qualify).
    """
    output_dir = os.path.abspath(output_dir)
    check_replaceable_dir(output_dir, overwrite, inputs=inputs)
    names = os.listdir(output_dir) if os.path.isdir(output_dir) else []
    run = sorted(name for name in names if name in TRAINING_RUN_FILES or CHECKPOINT_PATTERN.match(name))
    if run:
        raise OutputError(
            f"{output_dir}: holds a training run ({', '.join(run[:3])}{', ...' if len(run) > 3 else ''}); --overwrite "
            "replaces a converted model or a bilm-tf export, never a run's checkpoints. Remove it yourself or "
            "choose another output."
        )


def load_bilm_tf(options_file: str, weight_file: str, progress: bool = False) -> ElmoModel:
    """An `ElmoModel` holding the weights of a bilm-tf `options.json` + `.hdf5` pair."""
    config = bilm_tf.config_from_options(bilm_tf.read_options(options_file), source=options_file)
    state_dict = bilm_tf.read_weights(weight_file, config, progress=progress)
    with torch.device("meta"):
        model = ElmoModel(config)
    model.load_state_dict(state_dict, strict=True, assign=True)
    return model.eval()


def convert_bilm_tf_to_hf(
    options_file: str,
    weight_file: str,
    output_dir: str,
    vocab_file: str | None = None,
    overwrite: bool = False,
    progress: bool = True,
) -> str:
    """
    Convert bilm-tf's `options.json` + weights `.hdf5` (+ optional vocabulary) into a `save_pretrained` folder:
    config, `model.safetensors`, tokenizer files and a model card recording the source files' SHA-256.
    """
    from .model_card import converted_model_card

    sources = {"options": options_file, "weights": weight_file}
    if vocab_file is not None:
        sources["vocab"] = vocab_file
    # Before reading gigabytes: an output that may not be written is known at once.
    check_output_dir(output_dir, overwrite, inputs=list(sources.values()))
    model = load_bilm_tf(options_file, weight_file, progress=progress)
    if vocab_file is not None:
        bilm_tf.read_vocab(vocab_file)  # fail on a missing or unusable file before anything is written
    tokenizer = ElmoTokenizer(
        max_characters_per_token=model.config.max_characters_per_token, vocab_file=vocab_file
    )
    checksums = {role: {"file": os.path.basename(path), "sha256": sha256_of(path)} for role, path in sources.items()}
    with atomic_output_dir(output_dir, overwrite=overwrite, inputs=list(sources.values())) as staging:
        model.save_pretrained(staging)
        tokenizer.save_pretrained(staging)
        with open(os.path.join(staging, "bilm_tf_source.json"), "w", encoding="utf-8") as f:
            json.dump(checksums, f, indent=2)
        converted_model_card(model.config, checksums).save(os.path.join(staging, "README.md"))
    logger.info("Wrote %s", output_dir)
    return output_dir


def convert_hf_to_bilm_tf(model_dir: str, output_dir: str, overwrite: bool = False) -> list[str]:
    """
    Export a saved `ElmoModel` (or any ELMo head's biLM) as bilm-tf `options.json` + `weights.hdf5`, with the word
    vocabulary saved in a local `model_dir` (`vocab.txt`, already in bilm-tf's format) when it has one, all in one
    atomic write: the export appears whole or not at all. Returns the paths written, in that order.
    """
    check_output_dir(output_dir, overwrite, inputs=[model_dir])
    name, extra = resolve_model(model_dir)  # a mistyped folder fails here, without a Hub request
    model = ElmoModel.from_pretrained(name, **extra)
    config: ElmoConfig = model.config
    written = ["options.json", "weights.hdf5"]
    with atomic_output_dir(output_dir, overwrite=overwrite, inputs=[model_dir]) as staging:
        with open(os.path.join(staging, "options.json"), "w", encoding="utf-8") as f:
            json.dump(bilm_tf.options_from_config(config), f, indent=2)
        bilm_tf.write_weights(os.path.join(staging, "weights.hdf5"), model.state_dict(), config)
        vocab = os.path.join(model_dir, "vocab.txt")
        if os.path.isfile(vocab):
            shutil.copyfile(vocab, os.path.join(staging, "vocab.txt"))
            written.append("vocab.txt")
    return [os.path.join(output_dir, name) for name in written]


def run_convert(args, parser) -> int:
    if args.to_bilm_tf:
        written = convert_hf_to_bilm_tf(args.to_bilm_tf, args.output, overwrite=args.overwrite)
        logger.info("Wrote %s", ", ".join(written))
        return 0
    if not args.options or not args.weights:
        parser.error("--options and --weights are required (or --to-bilm-tf MODEL_DIR for the reverse direction)")
    convert_bilm_tf_to_hf(args.options, args.weights, args.output, vocab_file=args.vocab,
                          overwrite=args.overwrite, progress=not args.no_progress)
    return 0
