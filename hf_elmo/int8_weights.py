"""int8 weights for CPU inference: the biLM's linear maps stored as int8 with one bf16 scale per output channel.

Each recurrence step of "original" reads each direction's whole recurrent and projection weights for a few columns:
stored as int8 they are a quarter of the bytes, which pays where the steps are bound by memory (few sentences
still being read). At batch 32 most steps are bound by arithmetic instead, and the speed comes from "bf16-dot"
below. A product rounds its input columns to bf16, sums the int8 values times them in fp32, rounds each sum to
bf16 once, and multiplies it by its row's scale in fp32 (exact: both are bf16). Two of torch's own kernels compute
the sums; a process runs every product on one of them (`product_kernel`), so that a sentence's vectors do not
depend on its batch. Which one is measured, as the "cpu" path's fp32 products are (`cpu_tuning`): when the
process first quantizes a model, both kernels and the fp32 product are timed on its largest map
(`measure_kernels`), the faster kernel is kept, and where neither beats fp32 a warning says so (int8 then saves
memory, not time). Which wins depends on the CPU, not on whether it has bf16 instructions alone: on a Zen 4
"bf16-dot" ran "original" at 1.5x fp32; on an Intel Xeon with AMX it ran at 0.67x.

- "bf16-dot": the int8 values are widened to bf16, which holds every integer up to 256 exactly, and multiplied by
  oneDNN's bf16 matmul (`torch.mm`), which on a CPU with bf16 dot-product instructions (AVX512-BF16 or AMX) does
  two multiply-adds where fp32 does one, and elsewhere is emulated. Measured on a Zen 4 core, 390 GFLOP/s at 32
  columns, against 145 for "int8-pack" and 115 for MKL's fp32 sgemm on the same shape (benchmarks/README.md). The
  recurrence widens each direction's input, recurrent and projection weights once, into buffers it reuses for
  every product (`RecurrenceProducts`); other products widen a block of rows at a time.
- "int8-pack": torch's int8 weight-only kernel (`aten._weight_int8pack_mm`, the kernel torchao's int8 weight-only
  mode calls on a CPU), which widens to fp32 inside; vectorised for AVX2 and AVX-512, and only for bf16
  activations (fp16 and fp32 activations measured 10-30x slower). It is handed scales of 1, and the scales applied
  afterwards, so that both kernels compute one function, up to the order of each sum.

`HF_ELMO_INT8_KERNEL=int8-pack` (or `bf16-dot`) in the environment, read when weights are quantized, picks the
kernel instead, with no timing: for vectors that are the same on every machine, to the last bit.
`HF_ELMO_CPU_TUNING=fixed` skips the timing too, and takes "bf16-dot" where the CPU has bf16 dot products,
"int8-pack" elsewhere.

Both are torch's own kernels, chosen over torchao's int8 weight-only tensor subclass because the "cpu"
implementation multiplies feature-major (`weight @ columns`, into preallocated buffers), which the subclass does
not dispatch, and the kernel is all it would add.

What changes from fp32: each weight is rounded to 255 levels per output channel (symmetric, scale ≈ max |w| / 127),
each product's input and output are rounded to bf16. The cell state, the gates' non-linearities, the clipping, the
char CNN's convolutions and embeddings stay in fp32: a clip is still exact at its limit. The error this costs is
measured in benchmarks/README.md; the tests hold it to `INT8_FIXTURE_BOUND` on bilm-tf's fixture, on both kernels.
"""

import functools
import logging
import os

import torch
from torch import nn

from .configuration_elmo import ELMO_IMPLEMENTATIONS
from .cpu_tuning import best_times, few_column_matmul, product_columns, tuning_is_fixed


logger = logging.getLogger(__name__)


# The int8 levels are -127..127 (symmetric: -128 is left out so that w and -w round alike).
INT8_LEVELS = 127
# torch's AVX-512 int8 kernel reads the inner dimension in blocks of this many values (other widths crash the
# process): narrower weights are stored with zero columns up to a multiple of it.
KERNEL_WIDTH_MULTIPLE = 16
# torch's CPU kernel levels (`torch.backends.cpu.get_cpu_capability()`) on which the int8 kernel is vectorised.
VECTORISED_CPU_KERNELS = ("AVX2", "AVX512")
# The environment variable that picks the kernel (see the module's docstring).
KERNEL_VARIABLE = "HF_ELMO_INT8_KERNEL"
KERNELS = ("bf16-dot", "int8-pack")
# "bf16-dot" widens a weight that is not prepared (`RecurrenceProducts`) this many values at a time (2 MB of bf16):
# each block's product stays large while the widened copy stays small.
WIDENED_BLOCK_VALUES = 1 << 20


def has_bf16_dot_products() -> bool:
    """Whether this CPU has bf16 dot-product instructions (AVX512-BF16 or AMX), on which oneDNN's bf16 matmuls do two
    multiply-adds where fp32 does one (elsewhere they are emulated, slower than fp32)."""
    queries = ("_is_avx512_bf16_supported", "_is_amx_tile_supported")
    # Private queries of `torch.cpu`: a torch without them is taken to have neither.
    return any(getattr(torch.cpu, query, lambda: False)() for query in queries)


def product_kernel() -> str:
    """The kernel int8 weights quantized now run on: `HF_ELMO_INT8_KERNEL` when set; else the one this process
    measured faster (`measure_kernels`, when the first model was quantized); else, before any measurement or with
    `HF_ELMO_CPU_TUNING=fixed`, "bf16-dot" on a CPU with bf16 dot products and "int8-pack" elsewhere."""
    chosen = os.environ.get(KERNEL_VARIABLE, "").strip().lower()
    if chosen and chosen not in KERNELS:
        raise Int8CpuError(f"{KERNEL_VARIABLE}={chosen!r}: expected one of {', '.join(KERNELS)}, or unset.")
    if chosen:
        return chosen
    if _MEASURED_KERNEL and not tuning_is_fixed():
        return _MEASURED_KERNEL[0]
    return "bf16-dot" if has_bf16_dot_products() else "int8-pack"


# The kernel this process measured faster, once measured (`measure_kernels`): every later product runs on it.
_MEASURED_KERNEL: list[str] = []
# The column counts a measurement multiplies: a recurrence's last steps, and a batch of 32 sentences.
MEASURED_COLUMNS = (4, 32)


def measure_kernels(weight: torch.Tensor, quantized: "Int8Linear") -> dict[str, float] | None:
    """
    Time both int8 kernels and the fp32 product (`cpu_tuning.few_column_matmul`, itself measured) on a model's
    largest linear map, `weight` in fp32 and `quantized` its `Int8Linear` (the one the model keeps), as a recurrence
    step runs them (into a buffer, adding to what it holds; "bf16-dot" on weights widened once), for
    `MEASURED_COLUMNS` columns, the best of three each, interleaved; keep the faster int8 kernel for this process
    (`quantized` included) and log the seconds. Which is faster depends on the CPU: on a Zen 4 "bf16-dot" ran
    "original" at 1.5x fp32, on an Intel Xeon with AMX it ran at 0.67x. Where neither beats fp32, a warning says
    so. Measured once per process, and not at all when `HF_ELMO_INT8_KERNEL` or `HF_ELMO_CPU_TUNING=fixed` is set
    (returns None).
    """
    if _MEASURED_KERNEL or os.environ.get(KERNEL_VARIABLE, "").strip() or tuning_is_fixed():
        return None
    weight = weight.detach().float()
    pack = quantized
    pack.kernel = "int8-pack"  # its own products are the "int8-pack" ones; the kept kernel is set below
    seconds = dict.fromkeys(("fp32", *KERNELS), 0.0)
    with torch.no_grad():
        for count in MEASURED_COLUMNS:
            columns, out = weight.new_ones(weight.shape[1], count), weight.new_zeros(weight.shape[0], count)
            widened = RecurrenceProducts(pack, count, lambda name, size, dtype=torch.float32, zeroed=False:
                                         torch.zeros(size, dtype=dtype))
            runs = {"fp32": lambda: few_column_matmul(weight, columns, out, out),
                    "bf16-dot": lambda: widened.columns_product(columns, out, out),
                    "int8-pack": lambda: pack.columns_product(columns, out, out)}
            best = best_times(runs)
            for name in seconds:
                seconds[name] += best[name]
    kernel = faster_kernel(seconds)
    _MEASURED_KERNEL.append(kernel)
    quantized.kernel = kernel
    shown = ", ".join(f"{name} {1e3 * value:.2f} ms" for name, value in seconds.items())
    if seconds[kernel] >= seconds["fp32"]:
        logger.warning("int8 weights multiply slower than fp32 on this CPU (%s, for a %s weight): they save memory "
                       "here, not time; load the model without int8_weights for speed", shown, tuple(weight.shape))
    else:
        logger.info("int8 weights run on %s, measured fastest here (%s, for a %s weight)", kernel, shown,
                    tuple(weight.shape))
    return seconds


def faster_kernel(seconds: dict[str, float]) -> str:
    """The int8 kernel with the fewer of `seconds` (a tie keeps "bf16-dot", the first of `KERNELS`)."""
    return min(KERNELS, key=seconds.get)


def _scaled_into(out: torch.Tensor, product: torch.Tensor, scale: torch.Tensor, add: torch.Tensor | None,
                 widened: torch.Tensor | None = None) -> torch.Tensor:
    """
    `out = add + scale * product` for an unscaled bf16 `product`, in fp32. `add` may be `out` itself; then `product`
    is widened to fp32 first, into `widened` when given (`addcmul_` would widen it into a new temporary).
    """
    if add is out:
        widened = product.float() if widened is None else widened[: product.numel()].view_as(product).copy_(product)
        return out.addcmul_(widened, scale)
    # Widened, scaled, then added: three quick passes (`torch.addcmul` of a bf16 operand measured 3x slower).
    out.copy_(product).mul_(scale)
    return out if add is None else out.add_(add)


def quantized_rows(weight: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """
    `(weight_int8, scale)`: each row of `weight` rounded to the nearest multiple of its scale, the bf16 number
    nearest `max |w| / 127`. bf16 is within 2^-8 of it, so the row's largest value is 127 scales to within half a
    level (126.51 to 127.49): it rounds to 127 and no value is clipped. That also makes quantizing idempotent: the
    values `weight_int8 * scale` stand for (exact in fp32) quantize to these same int8 values and scales, which is
    how a model with int8 weights saves and loads (`Int8Linear`'s state dict).
    """
    weight = weight.detach().float()
    largest = weight.abs().amax(dim=1)
    # An all-zero row gets scale 1 (its int8 row is zero whatever the scale).
    scale = torch.where(largest > 0, largest / INT8_LEVELS, torch.ones_like(largest)).to(torch.bfloat16)
    weight_int8 = torch.round(weight / scale.float()[:, None]).clamp_(-INT8_LEVELS, INT8_LEVELS).to(torch.int8)
    return weight_int8, scale


class Int8Linear(nn.Module):
    """
    `nn.Linear`'s function with an int8 weight `(out_features, in_features)` and a bf16 scale per output row
    (`weight ≈ weight_int8 * weight_scale[:, None]`), for CPU inference only (no gradient reaches the weight).
    Inputs and outputs stay fp32; the product runs on bf16 activations (see the module's docstring).
    """

    def __init__(self, weight_int8: torch.Tensor, weight_scale: torch.Tensor, bias: torch.Tensor | None,
                 bilm_tf_variable: str | None = None):
        """`weight_scale` in bf16 (exact in fp32, where the products are scaled)."""
        super().__init__()
        self.out_features, self.in_features = weight_int8.shape
        self.bilm_tf_variable = bilm_tf_variable
        padding = -self.in_features % KERNEL_WIDTH_MULTIPLE
        self.register_buffer("weight_int8", nn.functional.pad(weight_int8, (0, padding)))
        self.register_buffer("weight_scale", weight_scale)
        self.bias = None if bias is None else nn.Parameter(bias.detach().clone(), requires_grad=False)
        # "int8-pack" is handed these scales, the scales applied afterwards (see the module's docstring).
        self.register_buffer("unit_scale", torch.ones_like(weight_scale), persistent=False)
        # The kernel every product of this weight runs on (`product_kernel`).
        self.kernel = product_kernel()

    @classmethod
    def from_linear(cls, linear: nn.Linear) -> "Int8Linear":
        """`linear`'s weight rounded per output row to int8 (`quantized_rows`), its bias kept in fp32."""
        bias = None if linear.bias is None else linear.bias.detach().float()
        return cls(*quantized_rows(linear.weight), bias, getattr(linear, "bilm_tf_variable", None))

    def dequantized_weight(self) -> torch.Tensor:
        """The fp32 weight these int8 values stand for (what the state dict holds; never used to compute)."""
        return self.weight_int8[:, : self.in_features].float() * self.weight_scale.float()[:, None]

    # The state dict holds `nn.Linear`'s entries, the weight as the fp32 values the int8 ones stand for, so that a
    # model with int8 weights saves (a Trainer checkpoint of a head over a frozen int8 biLM included) as a folder of
    # fp32 weights. Quantizing them gives back these int8 values and scales bit for bit: int8 times a bf16 scale is
    # exact in fp32, and each row's largest value is 127 of its scale. Loading quantizes the weight it is given.
    def _save_to_state_dict(self, destination, prefix, keep_vars):
        destination[prefix + "weight"] = self.dequantized_weight()
        if self.bias is not None:
            destination[prefix + "bias"] = self.bias if keep_vars else self.bias.detach()

    def _load_from_state_dict(self, state_dict, prefix, local_metadata, strict, missing_keys, unexpected_keys,
                              error_msgs):
        names = ("weight",) if self.bias is None else ("weight", "bias")
        missing_keys.extend(prefix + name for name in names if prefix + name not in state_dict)
        if strict:
            unexpected_keys.extend(key for key in state_dict if key.startswith(prefix)
                                   and "." not in key[len(prefix):] and key[len(prefix):] not in names)
        shape = (self.out_features, self.in_features)
        weight, bias = state_dict.get(prefix + "weight"), state_dict.get(prefix + "bias")
        with torch.no_grad():
            if weight is not None and tuple(weight.shape) != shape:
                error_msgs.append(f"size mismatch for {prefix}weight: copying a param with shape "
                                  f"{tuple(weight.shape)}, the model has {shape}.")
            elif weight is not None:
                values, scale = quantized_rows(weight)
                self.weight_int8[:, : self.in_features].copy_(values)
                self.weight_scale.copy_(scale)
            if self.bias is not None and bias is not None:
                self.bias.copy_(bias)

    def widened_weight(self, out: torch.Tensor | None = None) -> torch.Tensor:
        """The int8 values as bf16 `(out_features, in_features)` (exact), into `out` when given."""
        values = self.weight_int8[:, : self.in_features]
        return values.to(torch.bfloat16) if out is None else out.copy_(values)

    def int8_pack_product(self, columns: torch.Tensor) -> torch.Tensor:
        """The unscaled product of bf16 `columns` `(in_features, n)` on "int8-pack": bf16 `(out_features, n)` (a
        transposed view)."""
        rows = nn.functional.pad(columns.t(), (0, self.weight_int8.shape[1] - self.in_features))
        return torch.ops.aten._weight_int8pack_mm(rows.contiguous(), self.weight_int8, self.unit_scale).t()

    def forward(self, inputs: torch.Tensor) -> torch.Tensor:
        rows = inputs.reshape(-1, self.in_features)
        output = rows.new_empty(rows.shape[0], self.out_features)
        bias = None if self.bias is None else self.bias[:, None]
        # Feature-major products written through a transposed view: the output comes out row-major.
        self.columns_product(rows.t(), out=output.t(), add=bias)
        return output.view(*inputs.shape[:-1], self.out_features)

    def columns_product(self, columns: torch.Tensor, out: torch.Tensor | None = None,
                        add: torch.Tensor | None = None) -> torch.Tensor:
        """
        `add + weight @ columns` for feature-major fp32 `columns` `(in_features, n)`, the shape the "cpu"
        implementation multiplies in (as `cpu_tuning.few_column_matmul`): written into `out` when given, else
        returned. `add` may be `out` itself, or `(out_features, 1 or n)`.
        """
        count = columns.shape[1]
        out = columns.new_empty(self.out_features, count) if out is None else out
        scale = self.weight_scale.to(out.dtype)[:, None]
        columns = columns.to(torch.bfloat16)
        if self.kernel == "int8-pack":
            return _scaled_into(out, self.int8_pack_product(columns), scale, add)
        # "bf16-dot", the weight widened a block of rows at a time, each block's product scaled into its rows.
        columns = nn.functional.pad(columns, (0, product_columns(count) - count))
        block_rows = max(1, WIDENED_BLOCK_VALUES // self.in_features)
        widened = columns.new_empty(min(block_rows, self.out_features), self.in_features)
        for start in range(0, self.out_features, block_rows):
            rows = slice(start, min(start + block_rows, self.out_features))
            weight = widened[: rows.stop - start].copy_(self.weight_int8[rows, : self.in_features])
            target = out[rows]
            target_add = target if add is out else None if add is None else add[rows]
            _scaled_into(target, torch.mm(weight, columns)[:, :count], scale[rows], target_add)
        return out

    def extra_repr(self) -> str:
        return (f"in_features={self.in_features}, out_features={self.out_features}, int8 per-row scales, "
                f"kernel={self.kernel!r}")


class RecurrenceProducts:
    """
    An `Int8Linear` on "bf16-dot" prepared for the many products one direction of a recurrence layer runs, of at
    most `max_columns` columns (each step's few; each block of positions' input gates): its int8 values widened to
    bf16 once, and the buffers every product reuses, all from `buffer(name, numel, dtype=..., zeroed=False)` (the
    caller's scratch memory, shared between layers). Widening per product would cost a third of a step's product
    and about as much as a block's input product ("original", 128 positions: 5.2-6.4 against 3.1-3.7 ms here);
    allocating per step fragments the heap (measured: +30-60 MiB peak RSS on "original").
    """

    def __init__(self, linear: Int8Linear, max_columns: int, buffer):
        out_features, in_features = linear.out_features, linear.in_features
        width = product_columns(max_columns)
        self.weight = linear.widened_weight(out=buffer("weight", out_features * in_features, dtype=torch.bfloat16)
                                            .view(out_features, in_features))
        self.scale = linear.weight_scale.float()[:, None]
        self.columns = buffer("columns", in_features * width, dtype=torch.bfloat16, zeroed=True)
        self.product = buffer("product", out_features * width, dtype=torch.bfloat16)
        # Only a product added into its own output widens it first (`_scaled_into`): taken on the first such call.
        self.widened_product = functools.cache(functools.partial(buffer, "widened_product", out_features * max_columns,
                                                                 dtype=torch.float32))

    def columns_product(self, columns: torch.Tensor, out: torch.Tensor, add: torch.Tensor | None = None):
        """`Int8Linear.columns_product` for `columns` `(in_features, n <= max_columns)`, into `out`."""
        count, width = columns.shape[1], product_columns(columns.shape[1])
        # Feature-major, `weight @ columns`, as the state is: rounding the input and widening the product are then
        # plain copies. Multiplied row-major instead (`rows @ weight.t()`, the same sums bit for bit), both were
        # transposing copies, which on an Intel Xeon with AMX made each product 1.2-2.7x slower than this (a Zen 4
        # measured row-major 25-35% faster for 2-8 columns, as fast up to 32: the few last steps of a batch).
        # Columns past `count` hold zeros or earlier steps' (finite) values: their products are discarded.
        rounded = self.columns[: columns.shape[0] * width].view(-1, width)
        rounded[:, :count] = columns
        product = self.product[: self.weight.shape[0] * width].view(-1, width)
        product = torch.mm(self.weight, rounded, out=product)[:, :count]
        return _scaled_into(out, product, self.scale, add, self.widened_product() if add is out else None)


class Int8CpuError(RuntimeError):
    """int8 weights cannot run on this CPU as asked: it has no fast kernel for them, or the kernel asked for is
    unknown."""


def check_int8_cpu() -> None:
    """Fail with one line unless this process can run int8 weights fast: torch's CPU kernels at AVX2 or better."""
    level = torch.backends.cpu.get_cpu_capability()
    if level not in VECTORISED_CPU_KERNELS:
        raise Int8CpuError(
            f"int8 weights need a CPU on which torch runs AVX2 or AVX-512 kernels; this one runs {level!r}, where "
            f"torch's int8 kernel is scalar code, slower than the fp32 model. Load the model without int8."
        )


def quantize_linear_maps(module: nn.Module, linear_type: type) -> None:
    """Replace every `linear_type` submodule of `module` by its `Int8Linear`, on the kernel this process measured
    faster on the largest of them (`measure_kernels`)."""
    linears = [child for child in module.modules() if isinstance(child, linear_type)]
    if not linears:
        return
    # The largest is quantized first, measured on, and kept: it is not quantized a second time.
    largest = max(linears, key=lambda linear: linear.weight.numel())
    quantized = {largest: Int8Linear.from_linear(largest)}
    measure_kernels(largest.weight, quantized[largest])
    _replace_linear_maps(module, linear_type, quantized)


def _replace_linear_maps(module: nn.Module, linear_type: type, quantized: dict) -> None:
    for name, child in list(module.named_children()):
        if isinstance(child, linear_type):
            setattr(module, name, quantized[child] if child in quantized else Int8Linear.from_linear(child))
        else:
            _replace_linear_maps(child, linear_type, quantized)


def holds_int8_weights(module: nn.Module) -> bool:
    """Whether `module` or any of its submodules is an `Int8Linear`."""
    return any(isinstance(child, Int8Linear) for child in module.modules())


def check_int8_run(module: nn.Module, implementation, dropout: bool = False) -> None:
    """
    int8 weights (`ElmoPreTrainedModel.quantize_int8`) are for CPU inference: they run on the "cpu" implementation,
    with no weight of `module` trainable and no LSTM dropout. Anything else fails here with one line, before any work.
    """
    if not holds_int8_weights(module):
        return
    # The parameters (char embeddings, convolutions, biases) stay fp32 beside the int8 maps; the maps' own buffers
    # may hold bf16 copies by design (the bf16-dot kernel).
    moved = next((p.dtype for p in module.parameters() if p.dtype != torch.float32), None)
    if moved is not None:
        raise ValueError(
            f"This model holds int8 weights, whose other weights and activations are fp32: it was moved to {moved}. "
            "Keep it in fp32 (int8 already takes the place of bf16), or load the model without int8_weights to run "
            "it in bf16."
        )
    if implementation is not ELMO_IMPLEMENTATIONS.get("cpu"):
        name = next(name for name, value in ELMO_IMPLEMENTATIONS.items() if value is implementation)
        raise ValueError(
            f"This model holds int8 weights, which run on the 'cpu' implementation only (inputs on the CPU, "
            f"elmo_implementation None or 'cpu'), not on {name!r}. Load the model without int8_weights for that."
        )
    if dropout or (torch.is_grad_enabled() and any(p.requires_grad for p in module.parameters())):
        raise ValueError(
            "This model holds int8 weights, which cannot be trained: keep its biLM frozen and without LSTM dropout, "
            "or load the model without int8_weights to train it."
        )


def quantize_model(model: nn.Module, linear_type: type) -> nn.Module:
    """
    `ElmoPreTrainedModel.quantize_int8`: the biLM's `linear_type` maps (the char CNN's highways and projection, each
    LSTM's input, recurrent and projection maps) become `Int8Linear`s, in place. About 1.5x fp32 for "original"
    where the CPU has bf16 dot products (`HF_ELMO_INT8_KERNEL` picks the kernel). The model is put in eval mode and
    its biLM frozen; the biLM then runs only on the "cpu" implementation and cannot be trained. Saved, it holds the
    fp32 values the int8 ones stand for (`Int8Linear`'s state dict).
    """
    check_int8_cpu()
    if any(p.device.type != "cpu" for p in model.parameters()):
        raise ValueError("quantize_int8() works on a model on the CPU (int8 weights are for CPU inference).")
    if any(p.dtype != torch.float32 for p in model.parameters()):
        raise ValueError("quantize_int8() works on an fp32 model: load it without torch_dtype.")
    quantize_linear_maps(model, linear_type)
    # Loaded weights may be views of the memory-mapped checkpoint, which stays mapped (and resident, once read
    # to be quantized) while any of them lives: the weights left in fp32 get memory of their own.
    for parameter in model.parameters():
        parameter.data = parameter.data.clone()
    # The biLM's other weights (char embeddings, convolutions) are frozen with it; a task head's own layers stay
    # trainable (a head may learn over a frozen int8 biLM).
    if hasattr(model, "freeze_base_model"):
        model.freeze_base_model(True)
    else:
        model.requires_grad_(False)
    return model.eval()
