"""What a training run records of itself, so that a rerun resumes only a checkpoint it can show is its own.

A record is plain JSON: the model, each data file by name, size and SHA-256 (a path says nothing of what the file
holds now), the labels and the arguments that shape the run. `hf-elmo pretrain` keeps it in its checkpoints'
training state, the fine-tuning examples beside the Trainer's files in each checkpoint; both compare it with
what the rerun would do and name each difference (`differences`).
"""

import hashlib
import os


def sha256_of(path: str) -> str:
    digest = hashlib.sha256()
    with open(path, "rb") as f:
        for block in iter(lambda: f.read(1 << 20), b""):
            digest.update(block)
    return digest.hexdigest()


def file_record(path: str) -> dict:
    """A data file as a record holds it: its name (not its folder, which may be private and need not stay put),
    size and SHA-256."""
    return {"file": os.path.basename(path), "bytes": os.path.getsize(path), "sha256": sha256_of(path)}


def dataset_name_record(name: str) -> dict:
    """
    A `--dataset-name` as a record or a model card holds it: a Hub id as it is, a local folder by its name only (its
    path is the user's own). A name is local when it is a folder here, or a path no Hub id can be (absolute,
    starting with a dot, or deeper than owner/name): that decides it where the folder is not at hand, e.g. when a
    finished run is published from elsewhere.
    """
    local = os.path.isabs(name) or name.startswith(".") or name.count("/") > 1 or os.path.isdir(name)
    return {"name": os.path.basename(os.path.normpath(name)) if local else name, "hub": not local}


def _flat(record, prefix: str = "") -> dict:
    """{"a.b": value, "a.c.0": value, ...}: nested dicts and lists as dotted keys, so that a difference is named."""
    items = record.items() if isinstance(record, dict) else enumerate(record) if isinstance(record, list) else ()
    flat = {k: v for key, value in items for k, v in _flat(value, f"{prefix}{key}.").items()}
    return flat or {prefix.rstrip("."): record}


def _shown(flat: dict, key: str) -> str:
    if key not in flat:
        return "absent"
    value = flat[key]
    if isinstance(value, str) and len(value) == 64 and all(c in "0123456789abcdef" for c in value):
        return value[:12] + "…"  # a SHA-256: its start tells two files apart
    text = repr(value)
    return text if len(text) <= 80 else text[:77] + "..."


def differences(recorded: dict, current: dict) -> list[str]:
    """Each field that differs, as "field: VALUE then, VALUE now" (nested fields joined with dots, digests cut)."""
    then, now = _flat(recorded), _flat(current)
    return [f"{key}: {_shown(then, key)} then, {_shown(now, key)} now" for key in sorted(set(then) | set(now))
            if (key in then, then.get(key)) != (key in now, now.get(key))]
