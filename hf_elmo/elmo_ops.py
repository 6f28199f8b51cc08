"""The clipped LSTM recurrence with a hand-written backward, all directions of a layer at once, and the two
schedules of rows it runs (every row every step, or rows packed longest first): the "cuda" implementation's
(`elmo_cuda.py`) and the "cpu" one's with autograd (`elmo_cpu.py`). The LSTM maths itself (the step,
clipping, the forget-bias fold, reversal, layer stacking, the output layout) is the model's (`modeling_elmo.py`),
imported from there; this module adds the step's backward and the recurrence around it, and the char CNN's
filters as one product (`conv_kernel`) and one max (`pooled_windows`), over every word and position in static
shapes in `pooled_convolutions`. Its products go through
`cpu_tuning.matmul` (oneDNN on CPUs where that measures faster; torch's own product elsewhere). It comes with
`pip install hf-elmo`, not with a saved folder's code.
"""

import functools
import math

import torch

from .cpu_tuning import matmul, onednn_multiplies, padded_cat, padded_rows
from .modeling_elmo import (
    bidirectional_output,
    clip,
    fold_forget_bias,
    lstm_cell,
    matmul_dtype,
    reverse_within_lengths,
    stack_layers,
)


def lstm_cell_backward(cell, activations, grad_cell, grad_cell_output, active, cell_clip: float, out=None):
    """
    The backward of `lstm_cell` (row-major, `dim=-1`) at one step: `cell` the state before it, `activations` the
    step's, as `lstm_cell` returns them (`return_activations`), `grad_cell` the gradient of the state after it,
    `grad_cell_output` that of the cell's output. `active` (bool, broadcast over rows; None: every row reads the
    step): a row that does not read the step keeps its state, so its gradient passes through. Returns the gradient
    of the pre-activations (fp32; written into `out` when given) and of the state before the step. Clipping passes
    no gradient where it clipped, as TensorFlow's `clip_by_value`.
    """
    i, j, f, o, tanh_cell = activations
    unclipped = f * cell + i * j  # as the forward computed it, before the clip
    grad_cell_output = grad_cell_output.float()
    grad_new = grad_cell if active is None else torch.where(active, grad_cell, 0.0)
    grad_new = grad_new + grad_cell_output * o * (1 - tanh_cell * tanh_cell)
    grad_new = torch.where(unclipped.abs() <= cell_clip, grad_new, 0.0)
    grad_gates = torch.cat(
        [grad_new * j * i * (1 - i), grad_new * i * (1 - j * j), grad_new * cell * f * (1 - f),
         grad_cell_output * tanh_cell * o * (1 - o)],
        dim=-1, out=out,
    )
    return grad_gates, grad_new * f if active is None else torch.where(active, grad_new * f, grad_cell)


# ---------------------------------------------------------------------------------------------------------------
# The char CNN as one product and one max (both implementations); every word and position in static shapes ("cuda")
# ---------------------------------------------------------------------------------------------------------------
def conv_kernel(encoder) -> torch.Tensor:
    """All filters as one `(widest * char_dim, n_filters)` matrix, each zero-padded to the widest width."""
    widest = max(conv.kernel_size[0] for conv in encoder.convolutions)
    # Conv1d weight (n, char_dim, width) -> (width, char_dim, n), with zero taps past the filter's width.
    taps = [
        torch.nn.functional.pad(conv.weight.permute(2, 1, 0), (0, 0, 0, 0, 0, widest - conv.kernel_size[0]))
        for conv in encoder.convolutions
    ]
    return torch.cat(taps, dim=-1).flatten(0, 1)


def pooled_convolutions(encoder, char_ids: torch.Tensor) -> torch.Tensor:
    """
    The max-pooled convolutions of `char_encoder_reference`, bias added, `(words, n_filters)`, in static shapes:
    every position's widest window (im2col; the row zero-padded at its end) by all filters in ONE product, -inf at
    the positions where a filter reaches past the row, and ONE max over positions. Its backward puts each filter's
    gradient at the position the max took (one scatter). The reference's seven convolutions (each with two layout
    transposes on a GPU) and `amax`'s backward (compare, count, divide, multiply, per filter) took about half of a
    training step's GPU time (benchmarks/README.md, the H100 run of 2026-11-28). Where positions tie, as the
    identical windows inside a word's trailing padding do, the gradient goes to one of them instead of being split
    between them: their windows being equal, every parameter's gradient is the same.
    """
    num_chars = char_ids.shape[1]
    pooled = pooled_windows(encoder, char_ids, num_chars, num_chars, conv_kernel(encoder))
    return pooled + torch.cat([conv.bias for conv in encoder.convolutions])


def pooled_windows(encoder, char_ids: torch.Tensor, positions: int, num_chars: int, kernel: torch.Tensor):
    """
    The max-pooled convolutions, before the bias, `(words, n_filters)`, of `char_ids`, rows of `num_chars` chars or
    their first chars, at their first `positions` window positions: each position's widest window (im2col; the rows
    zero-padded at their end) by `kernel` (`conv_kernel`'s) in ONE product, then `max_over_positions`.
    """
    widest = kernel.shape[0] // encoder.char_embeddings.embedding_dim
    chars = encoder.char_embeddings(char_ids)  # (words, chars, char_dim)
    chars = torch.nn.functional.pad(chars, (0, 0, 0, positions + widest - 1 - chars.shape[1]))
    # (words, positions, widest * char_dim), contiguous: the product then folds into one matmul, a tensor of its own
    # that `max_over_positions` may add to in place.
    windows = chars.unfold(1, widest, 1).transpose(2, 3).flatten(2).contiguous()
    return max_over_positions(encoder, windows @ kernel, num_chars)


def max_over_positions(encoder, features: torch.Tensor, num_chars: int) -> torch.Tensor:
    """
    Each filter's max over the positions of `features` `(words, positions, n_filters)`, a product's own result
    (window `p` of rows of `num_chars` chars at position `p`), where the filter lies inside the row (a "valid"
    convolution): ONE max, after -inf is added in place where a filter reaches past the row, if any position does.
    With autograd the max keeps its positions, so that its backward is one scatter, where `amax`'s compares,
    counts, divides and multiplies per filter.
    """
    positions = features.shape[1]
    widths = [conv.kernel_size[0] for conv in encoder.convolutions]
    if positions > num_chars - max(widths) + 1:
        # The last valid position of each filter's column, from fills only: a host-to-device copy would sync, and
        # a CUDA graph recording refuses it.
        last_valid = torch.cat([
            torch.full((conv.out_channels,), num_chars - width, device=features.device)
            for conv, width in zip(encoder.convolutions, widths)
        ])
        position = torch.arange(positions, device=features.device)[:, None]
        features += features.new_zeros(features.shape[1:]).masked_fill_(position > last_valid, float("-inf"))
    return features.max(dim=1).values if features.requires_grad else features.amax(dim=1)


# ---------------------------------------------------------------------------------------------------------------
# The clipped recurrence with a hand-written backward (the "cuda" implementation, and "cpu" with autograd)
# ---------------------------------------------------------------------------------------------------------------
# The device types whose tensors go through the compiled kernels, and torch.compile's backend. The tests compile
# on the CPU with the "eager" backend, which traces, guards and recompiles as inductor does, without generating code.
COMPILED_DEVICE_TYPES = ("cuda",)
COMPILE_BACKEND = "inductor"
# Graphs each kernel may keep, one per layout of its inputs: Dynamo guards a view's offset and strides, treats sizes
# and offsets of 0 and 1 apart, and autocast's dtypes too. A process that trains in fp32 and bf16 (static rows) and
# runs inference (packed rows) needs more than torch's default of 8 (inductor on the CPU, test_implementations.py),
# past which a new layout runs eagerly: dozens of kernels a step.
KERNEL_GRAPHS = 32


def with_dynamo_settings(function, **settings):
    """
    `function`, called with Dynamo's config `settings` in force and restored after each call. They are applied by
    Dynamo's closure patcher, the one `torch.compile(dynamic=True)` itself applies at each call (torch 2.11 and
    2.13), not by a `config.patch` object: a compiled kernel that runs eagerly (past its recompile limit, or under a
    dispatch mode) calls the kernels inside it, and torch 2.11's patch object, shared by every call, raises when it
    is entered again ("prior should be empty when entering ConfigPatch"), or from a second thread. The patcher keeps
    each call's prior values itself, and costs the host 4.4 us a call where the object cost 10.
    """
    apply_settings = torch._dynamo.config._make_closure_patcher(**settings)

    @functools.wraps(function)
    def call(*args, **kwargs):
        restore = apply_settings()
        try:
            return function(*args, **kwargs)
        finally:
            restore()

    return call


def _compiled(function):
    """
    `function`, compiled into one fused kernel for tensors on `COMPILED_DEVICE_TYPES` (eager elsewhere, and when
    already compiling). Sizes and strides are symbolic from the first call (`dynamic=True`): the row count (64 rows
    in evaluation, 128 in training, a short last batch) and a step's stride (the padded length) change between
    batches, and each change would otherwise cost a recompilation. Not `fullgraph`: these are a few element-wise
    lines that trace whole, and past Dynamo's recompile limit (`KERNEL_GRAPHS`: views passed in still recompile on
    some changes of their base and offset) a full-graph function raises, where this one runs eagerly and warns.
    """
    compiled = {}

    @functools.wraps(function)
    def run(*args):
        if args[0].device.type not in COMPILED_DEVICE_TYPES or torch.compiler.is_compiling():
            return function(*args)
        if COMPILE_BACKEND not in compiled:
            compiled[COMPILE_BACKEND] = with_dynamo_settings(
                torch.compile(function, dynamic=True, backend=COMPILE_BACKEND), recompile_limit=KERNEL_GRAPHS)
        return compiled[COMPILE_BACKEND](*args)

    return run


@_compiled
def _step_forward(input_gates, recurrent_gates, cell, active, cell_clip: float, keep_activations: bool):
    """`lstm_cell` on the sum of the input and recurrent parts of the gates, in fp32: the step's activations (kept
    for the backward, which would otherwise compute its three sigmoids and two tanhs again; None without
    `keep_activations`, so that inference writes none), the new cell (changed only where `active`) and the cell's
    output in the matmul dtype."""
    gates = input_gates.float() + recurrent_gates.float()
    new_cell, cell_output, activations = lstm_cell(gates, cell, cell_clip, return_activations=True)
    if active is not None:
        new_cell = torch.where(active, new_cell, cell)
    return activations if keep_activations else None, new_cell, cell_output.to(recurrent_gates.dtype)


def _projection_output(projected, hidden, active, proj_clip: float):
    """The clipped projection -> the new hidden state (changed only where `active`) and the step's output (fp32,
    zero where not active)."""
    output = clip(projected.float(), proj_clip)
    if active is None:
        return output.to(hidden.dtype), output
    return torch.where(active, output.to(hidden.dtype), hidden), output * active


# Compiled where every row reads every step (training). Packed rows (inference) clip straight into the outputs
# instead (`_clipped_into`): a compiled call costs the host more than those one or two kernels (Dynamo's guards,
# inductor's launcher: 39-73 us a call against the clamp's 2.2-4.5 us, inductor on a 2-core Xeon's CPU, 2026-11-29).
_projection_forward = _compiled(_projection_output)


def _clipped_into(out, values, limit: float):
    """`clip(values, limit)` written into the fp32 `out`: one kernel where the dtypes agree, else a cast into `out`
    and a clip in place (a clamp's result must have its input's dtype)."""
    if values.dtype == out.dtype and limit != math.inf:
        return torch.clamp(values, -limit, limit, out=out)
    return clip(out.copy_(values), limit, in_place=True)


@_compiled
def _projection_backward(projected, grad_output, grad_hidden, active, proj_clip: float):
    """The gradient of a step's (unclipped) projection, in the matmul dtype, from those of its output and of the
    hidden state after it."""
    grad_step = grad_output.float() + grad_hidden
    if active is not None:
        grad_step = grad_step * active
    return torch.where(projected.float().abs() <= proj_clip, grad_step, 0.0).to(projected.dtype)


@_compiled
def _step_backward(cell, activations, grad_cell, grad_cell_output, active, cell_clip: float, out, gates_dtype):
    """`lstm_cell_backward`, one fused kernel on CUDA as each of the forward's two are (eager, it is about 25
    kernels), which also gives the gates' gradient in `gates_dtype`, the recurrent product's (in bf16 a cast fewer)."""
    grad_gates, grad_cell = lstm_cell_backward(cell, activations, grad_cell, grad_cell_output, active, cell_clip, out)
    return grad_gates, grad_gates.to(gates_dtype), grad_cell


@_compiled
def _hidden_gradient(grad_hidden, through_gates, active):
    """The gradient of the hidden state before a step: through the step's gates, and where a row did not read the
    step, unchanged from after it (one kernel where it was three: the cast, `where` and the sum)."""
    if active is None:
        return through_gates.float()
    return torch.where(active, 0.0, grad_hidden) + through_gates.float()


@_compiled
def _hidden_and_projection_backward(grad_hidden, through_gates, active, projected, grad_output, previous_active,
                                    proj_clip: float):
    """`_hidden_gradient` at a step and `_projection_backward` at the step before it, which reads that gradient:
    one kernel where every row reads every step (static shapes), where they were two a step on a GPU."""
    grad_hidden = _hidden_gradient(grad_hidden, through_gates, active)
    return grad_hidden, _projection_backward(projected, grad_output, grad_hidden, previous_active, proj_clip)


# What the forward keeps of each step for the backward: `lstm_cell`'s activations, the state before the step, the
# cell's output and the unclipped projection.
ACTIVATIONS = ("in_gates", "candidates", "forget_gates", "out_gates", "tanh_cells")  # as `lstm_cell` returns them
SAVED_PER_STEP = (*ACTIVATIONS, "cells", "hiddens", "cell_outputs", "projected")


class ClippedLstmRecurrence(torch.autograd.Function):
    """
    The recurrent part of one bilm-tf LSTM layer, all directions at once (time-major):

    `input_gates` `(time, directions, rows, 4 * lstm_dim)`: the input projection with its bias and the forget bias;
    `cell`/`hidden` `(directions, rows, ·)` the initial state (cell in fp32, hidden in the matmul dtype);
    `recurrent` `(directions, projection_dim, 4 * lstm_dim)` and `projection` `(directions, lstm_dim,
    projection_dim)` the transposed weights in the matmul dtype. Which rows read which step, one of:

    - `active` `(time, 1, rows, 1)` bool (`rows_at` None): every row computes every step and a row that is not
      active keeps its state. Static shapes, nothing read back to the host: the GPU's way.
    - `rows_at` (`active` None): rows sorted longest first, step t computes only its first `rows_at[t]` rows, so
      a batch of mixed lengths costs the sum of its lengths: the CPU's way.

    Returns the outputs `(time, directions, rows, projection_dim)` (fp32, zero where a row does not read) and
    each row's final state. Per step: two matmuls and two fused element-wise kernels each way; the weight
    gradients are one matmul over all steps.
    """

    @staticmethod
    def forward(ctx, input_gates, active, cell, hidden, recurrent, projection, cell_clip, proj_clip, rows_at):
        num_rows, packed = input_gates.shape[2], rows_at is not None
        schedule = rows_at if packed else (num_rows,) * input_gates.shape[0]
        # Every row every step (static shapes): the steps' outputs are stacked once at the end, where a write into
        # the result each step was one more kernel a step on a GPU. Packed rows write their part of each step.
        no_outputs = lambda: input_gates.new_zeros(  # noqa: E731
            *input_gates.shape[:3], projection.shape[-1], dtype=torch.float32)
        outputs, step_outputs = (no_outputs() if packed else None), []
        # Packed rows leave the state at their own last steps; with static shapes the last step's state is every
        # row's final one (a row that does not read a step keeps its state), and copying it was 4 kernels a layer.
        final_cell, final_hidden = (cell.clone(), hidden.clone()) if packed else (None, None)
        # The state the compiled kernels read is always a tensor of its own, never a view: Dynamo guards a view's
        # base too, and each new layout recompiled the step's kernels (training and packed inference in one process
        # reached its limit of 8 graphs per function, inductor on the CPU, after which a new layout runs eagerly).
        # Packed rows' hidden state in fp32 inference is the step's slice of the outputs, read by eager products only.
        cell, hidden = cell.clone(), hidden.clone()
        saved = {name: [] for name in SAVED_PER_STEP}
        training = any(ctx.needs_input_grad)
        for t, rows in enumerate(schedule):
            if rows == 0:
                break
            step_active = None if active is None else active[t, :, :rows]
            if rows < cell.shape[1]:  # the rows past their last step leave the state
                cell, hidden = cell[:, :rows].contiguous(), hidden[:, :rows].contiguous()
            activations, new_cell, cell_output = _step_forward(
                input_gates[t, :, :rows], matmul(hidden, recurrent), cell, step_active, cell_clip, training
            )
            projected = matmul(cell_output, projection)
            if packed:
                # Kept for the backward (training), the state must not be a view of the outputs, which the caller
                # may change in place (the skip connection).
                step_output = _clipped_into(outputs[t, :, :rows], projected, proj_clip)
                new_hidden = step_output.to(hidden.dtype, copy=training)
            else:
                new_hidden, step_output = _projection_forward(projected, hidden, step_active, proj_clip)
                step_outputs.append(step_output)
            if training:
                for name, value in zip(saved, (*activations, cell, hidden, cell_output, projected)):
                    saved[name].append(value)
            cell, hidden = new_cell, new_hidden
            if packed:  # rows whose last step this was keep this state as their final one
                done = schedule[t + 1] if t + 1 < len(schedule) else 0
                if done < rows:  # at most steps none do, and two empty copies cost the host 9-15 us (gpu_proxies.py)
                    final_cell[:, done:rows] = cell[:, done:]
                    final_hidden[:, done:rows] = hidden[:, done:]
        if not packed:
            outputs = torch.stack(step_outputs) if step_outputs else no_outputs()
            final_cell, final_hidden = cell, hidden
        ctx.steps = len(saved["cells"])
        ctx.schedule, ctx.clips, ctx.input_dtype = schedule, (cell_clip, proj_clip), input_gates.dtype
        if training:  # inference keeps nothing
            ctx.save_for_backward(active, recurrent, projection, *(v for values in saved.values() for v in values))
        return outputs, final_cell, final_hidden

    @staticmethod
    def backward(ctx, grad_outputs, grad_final_cell, grad_final_hidden):
        active, recurrent, projection, *saved = ctx.saved_tensors
        by_name = {name: saved[i * ctx.steps : (i + 1) * ctx.steps] for i, name in enumerate(SAVED_PER_STEP)}
        activations = list(zip(*(by_name[name] for name in ACTIVATIONS)))
        cells, hiddens, cell_outputs, projected = (by_name[name] for name in SAVED_PER_STEP[len(ACTIVATIONS):])
        cell_clip, proj_clip = ctx.clips
        num_steps, directions, num_rows = grad_outputs.shape[:3]
        # Every row every step (static shapes): each step's gradient of the gates is kept and stacked once at the end,
        # and the hidden state's gradient comes with the step before's projection gradient, in one kernel: a zeroed
        # result, a copy into it and a kernel a step fewer on a GPU (`benchmarks/gpu_proxies.py` counts them).
        static = active is not None and ctx.steps == num_steps > 0
        # The gradients of each row's state after the last step computed so far (going back): a row that does not
        # read a step passes its gradient on unchanged. Packed rows write theirs into these; static steps replace
        # them whole and never write, so they read autograd's own (a copy fewer of each, a layer).
        grad_cell, grad_hidden = grad_final_cell.float(), grad_final_hidden.float()
        if not static:
            grad_cell, grad_hidden = grad_cell.clone(), grad_hidden.clone()
        # Packed rows write each step's part into a result laid out direction-major, as the input products lay out
        # theirs: their backward then reads each direction's positions as they lie, where a time-major gradient was
        # first copied (about 30 ms per layer of a batch of 100-word sentences, recipe config, 2 CPU threads).
        # Eager, the step's kernel writes straight into its place; a compiled kernel returns a tensor of its own.
        grad_input_gates = None if static else grad_outputs.new_zeros(
            directions, num_steps, num_rows, recurrent.shape[-1], dtype=torch.float32).transpose(0, 1)
        into_result = not static and grad_outputs.device.type not in COMPILED_DEVICE_TYPES \
            and not torch.compiler.is_compiling()
        grad_gates, grad_projected, static_gates = [None] * ctx.steps, [None] * ctx.steps, [None] * ctx.steps
        grad_step = None
        for t in reversed(range(ctx.steps)):
            rows = ctx.schedule[t]
            step_active = None if active is None else active[t, :, :rows]
            if grad_step is None:  # else computed with the hidden state's gradient of the step after this one
                grad_step = _projection_backward(projected[t], grad_outputs[t, :, :rows], grad_hidden[:, :rows],
                                                 step_active, proj_clip)
            grad_cell_output = matmul(grad_step, projection.transpose(1, 2))
            result = None if static else grad_input_gates[t, :, :rows]
            step_gates_fp32, step_gates, step_grad_cell = _step_backward(
                cells[t], activations[t], grad_cell[:, :rows], grad_cell_output, step_active, cell_clip,
                result if into_result else None, recurrent.dtype,
            )
            if static:
                static_gates[t] = step_gates_fp32
            elif not into_result:
                result.copy_(step_gates_fp32)
            through_gates = matmul(step_gates, recurrent.transpose(1, 2))
            grad_gates[t], grad_projected[t], grad_step = step_gates, grad_step, None
            if static and t > 0:
                step_grad_hidden, grad_step = _hidden_and_projection_backward(
                    grad_hidden, through_gates, step_active, projected[t - 1], grad_outputs[t - 1], active[t - 1],
                    proj_clip)
            else:
                step_grad_hidden = _hidden_gradient(grad_hidden[:, :rows], through_gates, step_active)
            # Where every row read the step the new gradients replace the old ones whole (no copy: one kernel fewer
            # each, a step, on a GPU); packed rows write theirs into the first `rows`.
            if rows == num_rows:
                grad_cell, grad_hidden = step_grad_cell, step_grad_hidden
            else:
                grad_cell[:, :rows], grad_hidden[:, :rows] = step_grad_cell, step_grad_hidden
        if static:  # (time, directions, rows, gates), laid out direction-major as above
            grad_input_gates = torch.stack(static_gates, dim=1).transpose(0, 1)
        # Weight gradients: one matmul over every step's rows, per direction.
        if ctx.steps:
            # (directions, sum of rows, n), both operands of a product padded alike: a summed row costs one
            # multiply-add per weight value.
            packed = lambda values, weight: padded_cat(values, 1, weight.numel())  # noqa: E731
            grad_recurrent = matmul(packed(hiddens, recurrent).transpose(1, 2), packed(grad_gates, recurrent))
            grad_projection = matmul(packed(cell_outputs, projection).transpose(1, 2),
                                     packed(grad_projected, projection))
        else:  # no row read any step
            grad_recurrent, grad_projection = torch.zeros_like(recurrent), torch.zeros_like(projection)
        return (grad_input_gates.to(ctx.input_dtype), None, grad_cell, grad_hidden, grad_recurrent, grad_projection,
                None, None, None)


def needs_autograd(module, tensor: torch.Tensor) -> bool:
    """Whether autograd records this call: grad mode is on and `tensor` or one of `module`'s parameters requires
    grad (a frozen biLM under a trained head records nothing)."""
    return torch.is_grad_enabled() and (tensor.requires_grad or any(p.requires_grad for p in module.parameters()))


def recurrence_layer(layers, inputs, cell, hidden, active=None, rows_at=None):
    """
    One layer of every direction with `ClippedLstmRecurrence`: `layers` (one `ElmoLstmLayer` per direction),
    `inputs` `(time, directions, rows, projection_dim)`, state `(directions, rows, ·)`, and the rows each step
    reads (`active` or `rows_at`, see the recurrence). Returns the outputs (fp32, zero where a row does not read)
    and the final `(cell, hidden)`.
    """
    first = layers[0]
    dtype = matmul_dtype(inputs)
    stacked = lambda name: torch.stack([getattr(layer, name).weight for layer in layers]).to(dtype)  # noqa: E731
    bias = fold_forget_bias(torch.stack([layer.input_proj.bias for layer in layers]).float())
    # The input part of the gates in fp32, the bias added there: nn.Linear (the reference) rounds x @ W + b once to
    # the autocast dtype, and adding the bias in bf16 would round this, the largest activation, twice (the bf16
    # errors of the gpu_report tests). Under bf16 this holds the tensor in fp32, as the steps read it.
    # Packed input gates only where nothing records autograd: their scatter's gradient is one more padded tensor
    # (peak RSS +450 MB for "original" at 64 rows x 30 words on the CPU), and training batches come from length
    # buckets, where it saved no time (`bench_pretrain.py`, small, CPU).
    if rows_at is None or any(needs_autograd(layer, inputs) for layer in layers):
        # The bias broadcast over rows before it is added: its gradient is then a sum over time and one over rows,
        # where one sum over both (non-adjacent) dims runs ~15x slower on the CPU (20 ms a layer on the recipe config).
        input_gates = input_products(inputs.to(dtype), stacked("input_proj")).float() + bias[None, :, None].expand(
            1, -1, inputs.shape[2], -1
        )
    else:
        input_gates = _packed_input_gates(inputs, stacked("input_proj"), bias, rows_at)
    recurrent = stacked("recurrent_proj").transpose(1, 2)
    if isinstance(first.output_proj, torch.nn.Linear):
        projection = stacked("output_proj").transpose(1, 2)
    else:  # no projection: an identity matrix keeps one code path (such models are small)
        lstm_dim = first.recurrent_proj.out_features // 4
        projection = torch.eye(lstm_dim, device=inputs.device, dtype=dtype).expand(len(layers), -1, -1)
    return ClippedLstmRecurrence.apply(input_gates, active, cell.float(), hidden.to(dtype), recurrent, projection,
                                       first.cell_clip, first.proj_clip, rows_at)


def input_products(inputs, weights):
    """`inputs` `(time, directions, rows, width)` by each direction's `weights` `(gates, width)`: the input part of
    the gates without the bias, `(time, directions, rows, gates)`. Where `cpu_tuning.matmul` hands products to
    oneDNN, through `_InputProducts` (so that autograd's backward is oneDNN's too); elsewhere `torch.einsum`."""
    if not onednn_multiplies(inputs, inputs.numel() * weights.shape[1]):
        return torch.einsum("tdrp,dgp->tdrg", inputs, weights)
    return _InputProducts.apply(inputs, weights)


class _InputProducts(torch.autograd.Function):
    """`input_products` on `cpu_tuning.matmul`, forward and backward: each direction's positions as the rows of one
    product, laid out once with `padded_rows` rows (zeros past the positions) so that both of the backward's
    products read them as they lie."""

    @staticmethod
    def forward(ctx, inputs, weights):
        time, directions, rows, _ = inputs.shape
        positions = time * rows
        ctx.shape = inputs.shape
        padded_inputs = rows_by_direction(inputs)
        ctx.save_for_backward(padded_inputs, weights)
        gates = matmul(padded_inputs, weights.transpose(1, 2))[:, :positions]
        return gates.view(directions, time, rows, -1).permute(1, 0, 2, 3)

    @staticmethod
    def backward(ctx, grad_gates):
        padded_inputs, weights = ctx.saved_tensors
        time, directions, rows, width = ctx.shape
        padded_grad = rows_by_direction(grad_gates)
        grad_inputs = grad_weights = None
        if ctx.needs_input_grad[0]:
            grad_inputs = matmul(padded_grad, weights)[:, : time * rows]
            grad_inputs = grad_inputs.view(directions, time, rows, width).permute(1, 0, 2, 3)
        if ctx.needs_input_grad[1]:
            grad_weights = matmul(padded_grad.transpose(1, 2), padded_inputs)
        return grad_inputs, grad_weights


def rows_by_direction(values):
    """`(time, directions, rows, n)` -> `(directions, padded_rows(time * rows), n)`: each direction's positions as
    rows, time-major, then zero rows."""
    time, directions, rows, width = values.shape
    laid_out = values.new_zeros(directions, padded_rows(time * rows), width)
    laid_out[:, : time * rows].view(directions, time, rows, width).copy_(values.permute(1, 0, 2, 3))
    return laid_out


def _packed_input_gates(inputs, weights, bias, rows_at):
    """
    The input part of the gates `(time, directions, rows, gates)` (fp32, with the bias) at the positions the steps
    of `rows_at` read, zero elsewhere: one matmul per direction over the positions read alone, so that the largest
    product of a layer costs the sum of the lengths too, not rows times the longest.
    """
    time, directions, rows, width = inputs.shape
    # Flat `(time, directions, rows)` positions read, per direction (built on the host, from `rows_at`).
    step, row = (torch.arange(rows) < torch.tensor(rows_at, dtype=torch.long).view(-1, 1)).nonzero(as_tuple=True)
    index = (step * directions * rows + row + torch.arange(directions)[:, None] * rows).to(inputs.device)
    read = inputs.reshape(-1, width)[index].to(weights.dtype)
    gates = matmul(read, weights.transpose(1, 2)).float() + bias[:, None]
    # In place: this runs without autograd (`recurrence_layer`), and a copy would be one more padded tensor.
    flat = gates.new_zeros(time * directions * rows, gates.shape[-1])
    flat.index_copy_(0, index.flatten(), gates.flatten(0, 1))
    return flat.view(time, directions, rows, -1)


def batched_bilstm(module, tokens, mask, state, output_layers, words_only, dropout_masks=None, rows_at=None):
    """
    `ElmoBiLstm.forward`'s function with `recurrence_layer`: both directions of a layer advance together. By
    default every row computes every step (`active` from `mask`); `rows_at` (rows sorted longest first) computes
    only the rows still reading.
    """
    lengths = mask.sum(dim=1)
    # (time, directions, rows, width): the backward stack reads each sentence reversed within its length.
    layer_input = torch.stack([tokens, reverse_within_lengths(tokens, lengths)]).permute(2, 0, 1, 3)
    active = mask.t()[:, None, :, None] if rows_at is None else None
    pairs = list(zip(module.forward_layers, module.backward_layers))

    def run_layer(index, layer_input):
        initial = (state[0][index], state[1][index])
        first = pairs[index][0]
        if first.gradient_checkpointing and module.training:
            return first._gradient_checkpointing_func(recurrence_layer, pairs[index], layer_input, *initial, active,
                                                      rows_at)
        return recurrence_layer(pairs[index], layer_input, *initial, active, rows_at)

    # Dropout masks `(layers, directions, rows, time, width)` laid out as the inputs: `(time, directions, rows, ·)`.
    masks = None if dropout_masks is None else dropout_masks.permute(0, 3, 1, 2, 4)
    outputs, cells, hiddens = stack_layers(run_layer, layer_input, len(pairs), module.use_skip_connections, masks,
                                           keep=lambda index: index in output_layers)
    layer_outputs = []
    for index in output_layers:
        forward, backward = outputs[index].to(tokens.dtype).permute(1, 2, 0, 3).unbind(0)  # (rows, time, width) each
        layer_outputs.append(bidirectional_output(forward, backward, lengths, words_only))
    return layer_outputs, (cells.to(state[0].dtype), hiddens.to(state[1].dtype))


def longest_first(mask: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, tuple[int, ...]]:
    """
    The batch's rows sorted by length, longest first (stable): `order`, the sorted lengths, and `rows_at[t]`, how
    many sorted rows read step t (up to the longest length; read on the host).
    """
    lengths = mask.sum(dim=1)
    order = torch.argsort(lengths, descending=True, stable=True)
    sorted_lengths = lengths[order]
    host_lengths = sorted_lengths.tolist()
    rows_at, rows = [], len(host_lengths)
    for step in range(host_lengths[0] if host_lengths else 0):
        while host_lengths[rows - 1] <= step:
            rows -= 1
        rows_at.append(rows)
    return order, sorted_lengths, tuple(rows_at)


def packed_bilstm(module, tokens, mask, state, output_layers, words_only, dropout_masks=None):
    """`ElmoBiLstm.forward`'s function with `batched_bilstm` over the batch sorted longest first, each step computing
    only the rows still reading (the lengths are read back to the host once): a batch costs the sum of its lengths,
    not its rows times the longest."""
    order, _, rows_at = longest_first(mask)
    restore = torch.argsort(order)
    sorted_state = (state[0][:, :, order], state[1][:, :, order])
    sorted_masks = None if dropout_masks is None else dropout_masks[:, :, order]
    outputs, (cells, hiddens) = batched_bilstm(
        module, tokens[order], mask[order], sorted_state, output_layers, words_only, sorted_masks, rows_at=rows_at
    )
    return [output[restore] for output in outputs], (cells[:, :, restore], hiddens[:, :, restore])
