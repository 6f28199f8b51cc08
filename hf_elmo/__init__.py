"""hf_elmo: ELMo (Peters et al., 2018) as a Hugging Face Transformers model.

Importing the package registers the ELMo classes with the Auto classes, and marks every class for
`trust_remote_code` saving so that any folder written by `save_pretrained` loads where hf_elmo is not installed.
"""

from transformers import (
    AutoConfig,
    AutoModel,
    AutoModelForPreTraining,
    AutoModelForSequenceClassification,
    AutoModelForTokenClassification,
    AutoTokenizer,
)

from .configuration_elmo import ELMO_PRESETS, ElmoConfig
from .modeling_elmo import (
    ElmoForPreTraining,
    ElmoForPreTrainingOutput,
    ElmoForSequenceClassification,
    ElmoForTokenClassification,
    ElmoModel,
    ElmoModelOutput,
    ElmoPreTrainedModel,
    ElmoScalarMix,
)
from .tokenization_elmo import ElmoTokenizer


__version__ = "0.1.0"

AutoConfig.register(ElmoConfig.model_type, ElmoConfig, exist_ok=True)
AutoModel.register(ElmoConfig, ElmoModel, exist_ok=True)
AutoTokenizer.register(ElmoConfig, slow_tokenizer_class=ElmoTokenizer, exist_ok=True)
AutoModelForTokenClassification.register(ElmoConfig, ElmoForTokenClassification, exist_ok=True)
AutoModelForSequenceClassification.register(ElmoConfig, ElmoForSequenceClassification, exist_ok=True)
AutoModelForPreTraining.register(ElmoConfig, ElmoForPreTraining, exist_ok=True)

ElmoConfig.register_for_auto_class()
ElmoModel.register_for_auto_class("AutoModel")
ElmoTokenizer.register_for_auto_class("AutoTokenizer")
ElmoForTokenClassification.register_for_auto_class("AutoModelForTokenClassification")
ElmoForSequenceClassification.register_for_auto_class("AutoModelForSequenceClassification")
ElmoForPreTraining.register_for_auto_class("AutoModelForPreTraining")

__all__ = [
    "ELMO_PRESETS",
    "ElmoConfig",
    "ElmoForPreTraining",
    "ElmoForPreTrainingOutput",
    "ElmoForSequenceClassification",
    "ElmoForTokenClassification",
    "ElmoModel",
    "ElmoModelOutput",
    "ElmoPreTrainedModel",
    "ElmoScalarMix",
    "ElmoTokenizer",
]
