"""`hf-elmo` command line: help texts, convert, embed (values, layouts, bad lines, interruption), pretrain."""

import errno
import json
import os
import re
import signal
import subprocess
import sys
import time
from pathlib import Path

import h5py
import numpy as np
import pytest
import torch

from hf_elmo import ElmoModel, ElmoTokenizer
from hf_elmo.cli import build_parser, main
from hf_elmo.testing_utils import run_together
from help_imports import error_and_heavy_imports, help_and_heavy_imports


REPO_ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
TOLERANCE = 1e-5


# ---------------------------------------------------------------------------------------------- help
def subcommand_parsers():
    parser = build_parser()
    (commands,) = [a for a in parser._actions if a.dest == "command"]
    return commands.choices


@pytest.mark.parametrize("command", ["convert", "embed", "publish"])
def test_help_of_every_subcommand_mentions_every_option(command, capsys):
    options = [s for a in subcommand_parsers()[command]._actions for s in a.option_strings]
    assert len(options) >= 7
    with pytest.raises(SystemExit) as exit_info:
        main([command, "--help"])
    assert exit_info.value.code == 0
    text = capsys.readouterr().out
    missing = [option for option in options if option not in text]
    assert missing == []


def test_no_help_text_runs_two_lines_of_an_example_together():
    # A "\\" ending a line of a docstring is a line continuation to Python: `pretrain --help` and the scripts' help
    # showed two lines of an example command run together with the next line's indentation
    # ("--eval-fraction 0.01         --build-vocab"). Every module docstring is some command's help or a reader's.
    import ast

    joined = {}
    for folder in ("hf_elmo", "examples", "conversion", "benchmarks"):
        for path in sorted(Path(REPO_ROOT, folder).glob("*.py")):
            docstring = ast.get_docstring(ast.parse(path.read_text(encoding="utf-8")), clean=False) or ""
            if re.findall(r"\S {4,}--", docstring):
                joined[path.name] = re.findall(r"\S {4,}--", docstring)
    assert joined == {}
    from hf_elmo import pretraining_args

    assert "0.01 \\\n        --build-vocab" in pretraining_args.build_parser().description


def test_top_level_help_lists_every_command(capsys):
    with pytest.raises(SystemExit):
        main(["--help"])
    text = capsys.readouterr().out
    for command in ("convert", "embed", "publish", "pretrain"):
        assert f"    {command} " in text


# ---------------------------------------------------------------------------------------------- pretrain
def test_pretrain_help_and_usage_errors_are_its_own(capsys):
    with pytest.raises(SystemExit) as exit_info:
        main(["pretrain", "--help"])
    assert exit_info.value.code == 0 and capsys.readouterr().out.startswith("usage: hf-elmo pretrain ")
    with pytest.raises(SystemExit) as exit_info:
        main(["pretrain", "--train-files", "a b.txt", "--output-dir", "out"])
    err = capsys.readouterr().err
    assert exit_info.value.code == 2 and err.startswith("usage: hf-elmo pretrain ")
    assert err.strip().endswith("the following arguments are required: --max-steps")
    with pytest.raises(SystemExit) as exit_info:  # an option's value is checked as it is parsed
        main(["pretrain", "--train-files", "a b.txt", "--output-dir", "out", "--threads", "0"])
    err = capsys.readouterr().err
    assert exit_info.value.code == 2 and err.startswith("usage: hf-elmo pretrain ")
    assert "argument --threads: must be between 1 and" in err


@pytest.mark.parametrize("option, value, message", [
    ("--learning-rate", "-1", "--learning-rate must be a non-negative number, got -1.0"),
    ("--learning-rate", "nan", "--learning-rate must be a non-negative number, got nan"),
    ("--adagrad-initial-accumulator", "-0.5", "--adagrad-initial-accumulator must be a non-negative number, got -0.5"),
    ("--weight-decay", "-0.01", "--weight-decay must be a non-negative number, got -0.01"),
    ("--max-grad-norm", "nan", "--max-grad-norm, --num-workers and --data-timeout must be >= 0"),
    ("--max-vocab-size", "0", "--max-vocab-size must be >= 1, got 0"),
    ("--eval-max-sentences", "-2", "--eval-max-sentences must be >= 1, got -2"),
])
def test_pretrain_numbers_torch_would_refuse_mid_run_are_usage_errors(option, value, message, tmp_path, capsys):
    # `--learning-rate -1` reached torch's optimizer after the run had started: "ValueError: Invalid learning rate".
    argv = ["pretrain", "--train-files", "x.txt", "--config", "small", "--output-dir", str(tmp_path / "o"),
            "--max-steps", "1", option, value]
    with pytest.raises(SystemExit) as exit_info:
        main(argv)
    assert exit_info.value.code == 2 and message in capsys.readouterr().err
    assert not (tmp_path / "o").exists()


def test_embed_device_the_machine_lacks_is_a_usage_error(tmp_path, capsys):
    # Moving the model failed with torch's traceback ("Torch not compiled with CUDA enabled", "Cannot copy out of
    # meta tensor"); nothing tells a user which devices there are.
    cases = [("bogus", "argument --device: 'bogus' is not a torch device (e.g. cpu, cuda, cuda:1)"),
             ("meta", "argument --device: meta: not a device this machine can run the model on (cpu, cuda, cuda:N)"),
             ("cuda:99", "argument --device: cuda:99: this machine has ")]
    if not torch.cuda.is_available():
        cases.append(("cuda", "argument --device: cuda: this machine has 0 CUDA GPU(s) that torch can use; pass cpu "
                              "(or leave --device out)"))
    for device, message in cases:
        with pytest.raises(SystemExit) as exit_info:
            main(["embed", str(tmp_path / "in.txt"), str(tmp_path / "out.hdf5"), "--device", device])
        assert exit_info.value.code == 2 and message in capsys.readouterr().err, device
    assert os.listdir(tmp_path) == []


REGISTERED = """
import sys
{imports}
from transformers import AutoConfig, AutoModelForTokenClassification
config = AutoConfig.from_pretrained(sys.argv[1])  # no trust_remote_code: the registered classes
model = AutoModelForTokenClassification.from_pretrained(sys.argv[1], num_labels=3)
print(type(config).__module__, type(model).__module__, type(model).__name__)
"""


def test_importing_hf_elmo_registers_the_auto_classes(converted_dir):
    # Each in a fresh interpreter, all at once (run_together).
    imports = [
        "import hf_elmo",  # before transformers: registered once transformers is imported
        "import transformers, hf_elmo",  # after it: registered at once
        "from hf_elmo.modeling_elmo import ElmoModel",  # a module first: registered once it is complete
    ]
    results = run_together([[sys.executable, "-c", REGISTERED.format(imports=first), str(converted_dir)]
                            for first in imports], capture_output=True, text=True, timeout=300,
                           env={**os.environ, "PYTHONPATH": REPO_ROOT, "HF_HUB_OFFLINE": "1"})
    for first, result in zip(imports, results):
        assert result.stdout.split() == ["hf_elmo.configuration_elmo", "hf_elmo.modeling_elmo",
                                         "ElmoForTokenClassification"], (first, result.stderr[-3000:])


@pytest.mark.parametrize("command", [[], ["convert"], ["embed"], ["publish"], ["pretrain"]])
def test_help_imports_neither_torch_nor_transformers(command):
    help_text, imported = help_and_heavy_imports(*command)
    assert help_text.startswith(f"usage: hf-elmo {command[0] if command else ''}".rstrip()), help_text
    assert imported == []


@pytest.mark.parametrize("command, error", [
    (["embed", "{missing}", "{out}", "--model", "{missing}"], "error: {missing}: input file not found."),
    (["embed", "-", "{out}", "--model", "{missing}"],
     "error: {missing}: no such folder (and not a Hub repo id of the form owner/name)."),
    (["allennlp-elmo", "{missing}", "{out}", "--all"], "error: {missing}: input file not found."),
    (["allennlp-elmo", "{input}", "{input}", "--all"],
     "error: {input}: is the input {input}; writing there would destroy it."),
])
def test_a_missing_input_or_a_wrong_output_is_reported_before_torch_is_imported(command, error, tmp_path):
    # Importing torch and Transformers took 4-6 s of a one-line error about a missing file.
    paths = {"missing": str(tmp_path / "missing"), "out": str(tmp_path / "out.hdf5"), "input": __file__}
    stderr, imported = error_and_heavy_imports(*(part.format(**paths) for part in command))
    assert stderr.strip().splitlines()[-1] == error.format(**paths)
    assert imported == []
    assert not os.path.exists(paths["out"])


# ---------------------------------------------------------------------------------------------- convert
def test_convert_command_writes_a_loadable_folder_and_exports_back(elmo_fixture, tmp_path):
    out = tmp_path / "elmo"
    assert main(["convert", "--options", str(elmo_fixture / "options.json"), "--weights",
                 str(elmo_fixture / "lm_weights.hdf5"), "--vocab", str(elmo_fixture / "vocab_test.txt"),
                 "--output", str(out), "--no-progress"]) == 0
    assert {"config.json", "model.safetensors", "tokenizer_config.json", "README.md", "bilm_tf_source.json",
            "vocab.txt"} <= set(os.listdir(out))
    assert main(["convert", "--to-bilm-tf", str(out), "--output", str(tmp_path / "back")]) == 0
    # The vocabulary goes along, as with conversion/convert_hf_to_bilm_tf.py: the same function.
    assert sorted(os.listdir(tmp_path / "back")) == ["options.json", "vocab.txt", "weights.hdf5"]
    assert (tmp_path / "back" / "vocab.txt").read_bytes() == (out / "vocab.txt").read_bytes()
    with h5py.File(elmo_fixture / "lm_weights.hdf5") as original, h5py.File(tmp_path / "back" / "weights.hdf5") as back:
        assert np.array_equal(original["CNN_high_1/W_carry"][...], back["CNN_high_1/W_carry"][...])


def test_convert_command_errors(elmo_fixture, tmp_path, capsys):
    with pytest.raises(SystemExit) as exit_info:
        main(["convert", "--weights", str(elmo_fixture / "lm_weights.hdf5"), "--output", str(tmp_path / "x")])
    assert exit_info.value.code == 2
    assert "--options and --weights are required" in capsys.readouterr().err
    assert main(["convert", "--options", str(tmp_path / "nope.json"), "--weights",
                 str(elmo_fixture / "lm_weights.hdf5"), "--output", str(tmp_path / "x")]) == 1
    assert "nope.json: options file not found." in capsys.readouterr().err
    # --options and --weights swapped: one line that says so.
    assert main(["convert", "--options", str(elmo_fixture / "lm_weights.hdf5"), "--weights",
                 str(elmo_fixture / "options.json"), "--output", str(tmp_path / "x")]) == 1
    assert capsys.readouterr().err == (
        f"error: {elmo_fixture / 'lm_weights.hdf5'}: not an options file (binary, not UTF-8 JSON text). It is an "
        "HDF5 file: are --options and --weights swapped?\n")
    assert not (tmp_path / "x").exists()
    # options.json saved as "Unicode" by an editor: named as UTF-16 text, not as a binary file.
    utf16 = tmp_path / "options16.json"
    utf16.write_text((elmo_fixture / "options.json").read_text(encoding="utf-8"), encoding="utf-16")
    assert main(["convert", "--options", str(utf16), "--weights", str(elmo_fixture / "lm_weights.hdf5"), "--output",
                 str(tmp_path / "x")]) == 1
    assert capsys.readouterr().err.endswith(
        f"error: options file {utf16}: the file is UTF-16 (it starts with a UTF-16 byte-order mark); expected UTF-8. "
        f"Convert it: iconv -f UTF-16 -t UTF-8 {utf16} > NEW_FILE\n")
    assert not (tmp_path / "x").exists()


# ---------------------------------------------------------------------------------------------- embed
@pytest.fixture(scope="module")
def sentences(elmo_fixture):
    """bilm-tf's fixture sentences (tokenized, 30 lines)."""
    with open(elmo_fixture / "sentences.json", encoding="utf-8") as f:
        return [s for group in json.load(f) for s in group]


@pytest.fixture(scope="module")
def model_and_tokenizer(converted_dir):
    return ElmoModel.from_pretrained(converted_dir).eval(), ElmoTokenizer.from_pretrained(converted_dir)


def direct(model_and_tokenizer, words):
    """All layers of `words` embedded alone, the way a user would call the model: (L+1, words, H)."""
    model, tokenizer = model_and_tokenizer
    with torch.no_grad():
        output = model(**tokenizer([words], is_split_into_words=True, return_tensors="pt"), output_hidden_states=True)
    return torch.stack(output.hidden_states)[:, 0].numpy()


def embed(tmp_path, lines, *options, name="out.hdf5", model=None):
    source = tmp_path / f"{name}.txt"
    source.write_text("".join(line + "\n" for line in lines), encoding="utf-8")
    output = tmp_path / name
    # On the CPU on any machine: the tests compare with the CPU model bit for bit.
    rc = main(["embed", str(source), str(output), "--model", str(model), "--no-progress", "--device", "cpu", *options])
    return rc, output


@pytest.fixture(scope="module")
def corpus(sentences):
    """The fixture sentences with two lines without words after line 3 and one 744-word line at the end."""
    return sentences[:3] + ["", "  \t "] + sentences[3:] + [" ".join(sentences)]


@pytest.fixture(scope="module")
def embedded_all(corpus, converted_dir, tmp_path_factory):
    tmp = tmp_path_factory.mktemp("embed")
    rc, output = embed(tmp, corpus, "--tokenized", "--max-words", "100", "--batch-size", "4", "--window", "7",
                       model=converted_dir)
    assert rc == 0
    return output


def test_embed_all_layers_equal_the_model_called_directly(embedded_all, corpus, model_and_tokenizer, caplog):
    with h5py.File(embedded_all) as f:
        assert sorted(f.keys(), key=int) == [str(i) for i in range(len(corpus))]
        assert dict(f.attrs) == {
            "format_version": 1, "layers": "all", "dtype": "float32", "num_lines": 33, "num_layers": 3,
            "hidden_size": 32, "tokenized": True, "max_words": 100, "model": f.attrs["model"],
            "input": f.attrs["input"], "empty_lines": 2, "split_lines": 1, "cut_word_lines": 0,
        }
        for index, line in enumerate(corpus[:-1]):
            dataset = f[str(index)]
            words = line.split()
            assert dataset.attrs["line_number"] == index + 1 and dataset.attrs["text"] == line
            assert json.loads(dataset.attrs["words"]) == words
            assert dataset.dtype == np.float32 and dataset.shape == (3, len(words), 32)
            if words:
                assert np.abs(dataset[...] - direct(model_and_tokenizer, words)).max() <= TOLERANCE


def test_embed_splits_an_overlong_line_into_independent_pieces(embedded_all, corpus, model_and_tokenizer):
    words = corpus[-1].split()
    assert len(words) == 744
    with h5py.File(embedded_all) as f:
        dataset = f["32"]
        assert dataset.shape == (3, 744, 32)
        assert dataset.attrs["pieces"].tolist() == [0, 100, 200, 300, 400, 500, 600, 700]
        expected = np.concatenate([direct(model_and_tokenizer, words[s : s + 100]) for s in range(0, 744, 100)], axis=1)
        assert np.abs(dataset[...] - expected).max() <= TOLERANCE
        # ... which differs from reading the line as one sentence past the first piece.
        whole = direct(model_and_tokenizer, words)
        assert np.abs(dataset[2, 100:] - whole[2, 100:]).max() > 0.01


def test_embed_reports_lines_without_words_and_split_lines(corpus, converted_dir, tmp_path, caplog):
    caplog.set_level("WARNING", logger="hf_elmo.embed")
    rc, output = embed(tmp_path, corpus, "--tokenized", "--max-words", "100", "--top", model=converted_dir)
    assert rc == 0
    messages = [r.getMessage() for r in caplog.records]
    assert f"{tmp_path / 'out.hdf5.txt'}, line 4: no words; stored as the empty dataset '3'" in messages
    assert f"{tmp_path / 'out.hdf5.txt'}, line 5: no words; stored as the empty dataset '4'" in messages
    assert "2 lines without words, stored as empty datasets: lines 4, 5" in messages
    assert "1 line longer than max_words=100 split into pieces: line 33" in messages
    assert any(m.endswith("line 33: 744 words, more than max_words=100; embedded as 8 independent pieces "
                          "(context does not cross a piece boundary)") for m in messages)
    with h5py.File(output) as f:
        assert f["3"].shape == (0, 32) and f["4"].shape == (0, 32) and f["4"].attrs["text"] == "  \t "


def test_embed_reports_lines_with_words_longer_than_a_char_row_holds(converted_dir, model_and_tokenizer, tmp_path,
                                                                     caplog):
    caplog.set_level("WARNING")
    long_word = "Pneumonoultramicroscopicsilicovolcanoconiosis-related"  # 53 bytes
    lines = [f"a {long_word} and {'我爱北京天安门' * 3}", "all short words", "我爱北京天安门我爱北京天安门我爱 is 48 bytes"]
    rc, output = embed(tmp_path, lines, "--tokenized", model=converted_dir)
    assert rc == 0
    assert [r.getMessage() for r in caplog.records] == [
        f"{tmp_path / 'out.hdf5.txt'}, line 1: 2 word(s) longer than 48 UTF-8 bytes (the first: "
        "'Pneumonoultramicroscopicsilicovolcanocon...'); the model reads each as its first 48 bytes, as bilm-tf does",
        "1 line with words longer than 48 UTF-8 bytes, each read as its first 48 bytes: line 1"]
    with h5py.File(output) as f:
        assert f.attrs["cut_word_lines"] == 1
        # What the model reads of a cut word is its first 48 bytes: the vectors are those of the cut word.
        cut = ["a", long_word.encode()[:48].decode(), "and", "我爱北京天安门我爱北京天安门我爱"]
        assert np.abs(f["0"][...] - direct(model_and_tokenizer, cut)).max() <= TOLERANCE


def test_embed_of_an_empty_file_says_so_and_writes_a_file_without_datasets(converted_dir, tmp_path, caplog):
    caplog.set_level("WARNING", logger="hf_elmo.embed")
    rc, output = embed(tmp_path, [], model=converted_dir)
    assert rc == 0
    assert [r.getMessage() for r in caplog.records] == [
        f"{tmp_path / 'out.hdf5.txt'} has no lines: {output} holds no datasets"]
    with h5py.File(output) as f:
        assert list(f.keys()) == [] and f.attrs["num_lines"] == 0


def test_embed_top_average_and_float16(embedded_all, corpus, converted_dir, tmp_path):
    options = ["--tokenized", "--max-words", "100", "--batch-size", "4", "--window", "7"]
    assert embed(tmp_path, corpus, *options, "--top", "--float16", name="top16", model=converted_dir)[0] == 0
    assert embed(tmp_path, corpus, *options, "--average", name="average", model=converted_dir)[0] == 0
    with h5py.File(embedded_all) as all_layers, h5py.File(tmp_path / "top16") as top, \
            h5py.File(tmp_path / "average") as average:
        assert top.attrs["dtype"] == "float16" and top.attrs["layers"] == "top" and average.attrs["layers"] == "average"
        assert top["3"].shape == average["3"].shape == (0, 32)
        for key in ("0", "17", "32"):
            layers = all_layers[key][...]
            assert top[key].dtype == np.float16 and top[key].shape == layers.shape[1:]
            # Same batches, same arithmetic: the top layer is bit for bit the last of all layers, cast to float16.
            assert np.array_equal(top[key][...], layers[-1].astype(np.float16))
            assert average[key].dtype == np.float32 and average[key].shape == layers.shape[1:]
            assert np.abs(average[key][...] - layers.mean(axis=0)).max() <= 1e-6
    assert os.path.getsize(tmp_path / "top16") < os.path.getsize(embedded_all) / 4


def test_embed_vectors_do_not_depend_on_window_batch_or_position(sentences, converted_dir, model_and_tokenizer,
                                                                 tmp_path):
    lines = sentences[:12] + [sentences[5]] + sentences[12:20] + [sentences[5]]
    assert embed(tmp_path, lines, "--tokenized", "--batch-size", "1", "--window", "1", name="one",
                 model=converted_dir)[0] == 0
    assert embed(tmp_path, lines, "--tokenized", "--batch-size", "16", "--window", "1000", name="many",
                 model=converted_dir)[0] == 0
    assert embed(tmp_path, lines, "--tokenized", "--batch-size", "16", "--window", "1000", name="again",
                 model=converted_dir)[0] == 0
    alone = direct(model_and_tokenizer, sentences[5].split())
    with h5py.File(tmp_path / "one") as one, h5py.File(tmp_path / "many") as many, \
            h5py.File(tmp_path / "again") as again:
        # One sentence per forward pass is the very computation of the model called on it alone.
        for key in ("5", "12", "21"):
            assert np.array_equal(one[key][...], alone)
        for key in one:
            assert np.abs(one[key][...] - many[key][...]).max() <= TOLERANCE
            assert np.array_equal(many[key][...], again[key][...])  # a run is repeatable bit for bit
        assert np.abs(many["12"][...] - many["21"][...]).max() <= TOLERANCE


def test_embed_raw_text_uses_the_tokenizer_words(converted_dir, model_and_tokenizer, tmp_path):
    lines = ["I don't know... it's $3.50 in the U.S.", "Deep contextualized word representations, naïvely."]
    assert embed(tmp_path, lines, model=converted_dir)[0] == 0
    tokenizer = model_and_tokenizer[1]
    with h5py.File(tmp_path / "out.hdf5") as f:
        assert f.attrs["tokenized"] == False  # noqa: E712 (numpy bool)
        words = json.loads(f["0"].attrs["words"])
        assert words == ["I", "do", "n't", "know", "...", "it", "'s", "$", "3.50", "in", "the", "U.S."]
        for index, line in enumerate(lines):
            assert json.loads(f[str(index)].attrs["words"]) == tokenizer.tokenize(line)
            assert np.abs(f[str(index)][...] - direct(model_and_tokenizer, tokenizer.tokenize(line))).max() <= TOLERANCE


def test_embed_bad_input_is_a_clear_error_and_writes_nothing(sentences, converted_dir, tmp_path, capsys):
    source = tmp_path / "bad.txt"
    source.write_bytes(("\n".join(sentences[:9]) + "\n").encode() + b"caf\xe9 au lait\n")
    output = tmp_path / "bad.hdf5"
    assert main(["embed", str(source), str(output), "--model", str(converted_dir), "--window", "4",
                 "--no-progress"]) == 1
    assert (f"error: {source}, line 10: not UTF-8 text (byte 3: b'\\xe9 au'); expected UTF-8. Convert the file, e.g. "
            "iconv -f LATIN1 -t UTF-8 for Latin-1.\n") in capsys.readouterr().err
    assert sorted(os.listdir(tmp_path)) == ["bad.txt"]  # neither the output nor a partial file
    source.write_text("\n".join(sentences[:9]), encoding="utf-16")  # Windows' "Unicode": named, not its byte 0
    assert main(["embed", str(source), str(output), "--model", str(converted_dir), "--no-progress"]) == 1
    assert capsys.readouterr().err.endswith(f"error: {source}: the file is UTF-16 (it starts with a UTF-16 byte-order "
                                            f"mark); expected UTF-8. Convert it: iconv -f UTF-16 -t UTF-8 {source} > "
                                            "NEW_FILE\n")
    assert sorted(os.listdir(tmp_path)) == ["bad.txt"]

    assert main(["embed", str(tmp_path / "missing.txt"), str(output), "--model", str(converted_dir)]) == 1
    assert "missing.txt: input file not found." in capsys.readouterr().err

    output.write_bytes(b"keep me")
    assert main(["embed", str(source), str(output), "--model", str(converted_dir)]) == 1
    assert "already exists; pass overwrite=True (--overwrite)" in capsys.readouterr().err
    assert output.read_bytes() == b"keep me"

    with pytest.raises(SystemExit):
        main(["embed", str(source), str(output), "--model", str(converted_dir), "--batch-size", "0"])
    assert "--batch-size: expected a positive integer, got 0" in capsys.readouterr().err


def start_embed(source, output, converted_dir, preexec_fn=None):
    env = {**os.environ, "PYTHONPATH": REPO_ROOT}
    return subprocess.Popen(
        [sys.executable, "-m", "hf_elmo.cli", "embed", str(source), str(output), "--model", str(converted_dir),
         "--tokenized", "--batch-size", "4", "--window", "64", "--no-progress", "--device", "cpu"],
        stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, env=env, preexec_fn=preexec_fn,
    )


def wait_for_partial(process, folder, min_bytes=1 << 18, timeout=60):
    """The partial output file once it holds `min_bytes` (some batches written), with the process still running."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        assert process.poll() is None, process.stderr.read().decode()[-3000:]
        partials = [p for p in folder.iterdir() if p.name.endswith(".partial")]
        if partials and partials[0].stat().st_size >= min_bytes:
            return partials[0]
        time.sleep(0.02)
    raise AssertionError("no partial output appeared")


class HeldOpenInput:
    """
    A named pipe that the test writes `lines` to and then holds open. `hf-elmo embed` reading it embeds those lines
    and waits for more, so it is certainly still running when the test signals it, however fast the machine.
    """

    def __init__(self, folder, lines):
        self.path = folder / "input.fifo"
        os.mkfifo(self.path)
        self.lines = lines
        self.descriptor = None

    def feed(self, process):
        # The write end opens (without blocking) only once the embed process has opened the read end.
        while self.descriptor is None:
            assert process.poll() is None, process.stderr.read().decode()[-3000:]
            try:
                self.descriptor = os.open(self.path, os.O_WRONLY | os.O_NONBLOCK)
            except OSError as error:
                if error.errno != errno.ENXIO:
                    raise
                time.sleep(0.02)
        os.set_blocking(self.descriptor, True)
        os.write(self.descriptor, "".join(line + "\n" for line in self.lines).encode())

    def close(self):
        if self.descriptor is not None:
            os.close(self.descriptor)


def test_the_early_input_check_leaves_a_named_pipe_unopened(tmp_path):
    # A pipe's writer may see its reader close (EPIPE) if the input is opened once to check it and again to read
    # it; and with no writer yet, opening it would block.
    import threading

    from hf_elmo.embed import EmbedInputError, check_input

    fifo = tmp_path / "in.fifo"
    os.mkfifo(fifo)
    checked = threading.Thread(target=check_input, args=(str(fifo),), daemon=True)
    checked.start()
    checked.join(timeout=10)
    if checked.is_alive():  # blocked in open(): release it before failing
        os.close(os.open(fifo, os.O_WRONLY))
    assert not checked.is_alive()
    with pytest.raises(EmbedInputError, match="input file not found"):
        check_input(str(tmp_path / "missing.txt"))
    with pytest.raises(EmbedInputError, match="is a directory"):
        check_input(str(tmp_path))


@pytest.fixture
def held_input(sentences, tmp_path_factory):
    """200 lines (three windows of 64 embedded, ~2 MB of output), then an open pipe with nothing more in it."""
    held = HeldOpenInput(tmp_path_factory.mktemp("fifo"), (sentences * 20)[:200])
    yield held
    held.close()


def test_embed_killed_mid_way_leaves_no_output(held_input, sentences, converted_dir, tmp_path):
    output = tmp_path / "vectors.hdf5"
    process = start_embed(held_input.path, output, converted_dir)
    held_input.feed(process)
    partial = wait_for_partial(process, tmp_path)
    assert partial.name == f".vectors.hdf5.{process.pid}.partial"
    process.send_signal(signal.SIGKILL)
    assert process.wait(timeout=30) == -signal.SIGKILL
    assert not output.exists() and partial.exists()
    # The next run to the same output removes the dead run's partial file and leaves a complete file.
    rc, written = embed(tmp_path, sentences[:3], "--tokenized", name="vectors.hdf5", model=converted_dir)
    assert rc == 0 and written == output
    assert not partial.exists()
    with h5py.File(output) as f:
        assert f.attrs["num_lines"] == 3 and sorted(f.keys()) == ["0", "1", "2"]


def _block_sigterm():
    signal.pthread_sigmask(signal.SIG_BLOCK, {signal.SIGTERM})


# Blocked: as started by a parent that holds SIGTERM (a CI harness did), whose signal mask every child inherits.
@pytest.mark.parametrize("inherited_mask", ["default", "sigterm_blocked"])
def test_embed_terminated_cleans_up(held_input, converted_dir, tmp_path, inherited_mask):
    output = tmp_path / "vectors.hdf5"
    process = start_embed(held_input.path, output, converted_dir,
                          preexec_fn=_block_sigterm if inherited_mask == "sigterm_blocked" else None)
    held_input.feed(process)
    wait_for_partial(process, tmp_path)
    process.send_signal(signal.SIGTERM)
    try:
        process.wait(timeout=20)
    except subprocess.TimeoutExpired:
        # Once in a full CI run the process, waiting on the pipe, had not stopped: the kernel may hand a process
        # signal to another of its threads (torch's), which leaves the main thread's read() waiting. The end of
        # the input wakes it; a signal that was really lost (ignored or blocked) then ends in a complete output,
        # exit 0, and fails below.
        held_input.close()
        held_input.descriptor = None
    code = process.wait(timeout=30)
    err = process.stderr.read().decode()
    assert code == 130, err[-3000:]  # what the process said, should a signal ever be lost again
    assert "interrupted; no partial output is left behind" in err
    assert os.listdir(tmp_path) == []


def test_a_stop_signal_is_remembered_for_the_loops_that_check(monkeypatch):
    # The KeyboardInterrupt the handler raises can be swallowed by a C extension; embed's loop checks the flag too.
    from hf_elmo import safe_output
    from hf_elmo.cli import _interrupt

    monkeypatch.setattr(safe_output, "_stop_requested", None)
    safe_output.raise_if_stop_requested()  # no signal: nothing
    with pytest.raises(KeyboardInterrupt, match=f"signal {int(signal.SIGTERM)}"):
        _interrupt(signal.SIGTERM, None)
    with pytest.raises(KeyboardInterrupt, match=f"signal {int(signal.SIGTERM)}"):
        safe_output.raise_if_stop_requested()


def test_one_error_convention_usage_errors_and_debug(converted_dir, tmp_path, capsys, monkeypatch):
    # A usage error: the command's own usage line and exit status 2.
    with pytest.raises(SystemExit) as exit_info:
        main(["embed", "in.txt", "out.h5", "--model", str(converted_dir), "--layers", "top"])
    assert exit_info.value.code == 2
    err = capsys.readouterr().err
    assert err.startswith("usage: hf-elmo embed ") and err.strip().endswith("unrecognized arguments: --layers top")
    # Any other error: one line, exit status 1, pretraining included ...
    assert main(["embed", str(tmp_path / "missing.txt"), str(tmp_path / "o.h5"), "--model", str(converted_dir)]) == 1
    assert capsys.readouterr().err == f"error: {tmp_path / 'missing.txt'}: input file not found.\n"
    assert main(["pretrain", "--train-files", str(tmp_path / "none-*.txt"), "--build-vocab", "--config", "small",
                 "--max-steps", "1", "--output-dir", str(tmp_path / "run"), "--report-to", "none"]) == 1
    errors = [line for line in capsys.readouterr().err.splitlines() if line.startswith("error: ")]
    assert len(errors) == 1 and "none-*.txt" in errors[0]
    # ... and with --debug (or HF_ELMO_DEBUG=1) the traceback instead.
    from hf_elmo.embed import EmbedInputError

    with pytest.raises(EmbedInputError, match="input file not found"):
        main(["--debug", "embed", str(tmp_path / "missing.txt"), str(tmp_path / "o.h5"), "--model", str(converted_dir)])
    assert "HF_ELMO_DEBUG" not in os.environ  # for that call only
    monkeypatch.setenv("HF_ELMO_DEBUG", "1")
    with pytest.raises(EmbedInputError, match="input file not found"):
        main(["embed", str(tmp_path / "missing.txt"), str(tmp_path / "o.h5"), "--model", str(converted_dir)])


def test_the_retired_pretraining_module_entry_point_names_the_command():
    done = subprocess.run([sys.executable, "-m", "hf_elmo.pretraining", "--help"], capture_output=True, text=True,
                          timeout=120)
    assert done.returncode == 1 and done.stdout == ""
    assert done.stderr.strip().splitlines() == [
        "python -m hf_elmo.pretraining is gone: run `hf-elmo pretrain ARGS` (or `python -m hf_elmo.cli pretrain "
        "ARGS`, e.g. under accelerate launch)."
    ]
