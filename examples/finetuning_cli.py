"""The fine-tuning examples' shared parts, shaped like Transformers' own examples (run_ner.py, run_glue.py):
examples/run_token_classification.py and examples/run_sequence_classification.py import it from beside them.

- `ModelArguments`, `DataArguments`, `ElmoTrainingArguments`: the dataclasses `HfArgumentParser` turns into options.
  The training options are Transformers' `TrainingArguments`, every one of them (`--bf16`, `--lr_scheduler_type`,
  `--load_best_model_at_end`, `--push_to_hub`, `--report_to`, ...), with defaults measured for a frozen ELMo
  (see their help) and `--overwrite_output_dir`.
- `parse_arguments`: the command line (or one .json file of options), checked before any work.
- `OutputFolder`: where a run writes, by the rules of the `hf-elmo` commands (see its docstring).
- `run_finetuning`: train with the Trainer, evaluate, predict, and write the results.

The data readers, metrics and the layer-weight plot they use are the package's (`hf_elmo.finetuning`).
"""

import argparse
import json
import logging
import os
import pickle
import re
import shutil
import sys
from dataclasses import dataclass, field

from transformers import EarlyStoppingCallback, HfArgumentParser, TrainerCallback, TrainingArguments
from transformers.trainer_utils import IntervalStrategy

from hf_elmo.finetuning import (
    HEAD_MAX_EPOCHS,
    HEAD_MIN_EPOCHS,
    HEAD_MIN_STEPS,
    HEAD_PATIENCE,
    DataFileError,
    default_head_epochs,
    head_training_rule,
    plot_layer_weights,
)
from hf_elmo.option_checks import config_error_as_option, number_error
from hf_elmo.pretraining_checkpoints import TRAINING_ARGS_FILE
from hf_elmo.publish import LAYER_WEIGHTS_PLOT, METRICS_FILE, SOURCE_FILE, folder_model_card
from hf_elmo.safe_output import (
    OutputError,
    OutputLock,
    atomic_files_into,
    atomic_output_dir,
    check_folder_or_absent,
    check_not_an_input,
    no_room_reported,
    sibling_lock_file,
    write_json_atomic,
)
from hf_elmo.threads import THREADS_HELP, set_threads, threads_error


logger = logging.getLogger(__name__)

# The files a run adds to its output folder besides the model and tokenizer (metrics.json, our full report of every
# split and the layer weights, and layer_weights.png are named in hf_elmo.publish, which puts them on the card).
LABELS_FILE = "labels.json"
PREDICTIONS_FILE = "predictions.txt"
# The training arguments metrics.json records (and the model card shows).
TRAINING_ARGUMENTS_SHOWN = ("learning_rate", "num_train_epochs", "max_steps", "per_device_train_batch_size",
                            "gradient_accumulation_steps", "weight_decay", "warmup_steps", "lr_scheduler_type", "seed")


@dataclass
class ModelArguments:
    """The ELMo model and the head put on it. A model that already has the head (fine-tuned earlier) keeps its own
    head options, except those given: a run that only predicts with it, or trains it further, must not rebuild it
    another way. The defaults below are for a new head."""

    HEAD_OPTIONS = ("mix_layer_norm", "mix_l2_coef", "mix_dropout", "head_lstm_dim", "head_lstm_layers")
    CONFIG_KEYS = {}  # the head options ElmoConfig names otherwise

    model_name_or_path: str = field(metadata={"help": (
        "folder or Hub id of an ELMo model: a converted biLM (examples/quickstart.py writes bilm-tf's test model to "
        "out/elmo-bilm-tf-fixture), a pretrained one, or a head fine-tuned earlier (its labels, and the head "
        "options below that are not given, are then its own)."
    )})
    unfreeze_elmo: bool = field(default=False, metadata={"help": (
        "fine-tune the biLM's weights too (default: frozen, as in the paper: only the layer mix and the head learn)."
    )})
    mix_layer_norm: bool = field(default=False, metadata={"help": (
        "layer-normalise each biLM layer (per sentence) before mixing the layers."
    )})
    mix_l2_coef: float = field(default=0.0, metadata={"help": (
        "L2 penalty pulling the layer weights toward an even mix (the paper's lambda; 0 = none)."
    )})
    mix_dropout: float = field(default=0.2, metadata={"help": "dropout on the mixed ELMo vectors."})
    head_lstm_dim: int | None = field(default=128, metadata={"help": (
        "units per direction of the biLSTM between the mix and the classifier (the paper's task models have one); "
        "0 = none, a linear classifier on the mix."
    )})
    head_lstm_layers: int = field(default=1, metadata={"help": "layers of that biLSTM."})

    # The head options given on the command line (or in the options file); `parse_arguments` sets it. None: all.
    options_given = None

    def head_options(self, fine_tuned=None) -> dict:
        """
        `from_pretrained` keyword arguments for the head: each head option as given, else the value in `fine_tuned`
        (the config of a model that already has this head, `fine_tuned_config`), else the default.
        """
        options = {"freeze_elmo": not self.unfreeze_elmo}
        for name in self.HEAD_OPTIONS:
            key = self.CONFIG_KEYS.get(name, name)
            if fine_tuned is not None and self.options_given is not None and name not in self.options_given:
                options[key] = getattr(fine_tuned, key)
            else:
                options[key] = (getattr(self, name) or None) if name == "head_lstm_dim" else getattr(self, name)
        return options


def options_given(argv: list[str], names) -> set[str]:
    """Which of the options `names` `argv` gives (as --name, --name=..., or with dashes for underscores)."""
    spellings = {f"--{spelling}": name for name in names for spelling in (name, name.replace("_", "-"))}
    return {spellings[item.split("=", 1)[0]] for item in argv if item.split("=", 1)[0] in spellings}


@dataclass
class DataArguments:
    """Where the data comes from and how much of it is used (the scripts add their own columns)."""

    train_file: str | None = field(default=None, metadata={"help": "training data file."})
    validation_file: str | None = field(default=None, metadata={"help": (
        "evaluated after every epoch (--eval_strategy) and at the end."
    )})
    test_file: str | None = field(default=None, metadata={"help": (
        "scored once at the end; its predictions go to predictions.txt."
    )})
    dataset_name: str | None = field(default=None, metadata={"help": (
        "instead of files: a `datasets` name (needs the network and `pip install \"hf-elmo[examples]\"`) or a local "
        "folder of train/validation/test data files."
    )})
    dataset_config_name: str | None = field(default=None, metadata={"help": "configuration of --dataset_name."})
    max_train_samples: int | None = field(default=None, metadata={"help": "use only the first N training examples."})
    max_eval_samples: int | None = field(default=None, metadata={"help": "use only the first N validation examples."})
    max_predict_samples: int | None = field(default=None, metadata={"help": "use only the first N test examples."})
    label_list: list[str] | None = field(default=None, metadata={"help": (
        "the labels and their order (ids 0, 1, ...), e.g. --label_list O B-PER I-PER ...; any other label in the "
        "data is an error (default: a fine-tuned --model_name_or_path's labels, else those of the training data)."
    )})
    task_name: str | None = field(default=None, metadata={"help": (
        "name of the task in metrics.json, the plot and the model card (default: the head's, e.g. "
        "token-classification)."
    )})


@dataclass
class ElmoTrainingArguments(TrainingArguments):
    """
    Transformers' `TrainingArguments`, with defaults for a frozen ELMo: a head on frozen features learns at a rate
    100x a fine-tuning rate (measured on CoNLL-2003, README "Fine-tuning"), evaluates and saves every epoch.
    """

    overwrite_output_dir: bool = field(default=False, metadata={"help": (
        "replace a non-empty --output_dir (one that hf_elmo or the Trainer wrote) when the run has finished; without "
        "it such a folder is refused, unless it holds checkpoints of this same run (the same model, data files, "
        "labels and training arguments), which are then resumed from."
    )})
    learning_rate: float = field(default=1e-2, metadata={"help": "peak AdamW learning rate."})
    num_train_epochs: float | None = field(default=None, metadata={"help": (
        f"training epochs (default: enough for {HEAD_MIN_STEPS} optimizer steps, at least {HEAD_MIN_EPOCHS} and at "
        f"most {HEAD_MAX_EPOCHS}: {default_head_epochs(2000, 32)} for 2,000 sentences at batch 32, "
        f"{default_head_epochs(14041, 32)} for CoNLL-2003's 14,041; measured, README \"Small data\")."
    )})
    per_device_train_batch_size: int = field(default=32, metadata={"help": "sentences per device in training."})
    per_device_eval_batch_size: int = field(default=32, metadata={"help": "sentences per device in evaluation."})
    eval_strategy: IntervalStrategy | str = field(default="epoch", metadata={"help": (
        "when to evaluate the validation data: no, steps or epoch (with no validation data: no)."
    )})
    save_strategy: IntervalStrategy | str = field(default="epoch", metadata={"help": (
        "when to write a checkpoint: no, steps, epoch or best."
    )})
    save_total_limit: int | None = field(default=2, metadata={"help": "keep at most this many checkpoints."})
    logging_steps: float = field(default=50, metadata={"help": "log the training loss every this many steps."})
    threads: int | None = field(default=None, metadata={"help": THREADS_HELP})
    early_stopping_patience: int | None = field(default=None, metadata={"help": (
        "stop when the validation score has not improved for this many evaluations in a row, and keep the best "
        "checkpoint (Transformers' EarlyStoppingCallback; turns on --load_best_model_at_end). The score is "
        "--metric_for_best_model, default the task's: entity f1 with chunk tags, token_accuracy for other tags, "
        f"accuracy for sentence classes; 0 turns it off (default: {HEAD_PATIENCE} when there is validation data "
        "and it is scored when checkpoints are saved, --eval_strategy as --save_strategy; else off)."
    )})

    def __post_init__(self):
        # What the command line said, before TrainingArguments fills in its own defaults.
        self.output_dir_given = self.output_dir is not None
        self.steps_given = self.do_train or self.do_eval or self.do_predict
        # TrainingArguments turns do_eval on whenever eval_strategy is not "no" (ours is "epoch"): --do_predict
        # alone then asked for validation data it did not need.
        self.steps_asked = (self.do_train, self.do_eval, self.do_predict)
        super().__post_init__()
        import torch

        if not torch.accelerator.is_available():  # pinning needs an accelerator; without one torch only warns
            self.dataloader_pin_memory = False


class HelpFormatter(argparse.RawDescriptionHelpFormatter, argparse.ArgumentDefaultsHelpFormatter):
    """The script's docstring as written, and each option's default (as HfArgumentParser shows them), except where
    the help already says what the default is (a None there stands for a rule the help states)."""

    def _get_help_string(self, action):
        if "(default:" in (action.help or ""):
            return action.help
        return super()._get_help_string(action)


def options_from_json(path: str, parser) -> list[str]:
    """
    The command line that a .json options file stands for (`{"option": value, ...}`; a list gives several values,
    null the default), so that it is checked and converted exactly as the command line is: a type that does not
    fit, an unknown option or "false" for a flag (false, never true) mean what they mean there. HfArgumentParser's
    own `parse_json_file` builds the arguments without converting them, which stored "false" as a string and
    built a CRF head. A file that cannot be read or is not a JSON object is a usage error naming it.
    """
    try:
        with open(path, encoding="utf-8") as handle:
            options = json.load(handle)
    except FileNotFoundError:
        parser.error(f"{path}: no such options file")
    except (OSError, UnicodeDecodeError) as error:
        parser.error(f"{path}: cannot be read ({error})")
    except json.JSONDecodeError as error:
        parser.error(f"{path}: not valid JSON (line {error.lineno}, column {error.colno}: {error.msg})")
    if not isinstance(options, dict):
        parser.error(f"{path}: expected a JSON object of options and values, got a JSON {type(options).__name__}")
    text = lambda value: json.dumps(value) if isinstance(value, dict) else str(value)  # noqa: E731
    argv = []
    for key, value in options.items():
        if value is not None:
            argv += [f"--{key}", *(map(text, value) if isinstance(value, list) else [text(value)])]
    return argv


def parse_arguments(data_arguments, model_arguments=ModelArguments, argv=None, description=None):
    """
    (model, data, training) arguments from the command line, or from one .json file of them, as in Transformers'
    examples. Usage errors (exit status 2) for what cannot work: no data, no --output_dir, a Hub push offline.
    """
    parser = HfArgumentParser((model_arguments, data_arguments, ElmoTrainingArguments), description=description,
                              formatter_class=HelpFormatter)
    argv = sys.argv[1:] if argv is None else list(argv)
    options_file = argv[0] if len(argv) == 1 and argv[0].endswith(".json") else None
    if options_file:
        argv = options_from_json(options_file, parser)
    try:
        model, data, training, unknown = parser.parse_args_into_dataclasses(args=argv, return_remaining_strings=True)
    except ValueError as error:  # TrainingArguments' own checks (--bf16 on a CPU without --use_cpu, ...)
        parser.error(" ".join(str(error).split()))
    model.options_given = options_given(argv, model.HEAD_OPTIONS)
    if unknown:
        names = [item for item in unknown if item.startswith("-")] or unknown
        parser.error(f"{options_file}: unknown options {', '.join(n.lstrip('-') for n in names)}" if options_file
                     else f"unrecognized arguments: {' '.join(unknown)}")
    if not training.output_dir_given:
        parser.error("the following arguments are required: --output_dir")
    if not (data.train_file or data.validation_file or data.test_file or data.dataset_name):
        parser.error("give the data: --train_file (and --validation_file, --test_file), or --dataset_name")
    if data.dataset_name and (data.train_file or data.validation_file or data.test_file):
        parser.error("--dataset_name and --train_file / --validation_file / --test_file are exclusive")
    # Counts: the sample limits may be None (all); batch sizes and accumulation steps of 0 failed mid-run.
    for options, name in ((data, "max_train_samples"), (data, "max_eval_samples"), (data, "max_predict_samples"),
                          (training, "per_device_train_batch_size"), (training, "per_device_eval_batch_size"),
                          (training, "gradient_accumulation_steps")):
        value = getattr(options, name)
        if value is not None and value < 1:
            parser.error(f"--{name} must be >= 1, got {value}")
    if threads_error(training.threads):
        parser.error(threads_error(training.threads))
    if training.early_stopping_patience is not None and training.early_stopping_patience < 0:
        parser.error(f"--early_stopping_patience must be >= 0 (0: off), got {training.early_stopping_patience}")
    if training.num_train_epochs is not None and not training.num_train_epochs > 0:
        parser.error(f"--num_train_epochs must be > 0, got {training.num_train_epochs:g}")
    check_numbers(model, training, parser)
    check_trainer_packages(training, parser)
    if training.push_to_hub:
        from huggingface_hub import constants, get_token

        if constants.is_offline_mode():
            parser.error("--push_to_hub: HF_HUB_OFFLINE=1 is set, so nothing can be pushed to the Hub; unset it or "
                         "drop --push_to_hub")
        if get_token() is None:
            parser.error("--push_to_hub: not logged in to the Hugging Face Hub; run `hf auth login` or set HF_TOKEN")
    return model, data, training


def check_numbers(model, training, parser) -> None:
    """
    The head options, as ElmoConfig checks them, and the training numbers that torch would refuse only once the run
    has started (a learning rate of -1), or take without a word (a NaN gradient-norm limit turns clipping off, a
    negative weight decay or L2 penalty pushes weights away).
    """
    from hf_elmo import ElmoConfig

    try:
        ElmoConfig(**model.head_options())
    except ValueError as error:
        parser.error(config_error_as_option(error))
    for name in ("learning_rate", "weight_decay", "max_grad_norm"):
        if error := number_error(f"--{name}", getattr(training, name)):
            parser.error(error)


def check_trainer_packages(training, parser) -> None:
    """
    The optimizer and trackers the Trainer will build, checked as it checks them but before anything is written: a
    tracker it does not know, or one or an optimizer whose package is missing, is a usage error (the Trainer found
    them when it was built, or at its first step, with a traceback).
    """
    from transformers import Trainer
    from transformers.integrations import get_available_reporting_integrations, get_reporting_integration_callbacks

    try:
        Trainer.get_optimizer_cls_and_kwargs(training)
    except ImportError as error:
        parser.error(f"--optim {training.optim.value}: {' '.join(str(error).split())}")
    available = get_available_reporting_integrations()
    for name in training.report_to:
        try:
            (callback,) = get_reporting_integration_callbacks([name])
            if name not in available:
                callback()  # as the Trainer builds it: says which package is missing
        except (ValueError, ImportError, RuntimeError) as error:
            parser.error(f"--report_to {name}: {' '.join(str(error).split())}")


def steps_to_run(training, splits) -> tuple[bool, bool, bool]:
    """--do_train / --do_eval / --do_predict; when none is given, every step the data has a split for."""
    if training.steps_given:
        return training.steps_asked
    return "train" in splits, "validation" in splits, "test" in splits


def limited(splits: dict, data) -> dict:
    """Each split cut to its `--max_*_samples` (the first N examples), as in Transformers' examples."""
    limits = {"train": data.max_train_samples, "validation": data.max_eval_samples, "test": data.max_predict_samples}
    return {split: items if limits[split] is None else items[: limits[split]] for split, items in splits.items()}


def choose_labels(data, fine_tuned, from_training) -> dict[int, str]:
    """
    `id2label`: --label_list, else the labels of `fine_tuned` (the config of a model that already has this head,
    `fine_tuned_config`; None for a new head), else `from_training()` (the training data's labels; False when there
    is no training data).
    """
    if data.label_list:
        return fixed_label_map(data.label_list)
    if fine_tuned is not None:
        return {int(i): label for i, label in fine_tuned.id2label.items()}
    if not from_training:
        raise DataFileError("no training data to take the labels from: give --label_list or --train_file.")
    return from_training()


# Written into each checkpoint the run saves, before the Trainer's files (`RunRecordCallback`): whose checkpoint it is.
RUN_RECORD_FILE = "hf_elmo_run.json"
# The training arguments that change what a run computes, besides those metrics.json shows (when it logs, evaluates
# or saves does not).
TRAINING_ARGUMENTS_RECORDED = TRAINING_ARGUMENTS_SHOWN + (
    "optim", "adam_beta1", "adam_beta2", "adam_epsilon", "max_grad_norm", "bf16", "fp16", "data_seed",
    "label_smoothing_factor", "train_sampling_strategy", "world_size", "early_stopping_patience",
    "metric_for_best_model")


def run_record(model_args, data_args, training_args, id2label: dict, load_options: dict) -> dict:
    """
    What this run is, as its checkpoints record it: the model (its config and weights by SHA-256, and the head's
    options), the training and validation data (each file by name, size and SHA-256, and the options that select
    from it), the labels in id order and the training arguments that shape the run. A checkpoint is resumed only
    when its record is this.
    """
    from dataclasses import asdict

    from transformers.utils import cached_file

    from hf_elmo.run_record import file_record, sha256_of

    name = model_args.model_name_or_path
    files = {}
    for file in ("config.json", "model.safetensors"):
        path = cached_file(name, file, _raise_exceptions_for_missing_entries=False, **load_options)
        files[file] = sha256_of(path) if path else None
    # The test data, scored once at the end, and the task's name do not change what is trained; --label_list is
    # recorded as the labels it gives.
    data = {key: file_record(value) if key.endswith("_file") and value else value
            for key, value in asdict(data_args).items()
            if key not in ("test_file", "max_predict_samples", "task_name", "label_list")}
    return {
        "model": {"name": os.path.basename(os.path.normpath(name)), "sha256": files,
                  **{key: value for key, value in asdict(model_args).items() if key != "model_name_or_path"}},
        "data": data,
        "labels": [id2label[i] for i in sorted(id2label)],
        "training": {key: getattr(getattr(training_args, key, None), "value", getattr(training_args, key, None))
                     for key in TRAINING_ARGUMENTS_RECORDED},
    }


def _checkpoints(folder: str) -> list[str]:
    """The `checkpoint-N` folders in `folder`, newest (highest N) first."""
    found = [(int(m.group(1)), name) for name in os.listdir(folder)
             if (m := re.fullmatch(r"checkpoint-(\d+)", name)) and os.path.isdir(os.path.join(folder, name))]
    return [os.path.join(folder, name) for _, name in sorted(found, reverse=True)]


def _read_record(checkpoint: str) -> dict | None:
    try:
        with open(os.path.join(checkpoint, RUN_RECORD_FILE), encoding="utf-8") as handle:
            record = json.load(handle)
    except (OSError, ValueError):
        return None
    return record if isinstance(record, dict) else None


def is_complete(checkpoint: str) -> bool:
    """Whether the Trainer finished writing `checkpoint`: trainer_state.json, which it writes last, reads whole."""
    try:
        with open(os.path.join(checkpoint, "trainer_state.json"), encoding="utf-8") as handle:
            json.load(handle)
    except (OSError, ValueError):
        return False
    return os.path.isfile(os.path.join(checkpoint, "model.safetensors"))


def checkpoint_to_resume(folder: str, record: dict) -> str | None:
    """
    The newest complete checkpoint in `folder`, once every checkpoint there shows it is this run's (its record is
    `record`); None if there is none yet. An incomplete one (a run stopped while writing it) is skipped with a log
    line naming it. A checkpoint of another run (another model, data, labels or training arguments), or one without
    a record, is a `FileExistsError` naming it and what differs.
    """
    resume = None
    for checkpoint in _checkpoints(folder):
        check_own_checkpoint(checkpoint, record)
        if not is_complete(checkpoint):
            logger.warning("Skipping %s: incomplete (a run stopped while writing it)", checkpoint)
        elif resume is None:
            resume = checkpoint
    return resume


# What to do about a checkpoint that is not this run's: one found in --output_dir, or one named on the command line.
FOUND_CHECKPOINT_REMEDY = ("Pass --overwrite_output_dir to start afresh (the folder is replaced when this run has "
                           "finished), or choose another --output_dir.")
NAMED_CHECKPOINT_REMEDY = "Resume only a checkpoint of this run, or leave --resume_from_checkpoint out."


def check_own_checkpoint(checkpoint: str, record: dict, remedy: str = FOUND_CHECKPOINT_REMEDY) -> None:
    """A `FileExistsError` naming `checkpoint` unless its record is `record`: what differs, or that it has none."""
    from hf_elmo.run_record import differences

    recorded = _read_record(checkpoint)
    if recorded is None:
        raise FileExistsError(f"{checkpoint} is not a checkpoint of this script's runs (no readable "
                              f"{RUN_RECORD_FILE}); nothing was touched. {remedy}")
    changed = differences(recorded, record)
    if changed:
        raise FileExistsError(f"{checkpoint} is a checkpoint of another run ({'; '.join(changed)}); resuming it would "
                              f"continue that run, and nothing was touched. {remedy}")


class RunRecordCallback(TrainerCallback):
    """Writes the run's record into each checkpoint: before the Trainer writes it (when the step or epoch that
    saves ends), so that a checkpoint cut short is still known as this run's, and again once it is saved."""

    def __init__(self, record: dict):
        self.record = record

    def _write(self, args, state) -> None:
        if args.should_save:
            folder = os.path.join(args.output_dir, f"checkpoint-{state.global_step}")
            os.makedirs(folder, exist_ok=True)
            write_json(os.path.join(folder, RUN_RECORD_FILE), self.record)

    def on_step_end(self, args, state, control, **kwargs):
        if control.should_save:
            self._write(args, state)

    on_epoch_end = on_step_end

    def on_save(self, args, state, control, **kwargs):
        self._write(args, state)


class ValidationLog(TrainerCallback):
    """One log line per evaluation (the validation scores, and the best so far by --metric_for_best_model), and one
    at the end saying why training stopped: the epochs or steps asked for ran out, or early stopping."""

    def __init__(self, patience: int | None):
        self.patience = patience  # of the EarlyStoppingCallback beside it, if any
        self.best = None  # (score, step) by --metric_for_best_model, this evaluation included

    def on_evaluate(self, args, state, control, metrics=None, **kwargs):
        metrics = {k.removeprefix("eval_"): v for k, v in (metrics or {}).items()
                   if isinstance(v, float) and k != "epoch" and not k.endswith(("_runtime", "_per_second"))}
        scores = ", ".join(f"{k} {v:.4f}" for k, v in metrics.items())
        name, best = (args.metric_for_best_model or "").removeprefix("eval_"), ""
        if name in metrics:
            better = (lambda a, b: a > b) if args.greater_is_better is not False else (lambda a, b: a < b)
            if self.best is None or better(metrics[name], self.best[0]):
                self.best = (metrics[name], state.global_step)
            best = f"; best {name} {self.best[0]:.4f} (step {self.best[1]})"
        logger.info("Validation at epoch %.2f, step %d: %s%s", state.epoch or 0, state.global_step, scores, best)

    def on_train_end(self, args, state, control, **kwargs):
        if state.global_step >= state.max_steps:
            reason = (f"the {args.max_steps} steps of --max_steps ran" if args.max_steps > 0
                      else f"all {args.num_train_epochs:g} epochs ran")
        else:
            reason = (f"early stopping: {args.metric_for_best_model} did not improve for {self.patience} "
                      "evaluations in a row")
        kept = (f"; the best checkpoint (step {state.best_global_step}, {args.metric_for_best_model} "
                f"{state.best_metric:.4f}) is kept" if args.load_best_model_at_end and state.best_metric is not None
                else "")
        logger.info("Training stopped at step %d of %d: %s%s", state.global_step, state.max_steps, reason, kept)


class OutputFolder:
    """
    Where a run writes, by the rules of the `hf-elmo` commands:

    - never the base model's folder, a folder that holds it, or one of the data files;
    - one run at a time: the run holds a lock (`.NAME.lock` beside the folder) for its lifetime, and a second run
      on the same folder is refused, touching nothing;
    - a folder that holds anything is refused unless it holds checkpoints of this same run (`run_record`: model,
      data files, labels and training arguments), which are resumed from (the newest complete one, as
      Transformers' examples do), or `--overwrite_output_dir` is given;
    - the final files (model, tokenizer, results, card) appear together when the run has finished, never half of
      them; a failure removes only what this run created: its incomplete checkpoints, and the folder itself if it
      created it and no checkpoint was completed. A failure leaves the complete checkpoints, which the next run
      resumes from, or nothing;
    - with `--overwrite_output_dir` the run works in a hidden folder beside it, which replaces the old one only at
      the end: a failed run leaves the old folder as it was. A pretraining run's folder is never replaced.
    """

    def __init__(self, output_dir: str, overwrite: bool, inputs: list[str], record: dict, main_process: bool = True):
        self.path = os.path.abspath(output_dir)
        self.inputs = [os.path.abspath(p) for p in inputs if p and os.path.exists(p)]
        check_not_an_input(self.path, self.inputs)
        check_folder_or_absent(self.path, "--output_dir")
        self.lock = OutputLock(self.path, sibling_lock_file(self.path), "fine-tuning", "--output_dir") \
            if main_process else None
        try:
            names = os.listdir(self.path) if os.path.isdir(self.path) else []
            if overwrite and TRAINING_ARGS_FILE in names:
                # An ELMo model folder, so hf-elmo's rules would let it go, with every pretraining checkpoint in it.
                raise OutputError(
                    f"{self.path}: holds an hf-elmo pretrain run ({TRAINING_ARGS_FILE}); --overwrite_output_dir "
                    "replaces a fine-tuning run's folder, never a pretraining run. Choose another --output_dir "
                    "(and pass the pretrained model as --model_name_or_path)."
                )
            self.replaces = bool(names) and overwrite
            self.resume_from = checkpoint_to_resume(self.path, record) if names and not overwrite else None
            if names and not overwrite and not _checkpoints(self.path):
                raise FileExistsError(
                    f"{self.path} already exists and is not empty; pass --overwrite_output_dir to replace it when the "
                    "run has finished, or choose another --output_dir."
                )
        except BaseException:
            self.release()
            raise
        self.created = not os.path.isdir(self.path)
        self.found = set(names)

    def release(self) -> None:
        if self.lock is not None:
            self.lock.release()

    def run(self, work):
        """`work(folder)` with the folder to give the Trainer; its result."""
        if self.replaces:
            replacing = atomic_output_dir(self.path, overwrite=True, inputs=self.inputs, flag="--overwrite_output_dir")
            with replacing as staging:
                return work(staging)
        os.makedirs(self.path, exist_ok=True)
        try:
            return work(self.path)
        except BaseException:
            self.remove_what_failed()
            raise

    def remove_what_failed(self) -> None:
        """The checkpoints this run began and did not finish; the folder, if this run created it and holds no
        complete checkpoint. Nothing that was there before the run."""
        for checkpoint in _checkpoints(self.path):
            if os.path.basename(checkpoint) not in self.found and not is_complete(checkpoint):
                shutil.rmtree(checkpoint, ignore_errors=True)
        if self.created and not any(map(is_complete, _checkpoints(self.path))):
            shutil.rmtree(self.path, ignore_errors=True)


def write_json(path: str | os.PathLike, data) -> None:
    """JSON through a temporary file in the same folder, so a crash never leaves half a file."""
    write_json_atomic(path, data, indent=2, ensure_ascii=False, newline=True)


def dataset_splits(name: str, config: str | None, columns: tuple[str, ...]) -> dict:
    """
    The train / validation / test splits that a `datasets` dataset (a Hub name or a saved folder) has, each
    checked for `columns`. Needs the datasets package (the `examples` extra).
    """
    try:
        from datasets import load_dataset
    except ImportError:
        raise DataFileError('--dataset_name needs the datasets package: pip install "hf-elmo[examples]"') from None
    dataset = load_dataset(name, config)
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


def fine_tuned_config(name: str, load_options: dict, architecture: str):
    """The config of model `name` when it already holds this kind of head (`architecture`), else None (a new head)."""
    from transformers import AutoConfig

    config = AutoConfig.from_pretrained(name, **load_options)
    return config if architecture in (getattr(config, "architectures", None) or []) else None


def fixed_label_map(label_list: list[str]) -> dict[int, str]:
    """`--label_list`, checked: each label once."""
    repeated = sorted({label for label in label_list if label_list.count(label) > 1})
    if repeated:
        raise DataFileError(f"--label_list: {', '.join(repeated)} given more than once; each label once.")
    return dict(enumerate(label_list))


def _card_trainer_class():
    # Built on first use, so that importing this module does not build a Trainer subclass.
    import torch
    from transformers import Trainer

    class ElmoFinetuningTrainer(Trainer):
        """The Trainer, with hf_elmo's model card (labels, metrics, layer weights) instead of its generic summary, and
        evaluation in the data's order under every sampling strategy."""

        def _get_eval_sampler(self, eval_dataset):
            # Transformers 5 orders evaluation by length too under train_sampling_strategy="group_by_length", and
            # predict() then returns the sentences in that order: predictions.txt would pair them with the wrong
            # sentences. Evaluation keeps the data's order, as under the other strategies.
            if self.args.train_sampling_strategy != "group_by_length":
                return super()._get_eval_sampler(eval_dataset)
            return torch.utils.data.SequentialSampler(eval_dataset) if self.args.world_size <= 1 else None

        def create_model_card(self, **kwargs):
            # The Trainer's keywords (model_name, finetuned_from, dataset, ...) describe its own summary card; the
            # facts of this card come from the folder (config, metrics.json, layer_weights.png).
            if self.is_world_process_zero():
                write_model_card(self.args.output_dir, self.model.config,
                                 repo_id=self.hub_model_id or self.args.hub_model_id)

    return ElmoFinetuningTrainer


def write_model_card(folder: str, config, repo_id: str | None = None) -> str:
    """README.md of a fine-tuned folder: the card `hf-elmo publish` generates (labels, metrics, plot, provenance)."""
    path = os.path.join(folder, "README.md")
    folder_model_card(folder, config, repo_id=repo_id).save(path)
    return path


def copy_bilm_tf_source(name: str, load_options: dict, folder: str) -> None:
    """The base model's bilm_tf_source.json (the SHA-256 of the bilm-tf files its biLM came from), if it has one."""
    from transformers.utils import cached_file

    source = cached_file(name, SOURCE_FILE, _raise_exceptions_for_missing_entries=False, **load_options)
    if source is not None:
        shutil.copyfile(source, os.path.join(folder, SOURCE_FILE))


def save_results(folder: str, results: dict) -> None:
    """
    `{prefix}_results.json` for each of `results` (prefix -> metrics) and `all_results.json` with them all: the files
    Trainer.save_metrics writes, into `folder` (which it cannot target), all_results written once.
    """
    for prefix, metrics in results.items():
        write_json(os.path.join(folder, f"{prefix}_results.json"), metrics)
    if results:
        write_json(os.path.join(folder, "all_results.json"), {k: v for m in results.values() for k, v in m.items()})


@dataclass
class Task:
    """What a script tells `run_finetuning` about its task."""

    name: str  # the default task name, e.g. "token-classification"
    features: dict  # split -> encoded examples
    id2label: dict
    data_collator: object
    score: object  # (predictions, label_ids) -> report dict (argmax label ids in)
    summarise: object  # report -> the numbers the Trainer logs at each evaluation
    log_report: object  # (split, report) -> None
    prediction_lines: object  # (predictions, label_ids) -> lines of predictions.txt
    needs: tuple = ()  # importable modules its scores need (checked before training, with the plot's matplotlib)
    best_metric: str = "accuracy"  # the key of `summarise` that early stopping and the best checkpoint go by


def check_packages(modules) -> None:
    """One line, before any training, naming the packages of the `examples` extra that this run needs and lacks
    (it found seqeval missing only when it scored, after the whole training)."""
    import importlib.util

    missing = [module for module in ("matplotlib", *modules) if importlib.util.find_spec(module) is None]
    if missing:
        names = {"sklearn": "scikit-learn"}
        raise DataFileError(f"this run needs {', '.join(names.get(m, m) for m in missing)}, not installed: pip "
                            'install "hf-elmo[examples]"')


def apply_training_length_defaults(training_args, features: dict, do_train: bool) -> None:
    """
    --num_train_epochs and --early_stopping_patience that the user left unset take the small-data rule
    (`hf_elmo.finetuning.default_head_epochs`, HEAD_PATIENCE), and a training run says in one log line what it
    will do. Early stopping is a default only where the best evaluation has a checkpoint to go back to.
    """
    patience_given = training_args.early_stopping_patience is not None
    if not patience_given:
        scored = "validation" in features and training_args.eval_strategy != IntervalStrategy.NO
        saved_when_scored = training_args.save_strategy in (training_args.eval_strategy, "best") and (
            training_args.eval_strategy != IntervalStrategy.STEPS
            or training_args.save_steps % training_args.eval_steps == 0)
        training_args.early_stopping_patience = HEAD_PATIENCE if scored and saved_when_scored else 0
    examples = len(features.get("train", ()))
    batch_size = (training_args.train_batch_size * training_args.gradient_accumulation_steps
                  * training_args.world_size)
    epochs_given = training_args.num_train_epochs is not None
    if not epochs_given:
        training_args.num_train_epochs = float(default_head_epochs(examples, batch_size))
    if not do_train or (epochs_given and patience_given) or training_args.max_steps > 0:
        return
    patience = training_args.early_stopping_patience or None
    if not epochs_given:
        logger.info("Training length (the default; --num_train_epochs and --early_stopping_patience set it): %s",
                    head_training_rule(examples, batch_size, patience))
    elif patience:
        logger.info("Early stopping (the default; --early_stopping_patience 0 turns it off): training stops when the "
                    "validation score has not improved for %d evaluations in a row, and the best one is kept",
                    patience)


def run_finetuning(model_args, data_args, training_args, model, tokenizer, task: Task, load_options: dict) -> dict:
    """
    Train `model` with the Trainer on task.features["train"] (scored on "validation" every epoch when there is
    one), then score "validation" and "test", and write to --output_dir: the model and tokenizer, labels.json,
    metrics.json (every split's report, the layer weights), train/eval/predict/all_results.json,
    predictions.txt for the test data, layer_weights.png and the model card. With --push_to_hub the Trainer pushes
    as usual and the finished folder, without checkpoints, last. Returns metrics.json's content. `load_options`
    are the `from_pretrained` options of --model_name_or_path (model_source.resolve_model's).
    """
    check_packages(task.needs)
    do_train, do_eval, do_predict = steps_to_run(training_args, task.features)
    for wanted, split, option in ((do_train, "train", "--train_file"), (do_eval, "validation", "--validation_file"),
                                  (do_predict, "test", "--test_file")):
        if wanted and split not in task.features:
            raise DataFileError(f"there is no {split} data to {'train on' if split == 'train' else 'score'}: give "
                                f"{option}" + (" (or a --dataset_name with that split)" if split != "train" else ""))
    if "validation" not in task.features and training_args.eval_strategy != IntervalStrategy.NO:
        if training_args.load_best_model_at_end or training_args.early_stopping_patience:
            option = "early_stopping_patience" if training_args.early_stopping_patience else "load_best_model_at_end"
            raise DataFileError(f"--{option} needs validation data: give --validation_file.")
        training_args.eval_strategy = IntervalStrategy.NO
    apply_training_length_defaults(training_args, task.features, do_train)
    if training_args.early_stopping_patience:
        # Stopping on a score that no longer improves keeps the best checkpoint, as the Trainer does it.
        training_args.load_best_model_at_end = True
        training_args.metric_for_best_model = training_args.metric_for_best_model or task.best_metric
        training_args.greater_is_better = not training_args.metric_for_best_model.endswith("loss")
    set_threads(training_args.threads)
    inputs = [model_args.model_name_or_path, data_args.train_file, data_args.validation_file, data_args.test_file]
    record = run_record(model_args, data_args, training_args, task.id2label, load_options)
    resume = training_args.resume_from_checkpoint
    if resume is not None:
        if not os.path.isdir(resume):
            raise FileNotFoundError(f"--resume_from_checkpoint: {resume} is not a folder.")
        check_own_checkpoint(resume, record, NAMED_CHECKPOINT_REMEDY)
    output = OutputFolder(training_args.output_dir, training_args.overwrite_output_dir, inputs, record,
                          main_process=training_args.process_index == 0)
    try:
        if training_args.push_to_hub and training_args.hub_model_id is None:
            # The Trainer names the repository after the folder it writes to, which may be a hidden staging folder.
            training_args.hub_model_id = os.path.basename(output.path)
        if resume is None and output.resume_from is not None and do_train:
            resume = output.resume_from
            logger.info("Checkpoint found: resuming from %s (--overwrite_output_dir starts over instead)", resume)

        def work(folder: str) -> dict:
            training_args.output_dir = folder
            return _train_and_report(model_args, data_args, training_args, model, tokenizer, task, resume,
                                     (do_train, do_eval, do_predict), load_options, record)

        # A full disk: one line, not safetensors' or torch's traceback.
        with no_room_reported(output.path, "complete checkpoints are kept"):
            metrics = output.run(work)
    finally:
        output.release()
    training_args.output_dir = output.path
    return metrics


def _train_and_report(model_args, data_args, training_args, model, tokenizer, task: Task, resume, steps,
                      load_options, record: dict) -> dict:
    do_train, do_eval, do_predict = steps
    folder = training_args.output_dir

    def compute_metrics(evaluation):
        return task.summarise(task.score(evaluation.predictions, evaluation.label_ids))

    trainer = _card_trainer_class()(
        model=model,
        args=training_args,
        train_dataset=task.features.get("train") if do_train else None,
        eval_dataset=task.features.get("validation"),
        data_collator=task.data_collator,
        processing_class=tokenizer,
        compute_metrics=compute_metrics,
        # Keep only the argmax: whole logits of every evaluation example would be gathered in memory.
        preprocess_logits_for_metrics=lambda logits, labels: logits.argmax(-1),
        callbacks=[RunRecordCallback(record), ValidationLog(training_args.early_stopping_patience)]
        + ([EarlyStoppingCallback(training_args.early_stopping_patience)] if training_args.early_stopping_patience
           else []),
    )
    task_name = data_args.task_name or task.name
    metrics = {
        "task": task_name,
        # A local folder by its name only: its absolute path says nothing to a reader, and is the user's own (it
        # went into metrics.json and the card, which publish uploads).
        "model": os.path.basename(os.path.normpath(model_args.model_name_or_path))
        if os.path.isdir(model_args.model_name_or_path) else model_args.model_name_or_path,
        # Hub ids only (for the card's metadata): a local folder means nothing to a reader of the Hub page.
        "base_model": None if os.path.isdir(model_args.model_name_or_path) else model_args.model_name_or_path,
        "datasets": [data_args.dataset_name] if data_args.dataset_name and not os.path.isdir(data_args.dataset_name)
        else [],
        "dataset_config": data_args.dataset_config_name,
        "data_files": {split: os.path.basename(path) for split, path in (
            ("train", data_args.train_file), ("validation", data_args.validation_file),
            ("test", data_args.test_file)) if path},
        "training_arguments": {name: getattr(getattr(training_args, name), "value", getattr(training_args, name))
                               for name in TRAINING_ARGUMENTS_SHOWN},
    }
    results = {}
    if do_train:
        try:
            trained = trainer.train(resume_from_checkpoint=resume)
        except pickle.UnpicklingError:
            # torch's weights-only loader refused a file of the checkpoint (optimizer.pt, scheduler.pt,
            # rng_state.pth); its message ends by advising weights_only=False, which would run the file's code.
            raise DataFileError(
                f"--resume: a file of {resume} holds more than tensors and plain values, and loading it would mean "
                "unpickling it, which can run any code in the file: the checkpoint is not trusted, and nothing of it "
                f"was loaded. Remove {resume} to resume from an earlier checkpoint, or pass --overwrite_output_dir "
                "to start afresh."
            ) from None
        train_metrics = {**trained.metrics, "train_samples": len(task.features["train"])}
        trainer.log_metrics("train", train_metrics)
        metrics["train_loss"] = trained.training_loss
        results["train"] = train_metrics
    predictions = None
    for split, prefix, wanted in (("validation", "eval", do_eval), ("test", "predict", do_predict)):
        if not wanted:
            continue
        prediction = trainer.predict(task.features[split], metric_key_prefix=prefix)
        report = task.score(prediction.predictions, prediction.label_ids)
        report["loss"] = prediction.metrics[f"{prefix}_loss"]
        task.log_report(split, report)
        results[prefix] = {**prediction.metrics, f"{prefix}_samples": len(task.features[split])}
        trainer.log_metrics(prefix, results[prefix])
        metrics[split] = report
        if split == "test":
            predictions = task.prediction_lines(prediction.predictions, prediction.label_ids)
    weights = model.layer_weights().tolist()
    metrics["layer_weights"] = weights
    metrics["gamma"] = float(model.encoder.mix.gamma.detach())
    logger.info("Layer weights (token layer first): %s, gamma %.4f", ", ".join(f"{w:.3f}" for w in weights),
                metrics["gamma"])

    if trainer.is_world_process_zero():
        # The final files appear together, the weights last: a reader never finds half a model.
        with atomic_files_into(folder, last=("model.safetensors",)) as staging:
            trainer.save_model(staging, _internal_call=True)  # internal: no push of a folder not yet complete
            write_json(os.path.join(staging, LABELS_FILE), {"id2label": {str(i): l for i, l in task.id2label.items()}})
            write_json(os.path.join(staging, METRICS_FILE), metrics)
            save_results(staging, results)
            if predictions is not None:
                with open(os.path.join(staging, PREDICTIONS_FILE), "w", encoding="utf-8") as handle:
                    handle.writelines(line + "\n" for line in predictions)
            plot_layer_weights({task_name: weights}, os.path.join(staging, LAYER_WEIGHTS_PLOT))
            if model.config.freeze_elmo:  # the biLM is still the base's: its bilm-tf provenance holds
                copy_bilm_tf_source(model_args.model_name_or_path, load_options, staging)
            write_model_card(staging, model.config, repo_id=trainer.hub_model_id or training_args.hub_model_id)
    if training_args.push_to_hub:
        # Uploads the finished folder (its card included), checkpoints left out.
        commit = trainer.push_to_hub(commit_message="End of training")
        logger.info("Pushed %s to the Hub: %s", folder, getattr(commit, "commit_url", commit))
    logger.info("Saved the model, %s, %s, the *_results.json files%s, %s and README.md to %s", LABELS_FILE,
                METRICS_FILE, f", {PREDICTIONS_FILE}" if predictions is not None else "", LAYER_WEIGHTS_PLOT,
                training_args.output_dir)
    return metrics


def run_example(main) -> int:
    """
    An example's entry point, with the error convention of the `hf-elmo` commands: one `error: ...` line and exit
    status 1 for bad data files, missing files, outputs that cannot be written (a full disk included); the
    traceback with HF_ELMO_DEBUG=1. SIGTERM stops it as Ctrl-C does.
    """
    from hf_elmo.cli import handle_sigterm, run_reporting_errors
    from hf_elmo.hub_timeouts import enforce_hub_timeouts

    enforce_hub_timeouts()  # as the hf-elmo commands: a Hub that does not answer is an error, not a long wait
    handle_sigterm()

    def run() -> int:
        main()  # returns the metrics
        return 0

    return run_reporting_errors(run, "fine-tuning")
