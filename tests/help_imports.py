"""What a `--help` imports. Help must come without torch or Transformers (under a second, against ~10 s with them),
for `hf-elmo` and its commands as for the scripts of conversion/."""

import json
import os
import subprocess
import sys


REPO_ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
# Prints the help of `hf-elmo ARGS...` (or of the script ARGS[0], a .py file, run as __main__), then, as its last
# line, the torch and Transformers modules imported meanwhile.
_PROGRAM = """
import json, runpy, sys
argv = sys.argv[1:] + ["--help"]
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
    result = subprocess.run([sys.executable, "-c", _PROGRAM, *command], capture_output=True, text=True, timeout=120,
                            env={**os.environ, "PYTHONPATH": REPO_ROOT})
    lines = result.stdout.strip().splitlines()
    assert lines and lines[-1].startswith("["), result.stderr[-3000:]
    return "\n".join(lines[:-1]), json.loads(lines[-1])
