"""hf_elmo against bilm-tf's own numbers (the fixture model and outputs shipped in allennlp 0.9.0)."""

import json
import os

import h5py
import numpy as np
import pytest
import torch
from transformers import AutoConfig, AutoModel, AutoTokenizer

from hf_elmo import ElmoConfig, ElmoModel, ElmoTokenizer
from hf_elmo.convert import load_bilm_tf
from hf_elmo.testing_utils import assert_same_computation
from remote_code import run_without_hf_elmo


TOLERANCE = 1e-5


def golden_batches(elmo_fixture):
    """
    bilm-tf computed the fixture with batch size 3: sentences.json holds 3 lists of 10 sentences, batch i is the
    i-th sentence of each list, and lm_embeddings_k.hdf5 dataset "i" is row k of batch i as (forward, backward).
    """
    with open(elmo_fixture / "sentences.json", encoding="utf-8") as f:
        lists = json.load(f)
    expected = []
    for k in range(3):
        with h5py.File(elmo_fixture / f"lm_embeddings_{k}.hdf5", "r") as f:
            expected.append([np.concatenate([f[str(i)][0], f[str(i)][1]], axis=-1) for i in range(10)])
    for i in range(10):
        yield [lists[k][i].split() for k in range(3)], [expected[k][i] for k in range(3)]


def top_layer_diffs(model, tokenizer, elmo_fixture, carry_state: bool):
    """Max |diff| per batch of the top layer vs bilm-tf (state carried between batches when asked)."""
    diffs, state = [], None
    for words, expected in golden_batches(elmo_fixture):
        batch = tokenizer(words, is_split_into_words=True, padding=True, return_tensors="pt").to(model.device)
        with torch.no_grad():
            output = model(**batch, lstm_state=state, return_lstm_state=True) if carry_state else model(**batch)
        if carry_state:
            state = output.lstm_state
        top = output.last_hidden_state
        assert batch["attention_mask"].sum(1).tolist() == [len(w) for w in words]
        top = top.cpu()
        diffs.append(max(float(np.abs(top[k, : len(words[k])].numpy() - expected[k]).max()) for k in range(3)))
    return diffs


@pytest.fixture(scope="module")
def fixture_model(elmo_fixture):
    return load_bilm_tf(str(elmo_fixture / "options.json"), str(elmo_fixture / "lm_weights.hdf5"))


@pytest.fixture(
    scope="module",
    params=[
        ("reference", "cpu"), ("cpu", "cpu"), ("cuda", "cpu"),
        pytest.param(("cuda", "cuda"), marks=pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")),
    ],
    ids=lambda p: f"{p[0]}-on-{p[1]}",
)
def golden_model(request, elmo_fixture):
    """The fixture model under each implementation, on each device (fp32 matmuls in fp32: no TF32)."""
    implementation, device = request.param
    model = load_bilm_tf(str(elmo_fixture / "options.json"), str(elmo_fixture / "lm_weights.hdf5")).to(device)
    model.set_elmo_implementation(implementation)
    previous = torch.backends.cuda.matmul.allow_tf32, torch.backends.cudnn.allow_tf32
    torch.backends.cuda.matmul.allow_tf32 = torch.backends.cudnn.allow_tf32 = False
    yield model
    torch.backends.cuda.matmul.allow_tf32, torch.backends.cudnn.allow_tf32 = previous


def test_token_layer_matches_bilm_tf(golden_model, elmo_fixture):
    words = (elmo_fixture / "vocab_test.txt").read_text(encoding="utf-8").strip().split("\n")
    assert len(words) == 458 and "<S>" in words and "</S>" in words
    batch = ElmoTokenizer()(words, is_split_into_words=True, return_tensors="pt").to(golden_model.device)
    with torch.no_grad():
        layer0 = golden_model(**batch, output_hidden_states=True).hidden_states[0][0].cpu()
    with h5py.File(elmo_fixture / "elmo_token_embeddings.hdf5", "r") as f:
        expected = f["embedding"][...]
    assert layer0.shape == (458, 32)
    # Layer 0 is the token layer duplicated for both directions.
    assert torch.equal(layer0[:, :16], layer0[:, 16:])
    assert np.abs(layer0[:, :16].numpy() - expected).max() <= TOLERANCE


def test_first_batch_matches_with_zero_state(golden_model, elmo_fixture):
    diffs = top_layer_diffs(golden_model, ElmoTokenizer(), elmo_fixture, carry_state=False)
    assert diffs[0] <= TOLERANCE
    # bilm-tf carried its LSTM state between batches: later batches differ without it.
    assert min(diffs[1:]) > 0.1


def test_all_batches_match_with_state_carried(golden_model, elmo_fixture):
    diffs = top_layer_diffs(golden_model, ElmoTokenizer(), elmo_fixture, carry_state=True)
    assert max(diffs) <= TOLERANCE


def test_auto_classes_load_converted_folder(converted_dir, elmo_fixture):
    config = AutoConfig.from_pretrained(converted_dir)
    assert isinstance(config, ElmoConfig)
    assert (config.lstm_dim, config.projection_dim, config.n_highway, config.cell_clip) == (64, 16, 2, 3.0)
    tokenizer = AutoTokenizer.from_pretrained(converted_dir)
    model = AutoModel.from_pretrained(converted_dir)
    assert isinstance(tokenizer, ElmoTokenizer) and isinstance(model, ElmoModel)
    assert max(top_layer_diffs(model, tokenizer, elmo_fixture, carry_state=True)) <= TOLERANCE
    files = set(os.listdir(converted_dir))
    assert {"config.json", "model.safetensors", "tokenizer_config.json", "vocab.txt", "README.md",
            "bilm_tf_source.json", "configuration_elmo.py", "modeling_elmo.py", "tokenization_elmo.py"} <= files


REMOTE_CODE_SCRIPT = """
import json, sys
import torch
from transformers import AutoModel, AutoTokenizer

folder, sentences = sys.argv[1], json.loads(sys.argv[2])
tokenizer = AutoTokenizer.from_pretrained(folder, trust_remote_code=True)
model = AutoModel.from_pretrained(folder, trust_remote_code=True)
state, tops = None, []
for words in sentences:
    batch = tokenizer(words, is_split_into_words=True, padding=True, return_tensors="pt")
    with torch.no_grad():
        output = model(**batch, lstm_state=state, return_lstm_state=True)
    state = output.lstm_state
    tops.append(output.last_hidden_state.tolist())
print(json.dumps({"model": type(model).__module__, "tokenizer": type(tokenizer).__module__, "tops": tops}))
"""


def test_trust_remote_code_without_hf_elmo(converted_dir, elmo_fixture, tmp_path):
    batches = list(golden_batches(elmo_fixture))
    report = run_without_hf_elmo(REMOTE_CODE_SCRIPT, [str(converted_dir), json.dumps([w for w, _ in batches])],
                                 tmp_path)
    assert report["model"].startswith("transformers_modules.")
    assert report["tokenizer"].startswith("transformers_modules.")
    worst = 0.0
    for (words, expected), top in zip(batches, report["tops"]):
        for k in range(3):
            worst = max(worst, float(np.abs(np.array(top[k])[: len(words[k])] - expected[k]).max()))
    assert worst <= TOLERANCE


def test_vectors_do_not_depend_on_batch_or_padding(fixture_model):
    tokenizer = ElmoTokenizer()
    target = "The virus spread quickly through the schools .".split()
    others = [["Short", "."], "A much longer sentence that forces a lot of padding onto the target one".split(), []]
    with torch.no_grad():
        alone = fixture_model(**tokenizer([target], is_split_into_words=True, return_tensors="pt"),
                              output_hidden_states=True)
        mixed = fixture_model(**tokenizer(others[:2] + [target] + others[2:], is_split_into_words=True,
                                          padding=True, return_tensors="pt"), output_hidden_states=True)
    assert mixed.last_hidden_state.shape[1] == 14
    for layer_alone, layer_mixed in zip(alone.hidden_states, mixed.hidden_states):
        assert (layer_alone[0] - layer_mixed[2, : len(target)]).abs().max() <= 1e-6
        # Padded positions are exactly zero.
        assert layer_mixed[2, len(target):].abs().max() == 0


@pytest.mark.parametrize("language", ["es", "fr", "it"])
def test_multilingual_weight_files_convert_and_load(fixtures_root, language, tmp_path):
    from hf_elmo.convert import convert_bilm_tf_to_hf, convert_hf_to_bilm_tf

    source = fixtures_root / "elmo_multilingual" / language
    folder = tmp_path / f"elmo-{language}"
    convert_bilm_tf_to_hf(str(source / "options.json"), str(source / "weights.hdf5"), str(folder), progress=False)
    model = AutoModel.from_pretrained(folder)
    direct = load_bilm_tf(str(source / "options.json"), str(source / "weights.hdf5"))
    batch = AutoTokenizer.from_pretrained(folder)(["¿Dónde está la biblioteca ?", "Où est la gare ?"],
                                                   padding=True, return_tensors="pt")
    with torch.no_grad():
        loaded_out = model(**batch, output_hidden_states=True)
        direct_out = direct(**batch, output_hidden_states=True)
    assert len(loaded_out.hidden_states) == 3 and loaded_out.last_hidden_state.shape[-1] == 32
    # The conversion is lossless: the same tensors, bit for bit, and so the same function.
    direct_state = direct.state_dict()
    assert sorted(model.state_dict()) == sorted(direct_state)
    for name, tensor in model.state_dict().items():
        assert torch.equal(tensor, direct_state[name]), name
    for layer, (a, b) in enumerate(zip(loaded_out.hidden_states, direct_out.hidden_states)):
        assert_same_computation(a, b, f"layer {layer}")
    # And back to bilm-tf's layout, bit for bit.
    options, weights = convert_hf_to_bilm_tf(str(folder), str(tmp_path / "back"))  # (and no vocab.txt to copy)
    with h5py.File(source / "weights.hdf5", "r") as original, h5py.File(weights, "r") as exported:
        names = []
        original.visititems(lambda name, node: names.append(name) if hasattr(node, "shape") else None)
        exported_names = []
        exported.visititems(lambda name, node: exported_names.append(name) if hasattr(node, "shape") else None)
        assert sorted(names) == sorted(exported_names)
        for name in names:
            assert np.array_equal(original[name][...], exported[name][...]), name
