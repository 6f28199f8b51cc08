"""PyTorch ELMo: the bilm-tf bidirectional language model as a Transformers model.

Data flows top to bottom in this file: char ids -> `ElmoCharacterEncoder` (char CNN, highway,
projection) -> `ElmoBiLstm` (stacked `ElmoLstmLayer`s per direction) -> `ElmoModel`.
"""

import contextlib
import functools
import math
import os
from collections import OrderedDict
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

from .configuration_elmo import BEGIN_SENTENCE_WORD, END_SENTENCE_WORD, ElmoConfig, word_to_char_ids


logger = logging.get_logger(__name__)

# TensorFlow's LSTMCell adds this to the forget gate at run time; bilm-tf files do not store it.
FORGET_GATE_BIAS = 1.0


def few_column_matmul(
    weight: torch.Tensor, columns: torch.Tensor, out: torch.Tensor | None = None, add: torch.Tensor | None = None
) -> torch.Tensor:
    """
    `add + weight @ columns` for a tall `weight` and a few `columns` (one per sentence still being read), written
    into `out` when given (without autograd) or returned as a new tensor.

    CPU BLAS shares such a product between threads badly at some column counts (MKL with 32 columns: 2.2 ms for
    "original"'s 16384x512 recurrent weight, against 1.7 ms with 31). Handing it row blocks of the weight as one
    batched matmul keeps every thread on whole blocks: 1.5 ms at 32 columns and never slower elsewhere, except
    for a single column, where the matrix-vector product is faster still. (CPU only: GPUs get the plain product.)
    """
    blocks = max(2, min(16, weight.shape[0] // 256))
    if columns.shape[1] == 1 or weight.shape[0] % blocks or weight.device.type != "cpu":
        if add is None:
            return torch.mm(weight, columns, out=out)
        return torch.addmm(add, weight, columns, out=out)
    weight = weight.view(blocks, -1, weight.shape[1])
    columns = columns.expand(blocks, *columns.shape)
    blocked_out = None if out is None else out.view(blocks, -1, columns.shape[-1])
    if add is None:
        product = torch.bmm(weight, columns, out=blocked_out)
    else:
        product = torch.baddbmm(add.view(blocks, -1, add.shape[1]), weight, columns, out=blocked_out)
    return product.view(-1, columns.shape[-1]) if out is None else out


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


class ElmoHighwayGate(nn.Linear):
    """The gate of a highway layer: a plain linear map, its own class so that `_init_weights` can find it."""


class ElmoHighway(nn.Module):
    """One highway layer: a sigmoid gate mixes a ReLU transform of the input with the input itself."""

    def __init__(self, size: int):
        super().__init__()
        self.carry = ElmoHighwayGate(size, size)
        self.transform = nn.Linear(size, size)

    def forward(self, hidden: torch.Tensor) -> torch.Tensor:
        # bilm-tf calls this gate "carry", but it scales the transformed branch, not the input.
        gate = torch.sigmoid(self.carry(hidden))
        return gate * torch.relu(self.transform(hidden)) + (1 - gate) * hidden


class ElmoTokenCache:
    """
    A bounded least-recently-used memo of token-layer vectors, keyed by a word's char-id row. Valid because the
    token layer is context-free: a word's vector depends on its characters and the char-encoder weights only.
    Entries are dropped whenever those weights change (in place, or replaced, or cast), so it never serves stale
    vectors; it is bypassed whenever gradients are needed. Memory: `max_words * projection_dim` values.
    """

    def __init__(self, max_words: int):
        if isinstance(max_words, bool) or not isinstance(max_words, int) or max_words <= 0:
            raise ValueError(f"max_words must be a positive integer, got {max_words!r}.")
        self.max_words = max_words
        self.hits = self.misses = 0
        self._entries: OrderedDict[tuple, torch.Tensor] = OrderedDict()
        self._weights_key = None

    def __len__(self) -> int:
        return len(self._entries)

    def clear(self):
        self._entries.clear()

    def vectors(self, encoder: "ElmoCharacterEncoder", char_ids: torch.Tensor) -> torch.Tensor:
        """Token vectors of `char_ids` rows (distinct), computing only the rows not cached."""
        weights_key = tuple((p.data_ptr(), p._version, p.dtype, p.device) for p in encoder.parameters())
        if weights_key != self._weights_key:
            self._entries.clear()
            self._weights_key = weights_key
        keys = [tuple(row) for row in char_ids.tolist()]
        found = [self._entries.get(key) for key in keys]
        missing = [i for i, vector in enumerate(found) if vector is None]
        self.hits += len(keys) - len(missing)
        self.misses += len(missing)
        for key, vector in zip(keys, found):
            if vector is not None:
                self._entries.move_to_end(key)
        if missing:
            # Each entry is its own copy, so evicting it frees it (a view would keep the whole batch alive).
            computed = encoder._token_vectors(char_ids[missing])
            for i, vector in zip(missing, computed.unbind()):
                found[i] = vector
                self._entries[keys[i]] = vector.clone()
            while len(self._entries) > self.max_words:
                self._entries.popitem(last=False)
        return torch.stack(found)


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
        if self.use_fast_path:
            return self._fast_forward(char_ids)
        # The reference path: the specification of the token layer, and the oracle of the fast path's tests.
        chars = self.char_embeddings(char_ids).transpose(1, 2)  # (words, char_dim, chars)
        pooled = torch.cat([conv(chars).amax(dim=-1) for conv in self.convolutions], dim=-1)
        hidden = self.activation(pooled)
        for highway in self.highways:
            hidden = highway(hidden)
        return self.projection(hidden)

    # Fast path (the default): the same function as the reference path above, on the same parameters, computed
    # with fewer and better-shaped operations. Select the reference path with `use_fast_path = False`.
    use_fast_path = True
    # Window positions per convolution matmul: bounds the (positions, n_filters) activation (2 MB in fp32 for
    # 2048 filters; as fast as larger chunks, and small temporaries keep glibc's heap from growing).
    conv_chunk_positions = 256

    # An `ElmoTokenCache` once `enable_token_cache` was called (opt-in; used by the fast path only).
    token_cache = None

    def enable_token_cache(self, max_words: int = 100_000):
        """Memoise token vectors of up to `max_words` words (LRU) across calls, for inference on fixed weights."""
        self.token_cache = ElmoTokenCache(max_words)

    def disable_token_cache(self):
        self.token_cache = None

    def _fast_forward(self, char_ids: torch.Tensor) -> torch.Tensor:
        # A word's vector depends on its characters only, so each distinct word is computed once per call.
        distinct, inverse = torch.unique(char_ids, dim=0, return_inverse=True)
        needs_grad = torch.is_grad_enabled() and any(p.requires_grad for p in self.parameters())
        if self.token_cache is None or needs_grad:
            return self._token_vectors(distinct)[inverse]
        return self.token_cache.vectors(self, distinct)[inverse]

    def _token_vectors(self, char_ids: torch.Tensor) -> torch.Tensor:
        pooled = self._pooled_convolutions(char_ids)
        hidden = self.activation(pooled.add_(torch.cat([conv.bias for conv in self.convolutions])))
        for highway in self.highways:
            # ElmoHighway's function with 3 temporaries instead of 8 (in-place activations are autograd-safe here:
            # sigmoid and relu keep their results, the linear layers do not need their outputs).
            gate = highway.carry(hidden).sigmoid_()
            hidden = torch.lerp(hidden, highway.transform(hidden).relu_(), gate)
        return self.projection(hidden)

    def _conv_kernel(self) -> torch.Tensor:
        """All filters as one `(widest * char_dim, n_filters)` matrix, each zero-padded to the widest width."""
        widest = max(conv.kernel_size[0] for conv in self.convolutions)
        # Conv1d weight (n, char_dim, width) -> (width, char_dim, n), with zero taps past the filter's width.
        taps = [
            nn.functional.pad(conv.weight.permute(2, 1, 0), (0, 0, 0, 0, 0, widest - conv.kernel_size[0]))
            for conv in self.convolutions
        ]
        return torch.cat(taps, dim=-1).flatten(0, 1)

    def _pooled_convolutions(self, char_ids: torch.Tensor) -> torch.Tensor:
        """
        Max-pooled convolutions (before bias and activation) of `(words, chars)` ids, as im2col matmuls.

        A word's row ends in a run of one repeated id (the padding char). Every window that lies inside that run
        is the same window, so the max needs only the windows starting before the run plus the first one inside
        it: a 5-byte word needs 8 of the 50 positions. Words are sorted by that count and chunked, and each chunk
        computes as many positions as its longest word (extra positions repeat the run's window, which does not
        change the max). Each chunk is ONE matmul of every position's widest window (flattened) by all filters.
        """
        num_words, num_chars = char_ids.shape
        widths = [conv.kernel_size[0] for conv in self.convolutions]
        widest = max(widths)
        kernel = self._conv_kernel()
        # Positions needed per word: up to and including the first window that starts inside the trailing run.
        position = torch.arange(1, num_chars + 1, device=char_ids.device)
        run_start = ((char_ids != char_ids[:, -1:]) * position).amax(dim=1)
        needed, order = torch.sort((run_start + 1).clamp(max=num_chars))
        needed = needed.tolist()
        pooled, start = [], 0
        while start < num_words:
            # The chunk's positions are those of its longest (last) word.
            end = start + 1
            while end < num_words and (end + 1 - start) * needed[end] <= self.conv_chunk_positions:
                end += 1
            positions = needed[end - 1]
            ids = char_ids[order[start:end], : min(num_chars, positions + widest - 1)]
            chars = self.char_embeddings(ids)  # (words, chars, char_dim)
            chars = nn.functional.pad(chars, (0, 0, 0, positions + widest - 1 - chars.shape[1]))
            windows = chars.unfold(1, widest, 1).transpose(2, 3).flatten(2)  # (words, positions, widest*char_dim)
            features = (windows.flatten(0, 1) @ kernel).view(end - start, positions, -1)
            chunk, column = [], 0
            for conv, width in zip(self.convolutions, widths):
                # Only positions where the filter lies inside the row are valid (a "valid" convolution).
                valid = min(positions, num_chars - width + 1)
                chunk.append(features[:, :valid, column : column + conv.out_channels].amax(dim=1))
                column += conv.out_channels
            pooled.append(torch.cat(chunk, dim=-1))
            start = end
        if not pooled:
            return kernel.new_zeros(0, kernel.shape[1])
        return torch.cat(pooled)[torch.argsort(order)]


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
        self,
        tokens: torch.Tensor,
        mask: torch.Tensor,
        state: tuple[torch.Tensor, torch.Tensor],
        output_layers: tuple[int, ...] | None = None,
        words_only: bool = False,
    ) -> tuple[list[torch.Tensor], tuple[torch.Tensor, torch.Tensor]]:
        """
        tokens `(batch, time, projection_dim)`, mask `(batch, time)` prefix, state `(cell, hidden)` shaped
        `(layers, 2, batch, ·)`. Returns a `(batch, time, 2 * projection_dim)` tensor for each layer index in
        `output_layers` (all layers by default), zero past each row's length, and the final state. With
        `words_only`, each row's first and last position (`<S>`, `</S>`) are left out: `(batch, time - 2, ·)`.
        Only the layers asked for are laid out, which is most of this module's output memory.
        """
        if output_layers is None:
            output_layers = tuple(range(len(self.forward_layers)))
        if self.use_fast_path:
            return self._fast_forward(tokens, mask, state, output_layers, words_only)
        # The reference path: the specification of the biLSTM, and the oracle of the fast path's tests.
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
        for index in output_layers:
            output = torch.cat([directions[0][index], directions[1][index]], dim=-1)
            if words_only:
                # Word w sits at position w + 1; it is a word (not </S>) while w + 2 < length.
                output = output[:, 1:-1] * mask[:, 2:, None]
            layer_outputs.append(output)
        return layer_outputs, (torch.stack(final_cells, dim=1), torch.stack(final_hiddens, dim=1))

    # Fast path (the default): the same function as the reference path above, on the same parameters. Each step
    # computes only the rows still reading: rows are sorted longest first and packed time-major, so those rows are
    # a prefix. Select the reference path with `use_fast_path = False`.
    use_fast_path = True
    # Values of input gates computed by one matmul: larger blocks reuse each read of the input weights for more
    # positions, smaller ones bound the memory. 2M values (8 MB in fp32) is 128 positions of "original", as fast
    # as 256 (measured) and half the memory.
    input_gates_block_values = 1 << 21
    # The first layer's input gates are computed once per distinct word of the batch (a table the steps gather
    # from) when the table has at most this many values: 4M (16 MB) is 256 distinct words of "original". Worth
    # ~18% of "original"'s speed on the benchmark's batches; past the bound, blocks as in the other layers.
    input_gates_table_values = 1 << 22

    def _fast_forward(
        self,
        tokens: torch.Tensor,
        mask: torch.Tensor,
        state: tuple[torch.Tensor, torch.Tensor],
        output_layers: tuple[int, ...],
        words_only: bool,
    ) -> tuple[list[torch.Tensor], tuple[torch.Tensor, torch.Tensor]]:
        batch_size, num_steps, width = tokens.shape
        lengths = mask.sum(dim=1)
        order = torch.argsort(lengths, descending=True, stable=True)
        sorted_lengths = lengths[order]
        host_lengths = sorted_lengths.tolist()
        # rows_at[t]: how many (sorted) rows read step t.
        rows_at, rows = [], batch_size
        for step in range(host_lengths[0] if host_lengths else 0):
            while host_lengths[rows - 1] <= step:
                rows -= 1
            rows_at.append(rows)
        # Packed time-major order: step 0 of every reading row, then step 1, ... Each position's source in the
        # padded (batch * time) layout: forward reads step t, backward reads step length - 1 - t.
        reading = torch.arange(len(rows_at), device=tokens.device)[:, None] < sorted_lengths
        step_index, row_index = reading.nonzero(as_tuple=True)
        source = order[row_index] * num_steps
        forward_source = source + step_index
        backward_source = source + sorted_lengths[row_index] - 1 - step_index
        flat = tokens.reshape(batch_size * num_steps, width)
        distinct = None
        if self._works_in_place(tokens):
            # The first layer reads the token layer, where every occurrence of a word is the same vector: its input
            # gates are computed once per distinct vector, into a table that the steps gather from, when the table
            # is small enough. (Inference only: with autograd, equal rows may come from different sources, and
            # each must get its own gradient.)
            distinct_rows, forward_row = torch.unique(flat[forward_source], dim=0, return_inverse=True)
            gate_values = self.forward_layers[0].input_proj.out_features
            if distinct_rows.shape[0] * gate_values <= self.input_gates_table_values:
                row_of = forward_row.new_empty(batch_size * num_steps)
                row_of[forward_source] = forward_row
                distinct = (distinct_rows, torch.stack([forward_row, row_of[backward_source]]))
        # The first layer's inputs `(2, positions, width)`, unless it reads the table.
        layer_input = None if distinct is not None else torch.stack([flat[forward_source], flat[backward_source]])

        packed_outputs, final_cells, final_hiddens, workspace = [], [], [], {}
        for index in range(len(self.forward_layers)):
            initial = (state[0][index][:, order], state[1][index][:, order])
            layer = self.forward_layers[index]
            if layer.gradient_checkpointing and self.training:
                run = functools.partial(self._fast_layer, index, rows_at=rows_at)
                output, cell, hidden = layer._gradient_checkpointing_func(run, layer_input, *initial)
            else:
                output, cell, hidden = self._fast_layer(
                    index, layer_input, *initial, rows_at, distinct if index == 0 else None, workspace
                )
            if index == 0:
                # Only the first layer reads the table.
                workspace.pop("table", None)
                workspace.pop("gathered", None)
            if index > 0 and self.use_skip_connections:
                output = output.add_(layer_input) if not torch.is_grad_enabled() else output + layer_input
            # A layer that is not asked for is freed once the next one has read it.
            packed_outputs.append(output if index in output_layers else None)
            final_cells.append(cell)
            final_hiddens.append(hidden)
            layer_input = output

        workspace.clear()  # before the padded outputs are allocated
        # Unpack straight into the padded output layout (zeros past each row's length), backward outputs back in
        # reading order. Without the first and last positions, those land in one spare row past the end.
        out_steps = num_steps - 2 if words_only else num_steps
        steps = torch.stack([step_index, sorted_lengths[row_index] - 1 - step_index])  # (2, positions)
        target = order[row_index] * out_steps + steps
        if words_only:
            is_word = (steps >= 1) & (steps <= sorted_lengths[row_index] - 2)
            target = torch.where(is_word, target - 1, batch_size * out_steps)
        half = torch.arange(2, device=tokens.device)[:, None].expand_as(target)
        layer_outputs = []
        for index in output_layers:
            output = packed_outputs[index]
            unpacked = output.new_zeros(batch_size * out_steps + words_only, 2, width)
            unpacked.index_put_((target.flatten(), half.flatten()), output.flatten(0, 1))
            layer_outputs.append(unpacked[: batch_size * out_steps].view(batch_size, out_steps, 2 * width))
        restore = torch.argsort(order)
        return layer_outputs, (torch.stack(final_cells)[:, :, restore], torch.stack(final_hiddens)[:, :, restore])

    def _fast_layer(
        self,
        index: int,
        inputs: torch.Tensor,
        cell: torch.Tensor,
        hidden: torch.Tensor,
        rows_at: list[int],
        distinct: tuple[torch.Tensor, torch.Tensor] | None = None,
        workspace: dict | None = None,
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """
        Layer `index` of both directions on packed inputs `(2, positions, projection_dim)` from the initial state
        `(2, batch, ·)` (rows sorted longest first). Returns the packed outputs and each row's final state.
        `distinct`, working in place only: the distinct input rows and, per direction, each position's row; the
        inputs are then read from those alone (`inputs` may be None).
        """
        layers = (self.forward_layers[index], self.backward_layers[index])
        # Working in place, both directions write their outputs straight into one tensor.
        out = None
        if workspace is not None and self._works_in_place(hidden):
            out = hidden.new_empty(2, sum(rows_at), hidden.shape[-1])
        results = [
            self._fast_direction(
                layers[d],
                None if inputs is None else inputs[d],
                cell[d],
                hidden[d],
                rows_at,
                None if distinct is None else (distinct[0], distinct[1][d]),
                {} if workspace is None else workspace,
                None if out is None else out[d],
            )
            for d in range(2)
        ]
        outputs, cells, hiddens = zip(*results)
        return (torch.stack(outputs) if out is None else out), torch.stack(cells), torch.stack(hiddens)

    @staticmethod
    def _works_in_place(tensor: torch.Tensor) -> bool:
        # Under autocast the `out=` buffers would keep fp32 while autocast hands the matmuls bf16 operands.
        return not torch.is_grad_enabled() and not torch.is_autocast_enabled(tensor.device.type)

    def _fast_direction(
        self,
        layer: ElmoLstmLayer,
        inputs: torch.Tensor,
        cell: torch.Tensor,
        hidden: torch.Tensor,
        rows_at: list[int],
        distinct: tuple[torch.Tensor, torch.Tensor] | None = None,
        workspace: dict | None = None,
        out: torch.Tensor | None = None,
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """
        `layer` over packed inputs `(positions, projection_dim)` from the initial state `(batch, ·)`.

        One direction at a time: every step reads the whole recurrent and projection weights, and one direction's
        (40 MB for "original") stays in cache better than both directions' (measured ~13% faster than stepping the
        two together, and no stacked copy of the weights). Inside, vectors are columns (feature-major): the
        matmuls are then `weight @ states`, the shape that runs fastest on few rows, and dropping finished rows
        is a column slice.
        """
        lstm_dim = cell.shape[-1]
        # TensorFlow's forget bias is folded into the stored bias once instead of being added at every step.
        bias = layer.input_proj.bias
        bias = torch.cat([bias[: 2 * lstm_dim], bias[2 * lstm_dim : 3 * lstm_dim] + FORGET_GATE_BIAS, bias[3 * lstm_dim :]])
        bias = bias[:, None]
        cell, hidden = cell.t(), hidden.t()  # (lstm_dim, batch), (proj, batch)
        inputs = None if inputs is None else inputs.t()  # (proj, positions)
        batch_size, positions = cell.shape[1], sum(rows_at)
        block_positions = max(1, self.input_gates_block_values // (4 * lstm_dim))
        # Without autograd, each step completes its gates inside the input-gate buffer, updates the state in place
        # and writes its outputs into the result: no new tensors a step (faster, and flat memory).
        in_place = self._works_in_place(cell)
        if in_place:
            # Scratch buffers, shared by every layer and direction of this forward (fewer large allocations).
            def scratch(name: str, size: int) -> torch.Tensor:
                if name not in workspace or workspace[name].numel() < size:
                    workspace[name] = cell.new_empty(size)
                return workspace[name][:size]

            gates_buffer = scratch("gates", 4 * lstm_dim * batch_size)
            cell_buffers = [scratch(name, lstm_dim * batch_size) for name in ("cell_a", "cell_b")]
            # The state lives in contiguous feature-major buffers; each step's hidden state is then copied into
            # the (position-major) result: the projection writing straight into it runs ~40% slower.
            hidden_buffers = [scratch(name, hidden.shape[0] * batch_size) for name in ("hidden_a", "hidden_b")]
            packed = hidden.new_empty(positions, hidden.shape[0]) if out is None else out  # (positions, projection_dim)
            final_cell, final_hidden = torch.empty_like(cell), torch.empty_like(hidden)
            # Input gates of each distinct input row `(distinct, 4 * lstm_dim)`; each step gathers its rows.
            table = None
            if distinct is not None:
                table = scratch("table", 4 * lstm_dim * distinct[0].shape[0]).view(-1, 4 * lstm_dim)
                # In chunks, with the matmul shape of the blocks (an odd shape makes MKL keep extra buffers).
                for chunk, rows in zip(table.split(batch_size), distinct[0].split(batch_size)):
                    part = gates_buffer[: 4 * lstm_dim * rows.shape[0]].view(4 * lstm_dim, -1)
                    chunk.copy_(torch.addmm(bias, layer.input_proj.weight, rows.t(), out=part).t())
                gathered_buffer = scratch("gathered", batch_size * 4 * lstm_dim)
        else:
            outputs, finished_cells, finished_hiddens = [], [], []

        block_start = block_end = offset = 0
        input_gates = None
        for step_index, rows in enumerate(rows_at):
            if rows < hidden.shape[1]:
                # Rows past their length: their state is final.
                if in_place:
                    final_cell[:, rows : hidden.shape[1]] = cell[:, rows:]
                    final_hidden[:, rows : hidden.shape[1]] = hidden[:, rows:]
                else:  # copies, so as not to keep whole steps alive
                    finished_cells.append(cell[:, rows:].clone())
                    finished_hiddens.append(hidden[:, rows:].clone())
                cell, hidden = cell[:, :rows], hidden[:, :rows]
            if offset + rows > block_end and not (in_place and table is not None):
                # The input part of the gates, for the next block of positions at once.
                block_start, block_end = offset, min(offset + block_positions, positions)
                block_end = max(block_end, offset + rows)
                width, block = block_end - block_start, inputs[:, block_start:block_end]
                input_gates = None
                if in_place and width <= block_positions:
                    buffer = scratch("input_gates", 4 * lstm_dim * block_positions)[: 4 * lstm_dim * width]
                    buffer = buffer.view(4 * lstm_dim, width)
                    input_gates = torch.addmm(bias, layer.input_proj.weight, block, out=buffer)
                else:
                    input_gates = torch.addmm(bias, layer.input_proj.weight, block)
            step = slice(offset - block_start, offset - block_start + rows)
            if in_place:
                if table is not None:
                    gathered = gathered_buffer[: rows * 4 * lstm_dim].view(rows, 4 * lstm_dim)
                    input_part = torch.index_select(table, 0, distinct[1][offset : offset + rows], out=gathered).t()
                else:
                    input_part = input_gates[:, step]
                gates = gates_buffer[: 4 * lstm_dim * rows].view(4 * lstm_dim, rows)
                new_cell = cell_buffers[step_index % 2][: lstm_dim * rows].view(lstm_dim, rows)
                new_hidden = hidden_buffers[step_index % 2][: hidden.shape[0] * rows].view(-1, rows)
                cell, hidden = self._step_in_place(layer, input_part, cell, hidden, gates, new_cell, new_hidden)
                packed[offset : offset + rows].copy_(hidden.t())
            else:
                cell, hidden = self._step(layer, input_gates[:, step], cell, hidden)
                outputs.append(hidden)
            offset += rows
        if in_place:
            final_cell[:, : cell.shape[1]] = cell
            final_hidden[:, : hidden.shape[1]] = hidden
            return packed, final_cell.t(), final_hidden.t()
        final_cell = torch.cat([cell, *reversed(finished_cells)], dim=1).t()
        final_hidden = torch.cat([hidden, *reversed(finished_hiddens)], dim=1).t()
        packed = torch.cat(outputs, dim=1) if outputs else hidden.new_zeros(hidden.shape[0], 0)
        return packed.t(), final_cell, final_hidden

    @staticmethod
    def _step(layer: ElmoLstmLayer, input_part, cell, hidden):
        """One step, feature-major: input part of the gates `(4 * lstm_dim, rows)`, `cell` `(lstm_dim, rows)`..."""
        gates = few_column_matmul(layer.recurrent_proj.weight, hidden, add=input_part)
        in_gate, candidate, forget_gate, out_gate = gates.chunk(4, dim=0)
        cell = torch.sigmoid(forget_gate) * cell + torch.sigmoid(in_gate) * torch.tanh(candidate)
        if layer.cell_clip is not None:
            cell = cell.clamp(-layer.cell_clip, layer.cell_clip)
        hidden = torch.sigmoid(out_gate) * torch.tanh(cell)
        if isinstance(layer.output_proj, nn.Linear):
            hidden = few_column_matmul(layer.output_proj.weight, hidden)
        if layer.proj_clip is not None:
            hidden = hidden.clamp(-layer.proj_clip, layer.proj_clip)
        return cell, hidden

    @staticmethod
    def _step_in_place(layer: ElmoLstmLayer, input_part, cell, hidden, gates, new_cell, new_hidden):
        """
        `_step` without autograd, writing into the buffers `gates` `(4 * lstm_dim, rows)`, `new_cell` and
        `new_hidden` (not into `cell` and `hidden`, which it reads). Contiguous gates make the element-wise work
        ~4x faster than working in place on a column slice of the input gates.
        """
        few_column_matmul(layer.recurrent_proj.weight, hidden, gates, add=input_part)
        in_gate, candidate, forget_gate, out_gate = gates.chunk(4, dim=0)
        in_gate.sigmoid_()
        gates[2 * cell.shape[0] :].sigmoid_()  # forget and output gates
        candidate.tanh_()
        torch.mul(forget_gate, cell, out=new_cell)
        new_cell.addcmul_(in_gate, candidate)
        if layer.cell_clip is not None:
            new_cell.clamp_(-layer.cell_clip, layer.cell_clip)
        output = torch.tanh(new_cell, out=candidate).mul_(out_gate)  # candidate is spent: reuse its rows
        if isinstance(layer.output_proj, nn.Linear):
            few_column_matmul(layer.output_proj.weight, output, new_hidden)
        else:
            new_hidden.copy_(output)
        if layer.proj_clip is not None:
            new_hidden.clamp_(-layer.proj_clip, layer.proj_clip)
        return new_cell, new_hidden


class ElmoPreTrainedModel(PreTrainedModel):
    config_class = ElmoConfig
    config: ElmoConfig
    base_model_prefix = "elmo"
    main_input_name = "input_ids"
    supports_gradient_checkpointing = True
    _no_split_modules = ["ElmoCharacterEncoder", "ElmoLstmLayer"]

    def _init_weights(self, module):
        super()._init_weights(module)
        if isinstance(module, ElmoHighwayGate):
            # Start highways close to the identity (carry the input), as bilm-tf initialises them.
            init.constant_(module.bias, -2.0)

    # --- Hub tooling (hf-elmo publish / trust_remote_code): every saved folder has a tokenizer -------------------
    def save_pretrained(self, save_directory, *args, is_main_process: bool = True, **kwargs):
        """
        `PreTrainedModel.save_pretrained`, plus the default `ElmoTokenizer` of this model when the folder has no
        tokenizer yet. ELMo's tokenizer needs nothing but the config, so this makes every saved ELMo folder (a
        Trainer checkpoint, a model saved alone) load with `AutoTokenizer.from_pretrained(folder,
        trust_remote_code=True)`. A tokenizer saved into the folder, before or after, takes precedence.
        """
        folder = os.fspath(save_directory)
        if is_main_process and not os.path.isfile(folder) and not os.path.isfile(
            os.path.join(folder, "tokenizer_config.json")
        ):
            # Written first so that save_pretrained(push_to_hub=True) uploads it too. This relative import also
            # makes Transformers copy tokenization_elmo.py with this file (saving and trust_remote_code loading).
            from .tokenization_elmo import ElmoTokenizer

            os.makedirs(folder, exist_ok=True)
            # Without hf_elmo (remote code), the class is only registered if AutoTokenizer loaded it.
            ElmoTokenizer.register_for_auto_class("AutoTokenizer")
            ElmoTokenizer(max_characters_per_token=self.config.max_characters_per_token).save_pretrained(folder)
        return super().save_pretrained(save_directory, *args, is_main_process=is_main_process, **kwargs)


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
        vectors = self.char_encoder(torch.cat([self.boundary_char_ids(input_ids.device), input_ids[mask]]))
        boundary_vectors, word_vectors = vectors[:2], vectors[2:]

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
        num_layers = self.config.num_lstm_layers
        output_layers = tuple(range(num_layers)) if output_hidden_states else (num_layers - 1,)
        lstm_outputs, final_state = self.bilstm(
            tokens, sequence_mask, state, output_layers=output_layers, words_only=not keep_sentence_boundaries
        )

        layers = lstm_outputs
        if output_hidden_states:
            # The token layer is context-free: the same vector for both directions.
            if keep_sentence_boundaries:
                token_layer = torch.cat([tokens, tokens], dim=-1)
            else:
                token_layer = word_vectors.new_zeros(batch_size, num_words, 2 * word_vectors.shape[-1])
                token_layer[mask] = torch.cat([word_vectors, word_vectors], dim=-1)
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

# pipeline_elmo.py holds the token-classification pipeline that `config.custom_pipelines` points to.
# Transformers copies the files named in one-level relative imports along with this one (save_pretrained,
# trust_remote_code), so naming it here is what makes every saved folder carry it. Never imported at run time.
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
            lengths = mask.sum(dim=1).clamp(min=1).cpu()
            packed = nn.utils.rnn.pack_padded_sequence(features, lengths, batch_first=True, enforce_sorted=False)
            output, _ = self.lstm(packed)
            output, _ = nn.utils.rnn.pad_packed_sequence(output, batch_first=True, total_length=mask.shape[1])
            features = self.dropout(output * mask.unsqueeze(-1).to(output.dtype))
        return features


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

    def elmo_layers(self, input_ids, attention_mask):
        """All biLM layers and the word mask; without autograd when no biLM weight is trainable."""
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
    linear classifier. Word i of the input is position i of `logits` (the model adds `<S>`/`</S>` itself), so
    word-level labels need no alignment. Loss: cross-entropy over labels that are not -100.
    """

    def __init__(self, config: ElmoConfig):
        super().__init__(config)
        self.num_labels = config.num_labels
        # The stock pipeline cannot read per-word char ids; this makes pipeline(..., trust_remote_code=True) use ours.
        config.custom_pipelines = {**(getattr(config, "custom_pipelines", None) or {}), **ELMO_CUSTOM_PIPELINES}
        self.elmo = ElmoModel(config)
        self.encoder = ElmoTaskEncoder(config)
        self.classifier = nn.Linear(self.encoder.output_size, config.num_labels)
        self.post_init()

    @can_return_tuple
    def forward(
        self,
        input_ids: torch.LongTensor,
        attention_mask: torch.Tensor | None = None,
        labels: torch.LongTensor | None = None,
        output_hidden_states: bool | None = None,
        num_items_in_batch: torch.Tensor | int | None = None,
        **kwargs,
    ) -> TokenClassifierOutput:
        r"""
        labels (`torch.LongTensor` of shape `(batch_size, num_words)`, *optional*):
            Label id of each word in `[0, num_labels)`; -100 for words to ignore and for padding.
        num_items_in_batch (`int` or `torch.Tensor`, *optional*):
            Number of labels != -100 in the whole accumulated batch (passed by the Trainer); the loss is divided by
            it instead of by this batch's count.
        """
        layers, mask = self.elmo_layers(input_ids, attention_mask)
        logits = self.classifier(self.encoder(layers, mask))

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
            loss_sum = nn.functional.cross_entropy(logits[labelled].float(), labels[labelled], reduction="sum")
            loss = self.normalised_loss(loss_sum, labelled.sum(), num_items_in_batch)

        if output_hidden_states is None:
            output_hidden_states = self.config.output_hidden_states
        return TokenClassifierOutput(loss=loss, logits=logits, hidden_states=layers if output_hidden_states else None)


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
        if pooling == "mean":
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
        input_ids: torch.LongTensor,
        attention_mask: torch.Tensor | None = None,
        labels: torch.Tensor | None = None,
        output_hidden_states: bool | None = None,
        num_items_in_batch: torch.Tensor | int | None = None,
        **kwargs,
    ) -> SequenceClassifierOutput:
        r"""
        labels (`torch.Tensor`, *optional*):
            Single-label: class ids `(batch_size,)` (-100 ignores a sentence). Multi-label: 0/1 floats
            `(batch_size, num_labels)`. Regression: floats `(batch_size,)` or `(batch_size, num_labels)`.
        num_items_in_batch (`int` or `torch.Tensor`, *optional*):
            Number of labels (!= -100) in the whole accumulated batch (passed by the Trainer).
        """
        layers, mask = self.elmo_layers(input_ids, attention_mask)
        logits = self.classifier(self.pool(self.encoder(layers, mask), mask))
        loss = None if labels is None else self.sequence_loss(logits, labels, num_items_in_batch)
        if output_hidden_states is None:
            output_hidden_states = self.config.output_hidden_states
        return SequenceClassifierOutput(loss=loss, logits=logits, hidden_states=layers if output_hidden_states else None)


__all__ = ["ElmoPreTrainedModel", "ElmoModel", "ElmoModelOutput", "ElmoCharacterEncoder", "ElmoHighway",
           "ElmoLstmLayer", "ElmoBiLstm",
           "ElmoScalarMix", "ElmoTaskEncoder", "ElmoTaskPreTrainedModel", "ElmoForTokenClassification",
           "ElmoForSequenceClassification"]


# ---------------------------------------------------------------------------------------------
# Pretraining: ElmoForPreTraining, the forward and backward language models of bilm-tf over a word vocabulary.
# ---------------------------------------------------------------------------------------------
def sample_log_uniform_candidates(num_samples: int, vocab_size: int) -> tuple[torch.Tensor, int]:
    """
    `num_samples` distinct word ids drawn from the log-uniform (Zipfian) distribution
    `P(k) = log((k + 2) / (k + 1)) / log(vocab_size + 1)` by rejection, as TensorFlow's `log_uniform_candidate_sampler`
    with `unique=True` does. Returns the ids in order of first draw and the number of draws it took (which the
    expected counts need). Uses the global CPU random generator, so checkpointed RNG state replays it.
    """
    log_range = math.log(vocab_size + 1)
    draws = torch.empty(0, dtype=torch.long)
    while True:
        uniform = torch.rand(num_samples, dtype=torch.float64)
        new = (torch.exp(uniform * log_range).long() - 1).clamp_(0, vocab_size - 1)
        draws = torch.cat([draws, new])
        unique, inverse = torch.unique(draws, return_inverse=True)
        if unique.numel() >= num_samples:
            break
    positions = torch.arange(draws.numel())
    first = torch.full((unique.numel(),), draws.numel(), dtype=torch.long).scatter_reduce(
        0, inverse, positions, reduce="amin"
    )
    first = first.sort().values[:num_samples]
    return draws[first], int(first[-1]) + 1


def log_uniform_expected_count(ids: torch.Tensor, vocab_size: int, num_samples: int, num_tries: int) -> torch.Tensor:
    """Expected number of times each id appears among the samples: TensorFlow's `ExpectedCountHelper`."""
    ids = ids.to(torch.float64)
    probability = (torch.log(ids + 2) - torch.log(ids + 1)) / math.log(vocab_size + 1)
    if num_tries == num_samples:
        return probability * num_samples
    return -torch.expm1(num_tries * torch.log1p(-probability))


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
        self.softmax = nn.Linear(config.projection_dim, config.vocab_size)
        self.post_init()

    def _init_weights(self, module):
        super()._init_weights(module)
        if module is getattr(self, "softmax", None):
            # bilm-tf's softmax initialisation.
            init.normal_(module.weight, mean=0.0, std=self.config.projection_dim**-0.5)
            init.zeros_(module.bias)

    def get_input_embeddings(self) -> nn.Embedding:
        return self.elmo.get_input_embeddings()

    def set_input_embeddings(self, value: nn.Embedding):
        self.elmo.set_input_embeddings(value)

    @property
    def uses_sampled_softmax(self) -> bool:
        return self.training and 0 < self.config.num_softmax_samples < self.config.vocab_size

    def lm_targets(self, labels: torch.Tensor, word_mask: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """
        Per-position targets `(batch, num_words + 2)` of the forward and backward LM from word labels
        `(batch, num_words)` and the boundary-layout `word_mask`; -100 where nothing is predicted.
        """
        batch_size, num_words = labels.shape
        lengths = word_mask.sum(dim=1) - 2
        rows = torch.arange(batch_size, device=labels.device)
        forward_targets = labels.new_full((batch_size, num_words + 2), -100)
        forward_targets[:, :num_words] = labels
        forward_targets[rows, lengths] = self.config.eos_word_id
        backward_targets = labels.new_full((batch_size, num_words + 2), -100)
        backward_targets[:, 2:] = labels
        backward_targets[:, 1] = self.config.bos_word_id
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
        if bad.any():
            b, i = (int(v) for v in bad.nonzero()[0])
            raise ValueError(
                f"labels[{b}, {i}] = {int(labels[b, i])} is not a word id in [0, {self.config.vocab_size}) "
                "(config.vocab_size) nor -100 (ignored)."
            )
        return labels

    def _full_softmax_losses(self, hidden: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        # In row chunks so that evaluating a large vocabulary never holds (positions x vocab) scores at once.
        chunk = max(1, 2**25 // self.config.vocab_size)
        losses = [
            nn.functional.cross_entropy(self.softmax(h).float(), t, reduction="none")
            for h, t in zip(hidden.split(chunk), targets.split(chunk))
        ]
        return torch.cat(losses) if losses else hidden.new_zeros(0, dtype=torch.float32)

    def _sampled_softmax_losses(self, hidden: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        vocab_size, num_samples = self.config.vocab_size, self.config.num_softmax_samples
        candidates, num_tries = sample_log_uniform_candidates(num_samples, vocab_size)
        candidates = candidates.to(targets.device)
        log_q_sampled = log_uniform_expected_count(candidates, vocab_size, num_samples, num_tries).log()
        log_q_true = log_uniform_expected_count(targets, vocab_size, num_samples, num_tries).log()
        weight, bias = self.softmax.weight, self.softmax.bias
        true_logits = (hidden * weight[targets]).sum(-1) + bias[targets] - log_q_true.to(hidden.dtype)
        sampled_logits = hidden @ weight[candidates].t() + bias[candidates] - log_q_sampled.to(hidden.dtype)
        # A negative that happens to be the target would be counted against itself.
        sampled_logits = sampled_logits.float().masked_fill(candidates[None, :] == targets[:, None], float("-inf"))
        logits = torch.cat([true_logits.float()[:, None], sampled_logits], dim=1)
        return nn.functional.cross_entropy(logits, targets.new_zeros(targets.shape), reduction="none")

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
        forward_keep, backward_keep = forward_targets != -100, backward_targets != -100
        hidden = torch.cat([forward_hidden[forward_keep], backward_hidden[backward_keep]])
        targets = torch.cat([forward_targets[forward_keep], backward_targets[backward_keep]])
        if self.uses_sampled_softmax:
            losses = self._sampled_softmax_losses(hidden, targets)
        else:
            losses = self._full_softmax_losses(hidden, targets)
        forward_losses, backward_losses = losses.split([int(forward_keep.sum()), int(backward_keep.sum())])
        result.forward_loss = forward_losses.mean()
        result.backward_loss = backward_losses.mean()
        result.loss = (result.forward_loss + result.backward_loss) / 2
        result.num_predictions = forward_keep.sum()
        return result


__all__ += ["ElmoForPreTraining", "ElmoForPreTrainingOutput"]
