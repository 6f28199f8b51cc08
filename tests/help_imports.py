"""What a `--help`, or a command that fails on its arguments, imports. Help must come without torch or Transformers
(under a second, against ~10 s with them), for `hf-elmo` and its commands as for the scripts of conversion/; so must
the one-line error about an input that is not there."""

import json
import os
import subprocess
import sys


REPO_ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
# Runs `hf-elmo ARGS...` (or the script ARGS[0], a .py file, as __main__), with ARGS ending in `--help` when the first
# is --help, then prints, as its last line, the torch and Transformers modules imported meanwhile.
_PROGRAM = """
import json, runpy, sys
argv = sys.argv[2:] + ["--help"] if sys.argv[1] == "--help" else sys.argv[2:]
try:
    if argv[0].endswith(".py"):
        sys.argv = argv
        runpy.run_path(argv[0], run_name="__main__")
    else:
        from hf_elmo.cli import main
        main(argv)
except SystemExit:
    pass
print(json.dumps(sorted(name for name in sys.modules if name.split(".")[0] in ("torch", "transformers"))))
"""


def help_and_heavy_imports(*command: str) -> tuple[str, list[str]]:
    """The help text of `command` (hf-elmo's arguments, or a script's path) and the heavy modules printing it took."""
    help_text, _, imported = _output_and_heavy_imports("--help", *command)
    return help_text, imported


def error_and_heavy_imports(*command: str) -> tuple[str, list[str]]:
    """What `hf-elmo command...` writes to stderr, and the heavy modules it imported."""
    _, stderr, imported = _output_and_heavy_imports("--", *command)
    return stderr, imported


def _output_and_heavy_imports(mode: str, *command: str) -> tuple[str, str, list[str]]:
    result = subprocess.run([sys.executable, "-c", _PROGRAM, mode, *command], capture_output=True, text=True,
                            timeout=120, env={**os.environ, "PYTHONPATH": REPO_ROOT}, stdin=subprocess.DEVNULL)
    lines = result.stdout.strip().splitlines()
    assert lines and lines[-1].startswith("["), result.stderr[-3000:]
    return "\n".join(lines[:-1]), result.stderr, json.loads(lines[-1])
