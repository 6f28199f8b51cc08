"""A timeout on every Hub request that the `hf-elmo` commands make.

huggingface_hub gives its downloads and metadata requests a timeout (`HF_HUB_DOWNLOAD_TIMEOUT`,
`HF_HUB_ETAG_TIMEOUT`), but several API calls (`model_info`, through which Transformers resolves a revision,
`create_repo`, `create_commit`) pass `timeout=None`, and its shared client has no default either: against a Hub
that accepts the connection and never answers they wait forever. `enforce_hub_timeouts()` installs a client
factory whose request hook gives each phase (connect, read, write, pool) that has no limit the
`HF_HUB_DOWNLOAD_TIMEOUT` limit, the setting huggingface_hub documents as the default for requests that have
none. Limits that huggingface_hub sets itself are left as they are.

It changes the process-wide client of huggingface_hub, so only the command-line entry points call it; importing
hf_elmo changes nothing.
"""

import logging

from huggingface_hub import constants
from huggingface_hub.utils import _http as hub_http


logger = logging.getLogger(__name__)

_PHASES = ("connect", "read", "write", "pool")


def default_timeout() -> float:
    """Seconds allowed to each phase of a Hub request that huggingface_hub leaves without a limit."""
    return float(constants.HF_HUB_DOWNLOAD_TIMEOUT)


def _fill_missing_timeouts(request) -> None:
    limits = dict(request.extensions.get("timeout") or {})
    if all(limits.get(phase) is not None for phase in _PHASES):
        return
    seconds = default_timeout()
    for phase in _PHASES:
        if limits.get(phase) is None:
            limits[phase] = seconds
    request.extensions = {**request.extensions, "timeout": limits}


def _client_with_timeouts():
    client = hub_http.default_client_factory()
    hooks = client.event_hooks
    client.event_hooks = {**hooks, "request": [*hooks.get("request", []), _fill_missing_timeouts]}
    return client


def enforce_hub_timeouts() -> None:
    """Make every later huggingface_hub request of this process time out (see the module docstring)."""
    hub_http.set_client_factory(_client_with_timeouts)


def find_timeout(error: BaseException):
    """The HTTP timeout at the root of `error` (libraries wrap it in their own errors), or None."""
    seen = set()
    while error is not None and id(error) not in seen:
        seen.add(id(error))
        if type(error).__name__.endswith("Timeout") and hasattr(error, "request"):
            return error
        error = error.__cause__ or error.__context__
    return None


def describe_timeout(error: BaseException, what: str) -> str | None:
    """One line for a Hub timeout somewhere in `error`'s chain, saying what was being fetched; None if none is."""
    timeout = find_timeout(error)
    if timeout is None:
        return None
    try:
        request = timeout.request
        where = f"{request.method} {request.url}"
    except RuntimeError:  # no request attached
        where = constants.ENDPOINT
    return (
        f"the Hugging Face Hub did not answer in time while {what} ({where}; {type(timeout).__name__}). "
        f"Check the connection, or allow more time with HF_HUB_DOWNLOAD_TIMEOUT / HF_HUB_ETAG_TIMEOUT (seconds)."
    )
