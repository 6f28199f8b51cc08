"""Checks on weights as they are loaded: every value finite, every biLM weight actually read from the files.

Transformers' `from_pretrained` re-initialises any parameter the checkpoint lacks (a missing tensor, or a config
that asks for more layers than were saved) and only mentions it in its load report; NaN or infinite values load
silently. Either way the model then computes something other than what was trained, with no error. These
functions turn both into one clear error naming the tensor.

Used by `ElmoPreTrainedModel.from_pretrained` where hf_elmo is installed (a saved folder's copy of the model
loads without them), and by the commands that read weights.
"""

import torch


# Parameters of the biLM itself, as they are named in `ElmoModel` and, under `elmo.`, in every head. Head and
# softmax weights are legitimately new when a task or pretraining model starts from a biLM checkpoint.
_BILM_PREFIXES = ("char_encoder.", "bilstm.")
_HEAD_PREFIX = "elmo."


class WeightCheckError(ValueError):
    """Weights that must not be used: non-finite values, or biLM weights missing from the checkpoint."""


def is_bilm_key(key: str) -> bool:
    """Whether a state-dict key names a weight of the biLM (in `ElmoModel` or under a head's `elmo.`)."""
    if key.startswith(_HEAD_PREFIX):
        key = key[len(_HEAD_PREFIX):]
    return key.startswith(_BILM_PREFIXES)


def _named_tensors(weights):
    if isinstance(weights, torch.nn.Module):
        return weights.state_dict().items()
    return weights.items()


def check_finite(weights, source: str) -> None:
    """
    Raise `WeightCheckError` naming the first tensor of `weights` (a module or a state dict) that holds a NaN or an
    infinite value. Tensors on the meta device (not materialised) and integer tensors are skipped. One pass of
    `isfinite` per tensor: cheap next to reading the file.
    """
    for name, tensor in _named_tensors(weights):
        if not isinstance(tensor, torch.Tensor) or tensor.is_meta or not tensor.is_floating_point():
            continue
        finite = torch.isfinite(tensor)
        if not bool(finite.all()):
            bad = int(finite.numel() - finite.sum())
            raise WeightCheckError(
                f"{source}: weight '{name}' holds {bad} NaN or infinite value{'s' if bad != 1 else ''} (of "
                f"{finite.numel()}); the model would compute NaN. The file is damaged or came from a diverged run."
            )


def check_loading_info(loading_info: dict, source: str) -> None:
    """
    Raise `WeightCheckError` when Transformers' loading info (`from_pretrained(..., output_loading_info=True)`) shows
    biLM weights that were not read from the checkpoint, i.e. that the model would use freshly initialised.
    """
    missing = sorted(k for k in loading_info.get("missing_keys", ()) if is_bilm_key(k))
    # Entries are keys, or (key, stored shape, model shape) tuples depending on the Transformers version.
    mismatched_keys = [e if isinstance(e, str) else e[0] for e in loading_info.get("mismatched_keys", ())]
    mismatched = sorted(k for k in mismatched_keys if is_bilm_key(k))
    for names, why in ((missing, "not in the checkpoint"), (mismatched, "stored with another shape")):
        if names:
            listed = ", ".join(f"'{n}'" for n in names[:3]) + (f" and {len(names) - 3} more" if len(names) > 3 else "")
            raise WeightCheckError(
                f"{source}: biLM weight{'s' if len(names) != 1 else ''} {listed} {'are' if len(names) != 1 else 'is'} "
                f"{why} and would be randomly initialised. The weight file is incomplete or config.json does not "
                "match it (e.g. more num_lstm_layers or n_highway than were saved)."
            )


def check_loaded_model(model, loading_info: dict | None, source: str) -> None:
    """Both checks on a model returned by `from_pretrained` (`loading_info` may be None when it was not asked for)."""
    if loading_info is not None:
        check_loading_info(loading_info, source)
    check_finite(model, source)


def from_pretrained_checked(load, *args, **kwargs):
    """
    `load(*args, **kwargs)` (a `from_pretrained`) followed by `check_loaded_model`. Returns what `load` returns: the
    model, or `(model, loading_info)` when the caller asked for the loading info.
    """
    import pickle

    source = args[0] if args else kwargs.get("pretrained_model_name_or_path")
    wants_info = kwargs.pop("output_loading_info", False)
    try:
        model, loading_info = load(*args, output_loading_info=True, **kwargs)
    except pickle.UnpicklingError:
        # torch.load(weights_only=True) refused a pickle holding more than tensors: say so in one line.
        raise WeightCheckError(
            f"{source}: its weights are a pickle (pytorch_model.bin) that holds more than tensors, and loading it "
            "would mean unpickling it, which can run any code in the file; it is refused. Get the model as "
            "safetensors (model.safetensors) from a source you trust."
        ) from None
    check_loaded_model(model, loading_info, str(source))
    return (model, loading_info) if wants_info else model
