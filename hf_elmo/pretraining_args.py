"""Pretrain (or adapt) an ELMo biLM with Accelerate: one CPU, many GPUs, resumable.

    hf-elmo pretrain --train-files 'corpus/train-*.txt' --eval-file corpus/heldout.txt --build-vocab --min-count 3 \\
        --config small --batch-size 64 --max-steps 100000 --output-dir elmo-news

    accelerate launch --multi_gpu --num_processes 8 --mixed_precision bf16 -m hf_elmo.cli pretrain ...same options...

    hf-elmo pretrain --dataset-name wikimedia/wikipedia --dataset-config 20231101.nb --eval-fraction 0.01 \\
        --build-vocab --min-count 3 --config small --max-steps 100000 --output-dir elmo-nb \\
        --push-to-hub --hub-model-id your-name/elmo-nb

(`hf-elmo-pretrain` and `examples/pretrain_elmo.py` are older names of the same program.)

The corpus is plain text, one sentence per line, in any number of shards (globs), or a `datasets` dataset exported
once into such files, or read as a stream with --streaming (hf_elmo.pretraining_datasets). It is read a shuffle
window at a time, so it may be larger than memory. Batches are whole sentences, each read from a zero LSTM state
(see hf_elmo.pretraining_data for why this and not bilm-tf's stateful 20-token windows). The objective is bilm-tf's:
forward and backward LM losses over a frequency-sorted word vocabulary, one softmax shared by both directions, a
sampled softmax with 8192 log-uniform negatives in training, the full softmax for evaluation. So is the recipe, by
default: a new model starts from bilm-tf's initialisers, dropout 0.1 on every LSTM layer's input and on the top
layer, the gradient of the mean loss x 20 (bilm-tf's unroll_steps), clipped to a global norm of 10, and Adagrad (lr
0.2, initial accumulator 1.0).

OUTPUT_DIR ends up holding the final model (`AutoModel.from_pretrained(OUTPUT_DIR)` gives the biLM,
`AutoModelForPreTraining` the biLM with its softmax), the tokenizer with the vocabulary (vocab.txt, bilm-tf's
format), `checkpoint-STEP/` folders (each a model folder too; `--resume` continues from the latest one exactly as
if never stopped), every metric in metrics.jsonl (and TensorBoard logs under logs/ when TensorBoard is installed),
training_args.json and eval_results.json. Export the biLM and its vocabulary for bilm-tf with `hf-elmo convert
--to-bilm-tf OUTPUT_DIR --output DIR`.
"""

import argparse

from .elmo_presets import ELMO_PRESETS
from .option_checks import number_error
from .threads import THREADS_HELP, threads_argument


DEFAULT_LEARNING_RATES = {"adagrad": 0.2, "adamw": 1e-3}
# Transformers' schedules that need nothing but the warm-up and total steps.
LR_SCHEDULERS = ("constant", "constant_with_warmup", "linear", "cosine", "polynomial", "inverse_sqrt")


def build_parser() -> argparse.ArgumentParser:

    parser = argparse.ArgumentParser(
        prog="hf-elmo pretrain", description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    data = parser.add_argument_group("data")
    data.add_argument("--train-files", nargs="+", metavar="GLOB",
                      help="training text: one sentence per line, UTF-8; one or more files or glob patterns (quote "
                      "them), read as shards in a new shuffled order every epoch. Or --dataset-name.")
    data.add_argument("--eval-file", default=None,
                      help="held-out text (same format) for forward/backward perplexity with the full softmax.")
    data.add_argument("--pre-tokenizer", default="ptb", metavar="{ptb,bert,whitespace,MODULE:FUNCTION}",
                      help="how lines are split into words, saved with the tokenizer so that later use splits text "
                      "the same way (default: %(default)s; 'whitespace' for text that is already tokenised). None of "
                      "the three segments Chinese, Japanese or Thai: a run of such characters between spaces is one "
                      "word, read as its first 48 bytes. For those, segment the text first and use 'whitespace', or "
                      "name a segmenter of your own, MODULE:FUNCTION (a function of a line that returns its words, "
                      "e.g. a wrapper around jieba.lcut); the tokenizer records the name, and loading it later needs "
                      "the function registered (README, 'Scripts written without spaces').")
    hub_data = parser.add_argument_group(
        "data from `datasets` (instead of --train-files; needs `pip install datasets`): the split's text column is "
        "exported once into text files in the user cache ($HF_ELMO_CACHE/datasets) and read as --train-files are, "
        "or, with --streaming, read as the run trains")
    hub_data.add_argument("--dataset-name", metavar="NAME_OR_FOLDER",
                          help="a dataset on the Hub (e.g. wikimedia/wikipedia), a folder of data files (parquet, "
                          "json lines, csv, text) or a folder written by save_to_disk.")
    hub_data.add_argument("--dataset-config", default=None, help="its configuration (e.g. 20231101.nb).")
    hub_data.add_argument("--dataset-revision", default=None,
                          help="a Hub dataset's branch, tag or commit (default: the newest); the commit read is "
                          "recorded, and every process reads that one.")
    hub_data.add_argument("--dataset-split", default="train", help="the split to train on (default: %(default)s).")
    hub_data.add_argument("--text-column", default=None,
                          help="the column holding the text (default: the only string column; several are an "
                          "error listing them). A record's text is split into lines; records without text are "
                          "counted and skipped.")
    hub_data.add_argument("--streaming", action="store_true",
                          help="read the split as training goes instead of exporting it whole first: only what is "
                          "trained on is downloaded and read, and memory holds the shuffle window, not the corpus. "
                          "The dataset's shards (data files) are shuffled per epoch, records inside a window; "
                          "--resume reads on from where the checkpoint stopped.")
    hub_data.add_argument("--eval-split", default=None, help="a split of held-out text (instead of --eval-file).")
    hub_data.add_argument("--eval-fraction", type=float, default=None,
                          help="hold out this fraction of the training split's records, its last ones, as held-out "
                          "text (instead of --eval-file or --eval-split).")
    data.add_argument("--max-sentence-words", type=int, default=100,
                      help="lines with more words are cut into pieces of at most this many (default: %(default)s).")
    data.add_argument("--shuffle-window", type=int, default=100_000,
                      help="sentences read and shuffled together; the memory held by the data stream "
                      "(default: %(default)s).")
    data.add_argument("--no-group-by-length", action="store_true",
                      help="do not batch sentences of similar length together inside a shuffle window (grouping "
                      "saves padding; batches are still shuffled).")
    data.add_argument("--num-workers", type=int, default=2,
                      help="DataLoader worker processes per training process that read the corpus and build the "
                      "batches while the model trains; 0 = build them in the training process. The batches are "
                      "the same whatever the number (default: %(default)s).")
    data.add_argument("--data-timeout", type=float, default=600.0,
                      help="with --num-workers > 0: stop with an error when the workers deliver no batch for this "
                      "many seconds, instead of waiting forever for a worker that cannot hand its batch over (a small "
                      "/dev/shm, a file-size limit); 0 = wait forever (default: %(default)s).")

    vocab = parser.add_argument_group("word vocabulary (the softmax targets)")
    vocab.add_argument("--vocab", default=None,
                       help="bilm-tf vocabulary file: one word per line, most frequent first, holding <S>, </S> and "
                       "<UNK> (--build-vocab writes them first); checked before training starts.")
    vocab.add_argument("--build-vocab", action="store_true",
                       help="count the words of --train-files and write OUTPUT_DIR/vocab.txt (bilm-tf's format).")
    vocab.add_argument("--min-count", type=int, default=1,
                       help="with --build-vocab: keep words seen at least this often (default: %(default)s).")
    vocab.add_argument("--max-vocab-size", type=int, default=None,
                       help="with --build-vocab: keep at most this many entries, <S> </S> <UNK> included.")
    vocab.add_argument("--vocab-sentences", type=int, default=None, metavar="N",
                       help="with --build-vocab: count only the first N sentences (lines with a word) of the "
                       "training text, in file order: a large corpus need not be read whole first (the count is "
                       "logged). Under --streaming, without it the whole stream is read (and downloaded) first.")

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
                       help="dropout in training where bilm-tf has it: on the input of every LSTM layer and on the "
                       "top biLM layer before the softmax (default: %(default)s, as bilm-tf).")

    train = parser.add_argument_group("training")
    train.add_argument("--output-dir", required=True,
                       help="where the final model, checkpoints, logs and vocab.txt go: a new or empty folder (one "
                       "holding anything else is refused, untouched), or with --resume a folder of an earlier run. "
                       "No input may lie inside it, and one run at a time may write it (a second one is refused).")
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
    train.add_argument("--loss-scale", type=float, default=20.0,
                       help="differentiate the mean token loss times this, as bilm-tf does with its unroll_steps "
                       "(20): Adagrad's accumulator starts at 1.0, so unscaled gradients make its first steps ~75x "
                       "smaller and a new model learns several times slower. The gradient norm is clipped and "
                       "logged after scaling; the logged loss and perplexity are the true means. Set 1 for AdamW, "
                       "which is indifferent to it (default: %(default)s).")
    train.add_argument("--threads", type=threads_argument, default=None, metavar="N",
                       help=THREADS_HELP.replace("this process", "each training process"))
    train.add_argument("--max-grad-norm", type=float, default=10.0,
                       help="clip the global gradient norm to this (default: %(default)s, as bilm-tf; 0 = off).")
    train.add_argument("--mixed-precision", choices=("no", "bf16", "fp16"), default=None,
                       help="default: what `accelerate launch`/`accelerate config` says, else no.")
    train.add_argument("--seed", type=int, default=42,
                       help="seeds initialisation, data order, dropout and negatives (default: %(default)s).")
    train.add_argument("--training-step", choices=("auto", "captured", "eager"), default="auto",
                       help="captured: each optimizer step runs as two graphs (on a GPU the host launches a few "
                       "graphs a step instead of thousands of kernels), batches padded to --batch-size rows and to "
                       "a multiple of 8 words, the softmax's gradient in a dense buffer (computed and updated for "
                       "the rows a step read only); it needs Adagrad at a constant learning "
                       "rate and no fp16. eager: the step as plain PyTorch, with the softmax's sparse gradient on a "
                       "CPU. auto (default): captured on a GPU where the options allow it, else eager.")
    train.add_argument("--compile-backend", choices=("none", "inductor", "aot_eager"), default="none",
                       help="how the captured step makes its graphs. none (default): its functions as they are, "
                       "recorded as CUDA graphs on a GPU (seconds to start; plain calls on a CPU). inductor (a GPU "
                       "only): each function compiled whole by torch.compile, kernels fused, then replayed as CUDA "
                       "graphs; it compiles for minutes per sentence length with 'original' (over 3.5 minutes for one "
                       "length on an H100). aot_eager: traced and checked whole without generating code, quick on a "
                       "CPU. Not 'eager': with torch 2.13 its step keeps the step's saved tensors in reference "
                       "cycles, and memory grew by 150-200 MB a step until the kernel killed the run.")

    report = parser.add_argument_group("logging, evaluation, checkpoints")
    report.add_argument("--logging-steps", type=int, default=50,
                        help="log losses, learning rate, gradient norm and tokens/s every this many steps.")
    report.add_argument("--eval-steps", type=int, default=1000,
                        help="evaluate on --eval-file every this many steps, and at the start and end.")
    report.add_argument("--eval-batch-size", type=int, default=64, help="sentences per evaluation batch.")
    report.add_argument("--eval-max-sentences", type=int, default=None,
                        help="evaluate on the first this many sentences of --eval-file only (under --streaming, "
                        "only that many lines of --eval-split are read).")
    report.add_argument("--save-steps", type=int, default=1000, help="write a checkpoint every this many steps.")
    report.add_argument("--save-total-limit", type=int, default=2,
                        help="keep this many most recent checkpoints (default: %(default)s).")
    report.add_argument("--report-to", default="auto",
                        help="Accelerate tracker(s) for the metrics besides OUTPUT_DIR/metrics.jsonl (always written): "
                        "auto (default: tensorboard when it is installed, else none), tensorboard, wandb, ..., all, "
                        "none.")
    hub = parser.add_argument_group("publishing the finished model (as `hf-elmo publish`, with its card)")
    hub.add_argument("--push-to-hub", action="store_true",
                     help="when the run has finished, push the model, tokenizer, card and held-out perplexity curve "
                     "to --hub-model-id (needs `hf auth login` or HF_TOKEN). A failed push keeps the local result: "
                     "`hf-elmo publish OUTPUT_DIR --repo-id ...` pushes it later.")
    hub.add_argument("--hub-model-id", metavar="OWNER/NAME", help="the Hub repository to push to.")
    hub.add_argument("--hub-private", action="store_true", help="create the repository private.")
    return parser


def captured_step_unsupported(args, mixed_precision: str | None = None) -> str | None:
    """Why these options need the eager training step, or None. The captured step (hf_elmo.captured_step) runs
    Adagrad at a constant learning rate (a rate that changed every step would be a new graph every step) and no
    fp16 loss scaler (it reads the gradient on the host). `mixed_precision`, when given, is the run's own (from
    `accelerate launch` or its config when --mixed-precision is not given)."""
    mixed_precision = mixed_precision or args.mixed_precision
    if args.optimizer != "adagrad":
        return f"--optimizer {args.optimizer} (the captured step runs Adagrad, bilm-tf's optimizer)"
    if args.lr_scheduler != "constant" or args.warmup_steps:
        return "a learning-rate schedule (the captured step needs a constant learning rate)"
    if mixed_precision == "fp16":
        return "--mixed-precision fp16 (its loss scaler reads the gradient on the host; use bf16)"
    return None


def check_args(args, parser) -> None:
    for name in ("max_steps", "batch_size", "gradient_accumulation_steps", "logging_steps", "eval_steps",
                 "save_steps", "eval_batch_size", "max_sentence_words", "shuffle_window", "save_total_limit",
                 "min_count", "max_vocab_size", "eval_max_sentences"):
        value = getattr(args, name)  # the last two may be None: no limit
        if value is not None and value < 1:
            parser.error(f"--{name.replace('_', '-')} must be >= 1, got {value}")
    if bool(args.train_files) == bool(args.dataset_name):
        parser.error("give the training text: --train-files, or --dataset-name (not both)")
    dataset_options = [o for o in ("dataset_config", "dataset_revision", "text_column", "eval_split", "eval_fraction")
                       if getattr(args, o) is not None] + (["streaming"] if args.streaming else [])
    if dataset_options and not args.dataset_name:
        parser.error(f"--{dataset_options[0].replace('_', '-')} goes with --dataset-name")
    if sum(o is not None for o in (args.eval_file, args.eval_split, args.eval_fraction)) > 1:
        parser.error("--eval-file, --eval-split and --eval-fraction are exclusive: give one held-out text")
    if args.streaming and args.eval_fraction is not None:
        parser.error("--eval-fraction needs the split's length, which a stream does not know: with --streaming give "
                     "--eval-split or --eval-file")
    if args.eval_fraction is not None and not 0 < args.eval_fraction < 1:
        parser.error(f"--eval-fraction must be between 0 and 1, got {args.eval_fraction}")
    if args.vocab_sentences is not None and (args.vocab_sentences < 1 or not args.build_vocab):
        parser.error("--vocab-sentences goes with --build-vocab and must be >= 1")
    if args.vocab and args.build_vocab:
        parser.error("--vocab and --build-vocab are exclusive: use a vocabulary file, or build one")
    if (args.num_softmax_samples < 0 or args.warmup_steps < 0 or not args.max_grad_norm >= 0 or args.num_workers < 0
            or not args.data_timeout >= 0):
        parser.error("--num-softmax-samples, --warmup-steps, --max-grad-norm, --num-workers and --data-timeout must "
                     "be >= 0")
    if args.learning_rate is None:
        args.learning_rate = DEFAULT_LEARNING_RATES[args.optimizer]
    # Checked here, not by torch's optimizer when the run has started ("Invalid learning rate: -1.0", a traceback).
    for name, positive in (("loss_scale", True), ("learning_rate", False), ("adagrad_initial_accumulator", False),
                           ("weight_decay", False)):
        if error := number_error(f"--{name.replace('_', '-')}", getattr(args, name), positive):
            parser.error(error)
    if not 0 <= args.dropout < 1:
        parser.error(f"--dropout must be in [0, 1), got {args.dropout}")
    if args.training_step == "captured" and captured_step_unsupported(args):
        parser.error(f"--training-step captured does not support {captured_step_unsupported(args)}")
    check_report_to(args, parser)
    check_hub(args, parser)
    from .pretraining_data import PreTokenizerError, use_pre_tokenizer

    try:
        use_pre_tokenizer(args.pre_tokenizer)
    except PreTokenizerError as error:
        parser.error(str(error))


def check_hub(args, parser) -> None:
    """--push-to-hub can work before any training starts: a repository id, network allowed, a token (the same
    checks as `hf-elmo publish`)."""
    if not args.push_to_hub:
        if args.hub_model_id or args.hub_private:
            parser.error("--hub-model-id and --hub-private go with --push-to-hub")
        return
    if not args.hub_model_id:
        parser.error("--push-to-hub needs --hub-model-id OWNER/NAME")
    from huggingface_hub import constants, get_token

    from .publish import PublishError, check_repo_id

    try:
        check_repo_id(args.hub_model_id)
    except PublishError as error:
        parser.error(f"--hub-model-id: {error}")
    if constants.is_offline_mode():
        parser.error("--push-to-hub: HF_HUB_OFFLINE=1 is set, so nothing can be pushed to the Hub; unset it or drop "
                     "--push-to-hub")
    if get_token() is None:
        parser.error("--push-to-hub: not logged in to the Hugging Face Hub; run `hf auth login` or set HF_TOKEN")


def check_report_to(args, parser) -> None:
    """--report-to names one of Accelerate's trackers whose package is installed (asked through Accelerate's own
    `is_<name>_available`), "all" or "none"; "auto" becomes tensorboard where installed. Else a usage error, before
    anything is written."""
    import accelerate.tracking
    import accelerate.utils

    def available(name: str) -> bool:
        return getattr(accelerate.utils, f"is_{name}_available")()

    trackers = sorted(accelerate.tracking.LOGGER_TYPE_TO_CLASS)
    if args.report_to == "auto":
        args.report_to = "tensorboard" if available("tensorboard") else "none"
    elif args.report_to not in (*trackers, "all", "none"):
        parser.error(f"--report-to {args.report_to!r} is not a tracker Accelerate knows: choose one of "
                     f"{', '.join(trackers)}, all, none (or auto)")
    elif args.report_to in trackers and not available(args.report_to):
        extra = " (or hf-elmo[pretraining])" if args.report_to == "tensorboard" else ""
        parser.error(f"--report-to {args.report_to} needs the {args.report_to} package: pip install "
                     f"{args.report_to}{extra}; or pass --report-to none")


def parse_args(argv=None) -> argparse.Namespace:
    """The options of `hf-elmo pretrain`, checked; usage errors exit with status 2 and the command's usage."""
    parser = build_parser()
    args = parser.parse_args(argv)
    check_args(args, parser)
    return args
