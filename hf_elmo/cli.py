"""`hf-elmo`: convert bilm-tf ELMo files, embed text files, publish to the Hub, pretrain.

    hf-elmo convert --options options.json --weights weights.hdf5 --output elmo
    hf-elmo embed sentences.txt vectors.hdf5 --model elmo
    hf-elmo publish elmo --repo-id you/elmo --dry-run
    hf-elmo pretrain --help
    hf-elmo allennlp-elmo sentences.txt vectors.hdf5 --all   # AllenNLP 0.9's `allennlp elmo`, its file layout

Run `hf-elmo COMMAND --help` for the options of each command.
"""

import argparse
import logging
import os
import shutil
import signal
import sys

from .threads import THREADS_HELP, keep_compiled_code_in_user_cache, set_threads, threads_argument


logger = logging.getLogger("hf_elmo.cli")

EMBED_DESCRIPTION = """\
Embed every line of a text file (one sentence per line) with an ELMo model and write the vectors to HDF5.

Output: dataset "i" holds line i+1 of the input (keys are 0-based line indices, as AllenNLP's elmo command
wrote them), with shape
  --all      (L+1, words, H): every layer; layer 0 is the token layer [x; x], layer l the l-th biLSTM
             layer [forward; backward] (default)
  --top      (words, H): the top layer
  --average  (words, H): the mean of the L+1 layers
where H = 2 * projection_dim. Each dataset has attributes line_number (1-based), text (the line), words
(JSON list of the words, one per vector) and, for a line split into pieces, pieces (word offsets of the
pieces). The file's attributes record the options, the model and the counts of empty and split lines and
of lines with cut words.
Read it with h5py: vectors = f["0"][...]; words = json.loads(f["0"].attrs["words"]).

Lines with no words are stored as empty datasets (0 words) and logged with their line numbers; an empty
input gives a file without datasets, with a warning. Lines of more than --max-words words are split into
pieces embedded independently (context does not cross a piece boundary), stored one after the other in
the line's dataset, and logged. A word of more than 48 UTF-8 bytes is read as its first 48 (as bilm-tf
reads it), and its line is logged. The model is stateless: a line's vectors depend only on that line
(equal to float32 rounding wherever it appears; bit for bit with --batch-size 1), and the same input and
options give the same file. The output appears only when complete: it is written to a hidden
.NAME.<pid>.partial file beside it and renamed at the end.
"""

PUBLISH_DESCRIPTION = """\
Push a saved ELMo folder (from hf-elmo convert, save_pretrained or a Trainer) to the Hugging Face Hub.

The uploaded folder is prepared in a temporary directory: the model re-saved as safetensors with its config,
the tokenizer, the code files that let AutoModel/AutoTokenizer.from_pretrained(..., trust_remote_code=True)
work without hf_elmo installed, bilm_tf_source.json and other code/json/png files of the folder, and a model
card (README.md) generated from the folder's metadata (for a fine-tuned head: its labels, the metrics of its
run from metrics.json and the embedded layer_weights.png). Training state, other weight formats and
sub-folders are left out (listed with --dry-run). Log in first with `hf auth login` or set HF_TOKEN.
"""

ALLENNLP_ELMO_DESCRIPTION = """\
AllenNLP 0.9's `allennlp elmo` command, on hf_elmo: the same arguments, the same HDF5 layout, the same numbers.

One dataset per input line (one tokenised sentence per line, split on whitespace), named by its 0-based line
index (or by the sentence, --use-sentence-keys), holding (3, words, H) with --all, (words, H) with --top or
--average; and a "sentence_to_index" dataset with the JSON map of each sentence to its key (unless
--forget-sentences or --use-sentence-keys). A blank line is an error. As in AllenNLP the biLM is stateful: each
batch row starts from the LSTM state the same row ended the previous batch with (hf-elmo embed is stateless).
Weights: a bilm-tf options/weight pair (paths or URLs, converted once into $HF_ELMO_CACHE/allennlp, default
~/.cache/hf_elmo/allennlp), or a converted folder or Hub id as --options-file with --weight-file none. Unlike
AllenNLP, the output appears only when complete and an existing one is replaced only with --overwrite.
"""

PRETRAIN_HELP = "pretrain an ELMo biLM with Accelerate (options: hf-elmo pretrain --help)"
# Errors: one `error: ...` line and exit status 1 (usage errors: the command's usage and 2, as argparse does); with
# this variable set to 1 (or --debug), the traceback instead.
DEBUG_VARIABLE = "HF_ELMO_DEBUG"
ERROR_EXIT = 1


def add_convert_arguments(parser) -> None:
    """The converter's command-line options, shared by `conversion/` and `hf-elmo convert`."""
    parser.add_argument("--options", help="bilm-tf options.json (architecture of the model).")
    parser.add_argument("--weights", help="bilm-tf weights .hdf5 (as written by bilm-tf's dump_weights).")
    parser.add_argument("--vocab", default=None, help="optional bilm-tf vocabulary file (one word per line), "
                        "saved with the tokenizer for language-model heads.")
    parser.add_argument("--output", required=True, help="folder to write; created atomically (nothing is left "
                        "behind on failure).")
    parser.add_argument("--overwrite", action="store_true", help="replace --output if it is a folder this tool wrote "
                        "(an ELMo model folder or a bilm-tf export); never an input, the current folder or a "
                        "training run's folder (checkpoints).")
    parser.add_argument("--to-bilm-tf", metavar="MODEL_DIR", default=None,
                        help="reverse direction: export the hf_elmo model in MODEL_DIR as options.json + "
                        "weights.hdf5, and its vocab.txt if it has one, into --output (then --options/--weights "
                        "are not used).")
    parser.add_argument("--no-progress", action="store_true", help="do not show a progress bar.")


def add_threads_argument(parser) -> None:
    parser.add_argument("--threads", type=threads_argument, default=None, metavar="N", help=THREADS_HELP)


def build_parser() -> argparse.ArgumentParser:
    from .embed import LAYER_CHOICES

    parser = argparse.ArgumentParser(
        prog="hf-elmo", description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("-v", "--verbose", action="store_true", help="log debug messages too.")
    parser.add_argument("--debug", action="store_true",
                        help=f"on an error, show the traceback instead of one line (also {DEBUG_VARIABLE}=1).")
    commands = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")
    parser.command_parsers = commands.choices  # each command's own parser, for its own usage line

    convert = commands.add_parser(
        "convert",
        help="convert bilm-tf options.json + weights .hdf5 into a Hugging Face folder (or back)",
        description="Convert allenai bilm-tf ELMo files (options.json + weights .hdf5, optional vocabulary) into "
        "a folder that AutoModel/AutoTokenizer.from_pretrained load, with a model card recording the SHA-256 of "
        "the source files. With --to-bilm-tf MODEL_DIR it goes the other way.",
    )
    add_convert_arguments(convert)
    add_threads_argument(convert)
    convert.set_defaults(run=lambda args: _run_convert(args, convert))

    embed = commands.add_parser(
        "embed",
        help="embed a text file (one sentence per line) into an HDF5 file",
        description=EMBED_DESCRIPTION,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    embed.add_argument("input", metavar="INPUT", help="text file, UTF-8, one sentence per line; - reads standard "
                       "input (a file named - is ./-).")
    embed.add_argument("output", metavar="OUTPUT", help="HDF5 file to write.")
    embed.add_argument("--model", required=True, metavar="DIR",
                       help="ELMo folder (from hf-elmo convert or save_pretrained) or Hub repo id owner/name. A name "
                       "is a repo id only if no such local path exists, it has exactly one '/', does not start with "
                       "'.', '/' or '~', and its owner part is not a local folder; anything else is a local folder "
                       "and fails at once if missing.")
    which = embed.add_mutually_exclusive_group()
    for choice, text in zip(
        LAYER_CHOICES,
        ("store every layer, (L+1, words, H) (default)", "store the top layer, (words, H)",
         "store the mean of the layers, (words, H)"),
    ):
        which.add_argument(f"--{choice}", dest="layers", action="store_const", const=choice, help=text)
    embed.set_defaults(layers="all")
    embed.add_argument("--tokenized", action="store_true",
                       help="lines are already tokenized: words are split on whitespace only. Without it, lines "
                       "are raw text split into words by the model's tokenizer (punctuation and clitics apart).")
    embed.add_argument("--float16", action="store_true",
                       help="store float16 instead of float32 (half the file size; computation stays float32).")
    embed.add_argument("--batch-size", type=positive_int, default=32, metavar="N",
                       help="sentences per forward pass (default: %(default)s).")
    embed.add_argument("--window", type=positive_int, default=2048, metavar="LINES",
                       help="lines read at a time and sorted by length for batching; bounds memory "
                       "(default: %(default)s). Does not change the vectors.")
    embed.add_argument("--max-words", type=positive_int, default=512, metavar="N",
                       help="longer lines are split into pieces of at most N words (default: %(default)s).")
    embed.add_argument("--int8", action="store_true",
                       help="run the biLM with int8 weights (CPU only): a quarter of their memory, faster for large "
                       "models; the vectors differ slightly from the fp32 model's (README, 'int8 weights').")
    embed.add_argument("--device", type=device_argument, default=None,
                       help="torch device, e.g. cpu, cuda, cuda:1 (default: cuda if available, else cpu).")
    embed.add_argument("--overwrite", action="store_true",
                       help="replace OUTPUT if it is an HDF5 file written by hf-elmo embed (never INPUT).")
    embed.add_argument("--no-progress", action="store_true", help="do not show a progress bar.")
    add_threads_argument(embed)
    embed.set_defaults(run=_run_embed)

    publish = commands.add_parser(
        "publish",
        help="push a saved ELMo folder with its code and a model card to the Hugging Face Hub",
        description=PUBLISH_DESCRIPTION,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    publish.add_argument("model_dir", metavar="DIR", help="saved ELMo folder to publish.")
    publish.add_argument("--repo-id", required=True, metavar="NAME",
                         help="Hub repository, e.g. your-name/elmo-original (created if missing).")
    publish.add_argument("--private", action="store_true", help="create the repository as private.")
    publish.add_argument("--create-pr", action="store_true",
                         help="open a pull request instead of committing to main.")
    publish.add_argument("--dry-run", action="store_true",
                         help="no network: prepare the exact folder that would be uploaded, print its files and "
                         "its model card, and remove it.")
    publish.add_argument("--commit-message", default="Upload ELMo model with hf_elmo",
                         help="commit message (default: %(default)r).")
    publish.add_argument("--license", default=None,
                         help="Hub licence id for the card, e.g. apache-2.0 (default: other, as the released "
                         "ELMo weights state no licence).")
    publish.add_argument("--card", default=None, metavar="README",
                         help="publish this model card instead of generating one from the folder's metadata.")
    publish.set_defaults(run=_run_publish)

    allennlp = commands.add_parser(
        "allennlp-elmo", help="AllenNLP 0.9's `allennlp elmo`: its arguments and HDF5 layout",
        description=ALLENNLP_ELMO_DESCRIPTION, formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    allennlp.add_argument("input_file", help="the path to the input file (UTF-8, one tokenised sentence per line).")
    allennlp.add_argument("output_file", help="the path to the output file.")
    which = allennlp.add_mutually_exclusive_group(required=True)
    for choice, text in zip(LAYER_CHOICES, ("output all three ELMo vectors.", "output the top ELMo vector.",
                                            "output the average of the ELMo vectors.")):
        which.add_argument(f"--{choice}", dest="layers", action="store_const", const=choice, help=text)
    allennlp.add_argument("--options-file", default=None,
                          help="the ELMo options file, a path or URL (default: AllenNLP's, the original model's); or "
                          "a converted folder or Hub id, with --weight-file none.")
    allennlp.add_argument("--weight-file", default=None,
                          help="the ELMo weight file, a path or URL (default: AllenNLP's, the original model's); "
                          "'none' when --options-file names a converted folder or Hub id.")
    allennlp.add_argument("--batch-size", type=positive_int, default=64, help="the batch size to use (default: 64).")
    allennlp.add_argument("--cuda-device", type=int, default=-1, help="the CUDA device to run on (default: -1, CPU).")
    allennlp.add_argument("--forget-sentences", action="store_true",
                          help="leave out the sentence_to_index dataset that maps sentences to their keys.")
    allennlp.add_argument("--use-sentence-keys", action="store_true",
                          help="use each sentence itself as its key instead of its line index.")
    allennlp.add_argument("--vocab-path", help="accepted for AllenNLP's command lines; unused (as there).")
    allennlp.add_argument("--file-friendly-logging", action="store_true",
                          help="accepted for AllenNLP's command lines; progress goes through tqdm either way.")
    allennlp.add_argument("--overwrite", action="store_true",
                          help="replace OUTPUT if it was written by this command or hf-elmo embed (never the input).")
    add_threads_argument(allennlp)
    allennlp.set_defaults(run=_run_allennlp_elmo)

    # Its options belong to hf_elmo.pretraining: everything after the word is passed on untouched.
    commands.add_parser("pretrain", help=PRETRAIN_HELP, add_help=False, prefix_chars="\0")
    return parser


def device_argument(text: str) -> str:
    """
    argparse's type for --device: a torch device this machine can run a model on, else a usage error (moving the
    model failed with torch's traceback: "Torch not compiled with CUDA enabled", "Cannot copy out of meta tensor").
    """
    import torch

    try:
        device = torch.device(text)
    except (RuntimeError, ValueError):
        raise argparse.ArgumentTypeError(f"{text!r} is not a torch device (e.g. cpu, cuda, cuda:1)") from None
    if device.type == "cuda":
        count = torch.cuda.device_count() if torch.cuda.is_available() else 0
        if (device.index or 0) >= count:
            raise argparse.ArgumentTypeError(f"{text}: this machine has {count} CUDA GPU(s) that torch can use; "
                                             "pass cpu (or leave --device out)")
    elif not (device.type == "cpu" or (device.type == "mps" and torch.backends.mps.is_available())):
        raise argparse.ArgumentTypeError(f"{text}: not a device this machine can run the model on (cpu, cuda, cuda:N)")
    return text


def positive_int(text: str) -> int:
    """argparse's type for a count of at least 1 (a usage error otherwise)."""
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a positive integer, got {text!r}") from None
    if value < 1:
        raise argparse.ArgumentTypeError(f"expected a positive integer, got {value}")
    return value


def _run_convert(args, parser) -> int:
    from .convert import run_convert

    return run_convert(args, parser)


def _run_embed(args) -> int:
    from .embed import EmbedInputError, check_input, embed_file, load_model_and_tokenizer
    from .safe_output import check_replaceable_file

    # Before loading the model, and before importing torch (seconds): a bad input or an output that may not be
    # written is reported at once.
    check_input(args.input)
    check_replaceable_file(os.path.abspath(args.output), args.overwrite, inputs=[args.input])
    if args.int8 and args.device not in (None, "cpu"):
        raise EmbedInputError(f"--int8 runs on the CPU only; drop --device {args.device} or --int8.")
    model, tokenizer = load_model_and_tokenizer(args.model, args.device, int8_weights=args.int8)
    from tqdm.contrib.logging import logging_redirect_tqdm

    with logging_redirect_tqdm():
        summary = embed_file(
            args.input, args.output, model, tokenizer, layers=args.layers, tokenized=args.tokenized,
            float16=args.float16, batch_size=args.batch_size, window=args.window, max_words=args.max_words,
            overwrite=args.overwrite, progress=not args.no_progress, model_name=args.model,
        )
    logger.info("Wrote %s: %d lines (%d without words, %d split, %d with cut words), %d words, layers=%s, %s",
                summary.output_path, summary.num_lines, summary.empty_lines, summary.split_lines,
                summary.cut_word_lines, summary.num_words, args.layers, "float16" if args.float16 else "float32")
    return 0


def _run_allennlp_elmo(args) -> int:
    from .embed import EmbedInputError, check_input
    from .safe_output import check_replaceable_file

    # Before importing torch (seconds), as in `_run_embed`.
    check_input(args.input_file)
    check_replaceable_file(os.path.abspath(args.output_file), args.overwrite, inputs=[args.input_file])
    from . import allennlp

    weight_file = args.weight_file or allennlp.DEFAULT_WEIGHT_FILE
    try:
        allennlp.read_sentences(args.input_file)  # a blank line is reported before the model is loaded
        embedder = allennlp.ElmoEmbedder(args.options_file or allennlp.DEFAULT_OPTIONS_FILE,
                                         None if weight_file == "none" else weight_file, args.cuda_device)
        embedder.embed_file(args.input_file, args.output_file, output_format=args.layers,
                            batch_size=args.batch_size, forget_sentences=args.forget_sentences,
                            use_sentence_keys=args.use_sentence_keys)
    except (allennlp.ConfigurationError, FileNotFoundError) as error:
        raise EmbedInputError(str(error)) from None
    logger.info("Wrote %s", args.output_file)
    return 0


def _run_publish(args) -> int:
    from .publish import publish

    prepared, commit = publish(
        args.model_dir, args.repo_id, private=args.private, create_pr=args.create_pr, dry_run=args.dry_run,
        commit_message=args.commit_message, license=args.license, card_file=args.card,
    )
    if commit is None:
        try:
            print(f"Dry run: nothing was uploaded. {args.repo_id} would receive:")
            for name in prepared.files:
                print(f"  {name}")
            if prepared.left_out:
                print(f"Left out: {', '.join(prepared.left_out)}")
            with open(prepared.card_path, encoding="utf-8") as card:
                print(f"Model card (README.md):\n{card.read()}")
        finally:
            shutil.rmtree(prepared.path, ignore_errors=True)  # a dry run leaves nothing behind
    else:
        print(f"Published {len(prepared.files)} files to {args.repo_id}: {commit.pr_url or commit.commit_url}")
    return 0


def _run_pretrain(argv: list[str]) -> int:
    from .pretraining_args import parse_args

    args = parse_args(argv)  # --help and usage errors end here, before torch is imported
    from .pretraining import run

    return run(args)


def pretrain_main(argv: list[str] | None = None) -> int:
    """`hf-elmo-pretrain ARGS` and `examples/pretrain_elmo.py ARGS`: older names of `hf-elmo pretrain ARGS`."""
    return main(["pretrain", *(sys.argv[1:] if argv is None else argv)])


def _interrupt(signum, frame):
    # Let `finally`/`except` blocks clean up (embed removes its partial output) on `kill` as on Ctrl-C. Remembered
    # too, for the loops that check between steps (safe_output.raise_if_stop_requested).
    from .safe_output import request_stop

    request_stop(signum)
    raise KeyboardInterrupt(f"signal {signum}")


def handle_sigterm() -> None:
    """
    SIGTERM cleans up like Ctrl-C (unless someone installed another handler). Both are also unblocked: a blocked
    signal mask is inherited through fork and exec, so a process started by a parent that held them (some job
    runners and CI harnesses do) would ignore `kill` and Ctrl-C, and so would the DataLoader workers it forks, which
    then never stop when their loader shuts them down and keep the run from exiting.
    """
    if signal.getsignal(signal.SIGTERM) is signal.SIG_DFL:
        signal.signal(signal.SIGTERM, _interrupt)
    if hasattr(signal, "pthread_sigmask"):  # not on Windows, which has no signal masks
        from .safe_output import STOP_SIGNALS

        signal.pthread_sigmask(signal.SIG_UNBLOCK, STOP_SIGNALS)


def debugging() -> bool:
    return os.environ.get(DEBUG_VARIABLE, "") not in ("", "0")


def report_error(error: BaseException) -> int:
    """The one line every command prints for a failure it expects; the exit status."""
    print(f"error: {' '.join(str(error).split())}", file=sys.stderr)
    return ERROR_EXIT


# The failures every command reports in one line: (module, names of its exception classes). "." is this package.
EXPECTED_ERRORS = (
    (".bilm_tf", ("BilmTfFormatError",)),
    (".embed", ("EmbedInputError", "EmbedOutputError")),
    (".finetuning", ("DataFileError",)),
    (".int8_weights", ("Int8CpuError",)),
    (".model_source", ("ModelSourceError",)),
    (".publish", ("PublishError",)),
    (".weight_checks", ("WeightCheckError",)),
    (".pretraining", ("TrainingDiverged", "DataPipelineError", "DeviceOptionError")),
    (".pretraining_checkpoints", ("CheckpointError",)),
    (".pretraining_data", ("CorpusError",)),
    ("huggingface_hub.errors", ("HfHubHTTPError",)),
)


def _expected_errors() -> tuple:
    """
    The classes of `EXPECTED_ERRORS` whose modules are imported. An error can only have been raised by a module
    that is, so none is imported here: importing them all (the model's modules import torch and Transformers) made
    a one-line error about a missing file take 4-6 s.
    """
    classes = [FileExistsError]
    for module, names in EXPECTED_ERRORS:
        loaded = sys.modules.get(f"{__package__}{module}" if module.startswith(".") else module)
        classes.extend(getattr(loaded, name) for name in names if loaded is not None)
    return tuple(classes)


def run_reporting_errors(run, what: str) -> int:
    """
    `run()`, with every expected failure turned into one `error: ...` line on stderr and exit status 1 (130 for an
    interrupt): bad input files, outputs that may not be written, bad weights, Hub errors and timeouts. With
    HF_ELMO_DEBUG=1 (`hf-elmo --debug`) they raise, with their traceback.
    """
    try:
        return run()
    except KeyboardInterrupt:
        print("interrupted; no partial output is left behind", file=sys.stderr)
        return 130
    except Exception as error:
        if debugging():
            raise
        if isinstance(error, _expected_errors()):
            return report_error(error)
        from .hub_timeouts import describe_timeout
        from .safe_output import os_error_line

        timed_out = describe_timeout(error, what)
        if timed_out is not None:
            return report_error(timed_out)
        if isinstance(error, OSError):
            return report_error(os_error_line(error))
        raise


def _what(args) -> str:
    if args.command == "embed":
        return f"fetching the model {args.model}"
    if args.command == "publish":
        return f"publishing to {args.repo_id}"
    if args.command == "pretrain":
        return "pretraining"
    if args.command == "allennlp-elmo":
        return f"fetching the model {args.options_file}"
    return f"fetching the model {args.to_bilm_tf}" if getattr(args, "to_bilm_tf", None) else "converting"


def main(argv: list[str] | None = None) -> int:
    keep_compiled_code_in_user_cache()
    parser = build_parser()
    args, rest = parser.parse_known_args(sys.argv[1:] if argv is None else argv)
    if args.command != "pretrain" and rest:
        # The command's own usage, not the list of commands.
        parser.command_parsers[args.command].error(f"unrecognized arguments: {' '.join(rest)}")
    from .hub_timeouts import enforce_hub_timeouts

    enforce_hub_timeouts()
    handle_sigterm()
    previous = os.environ.get(DEBUG_VARIABLE)
    if args.debug:  # for this call (pretraining reads it too), not for the rest of a calling process
        os.environ[DEBUG_VARIABLE] = "1"
    try:
        if args.command == "pretrain":
            return run_reporting_errors(lambda: _run_pretrain(rest), _what(args))
        logging.basicConfig(level=logging.DEBUG if args.verbose else logging.INFO,
                            format="%(levelname)s %(name)s: %(message)s")
        set_threads(getattr(args, "threads", None))
        return run_reporting_errors(lambda: args.run(args), _what(args))
    finally:
        if args.debug and previous is None:
            del os.environ[DEBUG_VARIABLE]
        elif args.debug:
            os.environ[DEBUG_VARIABLE] = previous


if __name__ == "__main__":
    sys.exit(main())
