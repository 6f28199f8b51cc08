"""Writing one file so that readers see the old file or the whole new one, never half of it.

The primitive every writer of the package uses: a hidden partial file beside the output, flushed to disk and renamed
into place when complete, removed on failure. Kept apart from `safe_output.py` (the commands' overwrite policy,
disk-space messages, clean-up after killed runs, signals) because a saved model's code carries it: the tokenizer
writes its vocabulary with it, and everything this module imports travels into every saved folder.
"""

import contextlib
import os


def partial_path(output_path: str) -> str:
    """The hidden `.NAME.<pid>.partial` file beside `output_path` that is written first."""
    folder, name = os.path.split(output_path)
    return os.path.join(folder, f".{name}.{os.getpid()}.partial")


def create_partial(output_path: str) -> str:
    """Create the partial file of `output_path`, empty, with the permissions a plain open() gives; return its path."""
    partial = partial_path(output_path)
    with open(partial, "wb"):
        pass
    return partial


def finish_partial(partial: str, output_path: str, put_in_place=os.replace) -> None:
    """Flush the written `partial` to disk, then `put_in_place(partial, output_path)` (a rename by default)."""
    with open(partial, "rb") as handle:
        os.fsync(handle.fileno())
    put_in_place(partial, output_path)


def discard_partial(partial: str) -> None:
    with contextlib.suppress(FileNotFoundError):
        os.remove(partial)


@contextlib.contextmanager
def atomic_write(output_path):
    """Yields the path of the partial file to write; when the block succeeds it replaces `output_path`."""
    output_path = os.path.abspath(os.fspath(output_path))
    partial = create_partial(output_path)
    try:
        yield partial
        finish_partial(partial, output_path)
    except BaseException:
        discard_partial(partial)
        raise
