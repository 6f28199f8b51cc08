"""What makes every saved ELMo folder work from the Hub without hf_elmo installed (`trust_remote_code=True`).

Kept apart from `modeling_elmo.py`, which holds only the model:

- `ElmoHubMixin.save_pretrained` also writes the default `ElmoTokenizer` into a folder that has no tokenizer, so that
  `AutoTokenizer.from_pretrained(folder, trust_remote_code=True)` works for any saved model (a Trainer checkpoint, a
  model saved alone);
- a model class with `elmo_pipeline_task` (`ElmoForTokenClassification`) saves `config.custom_pipelines` pointing
  at `pipeline_elmo.py`'s pipeline for that task, which reads per-word char ids (the stock one cannot).

Transformers copies the files reached by relative imports from `modeling_elmo.py` (recursively) into every saved
folder, and loads them from there with `trust_remote_code=True`: this file, `tokenization_elmo.py` (imported in
`save_pretrained`) and `pipeline_elmo.py` (named under `TYPE_CHECKING`, never imported at run time) travel with it.
"""

import os
from typing import TYPE_CHECKING


if TYPE_CHECKING:
    from .pipeline_elmo import ElmoTokenClassificationPipeline  # noqa: F401

ELMO_CUSTOM_PIPELINES = {
    "token-classification": {
        "impl": "pipeline_elmo.ElmoTokenClassificationPipeline",
        "pt": ["AutoModelForTokenClassification"],
        "tf": [],
        "type": "text",
    }
}


def add_custom_pipelines(config, task: str) -> None:
    """
    Make `pipeline(task, FOLDER, trust_remote_code=True)` on a folder saved with this config use ELMo's pipeline,
    under the task's name and under each of Transformers' aliases for it ("ner" for "token-classification").

    pipeline() looks the name it is given up in `custom_pipelines` before it resolves an alias, so an alias that is
    not listed here would get the stock class. Listing two names has one cost: pipeline(FOLDER,
    trust_remote_code=True) without a task can no longer guess it, and says so, naming both.
    """
    from transformers.pipelines import TASK_ALIASES

    names = [task] + sorted(alias for alias, target in TASK_ALIASES.items() if target == task)
    custom = getattr(config, "custom_pipelines", None) or {}
    config.custom_pipelines = {**custom, **{name: ELMO_CUSTOM_PIPELINES[task] for name in names}}


class ElmoHubMixin:
    """
    Mixed into `ElmoPreTrainedModel` (before `PreTrainedModel`): every saved ELMo folder has a tokenizer, and a
    folder of a class that names an `elmo_pipeline_task` names ELMo's pipeline for it.
    """

    # The pipeline task (a key of `ELMO_CUSTOM_PIPELINES`) whose ELMo pipeline this class's saved folders name.
    elmo_pipeline_task: str | None = None

    def save_pretrained(self, save_directory, *args, is_main_process: bool = True, **kwargs):
        """
        `PreTrainedModel.save_pretrained`, plus the default `ElmoTokenizer` of this model when the folder has no
        tokenizer yet. ELMo's tokenizer needs nothing but the config, so this makes every saved ELMo folder (a
        Trainer checkpoint, a model saved alone) load with `AutoTokenizer.from_pretrained(folder,
        trust_remote_code=True)`. A tokenizer saved into the folder, before or after, takes precedence.
        """
        folder = os.fspath(save_directory)
        if self.elmo_pipeline_task is not None:
            # Saved with the config: pipeline(FOLDER, trust_remote_code=True) then builds ELMo's pipeline.
            add_custom_pipelines(self.config, self.elmo_pipeline_task)
        if is_main_process and not os.path.isfile(folder) and not os.path.isfile(
            os.path.join(folder, "tokenizer_config.json")
        ):
            # Written first so that save_pretrained(push_to_hub=True) uploads it too. This relative import also
            # makes Transformers copy tokenization_elmo.py with the model (saving and trust_remote_code loading).
            from .tokenization_elmo import ElmoTokenizer

            os.makedirs(folder, exist_ok=True)
            # Without hf_elmo (remote code), the class is only registered if AutoTokenizer loaded it.
            ElmoTokenizer.register_for_auto_class("AutoTokenizer")
            ElmoTokenizer(max_characters_per_token=self.config.max_characters_per_token).save_pretrained(folder)
        return super().save_pretrained(save_directory, *args, is_main_process=is_main_process, **kwargs)
