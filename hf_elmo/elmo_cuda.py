"""The "cuda" implementation of ELMo: static shapes, no host syncs, a fused clipped LSTM recurrence.

Computes the function that `ElmoCharacterEncoder.forward` and `ElmoBiLstm.forward` specify, on any device (the
tests hold it to the reference on the CPU), shaped for a GPU:

- every batch row reads every step (finished rows keep their state, as in the specification), so shapes depend
  on the batch's padded size only and nothing is read back to the host;
- both directions of a layer advance together, as one batched matmul per step;
- the recurrence is one `torch.autograd.Function` per layer with a hand-written backward: per step, two matmuls
  and two fused element-wise kernels each way (compiled with `torch.compile` on CUDA), instead of the dozen
  autograd nodes a step of the specification records. The weight gradients are one large matmul over all steps.

Clipping follows bilm-tf (TensorFlow's `clip_by_value`): the gradient is zero where a value was clipped.
Under autocast the matmuls run in the autocast dtype, the cell state and all element-wise maths in fp32.
"""

import functools

import torch
from torch import nn

from .configuration_elmo import FORGET_GATE_BIAS


def _compiled(function):
    """`function`, compiled for CUDA tensors into one fused kernel (eager elsewhere, and when already compiling)."""
    compiled = None

    @functools.wraps(function)
    def run(*args):
        nonlocal compiled
        if args[0].device.type != "cuda" or torch.compiler.is_compiling():
            return function(*args)
        if compiled is None:
            compiled = torch.compile(function, fullgraph=True)
        return compiled(*args)

    return run


@_compiled
def _cell_forward(input_gates, recurrent_gates, cell, active, cell_clip: float):
    """
    One step's element-wise part: the input and recurrent parts of the gate pre-activations `(directions, rows,
    4 * lstm_dim)` (forget bias folded in) and the cell state -> the gates (fp32, kept for the backward), the new
    cell state (changed only where `active`; `active` None: every row reads the step) and the projection's input
    (in the matmul dtype).
    """
    gates = input_gates.float() + recurrent_gates.float()
    in_gate, candidate, forget_gate, out_gate = gates.chunk(4, dim=-1)
    new_cell = torch.sigmoid(forget_gate) * cell + torch.sigmoid(in_gate) * torch.tanh(candidate)
    new_cell = new_cell.clamp(-cell_clip, cell_clip)
    projection_input = torch.sigmoid(out_gate) * torch.tanh(new_cell)
    if active is not None:
        new_cell = torch.where(active, new_cell, cell)
    return gates, new_cell, projection_input.to(recurrent_gates.dtype)


@_compiled
def _cell_backward(gates, cell, grad_cell, grad_projection_input, active, cell_clip: float):
    """
    The backward of `_cell_forward` at one step, with `cell` the state before the step, `grad_cell` the gradient
    of the state after it and `grad_projection_input` that of the projection's input. Returns the gradient of the
    gate pre-activations (fp32) and of the state before the step.
    """
    in_gate, candidate, forget_gate, out_gate = gates.chunk(4, dim=-1)
    i, j, f, o = torch.sigmoid(in_gate), torch.tanh(candidate), torch.sigmoid(forget_gate), torch.sigmoid(out_gate)
    unclipped = f * cell + i * j
    tanh_cell = torch.tanh(unclipped.clamp(-cell_clip, cell_clip))
    grad_projection_input = grad_projection_input.float()
    # Rows past their length keep their state: the step's cell gets the state's gradient only where active.
    grad_new = grad_cell if active is None else torch.where(active, grad_cell, 0.0)
    grad_new = grad_new + grad_projection_input * o * (1 - tanh_cell * tanh_cell)
    grad_new = torch.where(unclipped.abs() <= cell_clip, grad_new, 0.0)
    grad_gates = torch.cat(
        [grad_new * j * i * (1 - i), grad_new * i * (1 - j * j), grad_new * cell * f * (1 - f),
         grad_projection_input * tanh_cell * o * (1 - o)],
        dim=-1,
    )
    return grad_gates, grad_new * f if active is None else torch.where(active, grad_new * f, grad_cell)


@_compiled
def _projection_forward(projected, hidden, active, proj_clip: float):
    """The clipped projection -> the new hidden state (changed only where `active`) and the step's output (fp32)."""
    projected = projected.float().clamp(-proj_clip, proj_clip)
    return torch.where(active, projected.to(hidden.dtype), hidden), projected * active


@_compiled
def _projection_backward(projected, grad_output, grad_hidden, grad_hidden_recurrent, active, proj_clip: float):
    """
    `grad_hidden` + `grad_hidden_recurrent`: the gradient of the hidden state after the step (the part passed on
    unchanged and the part through the next step's gates). Returns the gradient of the step's (unclipped)
    projection, in the matmul dtype, and the part of the hidden state's gradient that passes to the state before.
    """
    grad_hidden = grad_hidden + grad_hidden_recurrent.float()
    grad_step = (grad_output.float() + grad_hidden) * active
    grad_step = torch.where(projected.float().abs() <= proj_clip, grad_step, 0.0)
    return grad_step.to(projected.dtype), torch.where(active, 0.0, grad_hidden)


class ClippedLstmRecurrence(torch.autograd.Function):
    """
    The recurrent part of one bilm-tf LSTM layer, all directions at once (time-major):

    `input_gates` `(time, directions, rows, 4 * lstm_dim)`: the input projection with its bias and the forget bias;
    `active` `(time, 1, rows, 1)` bool: which rows read each step; `cell`/`hidden` `(directions, rows, ·)` the
    initial state (cell in fp32, hidden in the matmul dtype); `recurrent` `(directions, projection_dim,
    4 * lstm_dim)` and `projection` `(directions, lstm_dim, projection_dim)` the transposed weights in the matmul
    dtype. Returns the outputs `(time, directions, rows, projection_dim)` (fp32, zero where inactive) and the final
    state. Per step: two matmuls and two fused element-wise kernels each way.
    """

    @staticmethod
    def forward(ctx, input_gates, active, cell, hidden, recurrent, projection, cell_clip, proj_clip):
        cells, hiddens, gates, projection_inputs, projected, outputs = [cell], [hidden], [], [], [], []
        for t in range(input_gates.shape[0]):
            step_gates, cell, projection_input = _cell_forward(
                input_gates[t], torch.bmm(hidden, recurrent), cell, active[t], cell_clip
            )
            projected.append(torch.bmm(projection_input, projection))
            hidden, output = _projection_forward(projected[-1], hidden, active[t], proj_clip)
            for saved, value in ((gates, step_gates), (cells, cell), (hiddens, hidden),
                                 (projection_inputs, projection_input), (outputs, output)):
                saved.append(value)
        if any(ctx.needs_input_grad):  # inference keeps nothing
            saved = [torch.stack(values) for values in (gates, cells, hiddens, projection_inputs, projected)]
            ctx.save_for_backward(active, *saved, recurrent, projection)
            ctx.clips = (cell_clip, proj_clip)
        return torch.stack(outputs), cell, hidden

    @staticmethod
    def backward(ctx, grad_outputs, grad_final_cell, grad_final_hidden):
        active, gates, cells, hiddens, projection_inputs, projected, recurrent, projection = ctx.saved_tensors
        cell_clip, proj_clip = ctx.clips
        grad_cell, grad_hidden = grad_final_cell.float(), grad_final_hidden.float()
        grad_hidden_recurrent = torch.zeros_like(grad_hidden)
        grad_gates, grad_projected = [], []
        for t in reversed(range(gates.shape[0])):
            grad_step, grad_hidden = _projection_backward(
                projected[t], grad_outputs[t], grad_hidden, grad_hidden_recurrent, active[t], proj_clip
            )
            grad_projection_input = torch.bmm(grad_step, projection.transpose(1, 2))
            step_gates, grad_cell = _cell_backward(gates[t], cells[t], grad_cell, grad_projection_input, active[t],
                                                   cell_clip)
            step_gates = step_gates.to(recurrent.dtype)
            grad_hidden_recurrent = torch.bmm(step_gates, recurrent.transpose(1, 2))
            grad_gates.append(step_gates)
            grad_projected.append(grad_step)
        grad_gates, grad_projected = torch.stack(grad_gates[::-1]), torch.stack(grad_projected[::-1])
        grad_hidden = grad_hidden + grad_hidden_recurrent.float()
        # Weight gradients: one matmul over every step and row, per direction.
        steps_rows = lambda x: x.transpose(0, 1).flatten(1, 2)  # (time, dirs, rows, n) -> (dirs, time * rows, n)
        grad_recurrent = torch.bmm(steps_rows(hiddens[:-1]).transpose(1, 2), steps_rows(grad_gates))
        grad_projection = torch.bmm(steps_rows(projection_inputs).transpose(1, 2), steps_rows(grad_projected))
        return grad_gates, None, grad_cell, grad_hidden, grad_recurrent, grad_projection, None, None


def _matmul_dtype(reference: torch.Tensor) -> torch.dtype:
    if torch.is_autocast_enabled(reference.device.type):
        return torch.get_autocast_dtype(reference.device.type)
    return reference.dtype


def _stacked(layers, name: str) -> torch.Tensor:
    return torch.stack([getattr(layer, name).weight for layer in layers])


def lstm_layer(layers, inputs, recurrence, cell, hidden):
    """
    One layer of every direction: `layers` (one `ElmoLstmLayer` per direction), `inputs` `(time, directions, rows,
    projection_dim)`, state `(directions, rows, ·)`, `recurrence(input_gates, cell, hidden, recurrent, projection,
    cell_clip, proj_clip)` the recurrent part (`ClippedLstmRecurrence` with the batch's `active` steps, or the
    packed one of elmo_cpu). Returns the outputs (fp32, zero where inactive) and the final `(cell, hidden)`.
    """
    first = layers[0]
    dtype = _matmul_dtype(inputs)
    lstm_dim = first.input_proj.out_features // 4
    # TensorFlow adds the forget bias at every step; folded into the input projection's bias once here.
    forget_bias = torch.zeros(4 * lstm_dim, device=inputs.device, dtype=torch.float32)
    forget_bias[2 * lstm_dim : 3 * lstm_dim] = FORGET_GATE_BIAS
    weight = _stacked(layers, "input_proj").to(dtype)
    bias = torch.stack([layer.input_proj.bias for layer in layers]).float() + forget_bias
    input_gates = torch.einsum("tdrp,dgp->tdrg", inputs.to(dtype), weight) + bias[None, :, None]
    recurrent = _stacked(layers, "recurrent_proj").to(dtype).transpose(1, 2)
    if isinstance(first.output_proj, nn.Linear):
        projection = _stacked(layers, "output_proj").to(dtype).transpose(1, 2)
    else:  # no projection: an identity matrix keeps one code path (such models are small)
        projection = torch.eye(lstm_dim, device=inputs.device, dtype=dtype).expand(len(layers), -1, -1)
    inf = float("inf")
    cell_clip = inf if first.cell_clip is None else float(first.cell_clip)
    proj_clip = inf if first.proj_clip is None else float(first.proj_clip)
    return recurrence(input_gates, cell.float(), hidden.to(dtype), recurrent, projection, cell_clip, proj_clip)


def bilstm(module, tokens, mask, state, output_layers, words_only, dropout_masks=None, recurrence=None):
    """
    `ElmoBiLstm.forward`'s function (same arguments and results), with `module`'s parameters. `recurrence`: see
    `lstm_layer`; by default `ClippedLstmRecurrence`, every row reading every step.
    """
    from .modeling_elmo import reverse_within_lengths  # here: modeling_elmo imports this module

    lengths = mask.sum(dim=1)
    # (time, directions, rows, width): the backward stack reads each sentence reversed within its length.
    layer_input = torch.stack([tokens, reverse_within_lengths(tokens, lengths)]).permute(2, 0, 1, 3)
    if recurrence is None:
        active = mask.t()[:, None, :, None]

        def recurrence(input_gates, cell, hidden, *weights_and_clips):
            return ClippedLstmRecurrence.apply(input_gates, active, cell, hidden, *weights_and_clips)

    outputs, final_cells, final_hiddens = [], [], []
    for index, layers in enumerate(zip(module.forward_layers, module.backward_layers)):
        initial = (state[0][index], state[1][index])
        if dropout_masks is not None:
            layer_input = layer_input * dropout_masks[index].permute(2, 0, 1, 3)  # (time, directions, rows, width)
        if layers[0].gradient_checkpointing and module.training:
            output, cell, hidden = layers[0]._gradient_checkpointing_func(
                lstm_layer, layers, layer_input, recurrence, *initial
            )
        else:
            output, cell, hidden = lstm_layer(layers, layer_input, recurrence, *initial)
        if index > 0 and module.use_skip_connections:
            output = output + layer_input
        outputs.append(output)
        final_cells.append(cell)
        final_hiddens.append(hidden)
        layer_input = output
    layer_outputs = []
    for index in output_layers:
        forward, backward = outputs[index].to(tokens.dtype).permute(1, 2, 0, 3).unbind(0)  # (rows, time, width) each
        output = torch.cat([forward, reverse_within_lengths(backward, lengths)], dim=-1)
        if words_only:
            # Word w sits at position w + 1; it is a word (not </S>) while w + 2 < length.
            output = output[:, 1:-1] * mask[:, 2:, None]
        layer_outputs.append(output)
    final_state = (torch.stack(final_cells).to(state[0].dtype), torch.stack(final_hiddens).to(state[1].dtype))
    return layer_outputs, final_state
