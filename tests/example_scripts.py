"""Loading the scripts of examples/ as modules, for the tests that call their `main` in-process."""

import importlib.util
import os
import sys


EXAMPLES = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "examples")
if EXAMPLES not in sys.path:
    sys.path.insert(0, EXAMPLES)  # the example scripts import finetuning_cli from beside them


def load_example(name: str):
    """examples/NAME.py as a fresh module (its `if __name__ == "__main__"` block not run)."""
    spec = importlib.util.spec_from_file_location(name, os.path.join(EXAMPLES, f"{name}.py"))
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module
