#!/usr/bin/env python
"""Time AllenNLP 0.9.0's ELMo (`_ElmoBiLm`, what `allennlp elmo` and `ElmoEmbedder` run) and print ONE JSON line.

AllenNLP 0.9.0 is the strongest PyTorch ELMo there was, so it is the bar hf_elmo is held to. It cannot be
pip-installed next to current torch (it pins spacy 2.1, pytorch-transformers 1.1, ...), and is not installed
here at all. Instead:

1. The wheel is fetched once with `pip download --no-deps allennlp==0.9.0` into $HF_ELMO_TEST_CACHE (default
   ~/.cache/hf_elmo_tests, the cache the test suite already uses for the same wheel), or taken from --wheel.
2. An import hook serves the few `allennlp` modules that ELMo's forward pass uses straight from the zip, their
   code unchanged: modules/{elmo, elmo_lstm, lstm_cell_with_projection, encoder_base, highway, scalar_mix},
   nn/{util, initializers}, common/checks, data/token_indexers/elmo_indexer, data/tokenizers/token. The
   package __init__ files, which import the whole library, are not run. The handful of names those modules
   import from the rest of allennlp (Params, Registrable, cached_path, Vocabulary, ...) are small stand-ins
   defined in this file; none of them takes part in the forward pass (cached_path returns local paths as
   they are; the data classes raise if anything calls them).
3. Weights: random weights of the published shapes in bilm-tf's hdf5 layout (`random_bilm.py`), read by
   AllenNLP's own loaders. hf_elmo converts the very same file, so both sides compute the same function.

Python packages it needs besides torch: numpy and h5py (hf_elmo needs them too). Nothing of allennlp's long list
of requirements is imported: its `@overrides` decorator, which only checks at import that a method exists in a
base class, is a stand-in too (the `overrides` package's 3.x reads bytecode and fails on Python 3.12, and 4 and
later reject allennlp 0.9.0's method signatures).

Workload: --words FILE (one sentence per line, words separated by spaces, as `side_by_side.py` writes it from
real text) or --synthetic (the earlier 200-word-list workload). Char ids come from AllenNLP's own
`ELMoCharacterMapper`, padded as its `batch_to_ids` pads them, once before timing.

Device: `--device cpu` (default) or `cuda`, always fp32; the char ids are moved to the device before timing, as
hf_elmo's side does, and on cuda the clock is read after a synchronisation and peak GPU memory is reported.

Timing (`bench_utils.py`, the same code as hf_elmo's side): eval, no_grad; one untimed warm-up batch; then
--repeats passes over the batches in order; tokens_per_s = words (no <S>/</S>, no padding) / the sum over
batches of each batch's fastest pass. AllenNLP's biLM is stateful (each row's final LSTM state starts the
next batch's row); the state is reset before every pass, so every pass computes the same thing.
Peak RSS: VmHWM after the timed passes, restarted after loading (the freed loading buffers are first given
back to the OS), as on hf_elmo's side.

Examples:
    python benchmarks/allennlp_peer.py --config small --synthetic
    python benchmarks/allennlp_peer.py --config original --words /tmp/words.txt --threads 2 --batch-size 32
"""

import argparse
import importlib.abc
import importlib.util
import json
import os
import subprocess
import sys
import tempfile
import time
import zipfile


HERE = os.path.dirname(os.path.abspath(__file__))
if HERE not in sys.path:
    sys.path.insert(0, HERE)

import random_bilm  # noqa: E402  (these two import the standard library only)
import workload  # noqa: E402

WHEEL_NAME = "allennlp-0.9.0-py3-none-any.whl"
# Packages the peer needs in this Python, besides the standard library, and how to get them.
REQUIRED_PACKAGES = {"torch": "torch", "numpy": "numpy", "h5py": "h5py"}

# allennlp modules executed unchanged from the wheel.
FROM_WHEEL = (
    "allennlp.common.checks",
    "allennlp.nn.util",
    "allennlp.nn.initializers",
    "allennlp.modules.elmo",
    "allennlp.modules.elmo_lstm",
    "allennlp.modules.lstm_cell_with_projection",
    "allennlp.modules.encoder_base",
    "allennlp.modules.highway",
    "allennlp.modules.scalar_mix",
    "allennlp.data.token_indexers.elmo_indexer",
    "allennlp.data.tokenizers.token",
)

_UNUSED = '''
class _Unused:
    """A name some allennlp module imports but ELMo's forward pass never uses."""

    def __init__(self, *args, **kwargs):
        raise RuntimeError(f"{type(self).__name__} is not part of the benchmark's AllenNLP peer, "
                           "which loads only the ELMo modules")
'''

# Stand-ins for the parts of allennlp that the modules above import at the top but ELMo's forward pass does not
# use. Written for this harness; they are not allennlp's code.
STAND_INS = {
    # allennlp's decorator: it checks at import that the method overrides one (the `overrides` package itself
    # fails on Python 3.12, see the top); it has no part in what the modules compute.
    "overrides": "def overrides(method):\n    return method\n",
    "allennlp.common": _UNUSED + '''
import collections

class Params(_Unused):
    pass

class Registrable:
    """Enough of a registry for `nn/initializers.py`, which registers its initializers at import time."""
    _registry = collections.defaultdict(dict)

    @classmethod
    def register(cls, name):
        def add(subclass):
            Registrable._registry[cls][name] = subclass
            return subclass
        return add
''',
    "allennlp.common.params": "from allennlp.common import Params\n",
    "allennlp.common.file_utils": '''
import os

def cached_path(path):
    """Local files only: the peer never downloads."""
    path = os.fspath(path)
    if not os.path.exists(path):
        raise FileNotFoundError(path)
    return path
''',
    "allennlp.common.util": '''
import itertools

def lazy_groups_of(iterator, size):
    while True:
        group = list(itertools.islice(iterator, size))
        if not group:
            return
        yield group

def pad_sequence_to_length(sequence, desired_length, default_value=lambda: 0, padding_on_right=True):
    sequence = list(sequence)[:desired_length] if padding_on_right else list(sequence)[-desired_length:]
    padding = [default_value() for _ in range(desired_length - len(sequence))]
    return sequence + padding if padding_on_right else padding + sequence
''',
    "allennlp.data": _UNUSED + '''
from allennlp.data.tokenizers.token import Token

class Vocabulary(_Unused):
    pass

class Instance(_Unused):
    pass
''',
    "allennlp.data.vocabulary": "from allennlp.data import Vocabulary\n",
    "allennlp.data.dataset": _UNUSED + "\nclass Batch(_Unused):\n    pass\n",
    "allennlp.data.fields": _UNUSED + "\nclass TextField(_Unused):\n    pass\n",
    "allennlp.data.token_indexers.token_indexer": '''
from typing import Generic, TypeVar

TokenType = TypeVar("TokenType")

class TokenIndexer(Generic[TokenType]):
    """Base class of ELMoTokenCharactersIndexer; the peer builds char ids with ELMoCharacterMapper directly."""

    def __init__(self, token_min_padding_length=0):
        self._token_min_padding_length = token_min_padding_length

    @classmethod
    def register(cls, name):
        return lambda subclass: subclass

    # The methods ELMoTokenCharactersIndexer marks with @overrides (the real decorator checks that they exist here).
    def count_vocab_items(self, token, counter):
        raise NotImplementedError

    def tokens_to_indices(self, tokens, vocabulary, index_name):
        raise NotImplementedError

    def get_padding_lengths(self, token):
        raise NotImplementedError

    def as_padded_tensor(self, tokens, desired_num_tokens, padding_lengths):
        raise NotImplementedError
''',
}


class WheelModules(importlib.abc.MetaPathFinder, importlib.abc.Loader):
    """Imports the `allennlp` modules listed above from the wheel (a zip) and the stand-ins from this file."""

    def __init__(self, wheel: str):
        self.wheel = wheel
        self.archive = zipfile.ZipFile(wheel)
        names = set(FROM_WHEEL) | set(STAND_INS)
        # Every parent of a served module is a package; those without a stand-in are empty ones.
        self.packages = {name.rsplit(".", k)[0] for name in names for k in range(1, name.count(".") + 1)}

    def find_spec(self, fullname, path=None, target=None):
        if fullname in FROM_WHEEL or fullname in STAND_INS or fullname in self.packages:
            return importlib.util.spec_from_loader(fullname, self, is_package=fullname in self.packages)
        if fullname.startswith("allennlp."):
            raise ImportError(f"allennlp_peer: {fullname} is not among the modules the ELMo peer loads")
        return None

    def create_module(self, spec):
        return None

    def exec_module(self, module):
        name = module.__name__
        if name in FROM_WHEEL:
            member = name.replace(".", "/") + ".py"
            source, filename = self.archive.read(member), f"{self.wheel}/{member}"
        else:
            source, filename = STAND_INS.get(name, ""), f"<allennlp_peer stand-in for {name}>"
        exec(compile(source, filename, "exec"), module.__dict__)


def missing_packages() -> list[str]:
    """Requirements (pip syntax) of the peer that this Python does not meet."""
    return [pip for module, pip in REQUIRED_PACKAGES.items() if importlib.util.find_spec(module) is None]


def wheel_path(given: str | None = None) -> str:
    """The allennlp 0.9.0 wheel: `given`, $ALLENNLP_WHEEL, or fetched once with pip into the test cache."""
    given = given or os.environ.get("ALLENNLP_WHEEL")
    if given:
        return given
    # hf_elmo.testing_utils.cache_dir's rule (empty: unset), written again: this process never imports hf_elmo.
    cache = os.path.abspath(os.environ.get("HF_ELMO_TEST_CACHE")
                            or os.path.join(os.path.expanduser("~"), ".cache", "hf_elmo_tests"))
    wheel = os.path.join(cache, WHEEL_NAME)
    if not os.path.exists(wheel):
        os.makedirs(cache, exist_ok=True)
        print(f"allennlp_peer: fetching {WHEEL_NAME} into {cache} (pip download --no-deps)", file=sys.stderr)
        # Into a folder of its own, moved into place whole: the test suite's workers may be reading the same cache.
        with tempfile.TemporaryDirectory(dir=cache, prefix=".download-") as download:
            done = subprocess.run([sys.executable, "-m", "pip", "download", "--no-deps", "--quiet",
                                   "allennlp==0.9.0", "-d", download])
            if done.returncode == 0 and os.path.exists(os.path.join(download, WHEEL_NAME)):
                os.replace(os.path.join(download, WHEEL_NAME), wheel)
        if not os.path.exists(wheel):
            sys.exit(f"allennlp_peer: could not fetch allennlp==0.9.0 with pip; pass --wheel PATH to a local {WHEEL_NAME}")
    return wheel


def install(wheel: str):
    """Make `import allennlp.modules.elmo` work from `wheel`; exits with one line if a needed package is missing."""
    missing = missing_packages()
    if missing:
        wanted = " ".join(f"'{m}'" for m in missing)
        sys.exit(f"allennlp_peer: the AllenNLP peer needs {wanted}, missing here or of another version (pip install {wanted})")
    if "allennlp" in sys.modules and not isinstance(getattr(sys.modules["allennlp"], "__loader__", None), WheelModules):
        sys.exit("allennlp_peer: another allennlp is already imported in this process")
    if not any(isinstance(finder, WheelModules) for finder in sys.meta_path):
        sys.meta_path.insert(0, WheelModules(wheel))


def char_ids(batch: list[list[str]]):
    """AllenNLP's char ids of a batch: its ELMoCharacterMapper per word, zero rows past each sentence's end."""
    import torch
    from allennlp.data.token_indexers.elmo_indexer import ELMoCharacterMapper

    mapper = ELMoCharacterMapper()
    ids = torch.zeros(len(batch), max(len(s) for s in batch), ELMoCharacterMapper.max_word_length, dtype=torch.long)
    for row, sentence in enumerate(batch):
        ids[row, : len(sentence)] = torch.tensor([mapper.convert_word_to_char_ids(w) for w in sentence])
    return ids


def main():
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    random_bilm.add_weights_arguments(parser, cache_dir=False)
    parser.add_argument("--options", help="a bilm-tf options.json instead of --config (with --weights)")
    parser.add_argument("--weights", help="a bilm-tf weights .hdf5 instead of --config (with --options)")
    source = parser.add_mutually_exclusive_group(required=True)
    source.add_argument("--words", help="workload: one sentence per line, words separated by spaces")
    source.add_argument("--synthetic", action="store_true", help="workload: the 200-word-list sentences")
    parser.add_argument("--n-sentences", type=int, default=64, help="with --synthetic: how many (default 64)")
    parser.add_argument("--batch-size", type=int, default=32)
    parser.add_argument("--device", choices=("cpu", "cuda"), default="cpu",
                        help="where AllenNLP's biLM runs, always in fp32 (default cpu)")
    workload.add_timing_arguments(parser, repeats=5, wait_quiet=0.0)
    parser.add_argument("--wheel", help=f"a local {WHEEL_NAME} (default: fetched with pip, see above)")
    parser.add_argument("--weights-dir", help="where random weights are kept (default: random_bilm.py's)")
    parser.add_argument("--save-first-batch", metavar="PATH",
                        help="also save every layer's word vectors for batch 0 (zero initial state) with torch.save, "
                             "for comparing with hf_elmo's outputs")
    args = parser.parse_args()

    install(wheel_path(args.wheel))
    import torch

    import bench_utils  # torch: only once the peer's modules are installed

    torch.set_num_threads(args.threads)
    if args.device == "cuda" and not torch.cuda.is_available():
        sys.exit("allennlp_peer: --device cuda, but torch sees no CUDA device")
    device = torch.device(args.device)
    cuda = device.type == "cuda"
    synchronize = torch.cuda.synchronize if cuda else None
    from allennlp.modules.elmo import _ElmoBiLm
    from allennlp.nn.util import remove_sentence_boundaries

    if bool(args.options) != bool(args.weights):
        parser.error("--options and --weights go together")
    options, weights = (args.options, args.weights) if args.options else random_bilm.ensure(args.config, args.weights_dir)
    with open(options, encoding="utf-8") as handle:
        architecture = random_bilm.architecture_name(json.load(handle))

    sentences = workload.read_words(args.words) if args.words else workload.synthetic_sentences(args.n_sentences)
    groups = workload.batches(sentences, args.batch_size)
    start = time.perf_counter()
    inputs = [char_ids(group).to(device) for group in groups]  # on the device before timing, as hf_elmo's side
    char_ids_s = time.perf_counter() - start

    start = time.perf_counter()
    bilm = _ElmoBiLm(options, weights, requires_grad=False).to(device).eval()
    load_s = time.perf_counter() - start
    parts = bench_utils.PartTimer(synchronize)
    parts.watch("char_cnn", bilm._token_embedder)
    parts.watch("lstm", bilm._elmo_lstm)

    bench_utils.release_freed_memory()
    rss_after_load = bench_utils.proc_status_mib("VmRSS")
    peak_restarted = bench_utils.reset_peak_rss()
    if cuda:
        torch.cuda.reset_peak_memory_stats()
    with torch.no_grad():
        timing = bench_utils.time_passes(lambda i: bilm(inputs[i]), len(inputs), args.repeats, parts,
                                         wait_quiet_s=args.wait_quiet, before_pass=bilm._elmo_lstm.reset_states,
                                         synchronize=synchronize)
        peak_rss = bench_utils.proc_status_mib("VmHWM") if peak_restarted else None
        memory = {"rss_after_load_mib": rss_after_load, "peak_rss_mib": peak_rss}
        if cuda:
            memory.update(bench_utils.gpu_memory_peaks())
        if args.save_first_batch:
            bilm._elmo_lstm.reset_states()
            output = bilm(inputs[0])
            layers = [remove_sentence_boundaries(layer, output["mask"])[0].cpu() for layer in output["activations"]]
            torch.save({"layers": layers, "workload_sha1": workload.digest(sentences)}, args.save_first_batch)

    result = {
        "impl": "allennlp-0.9.0 _ElmoBiLm",
        "config": architecture,
        "weights": os.path.basename(weights),
        "workload": "synthetic" if args.synthetic else args.words,
        **workload.describe(sentences, args.batch_size),
        "batch_size": args.batch_size,
        "threads": args.threads,
        "repeats": args.repeats,
        "dtype": "fp32",
        "device": args.device,
        **bench_utils.summarize(timing, sum(len(s) for s in sentences)),
        "params": sum(p.numel() for p in bilm.parameters()),
        "load_s": round(load_s, 3),
        "char_ids_s": round(char_ids_s, 3),
        **memory,
        "peak_rss_process_mib": bench_utils.process_peak_rss_mib(),
        "loadavg_after": os.getloadavg(),
        "machine": bench_utils.machine_description(args.device),
    }
    print(json.dumps(result, ensure_ascii=False))


if __name__ == "__main__":
    main()
