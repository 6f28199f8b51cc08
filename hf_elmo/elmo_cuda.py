"""The "cuda" implementation of ELMo: a fused clipped LSTM recurrence; static shapes and no host syncs wherever a
step may be compiled or recorded as a CUDA graph, packed rows in inference.

Computes the function that `ElmoCharacterEncoder.forward` and `ElmoBiLstm.forward` specify, on any device (the tests
hold it to the reference on the CPU), shaped for a GPU:

- both directions of a layer advance together, as one batched matmul per step;
- the recurrence is `elmo_ops.ClippedLstmRecurrence`, with a hand-written backward: per step, two matmuls and
  two fused element-wise kernels each way (compiled with `torch.compile` on CUDA), instead of the dozen autograd
  nodes a step of the specification records. The weight gradients are one large matmul over all steps;
- where autograd records the call (training: the step `captured_step` records as CUDA graphs), inside
  `torch.compile` or a CUDA graph recording, and on the meta device, shapes are static: every batch row reads
  every step (finished rows keep their state, as in the specification), the char CNN reads every word and
  position, its filters as one product and one max (`elmo_ops.pooled_convolutions`), and nothing is read back to
  the host;
- elsewhere (inference, or a frozen biLM under a trained head) the lengths are read back once per call, as
  AllenNLP does: the biLSTM computes only the rows still reading at each step (rows sorted longest first; its
  input products too) and the char CNN each distinct word once. A batch then costs the sum of its lengths, not
  its rows times the longest: 2.3x less on the Wikipedia sample in batches of 256 sentences in reading order, and
  fewer words again for the char CNN.

Clipping follows bilm-tf (TensorFlow's `clip_by_value`): the gradient is zero where a value was clipped.
Under autocast the matmuls run in the autocast dtype, the cell state and all element-wise maths in fp32.
"""

import torch

from .configuration_elmo import ElmoImplementation, register
from .elmo_ops import batched_bilstm, needs_autograd, packed_bilstm, pooled_convolutions
from .modeling_elmo import char_encoder_reference


def keeps_static_shapes(module, tensor: torch.Tensor) -> bool:
    """Whether a call on `tensor` must keep static shapes and read nothing back to the host (see the module)."""
    return (
        needs_autograd(module, tensor)
        or torch.compiler.is_compiling()
        or tensor.device.type == "meta"
        or (tensor.is_cuda and torch.cuda.is_current_stream_capturing())
    )


def token_vectors(encoder, char_ids):
    """`ElmoCharacterEncoder.forward`'s function. In static shapes (training), every word with the convolutions as
    one product and one max (`elmo_ops.pooled_convolutions`); elsewhere the reference's, on each distinct word once:
    `torch.unique` finds them in one sort on the device, where the "cpu" implementation's `distinct_rows` checks its
    hash chunk by chunk on the host, a read back per chunk on a GPU."""
    if keeps_static_shapes(encoder, char_ids):
        return encoder.from_pooled(pooled_convolutions(encoder, char_ids))
    distinct, inverse = torch.unique(char_ids, dim=0, return_inverse=True)
    return char_encoder_reference(encoder, distinct)[inverse]


def bilstm(module, tokens, mask, state, output_layers, words_only, dropout_masks=None):
    """`ElmoBiLstm.forward`'s function (same arguments and results): every row computing every step, or rows packed."""
    run = batched_bilstm if keeps_static_shapes(module, tokens) else packed_bilstm
    return run(module, tokens, mask, state, output_layers, words_only, dropout_masks)


CUDA_IMPLEMENTATION = ElmoImplementation(bilstm=bilstm, token_vectors=token_vectors)
register("cuda", CUDA_IMPLEMENTATION)
