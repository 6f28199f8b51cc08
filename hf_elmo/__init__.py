"""hf_elmo: ELMo (Peters et al., 2018) as a Hugging Face Transformers model.

Importing the package registers the ELMo classes with the Auto classes, and marks every class for
`trust_remote_code` saving so that any folder written by `save_pretrained` loads where hf_elmo is not installed
(hf_elmo.auto_registration: at once when transformers is imported, else as soon as it is). The classes below load
on first use, so that importing the package, or its command line, costs nothing until a model is needed.
"""

import importlib

from .auto_registration import register_when_possible


__version__ = "0.1.0"

# Public name -> the module that defines it.
_EXPORTS = {
    "ELMO_PRESETS": "elmo_presets",
    "ElmoConfig": "configuration_elmo",
    "ElmoForPreTraining": "modeling_elmo",
    "ElmoForPreTrainingOutput": "modeling_elmo",
    "ElmoForSequenceClassification": "modeling_elmo",
    "ElmoForTokenClassification": "modeling_elmo",
    "ElmoModel": "modeling_elmo",
    "ElmoModelOutput": "modeling_elmo",
    "ElmoPreTrainedModel": "modeling_elmo",
    "ElmoScalarMix": "modeling_elmo",
    "ElmoTokenizer": "tokenization_elmo",
}
__all__ = sorted(_EXPORTS)


def __getattr__(name: str):
    if name not in _EXPORTS:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    value = getattr(importlib.import_module(f".{_EXPORTS[name]}", __name__), name)
    globals()[name] = value
    return value


def __dir__():
    return sorted(set(globals()) | set(_EXPORTS))


register_when_possible(__name__)
