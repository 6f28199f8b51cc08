"""Which code computes ELMo's char CNN and biLSTM: the implementation type, the registry and the selection rule.

As Transformers' attention implementations (`ALL_ATTENTION_FUNCTIONS`), an implementation changes speed, never the
function: `ElmoCharacterEncoder.forward` and `ElmoBiLstm.forward` look theirs up here on every call, and the tests
hold every implementation to "reference", the modules' own plain computation. Built in:

- "reference" (`modeling_elmo.py`): the specification, step by step;
- "cpu" (`elmo_cpu.py`): each distinct word once, a packed in-place recurrence for inference;
- "cuda" (`elmo_cuda.py`): static shapes and no host syncs, a fused recurrence with a hand-written backward.

`modeling_elmo` registers "reference", and `elmo_cpu` and `elmo_cuda` register themselves (the model imports them
only where hf_elmo is installed, not in a saved folder's copy). This module imports none of them, nor the model;
`ElmoConfig` validates names against it.
"""

from collections.abc import Callable
from dataclasses import dataclass

import torch


@dataclass(frozen=True)
class ElmoImplementation:
    """
    `bilstm(module, tokens, mask, state, output_layers, words_only, dropout_masks)` computes what `ElmoBiLstm`
    specifies, with `module`'s parameters. `token_vectors(encoder, char_ids)` computes what `ElmoCharacterEncoder`
    specifies; None keeps the encoder's own (reference) computation.
    """

    bilstm: Callable
    token_vectors: Callable | None = None


BUILT_IN_NAMES = ("reference", "cpu", "cuda")
ELMO_IMPLEMENTATIONS: dict[str, ElmoImplementation] = {}


def register(name: str, implementation: ElmoImplementation) -> None:
    """Make `implementation` selectable as `name` (`ElmoConfig.elmo_implementation`, `from_pretrained(...,
    elmo_implementation=name)`); registering a name again replaces it."""
    if not isinstance(implementation, ElmoImplementation):
        raise TypeError(f"register({name!r}, ...) takes an ElmoImplementation, got {type(implementation).__name__}.")
    ELMO_IMPLEMENTATIONS[name] = implementation


def implementation_names() -> tuple:
    """What `ElmoConfig.elmo_implementation` accepts: None (chosen per call by the inputs' device) or a name."""
    return (None, *BUILT_IN_NAMES, *(name for name in ELMO_IMPLEMENTATIONS if name not in BUILT_IN_NAMES))


def check_implementation_name(name) -> None:
    if name not in implementation_names():
        raise ValueError(
            f"elmo_implementation must be one of {implementation_names()} (None chooses by device), got {name!r}."
        )


def implementation_name(configured: str | None, device: torch.device) -> str:
    """
    The selection rule, in one place: `configured` when set, else by the inputs' device, "cuda" on a GPU and "cpu"
    on a CPU ("reference" elsewhere). Inside `torch.compile`, which traces static graphs, the default is "cuda" on
    any device (the "cpu" implementation reads lengths back to the host).
    """
    if configured is not None:
        return configured
    if device.type == "cuda" or torch.compiler.is_compiling():
        return "cuda"
    return "cpu" if device.type == "cpu" else "reference"


def elmo_implementation_for(config, device: torch.device) -> ElmoImplementation:
    """The implementation that computes a model with `config` (its `elmo_implementation`) on `device`. Where the
    rule's choice is not registered (a saved folder's copy of the model, loaded with trust_remote_code=True, has
    "reference" only: the others come with `pip install hf-elmo`), "reference" unless the config names it."""
    name = implementation_name(config.elmo_implementation, device)
    if name in ELMO_IMPLEMENTATIONS:
        return ELMO_IMPLEMENTATIONS[name]
    if config.elmo_implementation is None:
        return ELMO_IMPLEMENTATIONS["reference"]
    raise ValueError(f"elmo_implementation {name!r} is not available here: the 'cpu' and 'cuda' implementations "
                     "come with the hf_elmo package (`pip install hf-elmo`, then `import hf_elmo`).")
