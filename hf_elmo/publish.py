"""Publish a saved ELMo folder to the Hugging Face Hub (`hf-elmo publish`).

The folder that is uploaded is prepared first, in a temporary directory, and is exactly what the Hub receives:
the model re-saved with `save_pretrained` (safetensors weights, config with the full `auto_map`, and the code files
`configuration_elmo.py`, `modeling_elmo.py`, `tokenization_elmo.py` so that it loads with
`trust_remote_code=True` where hf_elmo is not installed), the tokenizer, the converter's `bilm_tf_source.json`
when present, any other code, json or png file of the folder (a fine-tuned head's `metrics.json`, `labels.json` and
`layer_weights.png`), and a model card generated from the folder's metadata and, for a head, its run's metrics.
Re-saving also proves that the folder loads before anything is sent. Training state (optimizer, scheduler, RNG,
Trainer state, a pretraining checkpoint's), weight files in other formats and sub-folders (checkpoints) are left
out, and said so. A link whose target lies outside the folder stops publishing before anything is read
(`_refuse_links_outside`).

Network calls go through `huggingface_hub.HfApi`: `create_repo` (exist_ok) then one `create_commit` holding every
file, optionally as a pull request.
"""

import fnmatch
import json
import logging
import os
import shutil
import tempfile
from dataclasses import dataclass

from huggingface_hub import CommitOperationAdd, HfApi, ModelCard, constants, get_token
from huggingface_hub.errors import HFValidationError, OfflineModeIsEnabled
from huggingface_hub.utils import validate_repo_id

from . import modeling_elmo
from .configuration_elmo import ElmoConfig
from .model_card import RECIPE_ARGUMENTS, elmo_model_card, plot_perplexity_curve
from .model_source import model_folder_problem
from .pretraining_checkpoints import (
    CHECKPOINT_PATTERN,
    METRICS_FILE as PRETRAINING_METRICS,
    RNG_STATE_FILE,
    TRAINING_ARGS_FILE,
    TRAINING_STATE_FILE,
)
from .run_record import dataset_name_record
from .safe_output import is_within, no_room_error
from .tokenization_elmo import ElmoTokenizer
from .weight_checks import WeightCheckError


logger = logging.getLogger(__name__)

SOURCE_FILE = "bilm_tf_source.json"
# Written by the fine-tuning examples (examples/finetuning_cli.py); the card shows them.
METRICS_FILE = "metrics.json"
LAYER_WEIGHTS_PLOT = "layer_weights.png"
PERPLEXITY_PLOT = "perplexity_curve.png"
# Never published: Trainer/Accelerate state, a pretraining run's options (they hold the user's local paths: the card
# shows the recipe and the files' names) and the resumable state of its checkpoints, and weights in formats other
# than the re-saved safetensors.
LEFT_OUT = (
    TRAINING_ARGS_FILE, TRAINING_STATE_FILE, RNG_STATE_FILE.format(rank="*"),
    "optimizer.pt", "scheduler.pt", "scaler.pt", "rng_state*.pth", "training_args.bin", "trainer_state.json",
    "*.bin", "*.safetensors", "*.safetensors.index.json", "*.pt", "*.pth", "*.ckpt", "*.h5", "*.hdf5", "*.msgpack",
)
# Extra top-level files of the folder that are carried over (code, metadata, the layer-weight plot), besides what
# save_pretrained writes.
CARRIED = ("*.py", "*.json", "*.txt", "*.png")


class PublishError(RuntimeError):
    """The folder cannot be published as asked (not an ELMo folder, offline, not logged in, ...)."""


@dataclass
class PreparedFolder:
    path: str
    files: list[str]  # relative paths, sorted
    left_out: list[str]
    card_path: str


def check_repo_id(repo_id: str) -> None:
    """`owner/name`, as huggingface_hub's own validator accepts it (the id is also written into the model card)."""
    try:
        if not isinstance(repo_id, str) or repo_id.count("/") != 1:
            raise HFValidationError("it must have the form owner/name")
        validate_repo_id(repo_id)
    except HFValidationError as error:
        raise PublishError(f"{repo_id!r} is not a valid Hub repository id: {' '.join(str(error).split())}") from None


def check_model_folder(model_dir: str) -> None:
    """The folder's own problems (none there, no model in it), found without loading anything."""
    if problem := model_folder_problem(model_dir):
        raise PublishError(problem)


def _load(model_dir: str):
    config_file = os.path.join(model_dir, "config.json")
    try:
        with open(config_file, encoding="utf-8") as f:
            content = json.load(f)
    except (ValueError, OSError) as error:
        raise PublishError(f"{config_file}: not a readable JSON file ({error}).") from None
    model_type = content.get("model_type") if isinstance(content, dict) else None
    if model_type != ElmoConfig.model_type:
        raise PublishError(f"{config_file}: model_type is {model_type!r}, expected 'elmo'.")
    try:
        config = ElmoConfig.from_pretrained(model_dir)
    except (OSError, ValueError, TypeError) as error:
        raise PublishError(f"{config_file}: not a usable ELMo config ({' '.join(str(error).split())}).") from None
    architecture = (config.architectures or ["ElmoModel"])[0]
    model_class = getattr(modeling_elmo, architecture, None)
    if model_class is None:
        raise PublishError(
            f"{config_file}: architecture {architecture!r} is not a class of this hf_elmo version "
            f"(hf_elmo.modeling_elmo has no {architecture})."
        )
    try:
        # Missing or non-finite weights would be uploaded as invented or NaN values: refuse them.
        model = model_class.from_pretrained(model_dir)
    except WeightCheckError as error:
        raise PublishError(str(error)) from None
    except Exception as error:  # noqa: BLE001 - safetensors, torch and Transformers each raise their own types
        raise PublishError(f"{model_dir}: the weights cannot be loaded ({' '.join(str(error).split())}).") from None
    if os.path.isfile(os.path.join(model_dir, "tokenizer_config.json")):
        try:
            tokenizer = ElmoTokenizer.from_pretrained(model_dir)
        except (OSError, ValueError, TypeError, KeyError) as error:
            raise PublishError(
                f"{model_dir}: the tokenizer files cannot be loaded ({' '.join(str(error).split())})."
            ) from None
    else:
        logger.info("%s has no tokenizer files; publishing the default ElmoTokenizer", model_dir)
        tokenizer = ElmoTokenizer(max_characters_per_token=config.max_characters_per_token)
    return config, model, tokenizer


def _read_json(path: str) -> dict | None:
    if not os.path.isfile(path):
        return None
    with open(path, encoding="utf-8") as f:
        return json.load(f)


def read_run_metrics(path: str) -> dict | None:
    """A fine-tuning run's metrics.json (as the examples write it), else None: other files may share the name."""
    metrics = _read_json(path)
    if isinstance(metrics, dict) and isinstance(metrics.get("layer_weights"), list) and "task" in metrics:
        return metrics
    if metrics is not None:
        logger.info("%s is not a fine-tuning run's metrics (no task / layer_weights); the card leaves it out", path)
    return None


def read_pretraining(model_dir: str) -> dict | None:
    """
    What a finished `hf-elmo pretrain` folder records of its run, for the card: the training files by name (never
    their folders, which are the user's own), tokens seen, the wall time of all its runs (resumed ones added),
    held-out perplexity at the end and at each evaluation (metrics.jsonl), and the recipe. For one of its
    `checkpoint-STEP` folders, the same up to that step. None for any other folder.
    """
    run_dir, results, last_step = model_dir, _read_json(os.path.join(model_dir, "eval_results.json")), None
    if CHECKPOINT_PATTERN.match(os.path.basename(os.path.normpath(model_dir))):
        state = _read_json(os.path.join(model_dir, TRAINING_STATE_FILE))
        progress = state.get("progress") if isinstance(state, dict) else None
        if isinstance(progress, dict) and isinstance(progress.get("step"), int):
            run_dir, last_step = os.path.dirname(os.path.normpath(model_dir)), progress["step"]
            results = {"step": last_step, "tokens_seen": progress.get("tokens"),
                       "sentences_seen": progress.get("sentences")}
    arguments = _read_json(os.path.join(run_dir, TRAINING_ARGS_FILE))
    if not isinstance(arguments, dict) or not isinstance(results, dict) or "train_files" not in arguments:
        return None
    curve, wall, segment = [], 0.0, 0.0
    metrics = os.path.join(run_dir, PRETRAINING_METRICS)
    if os.path.isfile(metrics):
        with open(metrics, encoding="utf-8") as handle:
            for line in handle:
                record = json.loads(line) if line.strip() else {}
                if last_step is not None and record.get("step", 0) > last_step:
                    continue  # logged after the checkpoint
                if "eval/forward_perplexity" in record:
                    curve.append({"step": record.get("step"), "forward": record["eval/forward_perplexity"],
                                  "backward": record["eval/backward_perplexity"]})
                if "wall_s" in record:
                    # Each process (a resumed run starts a new one) counts from its own start.
                    if record["wall_s"] < segment:
                        wall += segment
                    segment = record["wall_s"]
    final = ({"forward": results["eval/forward_perplexity"], "backward": results["eval/backward_perplexity"]}
             if "eval/forward_perplexity" in results else None)
    if last_step is not None and curve and curve[-1]["step"] == last_step:  # evaluated where the checkpoint was saved
        final = {key: curve[-1][key] for key in ("forward", "backward")}
    dataset = _pretraining_dataset(arguments)
    return {
        # A dataset's run names the dataset, not the text files it was exported to.
        "train_files": [] if dataset else [os.path.basename(pattern) for pattern in arguments["train_files"] or []],
        "dataset": dataset,
        "sentences_seen": results.get("sentences_seen"),
        "eval_file": os.path.basename(arguments["eval_file"]) if arguments.get("eval_file") else None,
        "step": results.get("step"), "tokens_seen": results.get("tokens_seen"),
        "train_wall_s": round(wall + segment, 1) if segment else None,
        "heldout_perplexity": final, "curve": curve,
        "recipe": {key: arguments[key] for key in RECIPE_ARGUMENTS if key in arguments},
    }


def _pretraining_dataset(arguments: dict) -> dict | None:
    """The `datasets` corpus of a run (`--dataset-name`), as its card shows it (`run_record.dataset_name_record`)."""
    name = arguments.get("dataset_name")
    if not name:
        return None
    return {**dataset_name_record(name), "config": arguments.get("dataset_config"),
            "split": arguments.get("dataset_split"), "revision": arguments.get("dataset_revision"),
            "text_column": arguments.get("text_column"), "streaming": bool(arguments.get("streaming"))}


def folder_model_card(model_dir: str, config, repo_id: str | None = None, license: str | None = None,
                      pretraining: dict | None = None, perplexity_plot: str | None = None):
    """
    The card of an ELMo folder, from what it holds: the converter's bilm_tf_source.json; for a fine-tuned head, the
    run's metrics.json and layer_weights.png; for a biLM of `hf-elmo pretrain`, its run (`pretraining`, as
    `read_pretraining` gives it, which `prepare_folder` reads once for the plot and the card), with
    `perplexity_plot` (a file the caller wrote beside the card). `hf-elmo publish` and the fine-tuning examples
    both write it.
    """
    return elmo_model_card(
        config,
        checksums=_read_json(os.path.join(model_dir, SOURCE_FILE)),
        repo_id=repo_id,
        license=license,
        training=read_run_metrics(os.path.join(model_dir, METRICS_FILE)),
        layer_weights_plot=LAYER_WEIGHTS_PLOT if os.path.isfile(os.path.join(model_dir, LAYER_WEIGHTS_PLOT)) else None,
        pretraining=pretraining,
        perplexity_plot=perplexity_plot,
    )


def _refuse_links_outside(model_dir: str) -> None:
    """
    Stop before anything is read if an entry of the folder is a link whose target lies outside it, or a file with
    more than one hard link: loading or carrying it over would upload someone's file from elsewhere (a link to a
    private file, listed like any other). Symbolic links that stay inside the folder are followed.
    """
    for name in sorted(os.listdir(model_dir)):
        path = os.path.join(model_dir, name)
        if os.path.islink(path) and not is_within(path, model_dir):
            target = os.path.realpath(path)
            raise PublishError(
                f"{path} is a link to {target}, outside {model_dir}; publish never uploads a file from outside the "
                f"model folder. Remove the link, or replace it with a copy of the file if it is meant to be "
                f"published (cp --remove-destination \"$(readlink -f {path})\" {path})."
            )
        # A hard link cannot say where its other names are: a file with more than one may be someone's file from
        # elsewhere (a private one, linked in), so it is refused as a link outside the folder is.
        if not os.path.islink(path) and os.path.isfile(path) and os.stat(path).st_nlink > 1:
            raise PublishError(
                f"{path} has {os.stat(path).st_nlink} hard links: it is also a file elsewhere, and publish never "
                "uploads a file that may come from outside the model folder. If it is meant to be published, give "
                f"the folder a copy of its own (cp {path} {path}.copy && mv {path}.copy {path})."
            )


def prepare_folder(
    model_dir: str,
    staging: str,
    repo_id: str | None = None,
    license: str | None = None,
    card_file: str | None = None,
) -> PreparedFolder:
    """Write into the empty folder `staging` exactly what `publish` uploads (see the module docstring)."""
    check_model_folder(model_dir)
    _refuse_links_outside(model_dir)
    config, model, tokenizer = _load(model_dir)
    model.save_pretrained(staging)
    tokenizer.save_pretrained(staging)

    left_out = []
    for name in sorted(os.listdir(model_dir)):
        source = os.path.join(model_dir, name)
        if name == "README.md" or os.path.exists(os.path.join(staging, name)):
            continue
        if name.startswith(".") or not os.path.isfile(source) or any(fnmatch.fnmatch(name, p) for p in LEFT_OUT):
            left_out.append(name)
        elif any(fnmatch.fnmatch(name, p) for p in CARRIED):
            shutil.copy2(source, os.path.join(staging, name))
        else:
            left_out.append(name)
    if left_out:
        logger.info("Not published from %s: %s", model_dir, ", ".join(left_out))

    card_path = os.path.join(staging, "README.md")
    if card_file is not None:
        try:
            card = ModelCard.load(card_file)
        except (OSError, ValueError) as error:
            raise PublishError(f"{card_file}: not a usable model card ({error}).") from None
    else:
        readme = os.path.join(model_dir, "README.md")
        if os.path.isfile(readme) and "hf_elmo" not in (ModelCard.load(readme).data.tags or []):
            # Not a card hf_elmo generated: the user may have written it.
            logger.warning("%s is replaced by a card generated from the folder's metadata; pass --card %s to "
                           "publish it instead", readme, readme)
        pretraining = read_pretraining(model_dir)
        plot = None
        if pretraining and pretraining["curve"]:
            try:
                plot_perplexity_curve(pretraining["curve"], os.path.join(staging, PERPLEXITY_PLOT))
                plot = PERPLEXITY_PLOT
            except ImportError:
                logger.info("matplotlib is not installed: the card shows the perplexity curve as a table")
        card = folder_model_card(model_dir, config, repo_id=repo_id, license=license, pretraining=pretraining,
                                 perplexity_plot=plot)
    card.save(card_path)

    files = sorted(
        os.path.relpath(os.path.join(root, name), staging) for root, _, names in os.walk(staging) for name in names
    )
    return PreparedFolder(path=staging, files=files, left_out=left_out, card_path=card_path)


def publish(
    model_dir: str,
    repo_id: str,
    private: bool = False,
    create_pr: bool = False,
    dry_run: bool = False,
    commit_message: str = "Upload ELMo model with hf_elmo",
    license: str | None = None,
    card_file: str | None = None,
):
    """
    Prepare `model_dir` for the Hub and push it to `repo_id` in one commit (a pull request with `create_pr`).
    Returns `(PreparedFolder, CommitInfo)`; with `dry_run`, nothing touches the network, the prepared folder is
    kept and the CommitInfo is None.
    """
    check_repo_id(repo_id)
    # The folder's mistakes are the user's to fix first: said before the login, which a typo never needs.
    check_model_folder(model_dir)
    if card_file is not None and not os.path.isfile(card_file):
        # ModelCard.load would take any other path for a Hub repo id and complain about that.
        what = "no such file" if not os.path.exists(card_file) else "not a regular file (a folder, a FIFO, a device)"
        raise PublishError(f"--card {card_file}: {what}; give the path of a model card file (a README.md).")
    if not dry_run:
        # Checked before the (possibly long) preparation, so that the user hears at once.
        if constants.is_offline_mode():
            raise PublishError(
                "HF_HUB_OFFLINE=1 is set, so nothing can be pushed to the Hub. Unset it to publish, or pass "
                "--dry-run to prepare the folder without network."
            )
        if get_token() is None:
            raise PublishError("Not logged in to the Hugging Face Hub: run `hf auth login` or set HF_TOKEN.")
    staging = tempfile.mkdtemp(prefix="hf-elmo-publish-")
    try:
        prepared = prepare_folder(model_dir, staging, repo_id=repo_id, license=license, card_file=card_file)
        if dry_run:
            return prepared, None
        api = HfApi()
        try:
            api.create_repo(repo_id, private=private, exist_ok=True, repo_type="model")
            operations = [
                CommitOperationAdd(path_in_repo=name, path_or_fileobj=os.path.join(staging, name))
                for name in prepared.files
            ]
            commit = api.create_commit(
                repo_id, operations, commit_message=commit_message, create_pr=create_pr, repo_type="model"
            )
        except OfflineModeIsEnabled as error:
            raise PublishError(f"Offline mode is enabled (HF_HUB_OFFLINE): {error}") from None
        shutil.rmtree(staging, ignore_errors=True)
        return prepared, commit
    except BaseException as error:
        shutil.rmtree(staging, ignore_errors=True)
        no_room = no_room_error(error, staging)
        if no_room is not None:
            raise PublishError(f"{no_room} (publish prepares the upload there: set TMPDIR to a folder with room)") from None
        raise
