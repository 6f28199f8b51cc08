"""The global L2 norm of many tensors, exact to fp32 rounding on any device: what gradient clipping divides by.

bilm-tf clips by TensorFlow's `global_norm` of all the gradients. torch 2.13's CPU `norm` (also `linalg.vector_norm`
and `_foreach_norm`) of one long fp32 vector comes out too small: by 2.5e-4 of itself at 8.4M values (one of
`original`'s LSTM matrices) and by 1% at 94M (all of `original` but the softmax, the captured step's flat gradient),
which moves every clipped update by as much. Norms of rows of `NORM_ROW` values, then the norm of those, are exact to
rounding (1.2e-8 and 4.3e-8 at those sizes) and no slower on the CPU (0.7 ms against 1.2 ms at 8.4M values, 11 ms
against 14 ms at 94M, 2-core Zen 4); on a GPU, where the captured and eager steps' norms already agreed (an H100:
weights 6e-8 apart), this adds two small kernels a tensor.
"""

import torch


# Values per row: short enough that a row's own sum of squares is exact to rounding, long enough that the rows'
# norms are few (23k for 94M values).
NORM_ROW = 4096


def global_norm(tensors) -> torch.Tensor:
    """The L2 norm of all the values of `tensors` together, as a 0-dim fp32 tensor (0 for none): static shapes, no
    host read, so that it records in a CUDA graph and compiles whole."""
    parts = []
    for tensor in tensors:
        values = tensor.reshape(-1).float()
        whole = values.numel() - values.numel() % NORM_ROW
        if whole:
            parts.append(torch.linalg.vector_norm(values[:whole].view(-1, NORM_ROW), dim=1))
        if whole < values.numel():
            parts.append(torch.linalg.vector_norm(values[whole:]).view(1))
    if not parts:
        return torch.zeros(())
    return torch.linalg.vector_norm(torch.cat(parts))
