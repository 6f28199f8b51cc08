"""hf_elmo.allennlp, the drop-in for AllenNLP 0.9's ELMo API: bilm-tf's fixture numbers, and AllenNLP's own code
(run from its wheel by benchmarks/allennlp_peer.py) on the same weights and batches."""

import json
import os
import sys
from pathlib import Path

import h5py
import numpy as np
import pytest
import torch

from hf_elmo.allennlp import ConfigurationError, DEFAULT_OPTIONS_FILE, Elmo, ElmoEmbedder, batch_to_ids, cache_dir


REPO_ROOT = Path(__file__).resolve().parents[1]
# The fixture's top layer reaches 6 (clipped at 3, plus the skip connection), where float32 steps are 4.8e-7: four
# steps of summation order. Measured: 1.2e-6 at worst, against bilm-tf's numbers and against AllenNLP's own code.
TOLERANCE = 2e-6


@pytest.fixture(scope="module")
def files(elmo_fixture, tmp_path_factory):
    """The fixture's bilm-tf pair, with the drop-in's conversion cache in a folder of this module's own."""
    cache = tmp_path_factory.mktemp("hf_elmo_cache")
    previous = os.environ.get("HF_ELMO_CACHE")
    os.environ["HF_ELMO_CACHE"] = str(cache)
    yield str(elmo_fixture / "options.json"), str(elmo_fixture / "lm_weights.hdf5")
    if previous is None:
        del os.environ["HF_ELMO_CACHE"]
    else:
        os.environ["HF_ELMO_CACHE"] = previous


@pytest.fixture(scope="module")
def allennlp():
    """AllenNLP 0.9.0's own `allennlp.modules.elmo`, from the wheel the suite fetches for the fixture."""
    sys.path.insert(0, str(REPO_ROOT / "benchmarks"))
    import allennlp_peer

    allennlp_peer.install(allennlp_peer.wheel_path())
    import allennlp.modules.elmo as elmo

    return elmo, allennlp_peer


def fixture_batches(elmo_fixture):
    """bilm-tf's batches (3 rows each, in its order) and its top layer for each row."""
    lists = json.loads((elmo_fixture / "sentences.json").read_text(encoding="utf-8"))
    expected = []
    for k in range(3):
        with h5py.File(elmo_fixture / f"lm_embeddings_{k}.hdf5", "r") as f:
            expected.append([np.concatenate([f[str(i)][0], f[str(i)][1]], axis=-1) for i in range(10)])
    return [([lists[k][i].split() for k in range(3)], [expected[k][i] for k in range(3)]) for i in range(10)]


def top_layer_only():
    return [-1e10, -1e10, 1e10]  # softmax (0, 0, 1), gamma 1: the mix is the top layer


def worst_against_fixture(call, batches) -> list[float]:
    diffs = []
    for words, expected in batches:
        vectors = call(words)
        diffs.append(max(float(np.abs(vectors[k][: len(words[k])] - expected[k]).max()) for k in range(3)))
    return diffs


# ------------------------------------------------------------------------------------------------ batch_to_ids
def test_batch_to_ids_is_allennlps_character_mapper(allennlp):
    _, peer = allennlp
    batch = [["Hello", "wörld", "<S>", "</S>", "日本語", "x" * 60, "🙂"], [], ["a"]]
    ids = batch_to_ids(batch)
    assert ids.shape == (3, 7, 50) and ids.dtype == torch.long
    expected = peer.char_ids([s or ["pad"] for s in batch])  # the peer's helper needs one word per row
    assert torch.equal(ids[0], expected[0]) and torch.equal(ids[2, :1], expected[2, :1])
    assert not ids[1].any() and not ids[2, 1:].any()
    assert ids[0, 5, 48] == ord("x") + 1 and ids[0, 5, 49] == 259 + 1  # 48 bytes kept, then end-of-word
    assert batch_to_ids([]).shape == (0, 0, 50)
    with pytest.raises(TypeError, match="a list of sentences, each a list of words"):
        batch_to_ids(["not", "split"])
    # A word that is not a string (it failed with "'int' object has no attribute 'encode'").
    with pytest.raises(TypeError) as error:
        batch_to_ids([["fine"], ["one", 2]])
    assert str(error.value) == ("batch_to_ids: sentence 1, word 1 is 2 (int), not a string; each sentence is a list "
                                "of words (strings).")


# ------------------------------------------------------------------------------------------------ Elmo
def test_elmo_matches_bilm_tf_across_the_fixtures_batches_stateful_and_not(files, elmo_fixture):
    batches = fixture_batches(elmo_fixture)
    elmo = Elmo(*files, 2, dropout=0.0, scalar_mix_parameters=top_layer_only())
    top = lambda words: elmo(batch_to_ids(words))["elmo_representations"][1].detach().numpy()  # noqa: E731
    assert max(worst_against_fixture(top, batches)) <= TOLERANCE  # stateful, as AllenNLP: bilm-tf's numbers
    elmo.reset_states()
    assert max(worst_against_fixture(top, batches)) <= TOLERANCE  # starts over
    stateless = Elmo(*files, 1, dropout=0.0, scalar_mix_parameters=top_layer_only(), stateful=False)
    top = lambda words: stateless(batch_to_ids(words))["elmo_representations"][0].detach().numpy()  # noqa: E731
    diffs = worst_against_fixture(top, batches)
    assert diffs[0] <= TOLERANCE and min(diffs[1:]) > 0.1  # bilm-tf carried the state; a zero state differs
    assert worst_against_fixture(top, batches[3:4]) == diffs[3:4]  # and depends on nothing read before


def test_elmo_equals_allennlps_elmo_call_by_call(files, allennlp):
    """Layer norm over the batch, two mixes, batches that grow and shrink (the state kept per row), boundaries
    kept or not, 3-D and 4-D inputs: AllenNLP 0.9's own Elmo on the same weights and inputs, call by call."""
    allennlp_elmo, _ = allennlp
    words = "The bank raised its rates . We sat on the river bank and watched the boats go by slowly".split()
    batches = [[words[i : i + n] for i, n in zip(range(0, 40, 3), lengths)]
               for lengths in ([4, 7, 2], [5, 1, 6, 3, 8], [2, 9], [6, 6, 1, 4])]
    for options in ({"do_layer_norm": True}, {"keep_sentence_boundaries": True},
                    {"scalar_mix_parameters": [0.5, -1.0, 2.0]}):
        theirs = allennlp_elmo.Elmo(*files, 2, dropout=0.0, **options).eval()
        ours = Elmo(*files, 2, dropout=0.0, **options).eval()
        for batch in batches:
            ids = batch_to_ids(batch)
            with torch.no_grad():
                expected, got = theirs(ids), ours(ids)
            assert torch.equal(got["mask"], expected["mask"]), options
            for a, b in zip(got["elmo_representations"], expected["elmo_representations"]):
                assert a.shape == b.shape and float((a - b).abs().max()) <= TOLERANCE, options
    # 4-D inputs (batch, n, timesteps, 50), e.g. several passages per example.
    theirs = allennlp_elmo.Elmo(*files, 1, dropout=0.0, do_layer_norm=True).eval()
    ours = Elmo(*files, 1, dropout=0.0, do_layer_norm=True).eval()
    ids = batch_to_ids(batches[1] + [words[:3]]).view(2, 3, -1, 50)
    with torch.no_grad():
        expected, got = theirs(ids), ours(ids)
    assert got["mask"].shape == (2, 3, ids.shape[2]) and torch.equal(got["mask"], expected["mask"])
    assert float((got["elmo_representations"][0] - expected["elmo_representations"][0]).abs().max()) <= TOLERANCE


def test_elmo_arguments_requires_grad_dropout_and_the_cached_vocabulary(files):
    batch = [["The", "bank", "rose"], ["A", "river"]]
    ids = batch_to_ids(batch)
    frozen = Elmo(*files, 1, stateful=False)
    assert not any(p.requires_grad for p in frozen._elmo_lstm.parameters())
    mix = dict(frozen.named_parameters())
    assert {"scalar_mix_0.gamma", "scalar_mix_0.scalar_parameters.0"} <= set(mix)
    assert mix["scalar_mix_0.gamma"].requires_grad
    trainable = Elmo(*files, 1, requires_grad=True, stateful=False, dropout=0.0)
    trainable(ids)["elmo_representations"][0].sum().backward()
    assert all(p.grad is not None for p in trainable._elmo_lstm.parameters())
    fixed = Elmo(*files, 1, scalar_mix_parameters=[0.0, 0.0, 0.0], stateful=False)
    assert not any(p.requires_grad for p in fixed.parameters())
    # Dropout (0.5 by default) in training mode only.
    frozen.eval()
    first, second = (frozen(ids)["elmo_representations"][0] for _ in range(2))
    assert torch.equal(first, second)
    frozen.train()
    dropped = frozen(ids)["elmo_representations"][0]
    assert not torch.equal(dropped, first) and ((dropped == 0) & (first != 0)).any()
    # vocab_to_cache: word ids into the cached words give what the characters give.
    vocab = ["@@PADDING@@", "@@UNKNOWN@@", "The", "bank", "rose", "A", "river"]
    cached = Elmo(*files, 1, vocab_to_cache=vocab, stateful=False).eval()
    word_ids = torch.tensor([[2, 3, 4], [5, 6, 0]])
    with torch.no_grad():
        by_words = cached(ids, word_ids)["elmo_representations"][0]
        by_chars = cached(ids)["elmo_representations"][0]
        outside = cached(ids, torch.tensor([[2, 3, 99], [5, 6, 0]]))["elmo_representations"][0]  # back to chars
    assert float((by_words - by_chars).abs().max()) <= TOLERANCE and torch.equal(outside, by_chars)
    with pytest.raises(ConfigurationError, match="Don't provide options_file or weight_file with module"):
        Elmo(*files, 1, module=frozen._elmo_lstm.elmo)
    from_module = Elmo(None, None, 1, module=frozen._elmo_lstm.elmo, stateful=False).eval()
    assert torch.equal(from_module(ids)["elmo_representations"][0], first)


def test_weights_convert_once_into_a_cache_keyed_by_their_sha256(files, converted_dir):
    from hf_elmo.run_record import sha256_of
    import hashlib

    Elmo(*files, 1)
    key = hashlib.sha256((sha256_of(files[0]) + sha256_of(files[1])).encode()).hexdigest()[:32]
    folder = Path(cache_dir()) / f"converted-{key}"
    assert (folder / "model.safetensors").is_file() and (folder / "config.json").is_file()
    stamp = (folder / "model.safetensors").stat().st_mtime_ns
    Elmo(*files, 1)
    assert (folder / "model.safetensors").stat().st_mtime_ns == stamp  # loaded, not converted again
    # A converted folder (or a Hub id) in options_file, weight_file None.
    a, b = Elmo(str(converted_dir), None, 1, stateful=False).eval(), Elmo(*files, 1, stateful=False).eval()
    ids = batch_to_ids([["a", "test"]])
    assert torch.equal(a(ids)["elmo_representations"][0], b(ids)["elmo_representations"][0])


def test_a_conversion_under_way_in_another_process_is_waited_for_and_loaded(files, tmp_path, monkeypatch):
    # Two processes started at once with the same weights: the second could be refused by the first's conversion
    # lock, then fail to load the half-written folder. Here this test plays the first process: it holds the cache
    # while the drop-in (in a thread) asks for the same weights, which must wait and then load what the test converted.
    import hashlib
    import threading

    from hf_elmo.convert import convert_bilm_tf_to_hf
    from hf_elmo.run_record import sha256_of
    from hf_elmo.safe_output import cache_fill_lock

    monkeypatch.setenv("HF_ELMO_CACHE", str(tmp_path))
    key = hashlib.sha256((sha256_of(files[0]) + sha256_of(files[1])).encode()).hexdigest()[:32]
    folder = Path(cache_dir()) / f"converted-{key}"
    loaded = []
    with cache_fill_lock(cache_dir()):
        second = threading.Thread(target=lambda: loaded.append(Elmo(*files, 1)))
        second.start()
        second.join(timeout=1.0)
        assert second.is_alive()  # waiting for this "process" to finish its conversion
        convert_bilm_tf_to_hf(*files, str(folder), progress=False)
        stamp = (folder / "model.safetensors").stat().st_mtime_ns
    second.join(timeout=60)
    assert len(loaded) == 1 and loaded[0].get_output_dim() == 32
    assert (folder / "model.safetensors").stat().st_mtime_ns == stamp  # loaded, not converted a second time


def test_default_files_without_network_say_what_to_download_and_where(monkeypatch):
    from huggingface_hub import constants

    monkeypatch.setattr(constants, "HF_HUB_OFFLINE", True)  # as HF_HUB_OFFLINE=1 at start-up: no request at all
    with pytest.raises(FileNotFoundError) as error:
        ElmoEmbedder()
    message = str(error.value)
    assert message.startswith(f"{DEFAULT_OPTIONS_FILE}: not downloaded (HF_HUB_OFFLINE is set). Download it yourself "
                               f"(curl -fLO {DEFAULT_OPTIONS_FILE}) and put it in {cache_dir()}/downloads")
    with pytest.raises(FileNotFoundError, match="nope.json: no such file"):
        Elmo("nope.json", "nope.hdf5", 1)


# ------------------------------------------------------------------------------------------------ ElmoEmbedder
def test_embedder_gives_allennlps_arrays_and_bilm_tf_numbers(files, elmo_fixture, allennlp):
    embedder = ElmoEmbedder(*files)
    batches = fixture_batches(elmo_fixture)
    top = lambda words: [v[2] for v in embedder.embed_batch(words)]  # noqa: E731
    assert max(worst_against_fixture(top, batches)) <= TOLERANCE
    stateless = ElmoEmbedder(*files, stateful=False)
    top = lambda words: [v[2] for v in stateless.embed_batch(words)]  # noqa: E731
    diffs = worst_against_fixture(top, batches)
    assert diffs[0] <= TOLERANCE and min(diffs[1:]) > 0.1  # zero states: bilm-tf's first batch only
    vectors = embedder.embed_sentence(["The", "bank"])
    assert isinstance(vectors, np.ndarray) and vectors.shape == (3, 2, 32)
    assert embedder.embed_sentence([]).shape == (3, 0, 32)
    assert [v.shape for v in embedder.embed_batch([["a", "b", "c"], [], ["d"]])] == [(3, 3, 32), (3, 0, 32), (3, 1, 32)]
    activations, mask = embedder.batch_to_embeddings([["a", "b", "c"], ["d"]])
    assert activations.shape == (2, 3, 3, 32) and mask.tolist() == [[1, 1, 1], [1, 0, 0]]
    assert len(list(embedder.embed_sentences([["a"]] * 5, batch_size=2))) == 5
    # AllenNLP's biLM (what its ElmoEmbedder runs) on the same batches, state carried, row by row.
    allennlp_elmo, _ = allennlp
    bilm = allennlp_elmo._ElmoBiLm(*files)
    ours = ElmoEmbedder(*files)
    for words, _ in batches[:4]:
        with torch.no_grad():
            theirs = bilm(batch_to_ids(words))["activations"]
        for row, got in enumerate(ours.embed_batch(words)):
            expected = np.stack([layer[row, 1 : len(words[row]) + 1].numpy() for layer in theirs])
            assert float(np.abs(got - expected).max()) <= TOLERANCE
    with pytest.raises(ValueError, match="cuda_device 7: this machine has \\d+ CUDA GPU\\(s\\)"):
        ElmoEmbedder(*files, cuda_device=7)


def test_embed_file_writes_allennlps_layout(files, tmp_path):
    embedder = ElmoEmbedder(*files, stateful=False)
    lines = ["The bank raised rates .", "We sat by the river", "The bank raised rates .", "  Hi  "]
    (tmp_path / "in.txt").write_text("\n".join(lines) + "\n", encoding="utf-8")
    expected = [embedder.embed_sentence(line.split()) for line in lines]
    for output_format, pick in (("all", lambda v: v), ("top", lambda v: v[-1]),
                                ("average", lambda v: np.average(v, axis=0))):
        out = tmp_path / f"{output_format}.hdf5"
        embedder.embed_file(str(tmp_path / "in.txt"), str(out), output_format=output_format, batch_size=3)
        with h5py.File(out, "r") as f:
            assert sorted(f.keys()) == ["0", "1", "2", "3", "sentence_to_index"]
            for i, vectors in enumerate(expected):
                assert f[str(i)].dtype == np.float32 and np.allclose(f[str(i)][...], pick(vectors), atol=1e-6)
            # A repeated line maps to its last key; lines are stripped, as AllenNLP did.
            assert json.loads(f["sentence_to_index"][0]) == {"The bank raised rates .": "2",
                                                             "We sat by the river": "1", "Hi": "3"}
    with open(tmp_path / "in.txt", encoding="utf-8") as handle:  # an open file, as AllenNLP's command passed
        embedder.embed_file(handle, str(tmp_path / "forget.hdf5"), forget_sentences=True)
        assert handle.closed
    with h5py.File(tmp_path / "forget.hdf5", "r") as f:
        assert sorted(f.keys()) == ["0", "1", "2", "3"]
    # An open file that is not UTF-8: its line, found in the file it names, as for a path.
    (tmp_path / "latin1.txt").write_bytes("Hi\ncaf\u00e9 au lait\n".encode("latin-1"))
    with open(tmp_path / "latin1.txt", encoding="utf-8") as handle:
        with pytest.raises(ConfigurationError) as refused:
            embedder.embed_file(handle, str(tmp_path / "latin1.hdf5"))
    assert str(refused.value) == (f"{tmp_path / 'latin1.txt'}, line 2: not UTF-8 text (byte 3: b'\\xe9 au'); expected "
                                  "UTF-8. Convert the file, e.g. iconv -f LATIN1 -t UTF-8 for Latin-1.")
    (tmp_path / "unique.txt").write_text("a b\nc d e\n", encoding="utf-8")
    embedder.embed_file(str(tmp_path / "unique.txt"), str(tmp_path / "keys.hdf5"), use_sentence_keys=True)
    with h5py.File(tmp_path / "keys.hdf5", "r") as f:
        assert sorted(f.keys()) == ["a b", "c d e"] and f["c d e"].shape == (3, 3, 32)
    with pytest.raises(ConfigurationError, match="Key already exists in .*dup.hdf5. To encode duplicate sentences"):
        embedder.embed_file(str(tmp_path / "in.txt"), str(tmp_path / "dup.hdf5"), use_sentence_keys=True)
    (tmp_path / "blank.txt").write_text("a\n\nb\n   \n", encoding="utf-8")
    with pytest.raises(ConfigurationError, match=r"empty lines at indexes \[1, 3\]. Please remove them."):
        embedder.embed_file(str(tmp_path / "blank.txt"), str(tmp_path / "blank.hdf5"))
    with pytest.raises(ConfigurationError, match="output_format must be 'all', 'top' or 'average'"):
        embedder.embed_file(str(tmp_path / "in.txt"), str(tmp_path / "x.hdf5"), output_format="bottom")
    # Nothing is left of the runs that failed (the file appears only when complete).
    assert not [p.name for p in tmp_path.iterdir() if p.name.startswith((".dup", "dup", "blank.hdf5", "x.hdf5"))]


# ------------------------------------------------------------------------------------------------ the command
def test_the_allennlp_elmo_command(files, tmp_path, capsys, monkeypatch):
    from huggingface_hub import constants

    from hf_elmo.cli import main

    (tmp_path / "in.txt").write_text("The bank raised rates .\nWe sat by the river\n", encoding="utf-8")
    out = tmp_path / "out.hdf5"
    assert main(["allennlp-elmo", str(tmp_path / "in.txt"), str(out), "--top", "--options-file", files[0],
                 "--weight-file", files[1], "--batch-size", "1"]) == 0
    expected = ElmoEmbedder(*files).embed_batch([["The", "bank", "raised", "rates", "."], ["We", "sat", "by", "the",
                                                                                          "river"]])
    with h5py.File(out, "r") as f:
        assert sorted(f.keys()) == ["0", "1", "sentence_to_index"] and f["0"].shape == (5, 32)
        # Batches of one sentence, stateful: sentence 1 starts from sentence 0's final state (in the 2-row batch
        # above both started from zeros), so only sentence 0's vectors agree.
        assert np.allclose(f["0"][...], expected[0][-1], atol=TOLERANCE)
        assert not np.allclose(f["1"][...], expected[1][-1], atol=1e-3)
    capsys.readouterr()
    assert main(["allennlp-elmo", str(tmp_path / "in.txt"), str(out), "--all", "--options-file", files[0],
                 "--weight-file", files[1]]) == 1
    assert capsys.readouterr().err.strip().splitlines()[-1] == (
        f"error: {out} already exists; pass overwrite=True (--overwrite) to replace it.")
    assert main(["allennlp-elmo", str(tmp_path / "in.txt"), str(out), "--all", "--options-file", files[0],
                 "--weight-file", files[1], "--overwrite"]) == 0
    with h5py.File(out, "r") as f:
        assert f["0"].shape == (3, 5, 32) and np.allclose(f["1"][...], expected[1], atol=TOLERANCE)
    (tmp_path / "blank.txt").write_text("a\n\n", encoding="utf-8")
    capsys.readouterr()
    assert main(["allennlp-elmo", str(tmp_path / "blank.txt"), str(tmp_path / "b.hdf5"), "--all",
                 "--options-file", files[0], "--weight-file", files[1]]) == 1
    assert capsys.readouterr().err == ("error: Your input file contains empty lines at indexes [1]. Please remove "
                                       "them.\n")
    (tmp_path / "latin1.txt").write_bytes("caf\u00e9 au lait\n".encode("latin-1"))
    assert main(["allennlp-elmo", str(tmp_path / "latin1.txt"), str(tmp_path / "b.hdf5"), "--all",
                 "--options-file", files[0], "--weight-file", files[1]]) == 1
    assert capsys.readouterr().err == (f"error: {tmp_path / 'latin1.txt'}, line 1: not UTF-8 text (byte 3: "
                                       "b'\\xe9 au'); expected UTF-8. Convert the file, e.g. iconv -f LATIN1 -t UTF-8 "
                                       "for Latin-1.\n")
    monkeypatch.setattr(constants, "HF_HUB_OFFLINE", True)
    assert main(["allennlp-elmo", str(tmp_path / "in.txt"), str(tmp_path / "c.hdf5"), "--all"]) == 1
    assert capsys.readouterr().err.strip().splitlines()[-1].startswith(f"error: {DEFAULT_OPTIONS_FILE}: not downloaded")
    assert main(["allennlp-elmo", str(tmp_path / "in.txt"), str(tmp_path / "c.hdf5"), "--all", "--options-file",
                 files[0], "--weight-file", files[1], "--cuda-device", "9"]) == 1
    assert "error: cuda_device 9: this machine has" in capsys.readouterr().err
    assert not [p.name for p in tmp_path.iterdir() if p.name in ("b.hdf5", "c.hdf5") or p.name.startswith(".")]


# ------------------------------------------------------------------------------------------------ an AllenNLP script
def test_an_allennlp_script_with_only_its_imports_changed_gives_allennlps_numbers(files, allennlp, monkeypatch, capsys):
    import runpy

    allennlp_elmo, peer = allennlp
    monkeypatch.setattr(sys, "argv", ["allennlp_script.py", *files])
    script = runpy.run_path(str(REPO_ROOT / "examples" / "allennlp_script.py"))
    printed = capsys.readouterr().out
    assert "elmo_representations: [(2, 7, 32), (2, 7, 32)] mask: (2, 7)" in printed
    assert "embed_sentence: (3, 4, 32)" in printed
    # The same statements on AllenNLP 0.9's own modules (its char ids from its ELMoCharacterMapper).
    theirs = allennlp_elmo.Elmo(*files, num_output_representations=2, dropout=0.0)
    expected = theirs(peer.char_ids(script["sentences"]))
    assert torch.equal(script["mask"], expected["mask"])
    for ours, reference in zip(script["representations"], expected["elmo_representations"]):
        assert float((ours - reference).detach().abs().max()) <= TOLERANCE
    sentence = ["Deep", "contextualized", "word", "representations"]
    activations = allennlp_elmo._ElmoBiLm(*files)(peer.char_ids([sentence]))["activations"]
    reference = np.stack([layer[0, 1 : len(sentence) + 1].detach().numpy() for layer in activations])
    assert float(np.abs(script["layers"] - reference).max()) <= TOLERANCE
