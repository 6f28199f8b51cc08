"""The "cuda" implementation of ELMo: static shapes, no host syncs, a fused clipped LSTM recurrence.

Computes the function that `ElmoBiLstm.forward` specifies, on any device (the tests hold it to the reference on
the CPU), shaped for a GPU; the char CNN is the encoder's own (reference) computation:

- every batch row reads every step (finished rows keep their state, as in the specification), so shapes depend
  on the batch's padded size only and nothing is read back to the host;
- both directions of a layer advance together, as one batched matmul per step;
- the recurrence is `elmo_ops.ClippedLstmRecurrence`, with a hand-written backward: per step, two matmuls and
  two fused element-wise kernels each way (compiled with `torch.compile` on CUDA), instead of the dozen autograd
  nodes a step of the specification records. The weight gradients are one large matmul over all steps.

Clipping follows bilm-tf (TensorFlow's `clip_by_value`): the gradient is zero where a value was clipped.
Under autocast the matmuls run in the autocast dtype, the cell state and all element-wise maths in fp32.
"""

from .configuration_elmo import ElmoImplementation, register
from .elmo_ops import batched_bilstm


def bilstm(module, tokens, mask, state, output_layers, words_only, dropout_masks=None):
    """`ElmoBiLstm.forward`'s function (same arguments and results), every row computing every step."""
    return batched_bilstm(module, tokens, mask, state, output_layers, words_only, dropout_masks)


CUDA_IMPLEMENTATION = ElmoImplementation(bilstm=bilstm)
register("cuda", CUDA_IMPLEMENTATION)
