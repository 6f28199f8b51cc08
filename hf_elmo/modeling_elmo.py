"""PyTorch ELMo: the bilm-tf bidirectional language model as a Transformers model.

Data flows top to bottom in this file: char ids -> `ElmoCharacterEncoder` (char CNN, highway,
projection) -> `ElmoBiLstm` (stacked `ElmoLstmLayer`s per direction) -> `ElmoModel`.
"""

import functools
from collections import OrderedDict
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
        self, tokens: torch.Tensor, mask: torch.Tensor, state: tuple[torch.Tensor, torch.Tensor]
    ) -> tuple[list[torch.Tensor], tuple[torch.Tensor, torch.Tensor]]:
        """
        tokens `(batch, time, projection_dim)`, mask `(batch, time)` prefix, state `(cell, hidden)` shaped
        `(layers, 2, batch, ·)`. Returns one `(batch, time, 2 * projection_dim)` tensor per layer and the final state.
        """
        if self.use_fast_path:
            return self._fast_forward(tokens, mask, state)
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
        for forward_output, backward_output in zip(*directions):
            layer_outputs.append(torch.cat([forward_output, backward_output], dim=-1))
        return layer_outputs, (torch.stack(final_cells, dim=1), torch.stack(final_hiddens, dim=1))

    # Fast path (the default): the same function as the reference path above, on the same parameters. Each step
    # computes only the rows still reading: rows are sorted longest first and packed time-major, so those rows are
    # a prefix. Select the reference path with `use_fast_path = False`.
    use_fast_path = True
    # Values of input gates computed by one matmul: larger blocks reuse each read of the input weights for more
    # positions (faster), smaller ones bound the memory; 4M values (16 MB in fp32) is 256 positions of "original".
    input_gates_block_values = 1 << 22

    def _fast_forward(
        self, tokens: torch.Tensor, mask: torch.Tensor, state: tuple[torch.Tensor, torch.Tensor]
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
        layer_input = torch.stack([flat[forward_source], flat[backward_source]])  # (2, positions, width)
        distinct = None
        if not torch.is_grad_enabled():
            # The first layer reads the token layer, where every occurrence of a word is the same vector: its input
            # gates are computed once per distinct vector. (Inference only: with autograd, equal rows may come from
            # different sources, and each must get its own gradient.)
            rows, forward_row = torch.unique(layer_input[0], dim=0, return_inverse=True)
            row_of = forward_row.new_empty(batch_size * num_steps)
            row_of[forward_source] = forward_row
            distinct = (rows, torch.stack([forward_row, row_of[backward_source]]))

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
            if index > 0 and self.use_skip_connections:
                output = output + layer_input
            packed_outputs.append(output)
            final_cells.append(cell)
            final_hiddens.append(hidden)
            layer_input = output

        # Unpack into the padded layout (zeros past each row's length), backward outputs back in reading order.
        target = torch.cat([forward_source, backward_source])
        half = torch.arange(2, device=tokens.device).repeat_interleave(forward_source.shape[0])
        layer_outputs = [
            output.new_zeros(batch_size * num_steps, 2, width)
            .index_put_((target, half), output.flatten(0, 1))
            .view(batch_size, num_steps, 2 * width)
            for output in packed_outputs
        ]
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
        `distinct`, without autograd only: the distinct input rows and, per direction, each position's row.
        """
        layers = (self.forward_layers[index], self.backward_layers[index])
        results = [
            self._fast_direction(
                layers[d],
                inputs[d],
                cell[d],
                hidden[d],
                rows_at,
                None if distinct is None else (distinct[0], distinct[1][d]),
                {} if workspace is None else workspace,
            )
            for d in range(2)
        ]
        return tuple(torch.stack(parts) for parts in zip(*results))

    def _fast_direction(
        self,
        layer: ElmoLstmLayer,
        inputs: torch.Tensor,
        cell: torch.Tensor,
        hidden: torch.Tensor,
        rows_at: list[int],
        distinct: tuple[torch.Tensor, torch.Tensor] | None = None,
        workspace: dict | None = None,
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
        cell, hidden, inputs = cell.t(), hidden.t(), inputs.t()  # (lstm_dim, batch), (proj, batch), (proj, positions)
        batch_size, positions = cell.shape[1], inputs.shape[1]
        block_positions = max(1, self.input_gates_block_values // (4 * lstm_dim))
        # Without autograd, each step completes its gates inside the input-gate buffer, updates the state in place
        # and writes its outputs into the result: no new tensors a step (faster, and flat memory).
        in_place = not torch.is_grad_enabled()
        if in_place:
            # Scratch buffers, shared by every layer and direction of this forward (fewer large allocations).
            def scratch(name: str, size: int) -> torch.Tensor:
                if name not in workspace or workspace[name].numel() < size:
                    workspace[name] = cell.new_empty(size)
                return workspace[name][:size]

            input_gates_buffer = scratch("input_gates", 4 * lstm_dim * block_positions)
            gates_buffer = scratch("gates", 4 * lstm_dim * batch_size)
            cell_buffers = [scratch(name, lstm_dim * batch_size) for name in ("cell_a", "cell_b")]
            packed = hidden.new_empty(positions, hidden.shape[0])  # (positions, projection_dim)
            final_cell, final_hidden = torch.empty_like(cell), torch.empty_like(hidden)
            # Input gates of each distinct input row `(distinct, 4 * lstm_dim)`, when they fit in the memory of one
            # block of positions; each step gathers its rows.
            table = None
            if distinct is not None and distinct[0].shape[0] <= block_positions:
                table = input_gates_buffer[: 4 * lstm_dim * distinct[0].shape[0]].view(-1, 4 * lstm_dim)
                # In chunks, with the matmul shape of the blocks (an odd shape makes MKL keep extra buffers).
                for chunk, rows in zip(table.split(64), distinct[0].split(64)):
                    part = scratch("table_part", 4 * lstm_dim * rows.shape[0]).view(4 * lstm_dim, -1)
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
                    buffer = input_gates_buffer[: 4 * lstm_dim * width].view(4 * lstm_dim, width)
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
                new_hidden = packed[offset : offset + rows].t()
                cell, hidden = self._step_in_place(layer, input_part, cell, hidden, gates, new_cell, new_hidden)
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
        gates = torch.addmm(input_part, layer.recurrent_proj.weight, hidden)
        in_gate, candidate, forget_gate, out_gate = gates.chunk(4, dim=0)
        cell = torch.sigmoid(forget_gate) * cell + torch.sigmoid(in_gate) * torch.tanh(candidate)
        if layer.cell_clip is not None:
            cell = cell.clamp(-layer.cell_clip, layer.cell_clip)
        hidden = torch.sigmoid(out_gate) * torch.tanh(cell)
        if isinstance(layer.output_proj, nn.Linear):
            hidden = layer.output_proj.weight @ hidden
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
        torch.addmm(input_part, layer.recurrent_proj.weight, hidden, out=gates)
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
            torch.mm(layer.output_proj.weight, output, out=new_hidden)
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
        lstm_outputs, final_state = self.bilstm(tokens, sequence_mask, state)

        # Every layer is already zero past each row's </S> (tokens and LSTM outputs alike).
        layers = [torch.cat([tokens, tokens], dim=-1), *lstm_outputs] if output_hidden_states else lstm_outputs[-1:]
        if keep_sentence_boundaries:
            out_mask = sequence_mask
        else:
            # Dropping <S> and the last position leaves the </S> of shorter rows inside: mask it out.
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
