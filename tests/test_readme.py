"""Every Python and shell snippet of README.md runs as written, in README order, in a fresh folder, offline, each in
a fresh interpreter (or bash).

bilm-tf's small test model stands in for the released weights: the folders the snippets name (`elmo-original`,
and `out/ner`, which the README's example run would write) are made from it first. A snippet that needs the network
or the Hub, or runs long, carries `<!-- readme-test: skip, REASON -->` on the line above its fence; nothing else
is skipped. Shell snippets run under bash with this environment's scripts (`hf-elmo`, `python`) first on PATH, as
with `.venv` activated.
"""

import os
import re
import shutil
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path

import h5py
import pytest
from transformers import AutoModelForTokenClassification, AutoTokenizer


README = Path(__file__).resolve().parent.parent / "README.md"
SKIP_MARKER = re.compile(r"^<!-- readme-test: skip, (.+) -->$")
SKIP_REASONS = ("needs the network", "needs the Hub", "long run")
RUN_LANGUAGES = ("python", "bash")


@dataclass
class Snippet:
    language: str
    code: str
    line: int  # of the opening fence, 1-based
    skip: str | None  # the marker's reason


def readme_snippets(text: str) -> list[Snippet]:
    snippets, lines, index = [], text.splitlines(), 0
    while index < len(lines):
        fence = re.match(r"^```(\w*)\s*$", lines[index])
        if not fence:
            index += 1
            continue
        end = next(i for i in range(index + 1, len(lines)) if lines[i].rstrip() == "```")
        previous = next((lines[i].strip() for i in range(index - 1, -1, -1) if lines[i].strip()), "")
        marker = SKIP_MARKER.match(previous)
        snippets.append(Snippet(fence.group(1), "\n".join(lines[index + 1 : end]) + "\n", index + 1,
                                marker.group(1) if marker else None))
        index = end + 1
    return snippets


def test_readme_snippets_are_parsed_and_every_skip_says_why():
    snippets = readme_snippets(README.read_text(encoding="utf-8"))
    runnable = [s for s in snippets if s.language in RUN_LANGUAGES]
    for snippet in runnable:
        if snippet.skip is not None:
            assert snippet.skip.startswith(SKIP_REASONS), f"README.md:{snippet.line}: unknown skip reason"
    # Most snippets run: a marker is an exception, not a way out.
    assert sum(s.skip is None for s in runnable if s.language == "python") >= 6
    assert sum(s.skip is None for s in runnable if s.language == "bash") >= 1
    # Fences without a language (the layout tree) are text; a marker on one would be a mistake.
    assert all(s.skip is None for s in snippets if s.language not in RUN_LANGUAGES)


@pytest.fixture
def readme_folder(converted_dir, tmp_path, monkeypatch):
    """A fresh folder holding what the snippets expect to exist beforehand, as the current directory."""
    shutil.copytree(converted_dir, tmp_path / "elmo-original")
    labels = ["O", "B-ORG", "B-PER", "B-LOC", "I-ORG", "I-PER", "I-LOC"]
    head = AutoModelForTokenClassification.from_pretrained(
        converted_dir, id2label=dict(enumerate(labels)), label2id={label: i for i, label in enumerate(labels)})
    head.save_pretrained(tmp_path / "out" / "ner")
    AutoTokenizer.from_pretrained(converted_dir).save_pretrained(tmp_path / "out" / "ner")
    (tmp_path / "tmp").mkdir()
    monkeypatch.chdir(tmp_path)
    return tmp_path


def test_readme_snippets_run_as_written(readme_folder):
    env = {
        **os.environ,
        "PATH": os.path.dirname(sys.executable) + os.pathsep + os.environ.get("PATH", ""),
        "HF_HUB_OFFLINE": "1",
        "TMPDIR": str(readme_folder / "tmp"),  # where `publish --dry-run` prepares its folder
    }
    ran = []
    for snippet in readme_snippets(README.read_text(encoding="utf-8")):
        if snippet.language not in RUN_LANGUAGES or snippet.skip is not None:
            continue
        where = f"README.md:{snippet.line}"
        # Each in a fresh interpreter, as a reader would run it: an import another snippet made does not count.
        command = [sys.executable, "-c", snippet.code] if snippet.language == "python" else [
            "bash", "-euo", "pipefail", "-c", snippet.code]
        result = subprocess.run(command, cwd=readme_folder, env=env, capture_output=True, text=True, timeout=600)
        assert result.returncode == 0, f"{where} failed:\n{result.stdout}\n{result.stderr}"
        ran.append(where)
    assert len(ran) >= 7
    # What the shell walkthrough wrote is real: 30 sentences embedded, and the folder the Hub would receive.
    with h5py.File(readme_folder / "sentences.hdf5") as f:
        assert len(f) == 30 and f["0"].shape[0] == 3
    assert (readme_folder / "elmo-fixture" / "model.safetensors").is_file()
    assert os.listdir(readme_folder / "tmp") == []  # `publish --dry-run` printed its folder and removed it
