"""int8 weights for CPU inference: the biLM's linear maps stored as int8 with one bf16 scale per output channel.

On a CPU, "original" is bound by memory traffic: each recurrence step reads each direction's whole recurrent and
projection weights for a few columns. Stored as int8 they are a quarter of the bytes. The products run on torch's
own int8 weight-only kernel (`aten._weight_int8pack_mm`, the kernel torchao's int8 weight-only mode calls on a CPU):
it takes bf16 activations, widens both operands to fp32 inside, accumulates in fp32 and applies the scales, and
returns bf16. Chosen over torchao itself because the "cpu" implementation multiplies feature-major (`weight @
columns`, into preallocated buffers), which torchao's tensor subclass does not dispatch, and the kernel is all it
would add; over fp16 activations (more mantissa) because the kernel has vectorised code only for bf16 (fp16 and
fp32 activations measured 10-30x slower here).

What changes from fp32: each weight is rounded to 255 levels per output channel (symmetric, scale ≈ max |w| / 127),
each product's input and output are rounded to bf16. The cell state, the gates' non-linearities, the clipping, the
char CNN's convolutions and embeddings stay in fp32: a clip is still exact at its limit. The error this costs is
measured in benchmarks/README.md; the tests hold it to `INT8_FIXTURE_BOUND` on bilm-tf's fixture.
"""

import torch
from torch import nn


# The int8 levels are -127..127 (symmetric: -128 is left out so that w and -w round alike).
INT8_LEVELS = 127
# torch's AVX-512 int8 kernel reads the inner dimension in blocks of this many values (other widths crash the
# process): narrower weights are stored with zero columns up to a multiple of it.
KERNEL_WIDTH_MULTIPLE = 16
# torch's CPU kernel levels (`torch.backends.cpu.get_cpu_capability()`) on which the int8 kernel is vectorised.
VECTORISED_CPU_KERNELS = ("AVX2", "AVX512")


class Int8Linear(nn.Module):
    """
    `nn.Linear`'s function with an int8 weight `(out_features, in_features)` and a bf16 scale per output row
    (`weight ≈ weight_int8 * weight_scale[:, None]`), for CPU inference only (no gradient reaches the weight).
    Inputs and outputs stay fp32; the product runs on bf16 activations (see the module's docstring).
    """

    def __init__(self, weight_int8: torch.Tensor, weight_scale: torch.Tensor, bias: torch.Tensor | None,
                 bilm_tf_variable: str | None = None):
        """`weight_scale` in bf16 (the kernel multiplies by the scales in the activations' dtype)."""
        super().__init__()
        self.out_features, self.in_features = weight_int8.shape
        self.bilm_tf_variable = bilm_tf_variable
        padding = -self.in_features % KERNEL_WIDTH_MULTIPLE
        self.register_buffer("weight_int8", nn.functional.pad(weight_int8, (0, padding)))
        self.register_buffer("weight_scale", weight_scale)
        self.bias = None if bias is None else nn.Parameter(bias.detach().clone(), requires_grad=False)

    @classmethod
    def from_linear(cls, linear: nn.Linear) -> "Int8Linear":
        """
        `linear`'s weight rounded per output row to int8 (its bias kept in fp32): each value to the nearest multiple
        of its row's scale, the smallest bf16 number at least `max |w| / 127` (so that no value needs clipping).
        """
        weight = linear.weight.detach().float()
        largest = weight.abs().amax(dim=1)
        # An all-zero row gets scale 1 (its int8 row is zero whatever the scale).
        exact = torch.where(largest > 0, largest / INT8_LEVELS, torch.ones_like(largest))
        scale = exact.to(torch.bfloat16)
        scale = torch.where(scale.float() < exact, torch.nextafter(scale, torch.full_like(scale, torch.inf)), scale)
        weight_int8 = torch.round(weight / scale.float()[:, None]).clamp_(-INT8_LEVELS, INT8_LEVELS).to(torch.int8)
        bias = None if linear.bias is None else linear.bias.detach().float()
        return cls(weight_int8, scale, bias, getattr(linear, "bilm_tf_variable", None))

    def dequantized_weight(self) -> torch.Tensor:
        """The fp32 weight these int8 values stand for (for tests and error bounds; never used to compute)."""
        return self.weight_int8[:, : self.in_features].float() * self.weight_scale.float()[:, None]

    def _rows_product(self, rows: torch.Tensor) -> torch.Tensor:
        """`rows @ weight.t()` for `rows` `(n, in_features)`, in bf16 `(n, out_features)`."""
        width = self.weight_int8.shape[1]
        if width == self.in_features:
            rows = rows.to(torch.bfloat16, memory_format=torch.contiguous_format)
        else:
            rows = nn.functional.pad(rows.to(torch.bfloat16), (0, width - self.in_features))
        return torch.ops.aten._weight_int8pack_mm(rows, self.weight_int8, self.weight_scale)

    def forward(self, inputs: torch.Tensor) -> torch.Tensor:
        product = self._rows_product(inputs.reshape(-1, self.in_features)).view(*inputs.shape[:-1], -1)
        output = product.to(inputs.dtype)
        return output if self.bias is None else output.add_(self.bias)

    def columns_product(self, columns: torch.Tensor, out: torch.Tensor | None = None,
                        add: torch.Tensor | None = None) -> torch.Tensor:
        """
        `add + weight @ columns` for feature-major `columns` `(in_features, n)`, the shape the "cpu" implementation
        multiplies in (as `cpu_tuning.few_column_matmul`): written into `out` when given, else returned. `add` may
        be `out` itself or broadcast to it (a bias column).
        """
        product = self._rows_product(columns.t()).t()
        if out is None:
            return product.float() if add is None else add + product
        if add is None:
            return out.copy_(product)
        return torch.add(add, product, out=out)

    def extra_repr(self) -> str:
        return f"in_features={self.in_features}, out_features={self.out_features}, int8 per-row scales"


class Int8CpuError(RuntimeError):
    """This CPU cannot run int8 weights faster than fp32."""


def check_int8_cpu() -> None:
    """Fail with one line unless this process can run int8 weights fast: torch's CPU kernels at AVX2 or better."""
    level = torch.backends.cpu.get_cpu_capability()
    if level not in VECTORISED_CPU_KERNELS:
        raise Int8CpuError(
            f"int8 weights need a CPU on which torch runs AVX2 or AVX-512 kernels; this one runs {level!r}, where "
            f"torch's int8 kernel is scalar code, slower than the fp32 model. Load the model without int8."
        )


def quantize_linear_maps(module: nn.Module, linear_type: type) -> None:
    """Replace every `linear_type` submodule of `module` by its `Int8Linear`."""
    for name, child in list(module.named_children()):
        if isinstance(child, linear_type):
            setattr(module, name, Int8Linear.from_linear(child))
        else:
            quantize_linear_maps(child, linear_type)


def holds_int8_weights(module: nn.Module) -> bool:
    """Whether `module` or any of its submodules is an `Int8Linear`."""
    return any(isinstance(child, Int8Linear) for child in module.modules())
