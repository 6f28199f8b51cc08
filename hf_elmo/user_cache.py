"""Where hf_elmo keeps what it fetches or builds for a user: `$HF_ELMO_CACHE`, else `$XDG_CACHE_HOME/hf_elmo`, else
`~/.cache/hf_elmo`. Its own module, without torch: entry points call it before torch is imported."""

import os


def user_cache_dir(*parts: str) -> str:
    """The cache folder, or `parts` inside it (not created)."""
    root = os.environ.get("HF_ELMO_CACHE") or os.path.join(
        os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache"), "hf_elmo")
    return os.path.join(root, *parts)
