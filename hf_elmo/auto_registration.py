"""Registers the ELMo classes with Transformers' Auto classes, as soon as that is possible, without importing
transformers or torch to do it.

`import hf_elmo` must register them (a user then calls `AutoModel.from_pretrained(folder)`), but `hf-elmo --help`
imports the package too and must not pay several seconds for transformers and torch. So the package registers at
once only if transformers is already imported; otherwise a finder on `sys.meta_path` watches imports and registers
right after transformers has been imported, at the first moment when no hf_elmo module is half-way through its own
import (registering imports our model modules, which would fail inside one of them). Then the finder removes
itself. `register()` may also be called directly; it runs once.
"""

import importlib.abc
import importlib.util
import sys


_registered = False


def register() -> None:
    """Register every ELMo class with its Auto class and for `trust_remote_code` saving (once)."""
    global _registered
    if _registered:
        return
    _registered = True
    from transformers import (
        AutoConfig,
        AutoModel,
        AutoModelForPreTraining,
        AutoModelForSequenceClassification,
        AutoModelForTokenClassification,
        AutoTokenizer,
    )

    from .configuration_elmo import ElmoConfig
    from .modeling_elmo import (
        ElmoForPreTraining,
        ElmoForSequenceClassification,
        ElmoForTokenClassification,
        ElmoModel,
    )
    from .tokenization_elmo import ElmoTokenizer

    AutoConfig.register(ElmoConfig.model_type, ElmoConfig, exist_ok=True)
    AutoTokenizer.register(ElmoConfig, slow_tokenizer_class=ElmoTokenizer, exist_ok=True)
    ElmoConfig.register_for_auto_class()
    ElmoTokenizer.register_for_auto_class("AutoTokenizer")
    for auto_class, model_class in (
        (AutoModel, ElmoModel),
        (AutoModelForTokenClassification, ElmoForTokenClassification),
        (AutoModelForSequenceClassification, ElmoForSequenceClassification),
        (AutoModelForPreTraining, ElmoForPreTraining),
    ):
        auto_class.register(ElmoConfig, model_class, exist_ok=True)
        model_class.register_for_auto_class(auto_class.__name__)


class _RegisterAfterImports(importlib.abc.MetaPathFinder):
    """Finds nothing itself: it wraps the loading of transformers and of hf_elmo's modules to call `register`."""

    def __init__(self, package: str):
        self.package = package
        self.loading = 0  # hf_elmo modules being executed right now
        self.finding = False

    def find_spec(self, name, path=None, target=None):
        if self.finding or not (name == "transformers" or name.startswith(self.package + ".")):
            return None
        self.finding = True
        try:
            spec = importlib.util.find_spec(name) if path is None else self._find_with_others(name, path, target)
        finally:
            self.finding = False
        if spec is not None and spec.loader is not None and hasattr(spec.loader, "exec_module"):
            spec.loader.exec_module = self._wrapped(spec.loader.exec_module, ours=name != "transformers")
        return spec

    def _find_with_others(self, name, path, target):
        for finder in sys.meta_path:
            if finder is not self and hasattr(finder, "find_spec"):
                spec = finder.find_spec(name, path, target)
                if spec is not None:
                    return spec
        return None

    def _wrapped(self, exec_module, ours: bool):
        def exec_then_register(module):
            self.loading += ours
            try:
                exec_module(module)
            finally:
                self.loading -= ours
            if self.loading == 0 and "transformers" in sys.modules and self in sys.meta_path:
                sys.meta_path.remove(self)
                register()

        return exec_then_register


def register_when_possible(package: str) -> None:
    """At once if transformers is imported, else after it is (see the module docstring)."""
    if "transformers" in sys.modules:
        register()
    else:
        sys.meta_path.insert(0, _RegisterAfterImports(package))
