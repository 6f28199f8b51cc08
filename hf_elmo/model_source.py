"""Where a `--model` argument points: a local folder or a Hub repository, decided before any network request.

A name is taken as a Hub repo id only when no local file or folder has that name and it has the `owner/name` form
that huggingface_hub's `validate_repo_id` accepts, with `owner` not a local folder. Everything else is a local
path, so a mistyped folder (`nope`, `./elmo`, `models/elmo-smal` where `models/` exists, `~/elmo`, `a/b/c`) fails
at once naming the folder, without a Hub request. Repo ids without an owner (`gpt2`-style) are not accepted here:
ELMo models on the Hub all have one.

For a repo id, one metadata request with the `HF_HUB_ETAG_TIMEOUT` limit and no retries comes first. If the Hub
does not answer (or cannot be reached) and the model is in the local cache, it is loaded from the cache;
otherwise the command stops with one line saying what was being fetched, instead of waiting through
huggingface_hub's retries.
"""

import logging
import os

from huggingface_hub import HfApi, constants, try_to_load_from_cache
from huggingface_hub.errors import HFValidationError, RepositoryNotFoundError
from huggingface_hub.utils import validate_repo_id


logger = logging.getLogger(__name__)


class ModelSourceError(ValueError):
    """A model argument that names neither an existing local folder nor a reachable Hub repository."""


def looks_like_repo_id(name: str) -> bool:
    """Whether `name` can only be meant as a Hub `owner/name` id (see the module docstring)."""
    if name.startswith((".", "/", "~")) or (os.altsep and os.altsep in name) or "\\" in name:
        return False
    if name.count("/") != 1 or os.path.lexists(name) or os.path.isdir(name.split("/")[0]):
        return False
    try:
        validate_repo_id(name)
    except HFValidationError:
        return False
    return True


def resolve_model(name: str, what: str = "model") -> tuple[str, dict]:
    """
    `(name, extra from_pretrained kwargs)` for a local folder or a Hub repo id; raises `ModelSourceError` for a
    missing local folder, an unknown repository, or a Hub that does not answer when the model is not cached.
    """
    if os.path.isdir(name):
        if problem := model_folder_problem(name):
            raise ModelSourceError(problem)
        return name, {}
    if not looks_like_repo_id(name):
        if os.path.exists(name):
            raise ModelSourceError(f"{name}: is a file; the {what} must be a folder (from hf-elmo convert or "
                                   "save_pretrained) or a Hub repo id such as owner/name.")
        raise ModelSourceError(f"{name}: no such folder (and not a Hub repo id of the form owner/name).")
    if constants.is_offline_mode():
        return name, {}
    try:
        HfApi().model_info(name, timeout=constants.HF_HUB_ETAG_TIMEOUT, files_metadata=False)
    except RepositoryNotFoundError:
        raise ModelSourceError(
            f"{name}: neither a local folder nor a model repository on {constants.ENDPOINT} that this account "
            "can read (log in with `hf auth login` for a private one)."
        ) from None
    except Exception as error:  # noqa: BLE001 - any failure to get an answer is handled the same way
        if not _is_no_answer(error):
            raise
        if isinstance(try_to_load_from_cache(name, "config.json"), str):
            logger.warning("%s: the Hub did not answer (%s); using the copy in the local cache", name,
                           type(error).__name__)
            return name, {"local_files_only": True}
        raise ModelSourceError(
            f"{name}: the Hugging Face Hub ({constants.ENDPOINT}) did not answer within {constants.HF_HUB_ETAG_TIMEOUT}"
            f" s while looking up this model ({type(error).__name__}), and it is not in the local cache. Check the "
            "connection, or allow more time with HF_HUB_ETAG_TIMEOUT / HF_HUB_DOWNLOAD_TIMEOUT (seconds)."
        ) from None
    return name, {}


def model_folder_problem(folder: str) -> str | None:
    """
    None where the local `folder` holds a model (its config.json), else the line every command that loads one says.
    An hf-elmo pretrain run that has not finished has no final model yet, but each of its checkpoints is one: the
    latest is named.
    """
    if os.path.isfile(os.path.join(folder, "config.json")):
        return None
    expected = "expected a model folder written by hf-elmo convert or save_pretrained."
    if not os.path.isdir(folder):
        return f"{folder}: {'not a folder' if os.path.exists(folder) else 'no such folder'}; {expected}"
    from .pretraining_checkpoints import TRAINING_ARGS_FILE, latest_checkpoint

    checkpoint = latest_checkpoint(folder)
    if checkpoint and os.path.isfile(os.path.join(folder, TRAINING_ARGS_FILE)):
        return (f"{folder}: an hf-elmo pretrain run that has not finished (no final model yet); use one of its "
                f"checkpoints instead, e.g. {checkpoint}.")
    return f"{folder}: no config.json; {expected}"


def _is_no_answer(error: BaseException) -> bool:
    """A timeout or a connection failure (the Hub gave no HTTP answer at all), at any depth of the chain."""
    seen = set()
    while error is not None and id(error) not in seen:
        seen.add(id(error))
        names = {cls.__name__ for cls in type(error).__mro__}
        if names & {"TimeoutException", "NetworkError", "ConnectError", "TransportError"}:
            return True
        error = error.__cause__ or error.__context__
    return False
