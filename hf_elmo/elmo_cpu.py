"""The "cpu" implementation of ELMo: inference tuned for CPUs, on the modules' parameters.

Computes the function that `ElmoCharacterEncoder.forward` and `ElmoBiLstm.forward` specify (the tests hold it to
them), with fewer and better-shaped operations:

- the char CNN runs once per distinct word of a call (the token layer is context-free), as im2col matmuls over
  only the window positions that can change the max, optionally memoised across calls (`ElmoTokenCache`);
- the biLSTM packs the batch time-major, longest rows first, so each step computes only the rows still reading
  (or a few finished ones besides, where this machine's BLAS measures faster on that many columns: `cpu_tuning`);
  vectors are columns (feature-major), the matmul shape that runs fastest on few rows; each step works in
  preallocated buffers (flat memory; only a product `cpu_tuning` hands to oneDNN comes back as a new tensor); the
  first layer's input gates come from a table of the batch's distinct words.

With autograd (training on a CPU), the char CNN keeps its distinct-word path and the biLSTM runs `elmo_ops`'s
batched layers with the packed schedule: rows sorted longest first, each step computing only the rows still
reading, with the recurrence's hand-written backward. The LSTM maths itself is the model's (`modeling_elmo`).
"""

import functools
import logging

import torch
from torch import nn

from .cpu_tuning import few_column_matmul, step_columns
from .configuration_elmo import ElmoImplementation, register
from .elmo_ops import conv_kernel, longest_first, needs_autograd, packed_bilstm, pooled_windows
from .modeling_elmo import clip, fold_forget_bias, is_word_position, lstm_cell, stack_layers
from .int8_weights import Int8Linear, RecurrenceProducts, has_bf16_dot_products


logger = logging.getLogger(__name__)


# Tuning constants, one place. Each trades speed against working memory; none depends on the processor's vendor.
# Window positions per char-convolution matmul: bounds the (positions, n_filters) activation (2 MB in fp32 for
# 2048 filters) while keeping each matmul large; small temporaries also keep glibc's heap from growing.
CONV_CHUNK_POSITIONS = 256
# Words per highway/projection matmul without autograd: bounds their (words, n_filters) temporaries (2 MB each for
# 2048 filters) however many distinct words a batch has.
HIGHWAY_CHUNK_WORDS = 256
# Values of input gates computed by one matmul: larger blocks reuse each read of the input weights for more
# positions, smaller ones bound the memory. 2M values (8 MB in fp32) is 128 positions of "original".
INPUT_GATES_BLOCK_VALUES = 1 << 21
# The first layer's input gates are computed once per distinct word of the batch (a table the steps gather from)
# when the table has at most this many values: 4M (16 MB) is 256 distinct words of "original".
INPUT_GATES_TABLE_VALUES = 1 << 22
# Rows `distinct_rows` hashes and checks at a time: bounds the float64 copy the hash is computed on.
HASH_CHUNK_ROWS = 256


@functools.cache
def _warn_about_emulated_bf16() -> None:
    if not has_bf16_dot_products():
        logger.warning(
            "ELMo runs in bf16 on a CPU without bf16 matrix instructions (AVX512-BF16 or AMX): its bf16 matmuls are "
            "emulated, many times slower than fp32 (benchmarks/README.md). Keep the model in fp32 on this machine."
        )


def _check_dtype(tensor: torch.Tensor) -> None:
    dtype = torch.get_autocast_dtype("cpu") if torch.is_autocast_enabled("cpu") else tensor.dtype
    if dtype == torch.bfloat16:
        _warn_about_emulated_bf16()


# Row width -> the fixed random vector `distinct_rows` hashes rows of that width with.
_ROW_HASH_VECTORS: dict[int, torch.Tensor] = {}


def distinct_rows(rows: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """
    The distinct rows of a 2-D tensor and each row's index among them: `torch.unique(rows, dim=0,
    return_inverse=True)` up to the order of the distinct rows, several times faster (that function compares rows
    one pair at a time). Rows are grouped by a hash, their float64 dot product with a fixed random vector, and the
    grouping is then checked exactly; two different rows with one hash (never seen, but possible) send the call to
    `torch.unique`. Equal means `==` on every value, as in `torch.unique`: 0.0 and -0.0 are one value, NaN none.
    """
    if rows.shape[0] == 0:
        return rows, rows.new_zeros(0, dtype=torch.long)
    width = rows.shape[1]
    if width not in _ROW_HASH_VECTORS:
        generator = torch.Generator().manual_seed(width)
        _ROW_HASH_VECTORS[width] = torch.randn(width, generator=generator, dtype=torch.float64)
    vector = _ROW_HASH_VECTORS[width].to(rows.device)
    hashes = torch.cat([torch.mv(part.double(), vector) for part in rows.split(HASH_CHUNK_ROWS)])
    hash_values, inverse = torch.unique(hashes, return_inverse=True)
    # A row of each hash (any: they are checked to be equal below).
    first = inverse.new_empty(len(hash_values)).scatter_(0, inverse, torch.arange(len(inverse), device=rows.device))
    distinct = rows[first]
    for part, part_inverse in zip(rows.split(HASH_CHUNK_ROWS), inverse.split(HASH_CHUNK_ROWS)):
        if not torch.equal(part, distinct[part_inverse]):
            return torch.unique(rows, dim=0, return_inverse=True)
    return distinct, inverse


def token_vectors(encoder, char_ids: torch.Tensor) -> torch.Tensor:
    """`ElmoCharacterEncoder.forward`'s function, each distinct word computed once (and cached, when enabled)."""
    _check_dtype(encoder.char_embeddings.weight)
    # A word's vector depends on its characters only, so each distinct word is computed once per call.
    distinct, inverse = distinct_rows(char_ids)
    if encoder.token_cache is None or needs_autograd(encoder, char_ids):
        return _distinct_token_vectors(encoder, distinct)[inverse]
    return encoder.token_cache.vectors(encoder, distinct, functools.partial(_distinct_token_vectors, encoder))[inverse]


def _distinct_token_vectors(encoder, char_ids: torch.Tensor) -> torch.Tensor:
    pooled = _pooled_convolutions(encoder, char_ids)
    pooled.add_(torch.cat([conv.bias for conv in encoder.convolutions]))
    if torch.is_grad_enabled():
        return encoder.from_pooled(pooled)
    # In chunks: bounds the highways' temporaries however many distinct words a batch has.
    return torch.cat([encoder.from_pooled(part, in_place=True) for part in pooled.split(HIGHWAY_CHUNK_WORDS)])


def _pooled_convolutions(encoder, char_ids: torch.Tensor) -> torch.Tensor:
    """
    Max-pooled convolutions (before bias and activation) of `(words, chars)` ids, as im2col matmuls.

    A word's row ends in a run of one repeated id (the padding char). Every window that lies inside that run
    is the same window, so the max needs only the windows starting before the run plus the first one inside
    it: a 5-byte word needs 8 of the 50 positions. Words are sorted by that count and chunked, and each chunk
    computes as many positions as its longest word (extra positions repeat the run's window, which does not
    change the max). Each chunk is ONE matmul of every position's widest window (flattened) by all filters and
    one max (`elmo_ops.pooled_windows`).
    """
    num_words, num_chars = char_ids.shape
    widest = max(conv.kernel_size[0] for conv in encoder.convolutions)
    kernel = conv_kernel(encoder)
    # Positions needed per word: up to and including the first window that starts inside the trailing run.
    position = torch.arange(1, num_chars + 1, device=char_ids.device)
    run_start = ((char_ids != char_ids[:, -1:]) * position).amax(dim=1)
    needed, order = torch.sort((run_start + 1).clamp(max=num_chars))
    needed = needed.tolist()
    # Allocated at the first chunk, in its dtype (under autocast the matmul's, not the kernel's).
    pooled, start = None, 0
    while start < num_words:
        # The chunk's positions are those of its longest (last) word.
        end = start + 1
        while end < num_words and (end + 1 - start) * needed[end] <= CONV_CHUNK_POSITIONS:
            end += 1
        positions = needed[end - 1]
        ids = char_ids[order[start:end], : min(num_chars, positions + widest - 1)]
        chunk = pooled_windows(encoder, ids, positions, num_chars, kernel)
        if pooled is None:
            pooled = chunk.new_empty(num_words, chunk.shape[-1])
        pooled.index_copy_(0, order[start:end], chunk)
        start = end
    return kernel.new_zeros(0, kernel.shape[1]) if pooled is None else pooled


def bilstm(
    module,
    tokens: torch.Tensor,
    mask: torch.Tensor,
    state: tuple[torch.Tensor, torch.Tensor],
    output_layers: tuple[int, ...],
    words_only: bool,
    dropout_masks: torch.Tensor | None = None,
) -> tuple[list[torch.Tensor], tuple[torch.Tensor, torch.Tensor]]:
    """`ElmoBiLstm.forward`'s function (same arguments and results), with `module`'s parameters."""
    if dropout_masks is not None or not _works_in_place(module, tokens):
        return packed_bilstm(module, tokens, mask, state, output_layers, words_only, dropout_masks)
    batch_size, num_steps, width = tokens.shape
    order, sorted_lengths, rows_at = longest_first(mask)
    # Packed time-major order: step 0 of every reading row, then step 1, ... Each position's source in the
    # padded (batch * time) layout: forward reads step t, backward reads step length - 1 - t.
    reading = torch.arange(len(rows_at), device=tokens.device)[:, None] < sorted_lengths
    step_index, row_index = reading.nonzero(as_tuple=True)
    source = order[row_index] * num_steps
    forward_source = source + step_index
    backward_source = source + sorted_lengths[row_index] - 1 - step_index
    flat = tokens.reshape(batch_size * num_steps, width)
    # The first layer reads the token layer, where every occurrence of a word is the same vector: its input
    # gates are computed once per distinct vector, into a table that the steps gather from, when the table is
    # small enough.
    distinct = None
    distinct_inputs, forward_row = distinct_rows(flat[forward_source])
    gate_values = module.forward_layers[0].input_proj.out_features
    if distinct_inputs.shape[0] * gate_values <= INPUT_GATES_TABLE_VALUES:
        row_of = forward_row.new_empty(batch_size * num_steps)
        row_of[forward_source] = forward_row
        distinct = (distinct_inputs, torch.stack([forward_row, row_of[backward_source]]))
    del distinct_inputs  # only the table reads it: without one, freed before the layers run
    workspace = {}

    def run_layer(index, layer_input):
        if index == 0 and distinct is None:
            # The first layer's inputs `(2, positions, width)`, made here so that they are freed with this call.
            layer_input = torch.stack([flat[forward_source], flat[backward_source]])
        initial = (state[0][index][:, order], state[1][index][:, order])
        result = _layer(module, index, layer_input, *initial, rows_at, distinct if index == 0 else None, workspace)
        # Only the first layer reads the table.
        workspace.pop("table", None)
        workspace.pop("gathered", None)
        return result

    packed_outputs, final_cells, final_hiddens = stack_layers(
        run_layer, None, len(module.forward_layers), module.use_skip_connections,
        keep=lambda index: index in output_layers, in_place=True,
    )
    workspace.clear()  # before the padded outputs are allocated
    # Unpack straight into the padded output layout (zeros past each row's length), backward outputs back in
    # reading order. Without the first and last positions, those land in one spare row past the end.
    out_steps = num_steps - 2 if words_only else num_steps
    steps = torch.stack([step_index, sorted_lengths[row_index] - 1 - step_index])  # (2, positions)
    target = order[row_index] * out_steps + steps
    if words_only:
        target = torch.where(is_word_position(steps, sorted_lengths[row_index]), target - 1, batch_size * out_steps)
    half = torch.arange(2, device=tokens.device)[:, None].expand_as(target)
    layer_outputs = []
    for position, index in enumerate(output_layers):
        output = packed_outputs[index]
        unpacked = output.new_zeros(batch_size * out_steps + words_only, 2, width)
        unpacked.index_put_((target.flatten(), half.flatten()), output.flatten(0, 1))
        layer_outputs.append(unpacked[: batch_size * out_steps].view(batch_size, out_steps, 2 * width))
        if index not in output_layers[position + 1 :]:
            packed_outputs[index] = output = None  # freed before the next layer is unpacked
    restore = torch.argsort(order)
    return layer_outputs, (final_cells[:, :, restore], final_hiddens[:, :, restore])


def _layer(
    module,
    index: int,
    inputs: torch.Tensor | None,
    cell: torch.Tensor,
    hidden: torch.Tensor,
    rows_at: list[int],
    distinct: tuple[torch.Tensor, torch.Tensor] | None,
    workspace: dict,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """
    Layer `index` of both directions on packed inputs `(2, positions, projection_dim)` from the initial state
    `(2, batch, ·)` (rows sorted longest first). Returns the packed outputs and each row's final state.
    `distinct`: the distinct input rows and, per direction, each position's row; the inputs are then read from
    those alone (`inputs` is None).
    """
    layers = (module.forward_layers[index], module.backward_layers[index])
    # Both directions write their outputs straight into one tensor.
    out = hidden.new_empty(2, sum(rows_at), hidden.shape[-1])
    finals = [
        _direction(
            layers[d],
            None if inputs is None else inputs[d],
            cell[d],
            hidden[d],
            rows_at,
            None if distinct is None else (distinct[0], distinct[1][d]),
            workspace,
            out[d],
        )
        for d in range(2)
    ]
    cells, hiddens = zip(*finals)
    return out, torch.stack(cells), torch.stack(hiddens)


def _works_in_place(module, tokens: torch.Tensor) -> bool:
    """Whether nothing needs autograd and no autocast is on (it would hand the matmuls bf16 operands while the
    `out=` buffers keep fp32)."""
    return not torch.is_autocast_enabled(tokens.device.type) and not needs_autograd(module, tokens)


def _product(linear, columns: torch.Tensor, out: torch.Tensor | None = None, add: torch.Tensor | None = None,
             few_columns: bool = True, step_products: dict | None = None) -> torch.Tensor:
    """
    `add + linear.weight @ columns` (feature-major), into `out` when given: for an `Int8Linear` on its kernel (as
    prepared in `step_products` when there), else for a recurrence step's few columns through `few_column_matmul`
    (BLAS or oneDNN, whichever measured faster here), else BLAS.
    """
    if step_products and linear in step_products:
        return step_products[linear].columns_product(columns, out, add)
    if isinstance(linear, Int8Linear):
        return linear.columns_product(columns, out=out, add=add)
    if few_columns:
        return few_column_matmul(linear.weight, columns, out=out, add=add)
    return torch.addmm(add, linear.weight, columns, out=out)


def _direction(
    layer,
    inputs: torch.Tensor | None,
    cell: torch.Tensor,
    hidden: torch.Tensor,
    rows_at: list[int],
    distinct: tuple[torch.Tensor, torch.Tensor] | None,
    workspace: dict,
    packed: torch.Tensor,
) -> tuple[torch.Tensor, torch.Tensor]:
    """
    `layer` (an `ElmoLstmLayer`) over packed inputs `(positions, projection_dim)` from the initial state
    `(batch, ·)`, writing the outputs into `packed` `(positions, projection_dim)`; returns the final state.

    One direction at a time: every step reads the whole recurrent and projection weights, and one direction's
    (40 MB for "original") stays in cache better than both directions' (and needs no stacked copy of the
    weights). Inside, vectors are columns (feature-major): the matmuls are then `weight @ states`, the shape that
    runs fastest on few rows, and dropping finished rows is a column slice. Each step completes its gates in a
    buffer, updates the state in preallocated buffers and writes its outputs into the result: no new tensors a
    step.
    """
    lstm_dim = cell.shape[-1]
    # TensorFlow's forget bias is folded into the stored bias once instead of being added at every step.
    bias = fold_forget_bias(layer.input_proj.bias)[:, None]
    cell, hidden = cell.t(), hidden.t()  # (lstm_dim, batch), (proj, batch)
    inputs = None if inputs is None else inputs.t()  # (proj, positions)
    batch_size, positions = cell.shape[1], sum(rows_at)
    # A block holds at least one step's rows (the first step reads every row), and at most the layer's positions:
    # a short batch allocates no more than it computes.
    block_positions = min(positions, max(1, INPUT_GATES_BLOCK_VALUES // (4 * lstm_dim), batch_size))

    # Scratch buffers, shared by every layer and direction of this forward (fewer large allocations).
    def scratch(name: str, size: int, zeroed: bool = False, dtype: torch.dtype | None = None) -> torch.Tensor:
        if name not in workspace or workspace[name].numel() < size:
            workspace[name] = cell.new_zeros(size, dtype=dtype) if zeroed else cell.new_empty(size, dtype=dtype)
        return workspace[name][:size]

    # Where int8 weights run on "bf16-dot", they are widened once for all of this direction's products: the
    # input map's too, which is multiplied once per block of positions (widening it per block cost as much as
    # its product).
    step_products = {
        linear: RecurrenceProducts(
            linear, columns, lambda name, size, role=role, **options: scratch(f"{role}_{name}", size, **options)
        )
        for role, linear, columns in (("input", layer.input_proj, block_positions),
                                      ("recurrent", layer.recurrent_proj, batch_size),
                                      ("projection", layer.output_proj, batch_size))
        if isinstance(linear, Int8Linear) and linear.kernel == "bf16-dot"
    }

    # Zeroed: a step may compute on columns it has not written yet, which must be finite.
    gates_buffer = scratch("gates", 4 * lstm_dim * batch_size, zeroed=True)
    cell_buffers = [scratch(name, lstm_dim * batch_size) for name in ("cell_a", "cell_b")]
    # The state lives in contiguous feature-major buffers; each step's hidden state is then copied into the
    # (position-major) result: the projection writing straight into it would write with a stride.
    hidden_buffers = [scratch(name, hidden.shape[0] * batch_size) for name in ("hidden_a", "hidden_b")]
    final_cell, final_hidden = torch.empty_like(cell), torch.empty_like(hidden)
    # Input gates of each distinct input row `(distinct, 4 * lstm_dim)`; each step gathers its rows.
    table = None
    if distinct is not None:
        table = scratch("table", 4 * lstm_dim * distinct[0].shape[0]).view(-1, 4 * lstm_dim)
        # In chunks, with the matmul shape of the blocks (an odd shape makes MKL keep extra buffers).
        for chunk, rows in zip(table.split(batch_size), distinct[0].split(batch_size)):
            part = gates_buffer[: 4 * lstm_dim * rows.shape[0]].view(4 * lstm_dim, -1)
            chunk.copy_(_product(layer.input_proj, rows.t(), out=part, add=bias, few_columns=False,
                                 step_products=step_products).t())
        gathered_buffer = scratch("gathered", batch_size * 4 * lstm_dim)

    block_start = block_end = offset = 0
    input_gates = None
    # The step's BLAS products, whose column counts `step_columns` may tune (int8 products are not tuned).
    products = [linear.weight for linear in (layer.recurrent_proj, layer.output_proj) if isinstance(linear, nn.Linear)]
    reading = batch_size
    for step_index, rows in enumerate(rows_at):
        if rows < reading:
            # Rows past their length: their state is final.
            final_cell[:, rows:reading] = cell[:, rows:reading]
            final_hidden[:, rows:reading] = hidden[:, rows:reading]
            reading = rows
        # Columns `rows:columns` are finished rows, computed on only because that is faster here.
        columns = step_columns(products, rows, hidden.shape[1]) if products else rows
        cell, hidden = cell[:, :columns], hidden[:, :columns]
        if table is not None:
            gathered = gathered_buffer[: rows * 4 * lstm_dim].view(rows, 4 * lstm_dim)
            input_part = torch.index_select(table, 0, distinct[1][offset : offset + rows], out=gathered).t()
        else:
            if offset + rows > block_end:
                # The input part of the gates, for the next block of positions at once.
                block_start, block_end = offset, min(offset + block_positions, positions)
                width, block = block_end - block_start, inputs[:, block_start:block_end]
                out = scratch("input_gates", 4 * lstm_dim * block_positions)[: 4 * lstm_dim * width]
                input_gates = _product(layer.input_proj, block, out=out.view(4 * lstm_dim, width), add=bias,
                                       few_columns=False, step_products=step_products)
            input_part = input_gates[:, offset - block_start : offset - block_start + rows]
        gates = gates_buffer[: 4 * lstm_dim * columns].view(4 * lstm_dim, columns)
        gates[:, :rows] = input_part  # the finished rows' columns keep earlier (finite) values
        new_cell = cell_buffers[step_index % 2][: lstm_dim * columns].view(lstm_dim, columns)
        new_hidden = hidden_buffers[step_index % 2][: hidden.shape[0] * columns].view(-1, columns)
        cell, hidden = _step(layer, cell, hidden, gates, new_cell, new_hidden, step_products)
        packed[offset : offset + rows].copy_(hidden[:, :rows].t())
        offset += rows
    final_cell[:, :reading] = cell[:, :reading]
    final_hidden[:, :reading] = hidden[:, :reading]
    return final_cell.t(), final_hidden.t()


def _step(layer, cell, hidden, gates, new_cell, new_hidden, step_products=None):
    """
    One step of `layer` (an `ElmoLstmLayer`), feature-major: `gates` `(4 * lstm_dim, columns)` holds the input part
    of the gates and receives the rest; the new state goes into the buffers `new_cell` and `new_hidden` (it reads
    `cell` and `hidden`); `step_products` as in `_product`. Contiguous gates make the element-wise work several
    times faster than working in place on a column slice of the input gates.
    """
    _product(layer.recurrent_proj, hidden, gates, add=gates, step_products=step_products)
    new_cell, cell_output = lstm_cell(gates, cell, layer.cell_clip, dim=0, in_place=True, new_cell=new_cell)
    if not isinstance(layer.output_proj, nn.Identity):
        _product(layer.output_proj, cell_output, new_hidden, step_products=step_products)
    else:
        new_hidden.copy_(cell_output)
    return new_cell, clip(new_hidden, layer.proj_clip, in_place=True)


CPU_IMPLEMENTATION = ElmoImplementation(bilstm=bilstm, token_vectors=token_vectors)
register("cpu", CPU_IMPLEMENTATION)
