"""PyTorch ELMo: the bilm-tf bidirectional language model as a Transformers model.

Data flows top to bottom in this file: char ids -> `ElmoCharacterEncoder` (char CNN, highway,
projection) -> `ElmoBiLstm` (stacked `ElmoLstmLayer`s per direction) -> `ElmoModel` -> the task heads and
`ElmoForPreTraining`.

`ElmoCharacterEncoder` and `ElmoBiLstm` each look their implementation up on every call, as `LlamaAttention`
looks up its attention function: "reference" is the plain functions `char_encoder_reference` and
`bilstm_reference` below, the specification that the tuned "cpu" (`elmo_cpu.py`) and "cuda" (`elmo_cuda.py`) are
tested against. The registry and selection rule are in `configuration_elmo.py`; the maths all of them share (the
LSTM step, clipping, the forget-bias fold, reversal, layer stacking, the output layout) is at the top of this file.
"""

import contextlib
import math
import os
from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch
from torch import nn
from transformers import PreTrainedModel
from transformers import initialization as init
from transformers.modeling_layers import GradientCheckpointingLayer
from transformers.modeling_outputs import BaseModelOutput, SequenceClassifierOutput, TokenClassifierOutput
from transformers.utils import ModelOutput, logging
from transformers.utils.generic import can_return_tuple

from .configuration_elmo import (
    BEGIN_SENTENCE_WORD,
    ELMO_IMPLEMENTATIONS,
    END_SENTENCE_WORD,
    N_CHARACTERS,
    ElmoConfig,
    ElmoImplementation,
    elmo_implementation_for,
    import_built_in_implementations,
    package_module,
    register,
    require_hf_elmo,
    word_to_char_ids,
)


# For speed, int8 inference, the sampled softmax and the checks on loaded weights; without them (a saved folder's
# copy) the model computes with the "reference" implementation, and asking for the others is one line
# (`require_hf_elmo`).
int8_weights = package_module("int8_weights")
sampled_softmax = package_module("sampled_softmax")
token_cache_module = package_module("token_cache")
weight_checks = package_module("weight_checks")


logger = logging.get_logger(__name__)


# ---------------------------------------------------------------------------------------------
# The maths every implementation shares (the tuned ones import it from here): the highway, one LSTM step, clipping,
# the forget-bias fold, reversal within lengths, layer stacking and the output layout. Changing bilm-tf's semantics
# is a change here. "No clip" is `math.inf`; gate pre-activations are laid out (input, candidate, forget, output),
# TensorFlow's `LSTMCell` order; a sentence in the biLSTM is `<S> w_1 .. w_n </S>` then padding, so its length
# counts the two boundaries.
# ---------------------------------------------------------------------------------------------
# TensorFlow's LSTMCell adds this to the forget gate's pre-activation at run time; bilm-tf files do not store it.
FORGET_GATE_BIAS = 1.0


def highway(carry: torch.Tensor, transform: torch.Tensor, hidden: torch.Tensor, in_place: bool = False):
    """
    bilm-tf's highway layer from its two linear maps of `hidden`: `gate * relu(transform) + (1 - gate) * hidden`
    with `gate = sigmoid(carry)` (bilm-tf's "carry" gate scales the transformed branch), computed as `hidden +
    gate * (relu(transform) - hidden)`. `in_place` (no autograd) overwrites `carry` and `transform`, whose result
    it returns.
    """
    if in_place:
        return transform.relu_().sub_(hidden).mul_(carry.sigmoid_()).add_(hidden)
    return hidden + torch.sigmoid(carry) * (torch.relu(transform) - hidden)


def clip_limit(value: float | None) -> float:
    """A clip setting from a config (None: no clipping) as the one representation used here: a float, inf for none."""
    return math.inf if value is None else float(value)


def clip(values: torch.Tensor, limit: float, in_place: bool = False) -> torch.Tensor:
    """TensorFlow's `clip_by_value(values, -limit, limit)`; `limit` inf leaves `values` as they are."""
    if limit == math.inf:
        return values
    return values.clamp_(-limit, limit) if in_place else values.clamp(-limit, limit)


def fold_forget_bias(bias: torch.Tensor) -> torch.Tensor:
    """The gate bias `(..., 4 * lstm_dim)` with `FORGET_GATE_BIAS` added to its forget block, once, instead of at
    every step."""
    in_gate, candidate, forget_gate, out_gate = bias.chunk(4, dim=-1)
    # Python numbers only as operands: writing one into a device tensor would be a host-to-device copy.
    return torch.cat([in_gate, candidate, forget_gate + FORGET_GATE_BIAS, out_gate], dim=-1)


def lstm_cell(gates: torch.Tensor, cell: torch.Tensor, cell_clip: float, dim: int = -1, in_place: bool = False,
              new_cell: torch.Tensor | None = None, return_activations: bool = False) -> tuple[torch.Tensor, ...]:
    """
    The element-wise part of one step of bilm-tf's LSTM (no peepholes): from the gate pre-activations (forget bias
    folded in) along `dim` and the cell state, the new cell state, clipped, and the cell's output `sigmoid(output) *
    tanh(cell)` that the projection reads.

    `in_place` (no autograd, the CPU inference path): the activations overwrite `gates`, the new cell goes into the
    buffer `new_cell`, and the output into the candidate's rows of `gates`; nothing is allocated.
    `return_activations` (not in place) adds the activations `(i, j, f, o, tanh(new cell))`, which a hand-written
    backward reads instead of computing them again (`elmo_ops.lstm_cell_backward`).
    """
    in_gate, candidate, forget_gate, out_gate = gates.chunk(4, dim=dim)
    if in_place:
        lstm_dim = gates.shape[dim] // 4
        in_gate.sigmoid_()
        candidate.tanh_()
        gates.narrow(dim, 2 * lstm_dim, 2 * lstm_dim).sigmoid_()  # the forget and output gates, in one call
        torch.mul(forget_gate, cell, out=new_cell).addcmul_(in_gate, candidate)
        clip(new_cell, cell_clip, in_place=True)
        return new_cell, torch.tanh(new_cell, out=candidate).mul_(out_gate)  # the candidate is spent
    i, j, f, o = torch.sigmoid(in_gate), torch.tanh(candidate), torch.sigmoid(forget_gate), torch.sigmoid(out_gate)
    new_cell = clip(f * cell + i * j, cell_clip)
    tanh_cell = torch.tanh(new_cell)
    if return_activations:
        return new_cell, o * tanh_cell, (i, j, f, o, tanh_cell)
    return new_cell, o * tanh_cell


def reverse_within_lengths(sequences: torch.Tensor, lengths: torch.Tensor) -> torch.Tensor:
    """Reverse each row's first `length` steps in place of the time axis (dim 1); padding stays put."""
    steps = torch.arange(sequences.shape[1], device=sequences.device)
    index = torch.where(steps < lengths[:, None], lengths[:, None] - 1 - steps, steps)
    index = index.view(*index.shape, *([1] * (sequences.dim() - 2))).expand_as(sequences)
    return sequences.gather(1, index)


def is_word_position(positions: torch.Tensor, lengths: torch.Tensor) -> torch.Tensor:
    """Whether a position of a sentence `lengths` long (`<S>` and `</S>` included) holds a word: word w sits at
    position w + 1, `</S>` at length - 1."""
    return (positions >= 1) & (positions <= lengths - 2)


def bidirectional_output(forward: torch.Tensor, backward: torch.Tensor, lengths: torch.Tensor, words_only: bool):
    """
    One layer's output `[forward; backward]` per position, `(batch, time, 2 * width)`, from each direction's output
    in its own reading order `(batch, time, width)` (zero past each row's length). `words_only` leaves out the
    `<S>` and `</S>` positions: `(batch, time - 2, ·)`, word i at i, zero after the row's last word.
    """
    output = torch.cat([forward, reverse_within_lengths(backward, lengths)], dim=-1)
    if words_only:
        positions = torch.arange(1, output.shape[1] - 1, device=output.device)
        output = output[:, 1:-1] * is_word_position(positions, lengths[:, None])[..., None]
    return output


def stack_layers(run_layer, layer_input, num_layers: int, skip_connections: bool, input_masks=None,
                 keep=lambda index: True, in_place: bool = False):
    """
    bilm-tf's stack of LSTM layers: `run_layer(index, input) -> (output, cell, hidden)` runs layer `index`; each
    layer reads the previous one's output. `input_masks[index]` (dropout, pretraining only) multiplies a layer's
    input; from the second layer on, with `skip_connections`, the layer's input (after its dropout, as bilm-tf's
    `DropoutWrapper` wraps its `ResidualWrapper`) is added to its output. Returns each layer's output (None for
    those `keep` rejects, freed once the next layer has read them) and the final cells and hiddens stacked over
    layers. `in_place` adds the skip connection into the layer's output.
    """
    outputs, cells, hiddens = [], [], []
    for index in range(num_layers):
        if input_masks is not None:
            layer_input = layer_input * input_masks[index]
        output, cell, hidden = run_layer(index, layer_input)
        if index > 0 and skip_connections:
            output = output.add_(layer_input) if in_place else output + layer_input
        outputs.append(output if keep(index) else None)
        cells.append(cell)
        hiddens.append(hidden)
        layer_input = output
    return outputs, torch.stack(cells), torch.stack(hiddens)


def matmul_dtype(reference: torch.Tensor) -> torch.dtype:
    """The dtype matmuls run in: autocast's where it is on, else the tensor's own."""
    device_type = reference.device.type
    # Not torch.amp.is_autocast_available(): torch 2.11's Dynamo cannot trace it, and the captured step compiled
    # whole failed on it on an H100. "meta" is the one device type ELMo's tensors meet that has no autocast state.
    if device_type != "meta" and torch.is_autocast_enabled(device_type):
        return torch.get_autocast_dtype(device_type)
    return reference.dtype


@dataclass
class ElmoModelOutput(BaseModelOutput):
    r"""
    last_hidden_state (`torch.FloatTensor` of shape `(batch_size, num_words, 2 * projection_dim)`):
        Top LSTM layer, `[forward; backward]`, one vector per input word (zeros at padded words).
    hidden_states (`tuple(torch.FloatTensor)`, returned with `output_hidden_states=True`):
        The `num_lstm_layers + 1` biLM layers: layer 0 is the context-free token layer duplicated
        (`[x; x]`), layer `l` is `[forward_l; backward_l]`.
    word_mask (`torch.BoolTensor` of shape `(batch_size, num_positions)`):
        Which output positions hold a word (with `keep_sentence_boundaries=True`, also `<S>`/`</S>`).
    lstm_state (`tuple(torch.FloatTensor, torch.FloatTensor)`, returned with `return_lstm_state=True` or when
        `lstm_state` was passed):
        The final `(cell, hidden)` state of every LSTM, shapes `(num_lstm_layers, 2, batch_size, lstm_dim)` and
        `(num_lstm_layers, 2, batch_size, projection_dim)` (direction 0 forward, 1 backward). Pass it back as
        `lstm_state` to continue each batch row where it stopped, as bilm-tf does at inference.
    """

    word_mask: torch.BoolTensor | None = None
    lstm_state: tuple[torch.FloatTensor, torch.FloatTensor] | None = None


class ElmoLinear(nn.Linear):
    """
    A linear map of the biLM that knows which bilm-tf variable it holds (`W_carry`, `W_transform`, `W_proj`, `W_0`,
    `W_P_0`), so that `ElmoPreTrainedModel._init_weights` starts it as bilm-tf's training does.
    """

    def __init__(self, in_features: int, out_features: int, bilm_tf_variable: str, bias: bool = True):
        super().__init__(in_features, out_features, bias=bias)
        self.bilm_tf_variable = bilm_tf_variable


class ElmoHighway(nn.Module):
    """One highway layer: a sigmoid gate mixes a ReLU transform of the input with the input itself."""

    def __init__(self, size: int):
        super().__init__()
        self.carry = ElmoLinear(size, size, "W_carry")
        self.transform = ElmoLinear(size, size, "W_transform")

    def forward(self, hidden: torch.Tensor, in_place: bool = False) -> torch.Tensor:
        """`in_place` (no autograd): the two linear maps' outputs hold the result; two temporaries instead of six."""
        return highway(self.carry(hidden), self.transform(hidden), hidden, in_place)


def check_input(condition: torch.Tensor, message: str, details: Callable[[], str] | None = None):
    """
    Fail with `message` unless the 0-dim bool `condition` holds. On a CPU the value is read and a `ValueError`
    says what is wrong (`details()`, which may read more values, when given), whatever the implementation. On a
    GPU, and inside `torch.compile`, the check stays on the device (`torch._assert_async`): no host sync, and a
    failure stops the process with `message`.
    """
    if condition.device.type != "cpu" or torch.compiler.is_compiling():
        torch._assert_async(condition, message)
    elif not bool(condition):
        raise ValueError(details() if details is not None else message)


def check_int8_run(module: nn.Module, implementation: ElmoImplementation, dropout: bool = False):
    """int8 weights run for CPU inference only (`int8_weights.check_int8_run`): anything else is one line."""
    if int8_weights is not None:
        int8_weights.check_int8_run(module, implementation, dropout)


def char_encoder_reference(encoder: "ElmoCharacterEncoder", char_ids: torch.Tensor) -> torch.Tensor:
    """
    The specification of the token layer (the "reference" implementation): embed each word's chars, convolve with
    every filter, max-pool over positions, activate, the highways, then the projection.
    """
    chars = encoder.char_embeddings(char_ids).transpose(1, 2)  # (words, char_dim, chars)
    pooled = torch.cat([conv(chars).amax(dim=-1) for conv in encoder.convolutions], dim=-1)
    return encoder.from_pooled(pooled)


class ElmoCharacterEncoder(nn.Module):
    """Char ids of words `(num_words, max_characters_per_token)` -> token vectors `(num_words, projection_dim)`."""

    def __init__(self, config: ElmoConfig):
        super().__init__()
        self.config = config
        # Row 0 is the padded-word row (ids are shifted by +1); it stays zero.
        self.char_embeddings = nn.Embedding(N_CHARACTERS, config.char_embedding_dim, padding_idx=0)
        self.convolutions = nn.ModuleList(
            nn.Conv1d(config.char_embedding_dim, n_filters, kernel_size=width) for width, n_filters in config.char_filters
        )
        self.activation = nn.ReLU() if config.char_activation == "relu" else nn.Tanh()
        self.highways = nn.ModuleList(ElmoHighway(config.n_filters) for _ in range(config.n_highway))
        # bilm-tf has no projection when the filters already give projection_dim features.
        if config.n_filters != config.projection_dim:
            self.projection = ElmoLinear(config.n_filters, config.projection_dim, "W_proj")
        else:
            self.projection = nn.Identity()

    def forward(self, char_ids: torch.Tensor) -> torch.Tensor:
        implementation = elmo_implementation_for(self.config, char_ids.device)
        check_int8_run(self, implementation)
        token_vectors = implementation.token_vectors or char_encoder_reference
        return token_vectors(self, char_ids)

    def from_pooled(self, pooled: torch.Tensor, in_place: bool = False) -> torch.Tensor:
        """
        The token layer from the max-pooled convolutions (bias added) `(words, n_filters)`: activation, highways,
        projection. `in_place` (no autograd) lets the highways work in their own outputs.
        """
        hidden = self.activation(pooled)
        for layer in self.highways:
            hidden = layer(hidden, in_place=in_place)
        return self.projection(hidden)

    # An `ElmoTokenCache` once `enable_token_cache` was called (opt-in; used by the "cpu" implementation).
    token_cache = None

    def enable_token_cache(self, max_words: int = 100_000):
        """
        Memoise token vectors of up to `max_words` words (LRU) across calls, for CPU inference on fixed weights
        (the "cpu" implementation uses it; the others compute every word).
        """
        require_hf_elmo("the token cache", token_cache_module)
        self.token_cache = token_cache_module.ElmoTokenCache(max_words)

    def disable_token_cache(self):
        self.token_cache = None


class ElmoLstmLayer(GradientCheckpointingLayer):
    """
    One LSTM layer reading in one direction, as TensorFlow's `LSTMCell(num_proj=...)` in bilm-tf: no peepholes,
    gates in the order (input, candidate, forget, output), forget bias +1, cell clipping, a projection of the
    output without bias, and projection clipping. Its `forward` is the reference computation, step by step.
    """

    def __init__(self, config: ElmoConfig):
        super().__init__()
        self.cell_clip = clip_limit(config.cell_clip)
        self.proj_clip = clip_limit(config.proj_clip)
        # Computed for all time steps at once; only the recurrent part runs step by step.
        self.input_proj = ElmoLinear(config.projection_dim, 4 * config.lstm_dim, "W_0")
        self.recurrent_proj = ElmoLinear(config.projection_dim, 4 * config.lstm_dim, "W_0", bias=False)
        if config.has_lstm_projection:
            self.output_proj = ElmoLinear(config.lstm_dim, config.projection_dim, "W_P_0", bias=False)
        else:
            self.output_proj = nn.Identity()

    def forward(
        self, inputs: torch.Tensor, mask: torch.Tensor, cell: torch.Tensor, hidden: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """
        inputs `(batch, time, projection_dim)` with each row's words first (`mask` `(batch, time)` a prefix);
        `cell`/`hidden` the initial state. Returns the outputs (zero past each row's length) and the state after
        each row's last real step.
        """
        input_gates = nn.functional.linear(inputs, self.input_proj.weight, fold_forget_bias(self.input_proj.bias))
        outputs = []
        for t in range(inputs.shape[1]):
            new_cell, cell_output = lstm_cell(input_gates[:, t] + self.recurrent_proj(hidden), cell, self.cell_clip)
            new_hidden = clip(self.output_proj(cell_output), self.proj_clip)
            # Rows already past their length keep their state, so the returned state is each row's final one.
            active = mask[:, t, None]
            cell = torch.where(active, new_cell, cell)
            hidden = torch.where(active, new_hidden, hidden)
            outputs.append(new_hidden * active)
        return torch.stack(outputs, dim=1), cell, hidden


def lstm_input_dropout_masks(probability: float, num_layers: int, tokens: torch.Tensor) -> torch.Tensor | None:
    """
    bilm-tf's `DropoutWrapper(input_keep_prob=1 - probability)` around every LSTM layer, as masks: per layer and
    direction, which values of the layer's input survive, scaled by `1 / (1 - probability)`; shape `(layers, 2,
    batch, time, width)` over `tokens` `(batch, time, width)`, each direction's input laid out as that direction
    reads it (the backward one reversed within lengths). Drawn here, in one place, so that every implementation
    drops the same values for the same random state. None when `probability` is 0.
    """
    if probability == 0:
        return None
    keep = torch.rand(num_layers, 2, *tokens.shape, device=tokens.device) >= probability
    return keep.to(tokens.dtype) / (1 - probability)


def bilstm_reference(
    module: "ElmoBiLstm",
    tokens: torch.Tensor,
    mask: torch.Tensor,
    state: tuple[torch.Tensor, torch.Tensor],
    output_layers: tuple[int, ...],
    words_only: bool,
    dropout_masks: torch.Tensor | None = None,
) -> tuple[list[torch.Tensor], tuple[torch.Tensor, torch.Tensor]]:
    """
    The specification of the biLSTM (the "reference" implementation): each direction's stack of `ElmoLstmLayer`s
    in turn, the backward one reading each sentence reversed within its length. Arguments and results as
    `ElmoBiLstm.forward`.
    """
    lengths = mask.sum(dim=1)
    directions, finals = [], []
    for direction, layers in enumerate((module.forward_layers, module.backward_layers)):
        # Reversing within lengths keeps the padding at the end.
        layer_input = tokens if direction == 0 else reverse_within_lengths(tokens, lengths)

        def run_layer(index, layer_input, layers=layers, direction=direction):
            return layers[index](layer_input, mask, state[0][index, direction], state[1][index, direction])

        masks = None if dropout_masks is None else dropout_masks[:, direction]
        outputs, cells, hiddens = stack_layers(run_layer, layer_input, len(layers), module.use_skip_connections, masks)
        directions.append(outputs)
        finals.append((cells, hiddens))
    layer_outputs = [
        bidirectional_output(directions[0][index], directions[1][index], lengths, words_only) for index in output_layers
    ]
    final_state = (torch.stack([finals[0][0], finals[1][0]], dim=1), torch.stack([finals[0][1], finals[1][1]], dim=1))
    return layer_outputs, final_state


class ElmoBiLstm(nn.Module):
    """Two stacks of `ElmoLstmLayer`: one reads each sentence forward, the other backward."""

    def __init__(self, config: ElmoConfig):
        super().__init__()
        self.config = config
        self.use_skip_connections = config.use_skip_connections
        self.forward_layers = nn.ModuleList(ElmoLstmLayer(config) for _ in range(config.num_lstm_layers))
        self.backward_layers = nn.ModuleList(ElmoLstmLayer(config) for _ in range(config.num_lstm_layers))

    def forward(
        self,
        tokens: torch.Tensor,
        mask: torch.Tensor,
        state: tuple[torch.Tensor, torch.Tensor],
        output_layers: tuple[int, ...] | None = None,
        words_only: bool = False,
        dropout_masks: torch.Tensor | None = None,
    ) -> tuple[list[torch.Tensor], tuple[torch.Tensor, torch.Tensor]]:
        """
        tokens `(batch, time, projection_dim)`, mask `(batch, time)` prefix, state `(cell, hidden)` shaped
        `(layers, 2, batch, ·)`. Returns a `(batch, time, 2 * projection_dim)` tensor for each layer index in
        `output_layers` (all layers by default), zero past each row's length, and the final state. With
        `words_only`, each row's first and last position (`<S>`, `</S>`) are left out: `(batch, time - 2, ·)`.
        Only the layers asked for are laid out, which is most of this module's output memory. `dropout_masks`
        (from `lstm_input_dropout_masks`, pretraining only) multiply each layer's input; as in bilm-tf, where the
        dropout wraps the residual connection, the skip connection adds the dropped input.
        """
        if output_layers is None:
            output_layers = tuple(range(len(self.forward_layers)))
        implementation = elmo_implementation_for(self.config, tokens.device)
        check_int8_run(self, implementation, dropout=dropout_masks is not None)
        return implementation.bilstm(self, tokens, mask, state, output_layers, words_only, dropout_masks)


# The specification; "cpu" and "cuda" register themselves (`elmo_cpu.py`, `elmo_cuda.py`), and
# `configuration_elmo.register` adds others.
register("reference", ElmoImplementation(bilstm=bilstm_reference, token_vectors=char_encoder_reference))


if TYPE_CHECKING:
    # Named, never imported at run time: the relative import makes Transformers copy it into every saved folder.
    from .pipeline_elmo import ElmoTokenClassificationPipeline  # noqa: F401

# The pipelines a saved folder names (`config.custom_pipelines`) for a task, so that `pipeline(task, FOLDER,
# trust_remote_code=True)` builds ELMo's own: the stock ones cannot read per-word char ids.
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
    Name ELMo's pipeline for `task` in `config.custom_pipelines`, under the task's name and each of Transformers'
    aliases for it ("ner"): pipeline() looks the name it is given up there before it resolves an alias. One cost:
    pipeline(FOLDER, trust_remote_code=True) without a task can no longer guess it, and says so, naming both.
    """
    from transformers.pipelines import TASK_ALIASES

    names = [task] + sorted(alias for alias, target in TASK_ALIASES.items() if target == task)
    custom = getattr(config, "custom_pipelines", None) or {}
    config.custom_pipelines = {**custom, **{name: ELMO_CUSTOM_PIPELINES[task] for name in names}}


class ElmoPreTrainedModel(PreTrainedModel):
    config_class = ElmoConfig
    config: ElmoConfig
    base_model_prefix = "elmo"
    main_input_name = "input_ids"
    supports_gradient_checkpointing = True
    # The biLSTM's implementations advance both directions' layers together: it stays on one device.
    _no_split_modules = ["ElmoCharacterEncoder", "ElmoBiLstm"]
    # A pretraining checkpoint holds the LM softmax; every other class rightly leaves it unread.
    _keys_to_ignore_on_load_unexpected = [r"^softmax\."]
    # The task (a key of `ELMO_CUSTOM_PIPELINES`) whose ELMo pipeline this class's saved folders name.
    elmo_pipeline_task: str | None = None

    def __init__(self, config: ElmoConfig, *args, **kwargs):
        # from_pretrained's keyword arguments (mix_dropout=1.5) reach the config by setattr, past its own checks.
        config.validate_elmo()
        super().__init__(config, *args, **kwargs)

    @classmethod
    def from_pretrained(cls, *args, **kwargs):
        """
        `PreTrainedModel.from_pretrained`. With hf_elmo installed it refuses weights the model must not run with
        (`weight_checks.py`): a NaN or infinite value, or a biLM weight the checkpoint lacks (Transformers would
        initialise it at random and only warn); the error names the tensor.
        """
        int8_weights = kwargs.pop("int8_weights", False)
        if int8_weights and kwargs.get("dtype", kwargs.get("torch_dtype")) is None:
            # int8 weights are made from fp32 ones: a folder saved in bf16 is read into fp32 first (it was refused
            # with a message about a torch_dtype nobody passed).
            kwargs["dtype"] = torch.float32
        load = super().from_pretrained
        loaded = load(*args, **kwargs) if weight_checks is None else weight_checks.from_pretrained_checked(
            load, *args, **kwargs
        )
        if int8_weights:
            (loaded[0] if isinstance(loaded, tuple) else loaded).quantize_int8()
        return loaded

    def quantize_int8(self) -> "ElmoPreTrainedModel":
        """
        Store the biLM's linear maps as int8 with one scale per output channel, in place, for CPU inference
        (`int8_weights.quantize_model`; README "int8 weights"): a quarter of their memory, and faster for large
        models. The model is put in eval mode and its biLM frozen; it then runs only on the "cpu" implementation.
        Saved, it holds the fp32 values the int8 ones stand for. Also `from_pretrained(..., int8_weights=True)`.
        """
        require_hf_elmo("int8 weights", int8_weights)
        return int8_weights.quantize_model(self, ElmoLinear)

    @property
    def has_int8_weights(self) -> bool:
        return int8_weights is not None and int8_weights.holds_int8_weights(self)

    def save_pretrained(self, save_directory, *args, is_main_process: bool = True, **kwargs):
        """
        `PreTrainedModel.save_pretrained`, so that every saved folder works without hf_elmo (trust_remote_code=True):
        a folder without a tokenizer also gets this model's default `ElmoTokenizer` (it needs nothing but the config),
        and a class with an `elmo_pipeline_task` names ELMo's pipeline in the config. A model with int8 weights is
        saved as the fp32 values they stand for: `from_pretrained(..., int8_weights=True)` gives it back.
        """
        folder = os.fspath(save_directory)
        if self.elmo_pipeline_task is not None:
            add_custom_pipelines(self.config, self.elmo_pipeline_task)
        if self.has_int8_weights:
            logger.info("Saving the int8 weights as the fp32 values they stand for (not the fp32 weights they were "
                        "made from): load the folder with int8_weights=True to get this same model back")
        if is_main_process and not os.path.isfile(folder) and not os.path.isfile(
            os.path.join(folder, "tokenizer_config.json")
        ):
            # Written first, so that push_to_hub uploads it too. This relative import also makes Transformers copy
            # tokenization_elmo.py with the model.
            from .tokenization_elmo import ElmoTokenizer

            os.makedirs(folder, exist_ok=True)
            # Without hf_elmo (remote code), the class is only registered if AutoTokenizer loaded it.
            ElmoTokenizer.register_for_auto_class("AutoTokenizer")
            ElmoTokenizer(max_characters_per_token=self.config.max_characters_per_token).save_pretrained(folder)
        return super().save_pretrained(save_directory, *args, is_main_process=is_main_process, **kwargs)

    def post_init(self):
        super().post_init()
        import_built_in_implementations()
        # DDP broadcasts every buffer at every training forward (a collective each time); the <S>/</S> char rows
        # follow from the config and are the same everywhere, so it leaves them out.
        self._ddp_params_and_buffers_to_ignore = [
            name for name, _ in self.named_buffers() if name.rsplit(".", 1)[-1] == "boundary_char_ids"
        ]

    def _init_weights(self, module):
        # Transformers' default (N(0, initializer_range), zero biases) is what the task heads keep. The biLM's
        # weights start as bilm-tf's do (bilm/training.py): with the default, its activations are ~100x smaller and
        # a random biLM gives features no tagger can use. Loaded weights are never touched (`init` skips them).
        config = self.config
        if isinstance(module, ElmoSoftmax):  # without the default's draw first: the table can be 793k x 512
            init.normal_(module.weight, mean=0.0, std=config.projection_dim**-0.5)  # softmax/W
            init.zeros_(module.bias)  # softmax/b
            return
        super()._init_weights(module)
        if isinstance(module, ElmoModel):
            init.copy_(module.boundary_char_ids, ElmoModel._boundary_rows(config))
        elif isinstance(module, nn.Embedding):  # the char embeddings, the only embedding of the model
            init.uniform_(module.weight, -1.0, 1.0)  # char_embed
            if not getattr(module.weight, "_is_hf_initialized", False):
                init.zeros_(module.weight[module.padding_idx])  # our extra row for padded words
        elif isinstance(module, nn.Conv1d):  # the char CNN's filters
            if config.char_activation == "relu":
                init.uniform_(module.weight, -0.05, 0.05)  # CNN/W_cnn_i with relu (Kim et al. 2015)
            else:
                width, char_dim = module.kernel_size[0], module.in_channels
                init.normal_(module.weight, 0.0, (width * char_dim) ** -0.5)  # CNN/W_cnn_i with tanh
        elif isinstance(module, ElmoLinear):
            if module.bilm_tf_variable in ("W_carry", "W_transform", "W_proj"):
                init.normal_(module.weight, 0.0, module.in_features**-0.5)  # CNN_high_k/W_*, CNN_proj/W_proj
            elif module.bilm_tf_variable == "W_0":
                # LSTMCell/W_0 is one kernel [input; previous output] x 4 * lstm_dim under TensorFlow's default
                # Glorot-uniform: our input and recurrent maps are its two row blocks, each projection_dim wide.
                bound = (6.0 / (2 * config.projection_dim + 4 * config.lstm_dim)) ** 0.5
                init.uniform_(module.weight, -bound, bound)
            else:  # LSTMCell/W_P_0
                init.xavier_uniform_(module.weight)
            if module.bilm_tf_variable == "W_carry":
                init.constant_(module.bias, -2.0)  # CNN_high_k/b_carry: start close to carrying the input
            # Every other bias, b_cnn_i, b_transform, b_proj and the LSTM's B, starts at zero, as the default does
            # (the LSTM's forget bias +1 is added when the cell runs).

    def set_elmo_implementation(self, name: str | None):
        """
        Compute the char CNN and the biLSTM with implementation `name` ("reference", "cpu", "cuda"), or choose by
        device on every call (None, the default). A choice of this process, never saved with the model; also
        `from_pretrained(..., elmo_implementation=name)`.
        """
        self.config.elmo_implementation = name
        for module in self.modules():
            if isinstance(module, PreTrainedModel):
                module.config.elmo_implementation = name


class ElmoModel(ElmoPreTrainedModel):
    """
    The ELMo biLM. Input: per-word char ids from `ElmoTokenizer` (`input_ids` `(batch, words, chars)`, words as a
    prefix of each row, zero rows for padding). `<S>`/`</S>` are added here, so output position i is word i.
    Stateless by default: every sentence starts from a zero LSTM state, so its vectors do not depend on the rest of
    the batch. Pass `lstm_state` (from a previous call's output) to carry the state over as bilm-tf does.
    """

    def __init__(self, config: ElmoConfig):
        super().__init__(config)
        self.char_encoder = ElmoCharacterEncoder(config)
        self.bilstm = ElmoBiLstm(config)
        # Char-id rows of <S> and </S>, (2, max_characters_per_token): a buffer, so that it lives on the model's
        # device and the forward makes no host-to-device copy (a blocking one, which also stops CUDA-graph capture).
        # Not saved (it follows from the config); `_init_weights` fills it, also after from_pretrained.
        self.register_buffer("boundary_char_ids", self._boundary_rows(config), persistent=False)
        self.post_init()

    @staticmethod
    def _boundary_rows(config: ElmoConfig) -> torch.Tensor:
        width = config.max_characters_per_token
        rows = [word_to_char_ids(word, width) for word in (BEGIN_SENTENCE_WORD, END_SENTENCE_WORD)]
        # On the host even under a meta-device context (`load_bilm_tf`, from_pretrained), as nothing loads it.
        return torch.tensor(rows, dtype=torch.long, device="cpu")

    def get_input_embeddings(self) -> nn.Embedding:
        return self.char_encoder.char_embeddings

    def set_input_embeddings(self, value: nn.Embedding):
        self.char_encoder.char_embeddings = value

    def word_mask(self, input_ids: torch.Tensor, attention_mask: torch.Tensor | None) -> torch.Tensor:
        """Checks the inputs and returns which positions hold words, `(batch, words)` bool."""
        if not isinstance(input_ids, torch.Tensor):
            raise TypeError(
                f"input_ids must be a torch.Tensor of char ids (from ElmoTokenizer(..., return_tensors='pt')), "
                f"got {type(input_ids).__name__}."
            )
        if input_ids.dim() != 3 or input_ids.shape[-1] != self.config.max_characters_per_token:
            raise ValueError(
                f"input_ids must have shape (batch, words, {self.config.max_characters_per_token}) (char ids per word, "
                f"from ElmoTokenizer), got {tuple(input_ids.shape)}."
            )
        if input_ids.shape[0] == 0:
            raise ValueError("input_ids is an empty batch (batch size 0); pass at least one sentence.")
        if input_ids.dtype.is_floating_point or input_ids.dtype == torch.bool or input_ids.dtype == torch.uint8:
            raise ValueError(f"input_ids must hold integer char ids (int64 or int32), got dtype {input_ids.dtype}.")
        has_chars = input_ids.ne(0).any(dim=-1)
        if attention_mask is None:
            mask = has_chars
        else:
            if attention_mask.shape != input_ids.shape[:2]:
                raise ValueError(
                    f"attention_mask must have shape {tuple(input_ids.shape[:2])} (batch, words), "
                    f"got {tuple(attention_mask.shape)}."
                )
            mask = attention_mask.bool()
            check_input(
                ~(mask & ~has_chars).any(),
                "attention_mask marks a word whose input_ids row is all zeros (a padded position).",
            )
        if input_ids.numel():
            check_input(
                (input_ids.min() >= 0) & (input_ids.max() < N_CHARACTERS),
                f"input_ids hold char ids outside [0, {N_CHARACTERS}).",
            )
        lengths = mask.sum(dim=1)
        prefix = torch.arange(mask.shape[1], device=mask.device) < lengths[:, None]
        check_input(
            (prefix == mask).all(),
            "Each row's words must come first and padding last (right padding): found a word after a padded "
            "position. ElmoTokenizer pads on the right.",
        )
        return mask

    def zero_lstm_state(self, batch_size: int, device, dtype) -> tuple[torch.Tensor, torch.Tensor]:
        c = self.config
        return (
            torch.zeros(c.num_lstm_layers, 2, batch_size, c.lstm_dim, device=device, dtype=dtype),
            torch.zeros(c.num_lstm_layers, 2, batch_size, c.projection_dim, device=device, dtype=dtype),
        )

    def _check_lstm_state(self, lstm_state, batch_size: int):
        c = self.config
        expected = (
            (c.num_lstm_layers, 2, batch_size, c.lstm_dim),
            (c.num_lstm_layers, 2, batch_size, c.projection_dim),
        )
        if not isinstance(lstm_state, (tuple, list)) or len(lstm_state) != 2:
            raise ValueError("lstm_state must be a (cell, hidden) pair, as returned in ElmoModelOutput.lstm_state.")
        for name, tensor, shape in zip(("cell", "hidden"), lstm_state, expected):
            if tuple(tensor.shape) != shape:
                raise ValueError(f"lstm_state {name} must have shape {shape}, got {tuple(tensor.shape)}.")

    @can_return_tuple
    def forward(
        self,
        input_ids: torch.LongTensor,
        attention_mask: torch.Tensor | None = None,
        lstm_state: tuple[torch.Tensor, torch.Tensor] | None = None,
        return_lstm_state: bool = False,
        output_hidden_states: bool | None = None,
        keep_sentence_boundaries: bool = False,
        lstm_dropout: float = 0.0,
        **kwargs,
    ) -> ElmoModelOutput:
        r"""
        input_ids (`torch.LongTensor` of shape `(batch_size, num_words, max_characters_per_token)`):
            Char ids per word from `ElmoTokenizer`; padded words are all-zero rows at the end of a row.
        attention_mask (`torch.Tensor` of shape `(batch_size, num_words)`, *optional*):
            1 for words, 0 for padding. Derived from `input_ids` when omitted.
        lstm_state (`tuple(torch.Tensor, torch.Tensor)`, *optional*):
            Initial LSTM `(cell, hidden)` state per batch row (see `ElmoModelOutput.lstm_state`); zeros when omitted.
        return_lstm_state (`bool`, *optional*, defaults to `False`):
            Return the final LSTM state (also returned whenever `lstm_state` is given).
        keep_sentence_boundaries (`bool`, *optional*, defaults to `False`):
            Also return the `<S>` and `</S>` positions: output position 0 is `<S>`, word i is at i + 1 and `</S>`
            follows each row's last word (`word_mask` tells which positions are real).
        lstm_dropout (`float`, *optional*, defaults to 0):
            Dropout on the input of every LSTM layer, bilm-tf's `DropoutWrapper`; `ElmoForPreTraining` passes
            `config.lm_dropout` in training. Inference and the task heads leave it at 0.
        """
        output_hidden_states = (
            output_hidden_states if output_hidden_states is not None else self.config.output_hidden_states
        )
        mask = self.word_mask(input_ids, attention_mask)
        batch_size, num_words = mask.shape
        lengths = mask.sum(dim=1)
        dtype = self.char_encoder.char_embeddings.weight.dtype

        # Every row as <S> w_1 .. w_n </S> followed by padding, laid out with static shapes (no host syncs): the
        # char CNN reads every position and padding is zeroed after it.
        positions = torch.arange(num_words + 2, device=mask.device)
        sequence_mask = positions < (lengths[:, None] + 2)
        boundaries = self.boundary_char_ids
        input_ids = input_ids.long()
        padding = input_ids.new_zeros(batch_size, 1, input_ids.shape[-1])
        char_ids = torch.cat([boundaries[0].expand(batch_size, 1, -1), input_ids, padding], dim=1)
        char_ids = torch.where((positions == lengths[:, None] + 1)[..., None], boundaries[1], char_ids)
        # One expression, so that the unmasked vectors are freed before the biLSTM runs.
        tokens = self.char_encoder(char_ids.flatten(0, 1)).unflatten(0, sequence_mask.shape) * sequence_mask[..., None]
        del char_ids  # not alive through the biLSTM

        state = lstm_state
        if state is None:
            state = self.zero_lstm_state(batch_size, input_ids.device, dtype)
        else:
            self._check_lstm_state(state, batch_size)
            state = (state[0].to(dtype), state[1].to(dtype))
        num_layers = self.config.num_lstm_layers
        output_layers = tuple(range(num_layers)) if output_hidden_states else (num_layers - 1,)
        dropout_masks = lstm_input_dropout_masks(lstm_dropout, num_layers, tokens)
        lstm_outputs, final_state = self.bilstm(
            tokens, sequence_mask, state, output_layers, not keep_sentence_boundaries, dropout_masks
        )

        layers = lstm_outputs
        if output_hidden_states:
            # The token layer is context-free: the words repeated for both directions, masked in place (no copy).
            token_layer = (tokens if keep_sentence_boundaries else tokens[:, 1:-1]).repeat(1, 1, 2)
            if not keep_sentence_boundaries:
                token_layer.mul_(mask[..., None])
            layers = [token_layer, *lstm_outputs]
        out_mask = sequence_mask if keep_sentence_boundaries else mask

        return ElmoModelOutput(
            last_hidden_state=layers[-1],
            hidden_states=tuple(layers) if output_hidden_states else None,
            word_mask=out_mask,
            lstm_state=final_state if (return_lstm_state or lstm_state is not None) else None,
        )


# ---------------------------------------------------------------------------------------------
# Task heads: the paper's recipe for using ELMo downstream. The biLM (usually frozen) gives L + 1
# layers per word; a task learns a softmax-normalised weight per layer and a scale gamma to mix them
# (`ElmoScalarMix`), applies dropout, optionally runs a small biLSTM over the mix, and classifies.
# ---------------------------------------------------------------------------------------------

class ElmoScalarMix(nn.Module):
    """
    `gamma * sum_j softmax(w)_j * h_j` over the biLM layers `h_j` (Peters et al. 2018, eq. 1), with `w` starting at
    zero (an even mix) and `gamma` at one.

    With `layer_norm`, each layer is first normalised to zero mean and unit variance over each sentence's own words
    and features (bilm-tf pooled these statistics over the whole batch, which made a sentence's vectors depend on
    its batch-mates). `penalty()` is `l2_coef * sum_j (w_j - mean(w))^2`: it pulls the softmax weights toward an
    even mix and is unaffected by the shift that softmax ignores.
    """

    def __init__(self, num_layers: int, layer_norm: bool = False, l2_coef: float = 0.0):
        super().__init__()
        self.layer_norm = layer_norm
        self.l2_coef = l2_coef
        self.scalar_weights = nn.Parameter(torch.zeros(num_layers))
        self.gamma = nn.Parameter(torch.ones(1))

    def layer_weights(self) -> torch.Tensor:
        """The normalised weight of each layer, `(num_layers,)`, summing to 1."""
        return torch.softmax(self.scalar_weights, dim=0)

    def penalty(self) -> torch.Tensor:
        centred = self.scalar_weights - self.scalar_weights.mean()
        return self.l2_coef * centred.pow(2).sum()

    @staticmethod
    def normalise_per_sentence(layer: torch.Tensor, mask: torch.Tensor, eps: float = 1e-12) -> torch.Tensor:
        """`layer` `(batch, words, dim)` normalised over each row's words (`mask` `(batch, words)`); padding stays 0."""
        weights = mask.unsqueeze(-1).to(layer.dtype)
        count = (weights.sum(dim=(1, 2), keepdim=True) * layer.shape[-1]).clamp(min=1)
        mean = (layer * weights).sum(dim=(1, 2), keepdim=True) / count
        centred = (layer - mean) * weights
        variance = centred.pow(2).sum(dim=(1, 2), keepdim=True) / count
        return centred / torch.sqrt(variance + eps)

    def forward(self, layers: tuple[torch.Tensor, ...], mask: torch.Tensor) -> torch.Tensor:
        if len(layers) != self.scalar_weights.numel():
            raise ValueError(f"ElmoScalarMix was built for {self.scalar_weights.numel()} layers, got {len(layers)}.")
        weights = self.layer_weights()
        mixed = 0
        for weight, layer in zip(weights, layers):
            if self.layer_norm:
                layer = self.normalise_per_sentence(layer, mask)
            mixed = mixed + weight * layer
        return self.gamma * mixed


# A transition that the label scheme forbids scores this (added to the learned score): no best path and no
# probable one takes it, while every sum stays finite.
FORBIDDEN_TRANSITION = -1e4


def iob2_transitions(id2label: dict) -> tuple[list[list[bool]], list[bool]] | None:
    """
    Which label may follow which (`allowed[previous][next]`) and which may start a sentence, under IOB2: `I-X`
    only after `B-X` or `I-X`, never first. None unless every label is `O`, `B-X` or `I-X` (no constraint then).
    """
    names = [id2label[i] for i in range(len(id2label))]
    if not all(name == "O" or name[:2] in ("B-", "I-") and len(name) > 2 for name in names):
        return None

    def may_follow(previous: str, name: str) -> bool:
        return not name.startswith("I-") or previous[2:] == name[2:] and previous[:2] in ("B-", "I-")

    allowed = [[may_follow(previous, name) for name in names] for previous in names]
    return allowed, [not name.startswith("I-") for name in names]


class ElmoCrf(nn.Module):
    """
    A linear-chain CRF over the word labels, the output layer of the paper's NER model: a learned score for each
    label transition, for starting and for ending a sentence, added to the classifier's scores per word. With IOB2
    labels (`iob2_transitions`) the forbidden transitions are held at `FORBIDDEN_TRANSITION`, in training and in
    decoding alike. All functions take `emissions` `(batch, words, labels)` and a prefix `mask` `(batch, words)`.
    """

    def __init__(self, num_labels: int, id2label: dict | None = None):
        super().__init__()
        self.transitions = nn.Parameter(torch.zeros(num_labels, num_labels))  # [previous, next]
        self.start_scores = nn.Parameter(torch.zeros(num_labels))
        self.end_scores = nn.Parameter(torch.zeros(num_labels))
        # Plain lists, turned into tensors where they are used: a tensor made here would be on the meta device
        # when Transformers builds the model to load it, and it is not a weight to save.
        self.constraints = iob2_transitions(id2label) if id2label and len(id2label) == num_labels else None

    def allowed(self) -> tuple[torch.Tensor, torch.Tensor]:
        """The constraints (when there are any) as bool tensors: `allowed[previous, next]`, `allowed_first[label]`."""
        return tuple(torch.tensor(c, device=self.transitions.device) for c in self.constraints)

    def scores(self) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """Transition, start and end scores with the constraints applied."""
        transitions, start = self.transitions, self.start_scores
        if self.constraints is not None:
            allowed, allowed_first = self.allowed()
            transitions = transitions + (~allowed) * FORBIDDEN_TRANSITION
            start = start + (~allowed_first) * FORBIDDEN_TRANSITION
        return transitions, start, self.end_scores

    def path_scores(self, emissions: torch.Tensor, labels: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
        """The score of each sentence's labelling `labels` `(batch, words)` (any value at padding), `(batch,)`."""
        transitions, start, end = self.scores()
        labels = labels.masked_fill(~mask, 0)
        rows = torch.arange(labels.shape[0], device=labels.device)
        lengths = mask.sum(dim=1)
        score = (emissions.gather(2, labels[..., None]).squeeze(-1) * mask).sum(dim=1)
        score = score + start[labels[:, 0]] * (lengths > 0)
        score = score + (transitions[labels[:, :-1], labels[:, 1:]] * mask[:, 1:]).sum(dim=1)
        return score + end[labels[rows, (lengths - 1).clamp(min=0)]] * (lengths > 0)

    def log_partition(self, emissions: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
        """log of the sum over every labelling of exp(score), `(batch,)` (0 for a sentence of no words)."""
        transitions, start, end = self.scores()
        alpha = start + emissions[:, 0]
        for t in range(1, emissions.shape[1]):
            step = torch.logsumexp(alpha[:, :, None] + transitions, dim=1) + emissions[:, t]
            alpha = torch.where(mask[:, t, None], step, alpha)
        return torch.where(mask[:, 0], torch.logsumexp(alpha + end, dim=1), 0.0)

    def max_marginals(self, emissions: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
        """
        `(batch, words, labels)`: for each word and label, the best score of a whole labelling that gives the word
        that label (max-product forward and backward). Its argmax at each word is the Viterbi path (when the best
        path is unique); 0 at padding.
        """
        transitions, start, end = self.scores()
        forward = [start + emissions[:, 0]]
        for t in range(1, emissions.shape[1]):
            forward.append((forward[-1][:, :, None] + transitions).amax(dim=1) + emissions[:, t])
        backward = [end.expand_as(forward[0])]
        for t in range(emissions.shape[1] - 2, -1, -1):
            step = (transitions + (emissions[:, t + 1] + backward[-1])[:, None, :]).amax(dim=2)
            # A row whose last word is t ends here.
            backward.append(torch.where(mask[:, t + 1, None], step, end))
        scores = torch.stack(forward, dim=1) + torch.stack(backward[::-1], dim=1)
        return scores * mask[..., None]

    def decode(self, emissions: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
        """The best labelling of each sentence (Viterbi), `(batch, words)`, -100 at padding."""
        if emissions.shape[1] == 0:
            return mask.long()
        transitions, start, end = self.scores()
        best, back_pointers = start + emissions[:, 0], []
        for t in range(1, emissions.shape[1]):
            step, pointer = (best[:, :, None] + transitions).max(dim=1)
            back_pointers.append(pointer)
            best = torch.where(mask[:, t, None], step + emissions[:, t], best)
        lengths = mask.sum(dim=1)
        label = (best + end).argmax(dim=1)
        path = [label]
        for t in range(emissions.shape[1] - 1, 0, -1):
            # Only words before a row's last word follow the pointers; later positions just pass the label on.
            previous = back_pointers[t - 1].gather(1, label[:, None]).squeeze(1)
            label = torch.where(t < lengths, previous, label)
            path.append(label)
        return torch.stack(path[::-1], dim=1).masked_fill(~mask, -100)


class ElmoTaskEncoder(nn.Module):
    """
    The task-specific part shared by the heads: biLM layers `(batch, words, 2P)` each -> mix -> dropout -> optional
    biLSTM (run within each sentence's length, so padding never leaks in) -> dropout -> word features
    `(batch, words, output_size)`.
    """

    def __init__(self, config: ElmoConfig):
        super().__init__()
        self.mix = ElmoScalarMix(config.num_lstm_layers + 1, config.mix_layer_norm, config.mix_l2_coef)
        self.dropout = nn.Dropout(config.mix_dropout)
        self.lstm = None
        self.output_size = config.hidden_size
        if config.head_lstm_dim is not None:
            self.lstm = nn.LSTM(
                config.hidden_size,
                config.head_lstm_dim,
                num_layers=config.head_lstm_layers,
                batch_first=True,
                bidirectional=True,
            )
            self.output_size = 2 * config.head_lstm_dim

    def forward(self, layers: tuple[torch.Tensor, ...], mask: torch.Tensor) -> torch.Tensor:
        features = self.dropout(self.mix(layers, mask))
        if self.lstm is not None:
            features = self.dropout(self.bilstm_within_lengths(features, mask) * mask.unsqueeze(-1).to(features.dtype))
        return features

    def bilstm_within_lengths(self, features: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
        """
        `self.lstm` (its weights) over each sentence's words only: the forward direction reads the padded batch
        (padding follows a row's words, so it never reaches them) and the backward one reads each row reversed
        within its length; both give garbage at padded positions, which the caller zeroes. One fused call per
        direction and layer, instead of a packed sequence: in training on a CPU, torch's packed LSTM zero-fills a
        (words, 4 * hidden) gradient buffer per time step, more than half of a NER head's step.
        """
        if features.shape[1] == 0:  # sentences of no words (torch's LSTM refuses a sequence of length 0)
            return features.new_zeros(features.shape[0], 0, 2 * self.lstm.hidden_size)
        lengths = mask.sum(dim=1)
        layer_input = features
        for layer in range(self.lstm.num_layers):
            directions = []
            for suffix in ("", "_reverse"):
                weights = [getattr(self.lstm, f"{name}_l{layer}{suffix}")
                           for name in ("weight_ih", "weight_hh", "bias_ih", "bias_hh")]
                reads = layer_input if not suffix else reverse_within_lengths(layer_input, lengths)
                state = reads.new_zeros(1, reads.shape[0], self.lstm.hidden_size)
                output = torch.lstm(reads, (state, state), weights, True, 1, 0.0, self.training, False, True)[0]
                directions.append(output if not suffix else reverse_within_lengths(output, lengths))
            layer_input = torch.cat(directions, dim=-1)
        return layer_input


class ElmoTaskPreTrainedModel(ElmoPreTrainedModel):
    """
    Shared by the task heads: the biLM under `self.elmo`, the layer mix and optional biLSTM under `self.encoder`, and
    the freezing of the biLM (`config.freeze_elmo`). A frozen biLM runs without autograd, so it costs no activation
    memory and cannot change during training.

    Losses are sums over the labelled items divided by `num_items_in_batch` when the Trainer passes it (the count over
    all gradient-accumulation micro-batches and devices), else by this batch's count: accumulated gradients then equal
    those of one large batch.
    """

    accepts_loss_kwargs = True

    def _init_weights(self, module):
        super()._init_weights(module)
        if isinstance(module, ElmoScalarMix):
            init.zeros_(module.scalar_weights)
            init.ones_(module.gamma)

    def post_init(self):
        super().post_init()
        self.freeze_base_model(self.config.freeze_elmo)

    @classmethod
    def from_pretrained(cls, *args, **kwargs):
        loaded = super().from_pretrained(*args, **kwargs)
        # Loading replaces every parameter with a new one that requires grad: freeze again.
        model = loaded[0] if isinstance(loaded, tuple) else loaded
        model.freeze_base_model(model.config.freeze_elmo)
        return loaded

    def freeze_base_model(self, frozen: bool = True):
        """Freeze (or, with `False`, unfreeze for fine-tuning) the biLM's weights; recorded in `config.freeze_elmo`."""
        self.config.freeze_elmo = frozen
        self.elmo.requires_grad_(not frozen)

    def layer_weights(self) -> torch.Tensor:
        """The learned softmax weight of each biLM layer (token layer first), `(num_lstm_layers + 1,)`."""
        return self.encoder.mix.layer_weights().detach()

    def elmo_layers(self, input_ids, attention_mask, elmo_hidden_states=None):
        """
        All biLM layers and the word mask; without autograd when no biLM weight is trainable. `elmo_hidden_states`
        `(batch, num_lstm_layers + 1, words, hidden_size)`: the layers computed earlier (a frozen biLM's features,
        computed once for every epoch; `attention_mask` then says which words are real); the biLM does not run.
        """
        if elmo_hidden_states is not None:
            expected = (self.config.num_lstm_layers + 1, self.config.hidden_size)
            if elmo_hidden_states.dim() != 4 or (elmo_hidden_states.shape[1], elmo_hidden_states.shape[3]) != expected:
                raise ValueError(
                    f"elmo_hidden_states must have shape (batch, {expected[0]}, words, {expected[1]}) (the biLM's "
                    f"layers), got {tuple(elmo_hidden_states.shape)}."
                )
            if attention_mask is None or attention_mask.shape != elmo_hidden_states.shape[::2]:
                raise ValueError("elmo_hidden_states needs the attention_mask (batch, words) of its words.")
            mask = attention_mask.bool()
            return tuple(layer * mask[..., None] for layer in elmo_hidden_states.unbind(1)), mask
        trainable = any(p.requires_grad for p in self.elmo.parameters())
        with contextlib.nullcontext() if trainable else torch.no_grad():
            output = self.elmo(input_ids, attention_mask=attention_mask, output_hidden_states=True, return_dict=True)
        return output.hidden_states, output.word_mask

    def normalised_loss(self, loss_sum: torch.Tensor, n_items: torch.Tensor, num_items_in_batch) -> torch.Tensor:
        """`loss_sum` over the whole (accumulated) batch, plus this batch's share of the layer-mix penalty."""
        denominator = num_items_in_batch if num_items_in_batch is not None else n_items.clamp(min=1)
        if torch.is_tensor(denominator):
            denominator = denominator.to(loss_sum.device)
        loss = loss_sum / denominator
        if self.encoder.mix.l2_coef > 0:
            # Each micro-batch adds its share, so the penalty counts once per optimiser step.
            loss = loss + self.encoder.mix.penalty() * (n_items / denominator)
        return loss


def _check_label_ids(labels: torch.Tensor, num_labels: int, id2label: dict):
    bad = (labels != -100) & ((labels < 0) | (labels >= num_labels))
    if bad.any():
        value = int(labels[bad][0])
        raise ValueError(
            f"labels hold the id {value}, outside this model's {num_labels} labels (0..{num_labels - 1}, "
            f"id2label={dict(id2label)}); use -100 for positions without a label."
        )


class ElmoForTokenClassification(ElmoTaskPreTrainedModel):
    """
    ELMo with a label per word (NER, POS tagging, chunking): mixed biLM layers -> dropout -> optional biLSTM ->
    linear classifier -> optional CRF (`config.head_crf`). Word i of the input is position i of `logits` (the model
    adds `<S>`/`</S>` itself), so word-level labels need no alignment. Loss: cross-entropy over labels that are not
    -100, or with the CRF the negative log-likelihood of each sentence's labelling, per labelled word.

    With the CRF, `logits` are its max-marginal scores (per word and label, the best score of a whole labelling that
    gives the word that label), so their argmax, which the Trainer's predictions and the token-classification
    pipeline take, is the Viterbi labelling; `decode` returns it directly. A training step (training mode, with
    `labels`) needs only the loss and skips them (two of its three passes over the words): `logits` are then the
    classifier's per-word scores.
    """

    # Saved folders name ELMo's own pipeline for this task (`ELMO_CUSTOM_PIPELINES`).
    elmo_pipeline_task = "token-classification"

    def __init__(self, config: ElmoConfig):
        super().__init__(config)
        self.num_labels = config.num_labels
        self.elmo = ElmoModel(config)
        self.encoder = ElmoTaskEncoder(config)
        self.classifier = nn.Linear(self.encoder.output_size, config.num_labels)
        self.crf = ElmoCrf(config.num_labels, config.id2label) if config.head_crf else None
        self.post_init()

    def _init_weights(self, module):
        super()._init_weights(module)
        if isinstance(module, ElmoCrf):
            # No preference between labels to start with: the classifier's scores alone decide.
            for parameter in module.parameters():
                init.zeros_(parameter)

    @torch.no_grad()
    def decode(
        self,
        input_ids: torch.LongTensor | None = None,
        attention_mask: torch.Tensor | None = None,
        elmo_hidden_states: torch.Tensor | None = None,
    ) -> torch.LongTensor:
        """The best label id of each word, `(batch, words)`, -100 at padding: Viterbi with the CRF, else argmax."""
        layers, mask = self.elmo_layers(input_ids, attention_mask, elmo_hidden_states)
        emissions = self.classifier(self.encoder(layers, mask))
        if self.crf is None:
            return emissions.argmax(dim=-1).masked_fill(~mask, -100)
        return self.crf.decode(emissions.float(), mask)

    @can_return_tuple
    def forward(
        self,
        input_ids: torch.LongTensor | None = None,
        attention_mask: torch.Tensor | None = None,
        labels: torch.LongTensor | None = None,
        output_hidden_states: bool | None = None,
        num_items_in_batch: torch.Tensor | int | None = None,
        elmo_hidden_states: torch.Tensor | None = None,
        **kwargs,
    ) -> TokenClassifierOutput:
        r"""
        labels (`torch.LongTensor` of shape `(batch_size, num_words)`, *optional*):
            Label id of each word in `[0, num_labels)`; -100 for words to ignore and for padding (with the CRF,
            every word of a sentence needs its label).
        num_items_in_batch (`int` or `torch.Tensor`, *optional*):
            Number of labels != -100 in the whole accumulated batch (passed by the Trainer); the loss is divided by
            it instead of by this batch's count.
        elmo_hidden_states (`torch.FloatTensor` of shape `(batch_size, num_lstm_layers + 1, num_words, hidden_size)`, *optional*):
            The biLM's layers, computed earlier, instead of `input_ids` (with `attention_mask`): a frozen biLM's
            features computed once (`ElmoModel(..., output_hidden_states=True)`) serve every epoch.
        """
        layers, mask = self.elmo_layers(input_ids, attention_mask, elmo_hidden_states)
        emissions = self.classifier(self.encoder(layers, mask))
        logits = emissions
        training_step = self.training and labels is not None
        if self.crf is not None and mask.shape[1] and not training_step:
            logits = self.crf.max_marginals(emissions.float(), mask).to(emissions.dtype)

        loss = None
        if labels is not None:
            if labels.shape != mask.shape:
                raise ValueError(
                    f"labels must have one entry per word, shape {tuple(mask.shape)} (batch, words) like input_ids' "
                    f"first two dimensions, got {tuple(labels.shape)}."
                )
            labels = labels.to(logits.device)
            stray = (labels != -100) & ~mask
            if stray.any():
                row = int(stray.any(dim=1).nonzero()[0])
                raise ValueError(
                    f"labels[{row}] has {int((labels[row] != -100).sum())} labels but the sentence has "
                    f"{int(mask[row].sum())} words: label a padded position -100 (DataCollatorForTokenClassification "
                    "does this)."
                )
            _check_label_ids(labels, self.num_labels, self.config.id2label)
            labelled = labels != -100
            if self.crf is None or not mask.shape[1]:  # (the CRF's loss of sentences of no words is 0 too)
                loss_sum = nn.functional.cross_entropy(emissions[labelled].float(), labels[labelled], reduction="sum")
            else:
                self._check_crf_labels(labels, mask)
                emissions = emissions.float()
                loss_sum = (self.crf.log_partition(emissions, mask) - self.crf.path_scores(emissions, labels, mask)).sum()
            loss = self.normalised_loss(loss_sum, labelled.sum(), num_items_in_batch)

        if output_hidden_states is None:
            output_hidden_states = self.config.output_hidden_states
        return TokenClassifierOutput(loss=loss, logits=logits, hidden_states=layers if output_hidden_states else None)

    def _check_crf_labels(self, labels: torch.Tensor, mask: torch.Tensor):
        unlabelled = mask & (labels == -100)
        if unlabelled.any():
            row, word = (int(v) for v in unlabelled.nonzero()[0])
            raise ValueError(
                f"labels[{row}, {word}] is -100 but the CRF scores whole sentences: give every word a label."
            )
        if self.crf.constraints is None or not mask.shape[1]:
            return
        allowed, allowed_first = self.crf.allowed()
        safe = labels.masked_fill(~mask, 0)
        forbidden = ~allowed[safe[:, :-1], safe[:, 1:]] & mask[:, 1:]
        first = ~allowed_first[safe[:, 0]] & mask[:, 0]
        if forbidden.any() or first.any():
            names = self.config.id2label
            if first.any():
                row, word = int(first.nonzero()[0]), 0
            else:
                row, previous = (int(v) for v in forbidden.nonzero()[0])
                word = previous + 1
            after = "at the start" if word == 0 else f"after {names[int(labels[row, word - 1])]}"
            raise ValueError(
                f"labels[{row}, {word}] is {names[int(labels[row, word])]} {after}, which IOB2 forbids (an I- tag "
                "continues a B- or I- tag of its type). Convert IOB1 tags to IOB2, or train without head_crf."
            )


class ElmoForSequenceClassification(ElmoTaskPreTrainedModel):
    """
    ELMo with a label per sentence: mixed biLM layers -> dropout -> optional biLSTM -> pooling over the words
    (`config.classifier_pooling`) -> linear classifier. `config.problem_type` picks the loss as in Transformers:
    `"single_label_classification"` (cross-entropy; -100 ignores a sentence), `"multi_label_classification"`
    (binary cross-entropy per label) or `"regression"` (mean squared error); inferred from `num_labels` and the
    label dtype when unset.
    """

    def __init__(self, config: ElmoConfig):
        super().__init__(config)
        self.num_labels = config.num_labels
        self.elmo = ElmoModel(config)
        self.encoder = ElmoTaskEncoder(config)
        self.classifier = nn.Linear(self.encoder.output_size, config.num_labels)
        self.post_init()

    def pool(self, features: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
        """Word features `(batch, words, dim)` -> one vector per sentence `(batch, dim)`; 0 for a sentence of no words."""
        weights = mask.unsqueeze(-1).to(features.dtype)
        has_words = mask.any(dim=1, keepdim=True)
        pooling = self.config.classifier_pooling
        if pooling == "mean" or features.shape[1] == 0:
            return (features * weights).sum(dim=1) / weights.sum(dim=1).clamp(min=1)
        if pooling == "max":
            masked = features.masked_fill(~mask.unsqueeze(-1), torch.finfo(features.dtype).min)
            return torch.where(has_words, masked.amax(dim=1), torch.zeros_like(masked[:, 0]))
        # "final": each direction's last step, i.e. forward at the last word and backward at the first word.
        half = features.shape[-1] // 2
        last = (mask.sum(dim=1) - 1).clamp(min=0)
        rows = torch.arange(features.shape[0], device=features.device)
        final = torch.cat([features[rows, last, :half], features[:, 0, half:]], dim=-1)
        return final * has_words.to(features.dtype)

    def sequence_loss(self, logits: torch.Tensor, labels: torch.Tensor, num_items_in_batch) -> torch.Tensor:
        config = self.config
        if config.problem_type is None:
            if self.num_labels == 1:
                config.problem_type = "regression"
            elif labels.dtype in (torch.long, torch.int):
                config.problem_type = "single_label_classification"
            else:
                config.problem_type = "multi_label_classification"
        labels = labels.to(logits.device)
        logits = logits.float()
        if config.problem_type == "single_label_classification":
            if labels.dim() != 1 or labels.shape[0] != logits.shape[0]:
                raise ValueError(
                    f"labels must hold one class id per sentence, shape ({logits.shape[0]},), got {tuple(labels.shape)}."
                )
            _check_label_ids(labels, self.num_labels, config.id2label)
            labelled = labels != -100
            loss_sum = nn.functional.cross_entropy(logits[labelled], labels[labelled], reduction="sum")
            return self.normalised_loss(loss_sum, labelled.sum(), num_items_in_batch)
        if config.problem_type == "regression" and self.num_labels == 1 and labels.dim() == 1:
            labels = labels.unsqueeze(-1)
        if labels.shape != logits.shape:
            raise ValueError(
                f"labels for {config.problem_type} must have shape {tuple(logits.shape)} (batch, num_labels), "
                f"got {tuple(labels.shape)}."
            )
        labels = labels.float()
        if config.problem_type == "regression":
            loss_sum = nn.functional.mse_loss(logits, labels, reduction="sum")
        elif config.problem_type == "multi_label_classification":
            loss_sum = nn.functional.binary_cross_entropy_with_logits(logits, labels, reduction="sum")
        else:
            raise ValueError(
                f"config.problem_type must be 'single_label_classification', 'multi_label_classification' or "
                f"'regression', got {config.problem_type!r}."
            )
        return self.normalised_loss(loss_sum, torch.tensor(labels.numel(), device=logits.device), num_items_in_batch)

    @can_return_tuple
    def forward(
        self,
        input_ids: torch.LongTensor | None = None,
        attention_mask: torch.Tensor | None = None,
        labels: torch.Tensor | None = None,
        output_hidden_states: bool | None = None,
        num_items_in_batch: torch.Tensor | int | None = None,
        elmo_hidden_states: torch.Tensor | None = None,
        **kwargs,
    ) -> SequenceClassifierOutput:
        r"""
        labels (`torch.Tensor`, *optional*):
            Single-label: class ids `(batch_size,)` (-100 ignores a sentence). Multi-label: 0/1 floats
            `(batch_size, num_labels)`. Regression: floats `(batch_size,)` or `(batch_size, num_labels)`.
        num_items_in_batch (`int` or `torch.Tensor`, *optional*):
            Number of labels (!= -100) in the whole accumulated batch (passed by the Trainer).
        elmo_hidden_states (`torch.FloatTensor` of shape `(batch_size, num_lstm_layers + 1, num_words, hidden_size)`, *optional*):
            The biLM's layers, computed earlier, instead of `input_ids` (see `ElmoForTokenClassification`).
        """
        layers, mask = self.elmo_layers(input_ids, attention_mask, elmo_hidden_states)
        logits = self.classifier(self.pool(self.encoder(layers, mask), mask))
        loss = None if labels is None else self.sequence_loss(logits, labels, num_items_in_batch)
        if output_hidden_states is None:
            output_hidden_states = self.config.output_hidden_states
        return SequenceClassifierOutput(loss=loss, logits=logits, hidden_states=layers if output_hidden_states else None)


# ---------------------------------------------------------------------------------------------
# Pretraining: ElmoForPreTraining, the forward and backward language models of bilm-tf over a word vocabulary.
# ---------------------------------------------------------------------------------------------
class ElmoSoftmax(nn.Embedding):
    """
    The LM's output layer, one for both directions: a weight row and a bias per vocabulary word (bilm-tf's
    `softmax/W` and `softmax/b`). Called on hidden states it gives the full softmax's scores; `rows(ids)` gives the
    weights and biases of some words, for the sampled softmax.

    With `sparse` on (set by `hf-elmo pretrain` for Adagrad), the rows' gradients are sparse: a step's gradient,
    its norm and its Adagrad update touch only the rows the step used, as bilm-tf's (TensorFlow's
    `IndexedSlices`), instead of every row of a vocabulary that can be 793k x 512. With Adagrad and no weight decay
    a row whose gradient is zero does not change, so the weights are those of the dense update. It is an
    `nn.Embedding` because that is the module DDP knows to expect sparse gradients from.
    """

    def __init__(self, vocab_size: int, hidden_size: int):
        # Undrawn: `_init_weights` draws it once (a pass over 793k x 512 rows takes 2 s on a 2-core CPU).
        super().__init__(vocab_size, hidden_size, _weight=torch.empty(vocab_size, hidden_size))
        self.bias = nn.Parameter(torch.zeros(vocab_size))
        self.keep_gathered = False  # set by the captured training step: `sampled_softmax.rows_for_training`

    def forward(self, hidden: torch.Tensor) -> torch.Tensor:
        return nn.functional.linear(hidden, self.weight, self.bias)

    def rows(self, ids: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """The weight rows `(len(ids), hidden_size)` and biases `(len(ids),)` of words `ids`."""
        if self.sparse or self.keep_gathered:
            require_hf_elmo("sparse softmax gradients", sampled_softmax)
            return sampled_softmax.rows_for_training(self, ids)
        return self.weight[ids], self.bias[ids]


@dataclass
class ElmoForPreTrainingOutput(ModelOutput):
    r"""
    loss (`torch.FloatTensor` of shape `()`, returned with `labels`):
        Mean of `forward_loss` and `backward_loss`.
    forward_loss (`torch.FloatTensor` of shape `()`, returned with `labels`):
        Mean negative log-likelihood per prediction of the forward LM (`<S>` predicts word 0, word i predicts word
        i + 1, the last word predicts `</S>`). `exp(forward_loss)` is its perplexity (with the full softmax).
    backward_loss (`torch.FloatTensor` of shape `()`, returned with `labels`):
        The same for the backward LM (`</S>` predicts the last word, word i predicts word i - 1, word 0 predicts
        `<S>`).
    num_predictions (`torch.LongTensor` of shape `()`, returned with `labels`):
        Predictions per direction behind each loss, to weight batches when averaging perplexities.
    forward_logits (`torch.FloatTensor` of shape `(batch_size, num_words + 2, vocab_size)`, returned without `labels`):
        Full-softmax scores of the word that follows each position, positions laid out as in
        `keep_sentence_boundaries=True` (0 = `<S>`, i + 1 = word i, then `</S>`).
    backward_logits (`torch.FloatTensor` of shape `(batch_size, num_words + 2, vocab_size)`, returned without `labels`):
        Full-softmax scores of the word that precedes each position.
    hidden_states (`tuple(torch.FloatTensor)`, returned with `output_hidden_states=True`):
        The biLM layers with the `<S>`/`</S>` positions, as in `ElmoModelOutput`.
    word_mask (`torch.BoolTensor` of shape `(batch_size, num_words + 2)`):
        Which positions are real (`<S>`, the words, `</S>`).
    """

    loss: torch.FloatTensor | None = None
    forward_loss: torch.FloatTensor | None = None
    backward_loss: torch.FloatTensor | None = None
    num_predictions: torch.LongTensor | None = None
    forward_logits: torch.FloatTensor | None = None
    backward_logits: torch.FloatTensor | None = None
    hidden_states: tuple[torch.FloatTensor, ...] | None = None
    word_mask: torch.BoolTensor | None = None


class ElmoForPreTraining(ElmoPreTrainedModel):
    """
    The biLM with bilm-tf's training objective: a forward and a backward language model over a word vocabulary
    (`config.vocab_size` words, frequency sorted, `<S>` = `config.bos_word_id`, `</S>` = `config.eos_word_id`), both
    directions scored by ONE softmax layer (`self.softmax`, a single module, so it is stored once). Loss = mean of
    the two directions. In training, when `0 < config.num_softmax_samples < vocab_size`, a sampled softmax with
    log-uniform negatives replaces the full one (bilm-tf's recipe: 8192 negatives, shared by all positions and
    both directions of a batch, expected-count correction, accidental hits removed). Evaluation always uses the
    full softmax, so `exp(forward_loss)` is a true perplexity there.
    """

    accepts_loss_kwargs = False

    def __init__(self, config: ElmoConfig):
        super().__init__(config)
        if config.vocab_size is None:
            raise ValueError(
                "ElmoForPreTraining needs config.vocab_size (the size of the word vocabulary, e.g. "
                "tokenizer.word_vocab_size)."
            )
        self.elmo = ElmoModel(config)
        self.dropout = nn.Dropout(config.lm_dropout)
        self.softmax = ElmoSoftmax(config.vocab_size, config.projection_dim)
        self.post_init()

    def get_input_embeddings(self) -> nn.Embedding:
        return self.elmo.get_input_embeddings()

    def set_input_embeddings(self, value: nn.Embedding):
        self.elmo.set_input_embeddings(value)

    @property
    def uses_sampled_softmax(self) -> bool:
        return self.training and self.config.samples_softmax

    def lm_targets(self, labels: torch.Tensor, word_mask: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """
        Per-position targets `(batch, num_words + 2)` of the forward and backward LM from word labels
        `(batch, num_words)` and the boundary-layout `word_mask`; -100 where nothing is predicted. A row without
        words predicts nothing, not even `</S>`: such rows pad a batch to a fixed row count (the captured training
        step's static shapes).
        """
        batch_size, num_words = labels.shape
        lengths = word_mask.sum(dim=1) - 2
        has_words = lengths > 0
        rows = torch.arange(batch_size, device=labels.device)
        forward_targets = labels.new_full((batch_size, num_words + 2), -100)
        forward_targets[:, :num_words] = labels
        forward_targets[rows, lengths] = torch.where(has_words, self.config.eos_word_id, -100)
        backward_targets = labels.new_full((batch_size, num_words + 2), -100)
        backward_targets[:, 2:] = labels
        backward_targets[:, 1] = torch.where(has_words, self.config.bos_word_id, -100)
        return forward_targets, backward_targets

    def _check_labels(self, labels: torch.Tensor, input_ids: torch.Tensor, words: torch.Tensor) -> torch.Tensor:
        if labels.shape != input_ids.shape[:2]:
            raise ValueError(
                f"labels must have shape {tuple(input_ids.shape[:2])} (batch, words): one word id per input word, "
                f"got {tuple(labels.shape)}."
            )
        if labels.dtype.is_floating_point or labels.dtype == torch.bool:
            raise ValueError(f"labels must hold integer word ids, got dtype {labels.dtype}.")
        labels = labels.masked_fill(~words, -100)
        bad = words & (labels != -100) & ((labels < 0) | (labels >= self.config.vocab_size))

        def message() -> str:
            b, i = (int(v) for v in bad.nonzero()[0])
            return (
                f"labels[{b}, {i}] = {int(labels[b, i])} is not a word id in [0, {self.config.vocab_size}) "
                "(config.vocab_size) nor -100 (ignored)."
            )

        check_input(~bad.any(), f"labels hold word ids outside [0, {self.config.vocab_size}) and not -100.", message)
        return labels

    def _full_softmax_losses(self, hidden: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        """Per-position losses (0 where the target is -100)."""
        # In row chunks so that evaluating a large vocabulary never holds (positions x vocab) scores at once.
        chunk = max(1, 2**25 // self.config.vocab_size)
        losses = [
            nn.functional.cross_entropy(self.softmax(h).float(), t, reduction="none")
            for h, t in zip(hidden.split(chunk), targets.split(chunk))
        ]
        return torch.cat(losses) if losses else hidden.new_zeros(0, dtype=torch.float32)

    def _sampled_softmax_losses(self, hidden: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        """Per-position losses of the sampled softmax (0 where the target is -100): `sampled_softmax.py`."""
        require_hf_elmo("the sampled softmax", sampled_softmax)
        return sampled_softmax.sampled_softmax_losses(self.softmax, hidden, targets, self.config.num_softmax_samples,
                                                      matmul_dtype(hidden))

    @can_return_tuple
    def forward(
        self,
        input_ids: torch.LongTensor,
        attention_mask: torch.Tensor | None = None,
        labels: torch.LongTensor | None = None,
        output_hidden_states: bool | None = None,
        **kwargs,
    ) -> ElmoForPreTrainingOutput:
        r"""
        input_ids (`torch.LongTensor` of shape `(batch_size, num_words, max_characters_per_token)`):
            Char ids per word from `ElmoTokenizer`.
        attention_mask (`torch.Tensor` of shape `(batch_size, num_words)`, *optional*):
            1 for words, 0 for padding.
        labels (`torch.LongTensor` of shape `(batch_size, num_words)`, *optional*):
            Word id of each input word in the word vocabulary (`tokenizer.words_to_indices(words)`), -100 for
            padding (a word labelled -100 is not predicted). The `<S>`/`</S>` targets are added here.
        """
        outputs = self.elmo(
            input_ids,
            attention_mask=attention_mask,
            output_hidden_states=output_hidden_states,
            keep_sentence_boundaries=True,
            # bilm-tf drops every LSTM layer's input in training, and the top output (below).
            lstm_dropout=self.config.lm_dropout if self.training else 0.0,
        )
        word_mask = outputs.word_mask
        forward_hidden, backward_hidden = self.dropout(outputs.last_hidden_state).split(self.config.projection_dim, -1)
        result = ElmoForPreTrainingOutput(hidden_states=outputs.hidden_states, word_mask=word_mask)
        if labels is None:
            result.forward_logits = self.softmax(forward_hidden)
            result.backward_logits = self.softmax(backward_hidden)
            return result

        labels = self._check_labels(labels, input_ids, word_mask[:, 1:-1])
        forward_targets, backward_targets = self.lm_targets(labels, word_mask)
        # Every position is scored and the ignored ones masked out of the sums: static shapes, no host sync.
        hidden = torch.cat([forward_hidden.flatten(0, 1), backward_hidden.flatten(0, 1)])
        targets = torch.cat([forward_targets.flatten(), backward_targets.flatten()])
        if self.uses_sampled_softmax:
            losses = self._sampled_softmax_losses(hidden, targets)
        else:
            losses = self._full_softmax_losses(hidden, targets)
        forward_losses, backward_losses = losses.view(2, -1)
        num_predictions = (forward_targets != -100).sum()
        # Every row with words predicts at least </S>; a batch of padding rows alone has loss 0, not 0 / 0.
        result.forward_loss = forward_losses.sum() / num_predictions.clamp(min=1)
        result.backward_loss = backward_losses.sum() / (backward_targets != -100).sum().clamp(min=1)
        result.loss = (result.forward_loss + result.backward_loss) / 2
        result.num_predictions = num_predictions
        return result


__all__ = [
    "ELMO_IMPLEMENTATIONS", "ElmoBiLstm", "ElmoCharacterEncoder", "ElmoCrf", "ElmoForPreTraining",
    "ElmoForPreTrainingOutput", "ElmoForSequenceClassification", "ElmoForTokenClassification", "ElmoHighway",
    "ElmoImplementation", "ElmoLinear", "ElmoLstmLayer", "ElmoModel", "ElmoModelOutput", "ElmoPreTrainedModel",
    "ElmoScalarMix", "ElmoSoftmax", "ElmoTaskEncoder", "ElmoTaskPreTrainedModel",
]
