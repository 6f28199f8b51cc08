"""`--threads`: torch's CPU threads for a process, one option for every command that computes.

Its own module (no torch at import) so that the command line, pretraining's options and the examples share it
without importing each other.
"""

THREADS_HELP = ("torch CPU threads of this process (default: torch's choice, one per core). On a machine that is "
                "busy with other work, or with several processes of a run, fewer than the cores is often faster: "
                "threads that wait for a busy core hold up every step (README: Command line).")


def set_threads(threads: int | None) -> None:
    """The torch CPU threads of this process (None keeps torch's default)."""
    if threads is not None:
        import torch

        torch.set_num_threads(threads)
