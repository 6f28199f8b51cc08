"""PyTorch ELMo: the bilm-tf bidirectional language model as a Transformers model.

Data flows top to bottom in this file: char ids -> `ElmoCharacterEncoder` (char CNN, highway,
projection) -> `ElmoBiLstm` (stacked `ElmoLstmLayer`s per direction) -> `ElmoModel`.
"""

from dataclasses import dataclass

import torch
from torch import nn
from transformers import PreTrainedModel
from transformers import initialization as init
from transformers.modeling_layers import GradientCheckpointingLayer
from transformers.modeling_outputs import BaseModelOutput
from transformers.utils import logging
from transformers.utils.generic import can_return_tuple

from .configuration_elmo import BEGIN_SENTENCE_WORD, END_SENTENCE_WORD, ElmoConfig, word_to_char_ids


logger = logging.get_logger(__name__)

# TensorFlow's LSTMCell adds this to the forget gate at run time; bilm-tf files do not store it.
FORGET_GATE_BIAS = 1.0


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


class ElmoHighway(nn.Module):
    """One highway layer: a sigmoid gate mixes a ReLU transform of the input with the input itself."""

    def __init__(self, size: int):
        super().__init__()
        self.carry = nn.Linear(size, size)
        self.transform = nn.Linear(size, size)

    def forward(self, hidden: torch.Tensor) -> torch.Tensor:
        # bilm-tf calls this gate "carry", but it scales the transformed branch, not the input.
        gate = torch.sigmoid(self.carry(hidden))
        return gate * torch.relu(self.transform(hidden)) + (1 - gate) * hidden


class ElmoCharacterEncoder(nn.Module):
    """Char ids of words `(num_words, max_characters_per_token)` -> token vectors `(num_words, projection_dim)`."""

    def __init__(self, config: ElmoConfig):
        super().__init__()
        # Row 0 is the padded-word row (ids are shifted by +1); it stays zero.
        self.char_embeddings = nn.Embedding(config.n_characters, config.char_embedding_dim, padding_idx=0)
        self.convolutions = nn.ModuleList(
            nn.Conv1d(config.char_embedding_dim, n_filters, kernel_size=width) for width, n_filters in config.char_filters
        )
        self.activation = nn.ReLU() if config.char_activation == "relu" else nn.Tanh()
        self.highways = nn.ModuleList(ElmoHighway(config.n_filters) for _ in range(config.n_highway))
        # bilm-tf has no projection when the filters already give projection_dim features.
        if config.n_filters != config.projection_dim:
            self.projection = nn.Linear(config.n_filters, config.projection_dim)
        else:
            self.projection = nn.Identity()

    def forward(self, char_ids: torch.Tensor) -> torch.Tensor:
        chars = self.char_embeddings(char_ids).transpose(1, 2)  # (words, char_dim, chars)
        pooled = torch.cat([conv(chars).amax(dim=-1) for conv in self.convolutions], dim=-1)
        hidden = self.activation(pooled)
        for highway in self.highways:
            hidden = highway(hidden)
        return self.projection(hidden)


class ElmoLstmLayer(GradientCheckpointingLayer):
    """
    One LSTM layer reading in one direction, as TensorFlow's `LSTMCell(num_proj=...)` in bilm-tf: no peepholes,
    gates in the order (input, candidate, forget, output), forget bias +1, cell clipping, a projection of the
    output without bias, and projection clipping.
    """

    def __init__(self, config: ElmoConfig):
        super().__init__()
        self.cell_clip = config.cell_clip
        self.proj_clip = config.proj_clip
        # Computed for all time steps at once; only the recurrent part runs step by step.
        self.input_proj = nn.Linear(config.projection_dim, 4 * config.lstm_dim)
        self.recurrent_proj = nn.Linear(config.projection_dim, 4 * config.lstm_dim, bias=False)
        if config.has_lstm_projection:
            self.output_proj = nn.Linear(config.lstm_dim, config.projection_dim, bias=False)
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
        input_gates = self.input_proj(inputs)
        outputs = []
        for t in range(inputs.shape[1]):
            gates = input_gates[:, t] + self.recurrent_proj(hidden)
            in_gate, candidate, forget_gate, out_gate = gates.chunk(4, dim=-1)
            new_cell = torch.sigmoid(forget_gate + FORGET_GATE_BIAS) * cell + torch.sigmoid(in_gate) * torch.tanh(
                candidate
            )
            if self.cell_clip is not None:
                new_cell = new_cell.clamp(-self.cell_clip, self.cell_clip)
            new_hidden = self.output_proj(torch.sigmoid(out_gate) * torch.tanh(new_cell))
            if self.proj_clip is not None:
                new_hidden = new_hidden.clamp(-self.proj_clip, self.proj_clip)
            # Rows already past their length keep their state, so the returned state is each row's final one.
            active = mask[:, t, None]
            cell = torch.where(active, new_cell, cell)
            hidden = torch.where(active, new_hidden, hidden)
            outputs.append(new_hidden * active)
        return torch.stack(outputs, dim=1), cell, hidden


def reverse_within_lengths(sequences: torch.Tensor, lengths: torch.Tensor) -> torch.Tensor:
    """Reverse each row's first `length` steps in place of the time axis (dim 1); padding stays put."""
    steps = torch.arange(sequences.shape[1], device=sequences.device)
    index = torch.where(steps < lengths[:, None], lengths[:, None] - 1 - steps, steps)
    index = index.view(*index.shape, *([1] * (sequences.dim() - 2))).expand_as(sequences)
    return sequences.gather(1, index)


class ElmoBiLstm(nn.Module):
    """Two stacks of `ElmoLstmLayer`: one reads each sentence forward, the other backward."""

    def __init__(self, config: ElmoConfig):
        super().__init__()
        self.use_skip_connections = config.use_skip_connections
        self.forward_layers = nn.ModuleList(ElmoLstmLayer(config) for _ in range(config.num_lstm_layers))
        self.backward_layers = nn.ModuleList(ElmoLstmLayer(config) for _ in range(config.num_lstm_layers))

    def forward(
        self, tokens: torch.Tensor, mask: torch.Tensor, state: tuple[torch.Tensor, torch.Tensor]
    ) -> tuple[list[torch.Tensor], tuple[torch.Tensor, torch.Tensor]]:
        """
        tokens `(batch, time, projection_dim)`, mask `(batch, time)` prefix, state `(cell, hidden)` shaped
        `(layers, 2, batch, ·)`. Returns one `(batch, time, 2 * projection_dim)` tensor per layer and the final state.
        """
        lengths = mask.sum(dim=1)
        final_cells, final_hiddens, layer_outputs = [], [], []
        directions = []
        for direction, layers in enumerate((self.forward_layers, self.backward_layers)):
            # The backward stack reads the reversed sentence; reversing within lengths keeps the padding at the end.
            layer_input = tokens if direction == 0 else reverse_within_lengths(tokens, lengths)
            outputs, cells, hiddens = [], [], []
            for index, layer in enumerate(layers):
                output, cell, hidden = layer(layer_input, mask, state[0][index, direction], state[1][index, direction])
                if index > 0 and self.use_skip_connections:
                    output = output + layer_input
                outputs.append(output if direction == 0 else reverse_within_lengths(output, lengths))
                cells.append(cell)
                hiddens.append(hidden)
                layer_input = output
            directions.append(outputs)
            final_cells.append(torch.stack(cells))
            final_hiddens.append(torch.stack(hiddens))
        for forward_output, backward_output in zip(*directions):
            layer_outputs.append(torch.cat([forward_output, backward_output], dim=-1))
        return layer_outputs, (torch.stack(final_cells, dim=1), torch.stack(final_hiddens, dim=1))


class ElmoPreTrainedModel(PreTrainedModel):
    config_class = ElmoConfig
    config: ElmoConfig
    base_model_prefix = "elmo"
    main_input_name = "input_ids"
    supports_gradient_checkpointing = True
    _no_split_modules = ["ElmoCharacterEncoder", "ElmoLstmLayer"]

    def _init_weights(self, module):
        super()._init_weights(module)
        if isinstance(module, ElmoHighway):
            # Start highways close to the identity (carry the input), as bilm-tf initialises them.
            init.constant_(module.carry.bias, -2.0)


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
        self.post_init()

    def get_input_embeddings(self) -> nn.Embedding:
        return self.char_encoder.char_embeddings

    def set_input_embeddings(self, value: nn.Embedding):
        self.char_encoder.char_embeddings = value

    def boundary_char_ids(self, device) -> torch.Tensor:
        """Char-id rows of `<S>` and `</S>`, shape `(2, max_characters_per_token)`."""
        width = self.config.max_characters_per_token
        rows = [word_to_char_ids(BEGIN_SENTENCE_WORD, width), word_to_char_ids(END_SENTENCE_WORD, width)]
        return torch.tensor(rows, dtype=torch.long, device=device)

    def word_mask(self, input_ids: torch.Tensor, attention_mask: torch.Tensor | None) -> torch.Tensor:
        """Checks the inputs and returns which positions hold words, `(batch, words)` bool."""
        if input_ids.dim() != 3 or input_ids.shape[-1] != self.config.max_characters_per_token:
            raise ValueError(
                f"input_ids must have shape (batch, words, {self.config.max_characters_per_token}) (char ids per word, "
                f"from ElmoTokenizer), got {tuple(input_ids.shape)}."
            )
        if input_ids.shape[0] == 0:
            raise ValueError("input_ids is an empty batch (batch size 0); pass at least one sentence.")
        if input_ids.dtype.is_floating_point or input_ids.dtype == torch.bool:
            raise ValueError(f"input_ids must hold integer char ids, got dtype {input_ids.dtype}.")
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
            if (mask & ~has_chars).any():
                raise ValueError("attention_mask marks a word whose input_ids row is all zeros (a padded position).")
        if input_ids.numel() and (input_ids.min() < 0 or input_ids.max() >= self.config.n_characters):
            raise ValueError(f"input_ids hold char ids outside [0, {self.config.n_characters}).")
        lengths = mask.sum(dim=1)
        prefix = torch.arange(mask.shape[1], device=mask.device) < lengths[:, None]
        if not torch.equal(prefix, mask):
            raise ValueError(
                "Each row's words must come first and padding last (right padding): found a word after a padded "
                "position. ElmoTokenizer pads on the right."
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
        """
        output_hidden_states = (
            output_hidden_states if output_hidden_states is not None else self.config.output_hidden_states
        )
        mask = self.word_mask(input_ids, attention_mask)
        batch_size, num_words = mask.shape
        lengths = mask.sum(dim=1)
        dtype = self.char_encoder.char_embeddings.weight.dtype

        # The char CNN runs on real words only, plus one <S> and one </S> for the whole batch.
        boundary_vectors = self.char_encoder(self.boundary_char_ids(input_ids.device))
        word_vectors = self.char_encoder(input_ids[mask])

        # Lay out every row as <S> w_1 .. w_n </S> followed by zero padding.
        sequence_mask = torch.arange(num_words + 2, device=mask.device) < (lengths[:, None] + 2)
        tokens = boundary_vectors.new_zeros(batch_size, num_words + 2, boundary_vectors.shape[-1])
        tokens[:, 0] = boundary_vectors[0]
        tokens[:, 1:-1][mask] = word_vectors
        tokens[torch.arange(batch_size, device=mask.device), lengths + 1] = boundary_vectors[1]

        state = lstm_state
        if state is None:
            state = self.zero_lstm_state(batch_size, input_ids.device, dtype)
        else:
            self._check_lstm_state(state, batch_size)
            state = (state[0].to(dtype), state[1].to(dtype))
        lstm_outputs, final_state = self.bilstm(tokens, sequence_mask, state)

        layers = [torch.cat([tokens, tokens], dim=-1) * sequence_mask[..., None], *lstm_outputs]
        if keep_sentence_boundaries:
            out_mask = sequence_mask
        else:
            layers = [layer[:, 1:-1] * mask[..., None] for layer in layers]
            out_mask = mask

        return ElmoModelOutput(
            last_hidden_state=layers[-1],
            hidden_states=tuple(layers) if output_hidden_states else None,
            word_mask=out_mask,
            lstm_state=final_state if (return_lstm_state or lstm_state is not None) else None,
        )


__all__ = ["ElmoPreTrainedModel", "ElmoModel", "ElmoModelOutput", "ElmoCharacterEncoder", "ElmoHighway",
           "ElmoLstmLayer", "ElmoBiLstm"]
