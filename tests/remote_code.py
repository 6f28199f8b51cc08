"""Run Python code in a fresh process where hf_elmo cannot be imported, as on a machine that never installed it.

Shared by the tests that load saved folders with `trust_remote_code=True`. The child gets no PYTHONPATH, runs in
a scratch folder (so the repository is not on sys.path), works offline, and has its own modules cache, so only
the code files inside the saved folders can define the ELMo classes.
"""

import json
import os
import subprocess
import sys
import textwrap


BLOCK_HF_ELMO = textwrap.dedent(
    """
    import importlib.abc, sys

    class BlockHfElmo(importlib.abc.MetaPathFinder):
        # Behave as if hf_elmo were not installed at all.
        def find_spec(self, name, path=None, target=None):
            if name == "hf_elmo" or name.startswith("hf_elmo."):
                raise ModuleNotFoundError(f"No module named {name!r}")

    sys.meta_path.insert(0, BlockHfElmo())
    try:
        import hf_elmo
        raise SystemExit("hf_elmo is importable; the test would prove nothing")
    except ModuleNotFoundError:
        pass
    """
)


def run_without_hf_elmo(script: str, args: list[str], workdir, timeout: int = 300) -> dict:
    """
    Run `script` (Python source) with `sys.argv[1:] == args` where hf_elmo cannot be imported; the script prints
    one JSON object as its last stdout line, which is returned.
    """
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
    env.update(HF_HUB_OFFLINE="1", HF_MODULES_CACHE=str(os.path.join(workdir, "modules")))
    result = subprocess.run(
        [sys.executable, "-c", BLOCK_HF_ELMO + textwrap.dedent(script), *args],
        capture_output=True, text=True, cwd=workdir, env=env, timeout=timeout,
    )
    assert result.returncode == 0, result.stderr[-5000:]
    return json.loads(result.stdout.strip().splitlines()[-1])
