"""The fine-tuning examples' shared command line and Trainer run (examples/run_token_classification.py and
examples/run_sequence_classification.py import it from beside them).

- `add_finetuning_arguments`, `check_finetuning_arguments`: the model, head, training and Hub options both scripts
  take, and the Hub checks made before any work.
- `head_options`, `training_arguments`: what those options mean for `from_pretrained` and `TrainingArguments`.
- `train_and_report`: train with the Trainer, save, score the validation and test splits, and write labels.json,
  metrics.json, layer_weights.png and the model card (and push, with `--push-to-hub`).

The data readers, metrics and the layer-weight plot they use are the package's (`hf_elmo.finetuning`).
"""

import argparse
import logging
import os

from hf_elmo.finetuning import DataFileError, plot_layer_weights
from hf_elmo.safe_output import atomic_output_file, no_room_reported, write_json_atomic


logger = logging.getLogger(__name__)


def add_finetuning_arguments(parser: argparse.ArgumentParser, default_learning_rate: float = 1e-3):
    """The model, head and training options both example scripts take."""
    model = parser.add_argument_group("model")
    model.add_argument("--model", required=True,
                       help="folder (or Hub name) of an ELMo model: a converted biLM such as the one "
                       "examples/quickstart.py writes, or a head fine-tuned earlier (its labels are then reused)")
    model.add_argument("--unfreeze-elmo", action="store_true",
                       help="fine-tune the biLM's weights too (default: keep them frozen and train only the layer "
                       "mix and the head, as in the paper)")
    model.add_argument("--mix-layer-norm", action="store_true",
                       help="layer-normalise each biLM layer (per sentence) before mixing the layers")
    model.add_argument("--mix-l2-coef", type=float, default=0.0,
                       help="L2 penalty pulling the layer weights toward an even mix (the paper's lambda; "
                       "default: %(default)s = none)")
    model.add_argument("--dropout", type=float, default=0.5,
                       help="dropout on the mixed ELMo vectors (default: %(default)s)")
    model.add_argument("--head-lstm-dim", type=int, default=None,
                       help="add a biLSTM with this many units per direction between the mix and the classifier "
                       "(default: none, a linear classifier on the mix)")
    model.add_argument("--head-lstm-layers", type=int, default=1,
                       help="layers of that biLSTM (default: %(default)s)")

    training = parser.add_argument_group("training")
    training.add_argument("--output-dir", required=True,
                          help="where the fine-tuned model, labels.json, metrics.json, layer_weights.png and the "
                          "checkpoints (checkpoint-N) are written")
    training.add_argument("--epochs", type=float, default=10, help="training epochs (default: %(default)s)")
    training.add_argument("--max-steps", type=int, default=-1,
                          help="stop after this many optimiser steps, overriding --epochs (default: no limit)")
    training.add_argument("--batch-size", type=int, default=32,
                          help="sentences per device per step (default: %(default)s)")
    training.add_argument("--gradient-accumulation-steps", type=int, default=1,
                          help="accumulate this many batches per optimiser step; the loss stays the mean over "
                          "every labelled item of the accumulated batch (default: %(default)s)")
    training.add_argument("--learning-rate", type=float, default=default_learning_rate,
                          help="peak AdamW learning rate, decayed linearly to 0 (default: %(default)s)")
    training.add_argument("--weight-decay", type=float, default=0.0, help="AdamW weight decay (default: %(default)s)")
    training.add_argument("--warmup", type=float, default=0.0,
                          help="learning-rate warm-up: steps, or a fraction of all steps when below 1 "
                          "(default: %(default)s)")
    training.add_argument("--seed", type=int, default=42, help="random seed (default: %(default)s)")
    training.add_argument("--save-total-limit", type=int, default=2,
                          help="keep at most this many epoch checkpoints (default: %(default)s)")
    training.add_argument("--resume-from-checkpoint", default=None, metavar="CHECKPOINT",
                          help="continue an interrupted run: a checkpoint-N folder, or 'last' for the newest one "
                          "in --output-dir")
    training.add_argument("--logging-steps", type=int, default=50,
                          help="log the training loss every this many steps (default: %(default)s)")
    training.add_argument("--task-name", default=None,
                          help="name of the task in metrics.json and on the layer-weight plot (default: derived "
                          "from the training data)")
    training.add_argument("--report-to", nargs="+", default=["none"], metavar="INTEGRATION",
                          help="where the Trainer logs training metrics, as TrainingArguments.report_to: none (the "
                          "default, nothing leaves the machine), all, or integrations such as tensorboard, wandb, "
                          "mlflow (installed separately)")

    hub = parser.add_argument_group("Hugging Face Hub")
    hub.add_argument("--push-to-hub", action="store_true",
                     help="push to the Hub as the Trainer does (TrainingArguments.push_to_hub): the model at every "
                     "save during training and, at the end, the final model with labels.json, metrics.json, "
                     "layer_weights.png and a model card showing them (log in first: `hf auth login` or HF_TOKEN)")
    hub.add_argument("--hub-model-id", default=None,
                     help="repository to push to, e.g. your-name/elmo-ner (default: the name of --output-dir under "
                     "your account)")
    hub.add_argument("--hub-private-repo", action="store_true",
                     help="create the Hub repository as private (no effect on one that exists)")
    return parser


def check_finetuning_arguments(parser: argparse.ArgumentParser, args) -> None:
    """Refuse, before any work, Hub options that cannot succeed (offline mode, not logged in)."""
    if not args.push_to_hub:
        if args.hub_model_id or args.hub_private_repo:
            parser.error("--hub-model-id / --hub-private-repo go with --push-to-hub")
        return
    from huggingface_hub import constants, get_token

    if constants.is_offline_mode():
        parser.error("--push-to-hub: HF_HUB_OFFLINE=1 is set, so nothing can be pushed to the Hub; unset it or drop "
                     "--push-to-hub")
    if get_token() is None:
        parser.error("--push-to-hub: not logged in to the Hugging Face Hub; run `hf auth login` or set HF_TOKEN")


def head_options(args) -> dict:
    """`from_pretrained` keyword arguments for the head, from the parsed options."""
    return {
        "freeze_elmo": not args.unfreeze_elmo,
        "mix_layer_norm": args.mix_layer_norm,
        "mix_l2_coef": args.mix_l2_coef,
        "mix_dropout": args.dropout,
        "head_lstm_dim": args.head_lstm_dim,
        "head_lstm_layers": args.head_lstm_layers,
    }


def training_arguments(args, evaluate: bool):
    """`TrainingArguments` for the parsed options: evaluate (when there is validation data) and save every epoch."""
    import torch
    from transformers import TrainingArguments

    return TrainingArguments(
        output_dir=args.output_dir,
        num_train_epochs=args.epochs,
        max_steps=args.max_steps,
        per_device_train_batch_size=args.batch_size,
        per_device_eval_batch_size=args.batch_size,
        gradient_accumulation_steps=args.gradient_accumulation_steps,
        learning_rate=args.learning_rate,
        weight_decay=args.weight_decay,
        warmup_steps=args.warmup,
        seed=args.seed,
        eval_strategy="epoch" if evaluate else "no",
        save_strategy="epoch",
        save_total_limit=args.save_total_limit,
        logging_steps=args.logging_steps,
        report_to=args.report_to,
        push_to_hub=args.push_to_hub,
        hub_model_id=args.hub_model_id,
        hub_private_repo=args.hub_private_repo or None,
        dataloader_pin_memory=torch.cuda.is_available(),
    )


def resolve_checkpoint(value: str | None, output_dir: str) -> str | None:
    """`--resume-from-checkpoint`: a folder, or 'last' for the newest checkpoint-N in `output_dir`."""
    if value != "last":
        if value is not None and not os.path.isdir(value):
            raise FileNotFoundError(f"--resume-from-checkpoint: {value} is not a folder.")
        return value
    from transformers.trainer_utils import get_last_checkpoint

    last = get_last_checkpoint(output_dir) if os.path.isdir(output_dir) else None
    if last is None:
        raise FileNotFoundError(f"--resume-from-checkpoint last: no checkpoint-N folder in {output_dir}.")
    return last


def write_json(path: str | os.PathLike, data) -> None:
    """Write JSON through a temporary file in the same folder, so a crash never leaves half a file."""
    write_json_atomic(path, data, indent=2, ensure_ascii=False, newline=True)


def dataset_splits(name: str, config: str | None, columns: tuple[str, ...]) -> dict:
    """
    The train / validation / test splits that a `datasets` dataset (a Hub name or a saved folder) has, each
    checked for `columns`; "train" is required. Needs the datasets package (the `examples` extra).
    """
    try:
        from datasets import load_dataset
    except ImportError as err:
        raise SystemExit('--dataset-name needs the datasets package: pip install "hf-elmo[examples]"') from err
    dataset = load_dataset(name, config)
    if "train" not in dataset:
        raise DataFileError(f"{name}: no 'train' split (it has {sorted(dataset)}).")
    tables = {}
    for split in ("train", "validation", "test"):
        if split not in dataset:
            continue
        table = dataset[split]
        for column in columns:
            if column not in table.column_names:
                raise DataFileError(f"{name}[{split}]: no column {column!r} (it has {table.column_names}).")
        tables[split] = table
    return tables


def write_model_card(output_dir: str, config, repo_id: str | None = None) -> str:
    """
    README.md of a fine-tuned folder: hf_elmo's card with the labels, the run's metrics.json and the embedded
    layer_weights.png (the same card `hf-elmo publish` generates). Returns its path.
    """
    from hf_elmo.model_card import elmo_model_card
    from hf_elmo.publish import LAYER_WEIGHTS_PLOT, METRICS_FILE, read_run_metrics

    card = elmo_model_card(
        config,
        repo_id=repo_id,
        training=read_run_metrics(os.path.join(output_dir, METRICS_FILE)),
        layer_weights_plot=(
            LAYER_WEIGHTS_PLOT if os.path.isfile(os.path.join(output_dir, LAYER_WEIGHTS_PLOT)) else None
        ),
    )
    path = os.path.join(output_dir, "README.md")
    with atomic_output_file(path) as partial:  # beside the saved model: never half a card
        card.save(partial)
    return path


def _card_trainer_class():
    # Built on first use: this module imports transformers only inside functions, like the rest of it.
    from transformers import Trainer

    class ElmoFinetuningTrainer(Trainer):
        """The Trainer, with hf_elmo's model card (labels, metrics, layer weights) instead of its generic summary."""

        def create_model_card(self, **kwargs):
            # The Trainer's keywords (model_name, finetuned_from, dataset, ...) describe its own summary card; the
            # facts of this card come from the folder (config, metrics.json, layer_weights.png).
            if self.is_world_process_zero():
                write_model_card(self.args.output_dir, self.model.config,
                                 repo_id=self.hub_model_id or self.args.hub_model_id)

    return ElmoFinetuningTrainer


def train_and_report(args, model, tokenizer, features: dict, id2label: dict, data_collator, score, summarise,
                     log_report) -> dict:
    """
    The examples' shared run: train `model` with the Trainer on `features["train"]` (scored on "validation" each
    epoch when present; `--resume-from-checkpoint` honoured), save it to `--output-dir`, score "validation" and
    "test", and write labels.json, metrics.json and the layer-weight plot there. Returns the metrics.

    `score(predictions, label_ids)` turns argmax label ids into a report dict, `summarise(report)` picks the
    numbers the Trainer logs at each evaluation, `log_report(split, report)` prints a split's report.

    The folder also gets a model card (README.md). With `--push-to-hub` the Trainer pushes as usual (at every save,
    and when the model is saved), and the finished folder (without checkpoints) is pushed last, with its card.
    """

    def compute_metrics(evaluation):
        return summarise(score(evaluation.predictions, evaluation.label_ids))

    trainer = _card_trainer_class()(
        model=model,
        args=training_arguments(args, evaluate="validation" in features),
        train_dataset=features["train"],
        eval_dataset=features.get("validation"),
        data_collator=data_collator,
        processing_class=tokenizer,
        compute_metrics=compute_metrics,
        # Keep only the argmax: whole logits of every evaluation example would be gathered in memory.
        preprocess_logits_for_metrics=lambda logits, labels: logits.argmax(-1),
    )
    # A full disk: one line, not safetensors' or torch's traceback. The Trainer writes in place, so what it had
    # begun is removed where it can be told apart (a checkpoint without its trainer_state.json, written last).
    left = "incomplete checkpoints were removed; files of the final save may be incomplete"
    with no_room_reported(args.output_dir, left, lambda: remove_incomplete_checkpoints(args.output_dir)):
        result = trainer.train(resume_from_checkpoint=resolve_checkpoint(args.resume_from_checkpoint, args.output_dir))
        trainer.save_model(args.output_dir)

    task = default_task_name(args)
    weights = model.layer_weights().tolist()
    dataset = getattr(args, "dataset_name", None)
    metrics = {
        "task": task,
        "model": args.model,
        # Hub ids only (for the card's metadata): a local folder means nothing to a reader of the Hub page.
        "base_model": None if os.path.isdir(args.model) else args.model,
        "datasets": [dataset] if dataset and not os.path.isdir(dataset) else [],
        "dataset_config": getattr(args, "dataset_config", None),
        "train_loss": result.training_loss,
        "layer_weights": weights,
        "gamma": float(model.encoder.mix.gamma.detach()),
    }
    for split in ("validation", "test"):
        if split in features:
            prediction = trainer.predict(features[split], metric_key_prefix=split)
            report = score(prediction.predictions, prediction.label_ids)
            report["loss"] = prediction.metrics[f"{split}_loss"]
            log_report(split, report)
            metrics[split] = report
    logger.info("Layer weights (token layer first): %s, gamma %.4f", ", ".join(f"{w:.3f}" for w in weights),
                metrics["gamma"])

    write_json(os.path.join(args.output_dir, "labels.json"), {"id2label": {str(i): l for i, l in id2label.items()}})
    write_json(os.path.join(args.output_dir, "metrics.json"), metrics)
    plot = plot_layer_weights({task: weights}, os.path.join(args.output_dir, "layer_weights.png"))
    if args.push_to_hub:
        # Writes the card (create_model_card above) and uploads the folder, checkpoints left out.
        commit = trainer.push_to_hub(commit_message="End of training")
        logger.info("Pushed %s to the Hub: %s", args.output_dir, getattr(commit, "commit_url", commit))
    else:
        trainer.create_model_card()
    logger.info("Saved the model, labels.json, metrics.json, %s and README.md to %s", os.path.basename(plot),
                args.output_dir)
    return metrics


def remove_incomplete_checkpoints(output_dir: str) -> None:
    """Trainer checkpoints that a failure cut short: `checkpoint-N` folders without `trainer_state.json`."""
    import shutil

    for name in os.listdir(output_dir) if os.path.isdir(output_dir) else ():
        folder = os.path.join(output_dir, name)
        if name.startswith("checkpoint-") and not os.path.exists(os.path.join(folder, "trainer_state.json")):
            shutil.rmtree(folder, ignore_errors=True)


def run_example(main) -> int:
    """
    An example's entry point, with the error convention of the `hf-elmo` commands: one `error: ...` line and exit
    status 1 for bad data files, missing files, outputs that cannot be written (a full disk included); the
    traceback with HF_ELMO_DEBUG=1. SIGTERM stops it as Ctrl-C does.
    """
    from hf_elmo.cli import handle_sigterm, run_reporting_errors

    handle_sigterm()

    def run() -> int:
        main()  # returns the metrics
        return 0

    return run_reporting_errors(run, "fine-tuning")


def default_task_name(args) -> str:
    """--task-name, else the training file's name, else the dataset's name."""
    if args.task_name:
        return args.task_name
    if args.train_file:
        return os.path.splitext(os.path.basename(args.train_file))[0]
    return os.path.basename(os.path.normpath(args.dataset_name))


def existing_label_map(config, architecture: str) -> dict[int, str] | None:
    """The `id2label` of a model folder that already holds this kind of head, else None (a new head)."""
    if architecture in (getattr(config, "architectures", None) or []):
        return {int(i): label for i, label in config.id2label.items()}
    return None
