"""The process settings of hf_elmo's entry points (the commands and the example scripts): `--threads`, torch's CPU
threads, and where torch keeps compiled code.

Its own module (no torch at import) so that the command line, pretraining's options and the examples share it
without importing each other, and call it before torch is imported.
"""

import argparse
import os

THREADS_HELP = ("torch CPU threads of this process (default: torch's choice, one per core). On a machine that is "
                "busy with other work, or with several processes of a run, fewer than the cores is often faster: "
                "threads that wait for a busy core hold up every step (README: Command line).")


def set_threads(threads: int | None) -> None:
    """The torch CPU threads of this process (None keeps torch's default)."""
    if threads is not None:
        import torch

        torch.set_num_threads(threads)


# Threads per logical CPU at most: more only wait for each other, and torch's thread pool crashes the process
# (SIGSEGV) on counts far beyond the machine's (100000 on a 2-core machine).
THREADS_PER_CPU = 4


def threads_error(threads: int | None) -> str | None:
    """Why `threads` cannot be a thread count here (one line), or None."""
    if threads is None:
        return None
    most = THREADS_PER_CPU * (os.cpu_count() or 1)
    if not 1 <= threads <= most:
        return (f"--threads must be between 1 and {most} ({THREADS_PER_CPU} per CPU of this machine; more only wait "
                f"for each other), got {threads}")
    return None


def threads_argument(text: str) -> int:
    """`--threads`' argparse type: a count `threads_error` accepts (else a usage error, exit 2)."""
    try:
        threads = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a whole number of threads, got {text!r}") from None
    error = threads_error(threads)
    if error:
        raise argparse.ArgumentTypeError(error.replace("--threads must be", "must be"))
    return threads


def keep_compiled_code_in_user_cache() -> None:
    """
    torch keeps compiled kernels in `$TMPDIR/torchinductor_$USER`, and creates that folder as soon as torch._dynamo is
    imported (Transformers imports it), so every command left it behind in the temporary folder. An entry point calls
    this before importing torch: the folder is `~/.cache/hf_elmo/torchinductor` instead (where the captured training
    step's graphs also survive for the next run), unless TORCHINDUCTOR_CACHE_DIR says otherwise. Library code never
    calls it: a user's own process keeps torch's choice.
    """
    from .user_cache import user_cache_dir

    os.environ.setdefault("TORCHINDUCTOR_CACHE_DIR", user_cache_dir("torchinductor"))
