"""ElmoConfig validation and the converter's handling of bad or mismatched bilm-tf files."""

import json
import os
import shutil
import subprocess
import sys

import h5py
import pytest

from hf_elmo import ElmoConfig
from hf_elmo.bilm_tf import BilmTfFormatError, config_from_options, read_options
from hf_elmo.convert import convert_bilm_tf_to_hf
from help_imports import help_and_heavy_imports


REPO_ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


# ---------------------------------------------------------------------------------------------- config
def test_presets_have_the_published_shapes():
    small, medium, original = (ElmoConfig.from_preset(n) for n in ("small", "medium", "original"))
    assert (small.lstm_dim, small.projection_dim, small.n_highway, small.hidden_size) == (1024, 128, 1, 256)
    assert (medium.lstm_dim, medium.projection_dim, medium.n_highway, medium.hidden_size) == (2048, 256, 1, 512)
    assert (original.lstm_dim, original.projection_dim, original.n_highway, original.hidden_size) == (4096, 512, 2, 1024)
    assert original.n_filters == 2048 and original.num_hidden_layers == 2
    with pytest.raises(ValueError, match="Unknown ELMo preset 'huge'"):
        ElmoConfig.from_preset("huge")


@pytest.mark.parametrize(
    "kwargs, message",
    [
        ({"char_activation": "gelu"}, "char_activation must be 'relu' or 'tanh', got 'gelu'"),
        ({"lstm_dim": 0}, "lstm_dim must be a positive integer, got 0"),
        ({"projection_dim": 5000}, r"projection_dim \(5000\) must not exceed lstm_dim \(4096\)"),
        ({"n_characters": 300}, "n_characters must be 261 or 262"),
        ({"n_highway": -1}, "n_highway must be an integer >= 0"),
        ({"char_filters": [[1, 32], [2]]}, r"char_filters must be a non-empty list of \[width, n_filters\]"),
        ({"char_filters": [[60, 4]]}, "filter of width 60, wider than max_characters_per_token=50"),
        ({"cell_clip": -3}, "cell_clip must be a positive finite number or None"),
        ({"num_lstm_layers": 1.5}, "num_lstm_layers must be a positive integer"),
    ],
)
def test_config_validation_names_the_bad_field(kwargs, message):
    with pytest.raises(ValueError, match=message):
        ElmoConfig(**kwargs)


@pytest.mark.parametrize("n_characters", [261, 262])
def test_config_json_written_with_n_characters_still_loads(tmp_path, n_characters):
    # config.json files written while n_characters was a field hold it; it is accepted, checked and not kept.
    ElmoConfig.from_preset("small").save_pretrained(tmp_path)
    written = json.loads((tmp_path / "config.json").read_text())
    (tmp_path / "config.json").write_text(json.dumps({**written, "n_characters": n_characters}))
    config = ElmoConfig.from_pretrained(tmp_path)
    assert config.n_characters == 262 and "n_characters" not in config.to_dict()
    (tmp_path / "config.json").write_text(json.dumps({**written, "n_characters": 300}))
    with pytest.raises(ValueError, match="n_characters must be 261 or 262"):
        ElmoConfig.from_pretrained(tmp_path)


def test_config_round_trip_and_261_characters(tmp_path):
    config = ElmoConfig.from_preset("small", n_characters=261, proj_clip=None)
    assert config.n_characters == 262 and config.proj_clip is None
    config.save_pretrained(tmp_path)
    again = ElmoConfig.from_pretrained(tmp_path)
    assert again.char_filters == config.char_filters and again.proj_clip is None and again.lstm_dim == 1024


# ---------------------------------------------------------------------------------------------- converter
@pytest.fixture
def fixture_copy(elmo_fixture, tmp_path):
    """A writable copy of the bilm-tf fixture's options and weights."""
    shutil.copy(elmo_fixture / "options.json", tmp_path / "options.json")
    shutil.copy(elmo_fixture / "lm_weights.hdf5", tmp_path / "weights.hdf5")
    return tmp_path


def convert(folder, **kwargs):
    return convert_bilm_tf_to_hf(str(folder / "options.json"), str(folder / "weights.hdf5"), str(folder / "out"),
                                 progress=False, **kwargs)


def assert_nothing_written(folder):
    assert not (folder / "out").exists()
    assert [p.name for p in folder.iterdir() if p.name.startswith(".out")] == []


def test_missing_dataset_is_named(fixture_copy):
    with h5py.File(fixture_copy / "weights.hdf5", "a") as f:
        del f["CNN_high_1/W_carry"]
    with pytest.raises(BilmTfFormatError) as error:
        convert(fixture_copy)
    message = str(error.value)
    assert "weights.hdf5" in message and "'CNN_high_1/W_carry' is missing" in message and "(124, 124)" in message
    assert_nothing_written(fixture_copy)


def test_wrong_shape_is_named(fixture_copy):
    with h5py.File(fixture_copy / "weights.hdf5", "a") as f:
        del f["RNN_1/RNN/MultiRNNCell/Cell1/LSTMCell/W_P_0"]
        f["RNN_1/RNN/MultiRNNCell/Cell1/LSTMCell/W_P_0"] = [[0.0] * 16] * 32
    with pytest.raises(BilmTfFormatError, match=r"'RNN_1/RNN/MultiRNNCell/Cell1/LSTMCell/W_P_0' has shape \(32, 16\), "
                                                r"expected \(64, 16\)"):
        convert(fixture_copy)
    assert_nothing_written(fixture_copy)


def test_options_for_another_model_are_caught(fixture_copy):
    options = json.loads((fixture_copy / "options.json").read_text())
    options["char_cnn"]["n_highway"] = 3
    (fixture_copy / "options.json").write_text(json.dumps(options))
    with pytest.raises(BilmTfFormatError, match="'CNN_high_2/W_carry' is missing"):
        convert(fixture_copy)


def test_bad_json_unknown_activation_and_missing_keys(fixture_copy):
    (fixture_copy / "options.json").write_text('{"lstm": {"dim": 64,')
    with pytest.raises(BilmTfFormatError, match="options.json: not valid JSON"):
        convert(fixture_copy)
    with pytest.raises(BilmTfFormatError, match="activation is 'gelu'"):
        config_from_options({"char_cnn": {"filters": [[1, 4]], "embedding": {"dim": 4}, "activation": "gelu"},
                             "lstm": {"dim": 8, "projection_dim": 4}})
    with pytest.raises(BilmTfFormatError, match="missing required key 'lstm.projection_dim'"):
        config_from_options({"char_cnn": {"filters": [[1, 4]], "embedding": {"dim": 4}}, "lstm": {"dim": 8}})
    with pytest.raises(BilmTfFormatError, match="nope.json: options file not found"):
        read_options(str(fixture_copy / "nope.json"))


def test_not_an_hdf5_file(fixture_copy):
    (fixture_copy / "weights.hdf5").write_bytes(b"this is not hdf5")
    with pytest.raises(BilmTfFormatError, match="weights.hdf5: not a readable HDF5 file"):
        convert(fixture_copy)
    assert_nothing_written(fixture_copy)


def test_training_options_with_261_characters(fixture_copy):
    options = json.loads((fixture_copy / "options.json").read_text())
    options["char_cnn"]["n_characters"] = 261
    options.update({"n_tokens_vocab": 3, "batch_size": 128, "unroll_steps": 20, "dropout": 0.1})
    (fixture_copy / "options.json").write_text(json.dumps(options))
    folder = convert(fixture_copy)
    # 262 rows whatever options.json says: a constant (N_CHARACTERS), no longer written to config.json.
    assert "n_characters" not in json.loads((fixture_copy / "out" / "config.json").read_text())
    assert ElmoConfig.from_pretrained(fixture_copy / "out").n_characters == 262
    assert os.path.exists(os.path.join(folder, "model.safetensors"))


def test_existing_output_needs_overwrite(fixture_copy):
    convert(fixture_copy)
    with pytest.raises(FileExistsError, match="already exists"):
        convert(fixture_copy)
    convert(fixture_copy, overwrite=True)
    assert (fixture_copy / "out" / "model.safetensors").exists()
    # The staged folder gets ordinary permissions, not mkdtemp's private 0700.
    umask = os.umask(0)
    os.umask(umask)
    assert os.stat(fixture_copy / "out").st_mode & 0o777 == 0o777 & ~umask


def test_model_card_records_source_checksums(converted_dir, elmo_fixture):
    import hashlib

    card = (converted_dir / "README.md").read_text()
    digest = hashlib.sha256((elmo_fixture / "lm_weights.hdf5").read_bytes()).hexdigest()
    assert digest in card and "library_name: transformers" in card
    source = json.loads((converted_dir / "bilm_tf_source.json").read_text())
    assert source["weights"] == {"file": "lm_weights.hdf5", "sha256": digest}


def test_conversion_script_cli(elmo_fixture, tmp_path):
    script = os.path.join(REPO_ROOT, "conversion", "convert_bilm_tf_to_hf.py")
    help_text, imported = help_and_heavy_imports(script)
    assert "--options" in help_text and "--to-bilm-tf" in help_text, help_text
    assert imported == []  # neither torch nor Transformers for --help
    result = subprocess.run(
        [sys.executable, script, "--options", str(elmo_fixture / "options.json"), "--weights",
         str(tmp_path / "missing.hdf5"), "--output", str(tmp_path / "out")],
        capture_output=True, text=True,
    )
    assert result.returncode == 1 and "missing.hdf5: weight file not found" in result.stderr
    assert not (tmp_path / "out").exists()
