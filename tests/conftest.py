"""Shared test fixtures: bilm-tf's own test model and outputs, read from the allennlp 0.9.0 wheel
(fetched once with pip into $HF_ELMO_TEST_CACHE, see hf_elmo.testing_utils; allennlp is never imported)."""

import random
import zlib
from pathlib import Path

import pytest

from hf_elmo.testing_utils import allennlp_fixture_root


@pytest.fixture(autouse=True)
def seeded_random_generators(request):
    """
    Each test starts from its own fixed random state, whatever ran before it: torch's, numpy's and Python's
    generators are seeded from the test's id. The suite runs in two workers (pytest-xdist) that share the tests out
    in no fixed order, so a test that draws its inputs from the global generator drew other inputs each run; one
    such test failed on about 1 in 15 of them.
    """
    import numpy as np
    import torch

    seed = zlib.crc32(request.node.nodeid.encode())
    torch.manual_seed(seed)
    np.random.seed(seed)
    random.seed(seed)


@pytest.fixture(scope="session")
def fixtures_root() -> Path:
    """`allennlp/tests/fixtures` from the allennlp 0.9.0 wheel."""
    return allennlp_fixture_root()


@pytest.fixture(scope="session")
def elmo_fixture(fixtures_root) -> Path:
    """bilm-tf's test model: options.json, lm_weights.hdf5, lm_embeddings_*.hdf5, sentences.json, ..."""
    return fixtures_root / "elmo"


@pytest.fixture(scope="session")
def converted_dir(elmo_fixture, tmp_path_factory) -> Path:
    """The bilm-tf fixture model converted with the converter, as a `save_pretrained` folder."""
    from hf_elmo.convert import convert_bilm_tf_to_hf

    output = tmp_path_factory.mktemp("converted") / "elmo-fixture"
    convert_bilm_tf_to_hf(
        str(elmo_fixture / "options.json"),
        str(elmo_fixture / "lm_weights.hdf5"),
        str(output),
        vocab_file=str(elmo_fixture / "vocab_test.txt"),
        progress=False,
    )
    return output


@pytest.fixture(scope="session")
def english_corpus(tmp_path_factory) -> Path:
    """Real English for pretraining runs (Wikipedia sentences): train.txt 3600 sentences, heldout.txt 400."""
    from hf_elmo.testing_utils import english_text_sample

    lines = english_text_sample().read_text(encoding="utf-8").splitlines()
    root = tmp_path_factory.mktemp("corpus")
    (root / "train.txt").write_text("\n".join(lines[:3600]) + "\n", encoding="utf-8")
    (root / "heldout.txt").write_text("\n".join(lines[3600:]) + "\n", encoding="utf-8")
    return root


@pytest.fixture
def fresh_accelerate_state():
    """In-process runs create Accelerate's process-wide singletons; each test using this starts without them."""
    from accelerate.state import AcceleratorState, GradientState

    yield
    AcceleratorState._reset_state(True)
    GradientState._reset_state()


@pytest.fixture
def onednn_products(monkeypatch):
    """Training's products on oneDNN (`cpu_tuning.matmul`) whatever their size and this machine's measurement; yields
    the list of products it ran, by their operands' shapes."""
    import torch

    from hf_elmo import cpu_tuning

    if not cpu_tuning.has_onednn_linear(torch.empty(1)):
        pytest.skip("torch built without oneDNN")
    products, linear = [], cpu_tuning._linear
    monkeypatch.setattr(cpu_tuning, "MIN_ONEDNN_MACS", 0)
    monkeypatch.setitem(cpu_tuning._ONEDNN_TRAINS, torch.get_num_threads(), True)
    monkeypatch.setattr(cpu_tuning, "_linear", lambda x, w: products.append((x.shape, w.shape)) or linear(x, w))
    monkeypatch.delenv(cpu_tuning.TUNING_VARIABLE, raising=False)
    yield products
