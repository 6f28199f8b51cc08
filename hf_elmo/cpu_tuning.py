"""CPU tuning that is measured, not assumed: how the CPU's products are handed to the libraries.

Each step of the CPU recurrence multiplies a tall weight by one column per sentence still being read. Some CPU BLAS
builds share such a product between threads badly at some column counts, some take several times longer for a
few columns than for a few more, and on some CPUs oneDNN's fp32 kernels run a few columns two to three times
faster than the BLAS (MKL on AMD's Zen 4: benchmarks/README.md). So, on this process's first product of each
shape, this module times the alternatives and keeps the fastest: BLAS, BLAS on row blocks or oneDNN
(`measured_product`), and extra columns of finished rows or not (`step_columns`). Training's large row-major
products (`matmul`) go to oneDNN or stay on the BLAS by one measurement per process (`onednn_trains`). The choices
live here, in three caches, and nowhere else.

Two processes may therefore choose differently, and a product's last bit may differ with its column count. Where
that matters (a bit-exact comparison across processes or machines), set `HF_ELMO_CPU_TUNING=fixed` in the
environment before the first forward (it is read when each choice is first made; reading it on every product
cost 2% of "small"'s speed): every product is then plain BLAS and every step computes exactly its rows, with no
timing at all. Results are the same function either way; the tests hold every way to the reference.
"""

import functools
import logging
import os
import time
from collections.abc import Callable

import torch
from torch import nn


logger = logging.getLogger(__name__)


# The environment variable, and its value, that turn the measured choices off (see above).
TUNING_VARIABLE = "HF_ELMO_CPU_TUNING"
FIXED = "fixed"


def tuning_is_fixed() -> bool:
    return os.environ.get(TUNING_VARIABLE, "").strip().lower() == FIXED


# The ways `few_column_matmul` hands a product to the libraries (see there).
PLAIN, BLOCKED, ONEDNN = "plain", "blocked", "onednn"
# The recurrent matmul may be handed to BLAS as this many row blocks at most, where that measures faster (see
# `few_column_matmul`).
MAX_ROW_BLOCKS = 16
# A recurrence step may compute up to this many columns of finished rows besides the rows still reading, where
# that measures faster (see `step_columns`) ...
MAX_EXTRA_COLUMNS = 16
# ... by at least this factor: a small gain is not worth a choice that timing noise could flip between runs (a
# product's rounding may differ with its column count) ...
MIN_STEP_SPEEDUP = 1.25
# ... and only for products that take longer than this: quicker ones are bound by dispatch, not arithmetic, and
# their timings are too noisy to choose by.
MIN_STEP_SECONDS = 50e-6
# oneDNN is chosen over the BLAS only where it measures this many times faster: where the two are close (most of
# "small"'s products), the choice would flip with timing noise, and each oneDNN shape keeps a kernel in memory.
MIN_ONEDNN_SPEEDUP = 1.25


def few_column_matmul(
    weight: torch.Tensor, columns: torch.Tensor, out: torch.Tensor | None = None, add: torch.Tensor | None = None
) -> torch.Tensor:
    """
    `add + weight @ columns` for a tall `weight` and a few `columns` (one per sentence still being read), written
    into `out` when given (without autograd) or returned as a new tensor. `add` may be `out` itself.

    Three ways, whichever this process measured fastest for the shape (`measured_product`): the BLAS product
    (PLAIN); the BLAS on row blocks of the weight as one batched matmul (BLOCKED: some BLAS builds share a product
    of few columns between threads badly, and row blocks keep every thread on whole blocks); oneDNN's fp32 linear
    (ONEDNN, `onednn_product`, where no gradient is needed). Which pays depends on the libraries, the processor and
    the thread count. GPUs, and `HF_ELMO_CPU_TUNING=fixed`, always get the plain product.
    """
    way = PLAIN if weight.device.type != "cpu" else measured_product(weight, columns.shape[1])[0]
    # oneDNN's op has no derivative; and `torch.backends.mkldnn.enabled = False` (or its `flags`) turns it off.
    if way == ONEDNN and (_needs_grad(weight, columns, add) or not torch.backends.mkldnn.enabled):
        way = PLAIN
    return _PRODUCTS_BY_WAY[way](weight, columns, out, add)


def _plain_product(weight, columns, out, add):
    if add is None:
        return torch.mm(weight, columns, out=out)
    return torch.addmm(add, weight, columns, out=out)


def _blocked_product(weight, columns, out, add):
    blocks = row_blocks(weight)
    weight = weight.view(blocks, -1, weight.shape[1])
    columns = columns.expand(blocks, *columns.shape)
    blocked_out = None if out is None else out.view(blocks, -1, columns.shape[-1])
    if add is None:
        product = torch.bmm(weight, columns, out=blocked_out)
    else:
        product = torch.baddbmm(add.view(blocks, -1, add.shape[1]), weight, columns, out=blocked_out)
    return product.view(-1, columns.shape[-1]) if out is None else out


def _needs_grad(*tensors: torch.Tensor | None) -> bool:
    return torch.is_grad_enabled() and any(t is not None and t.requires_grad for t in tensors)


def product_columns(count: int) -> int:
    """
    How many columns a oneDNN product computes to get `count` (the rest are discarded): 2, 4, 8, multiples of 8 up
    to 32, then powers of 2. oneDNN builds and keeps a kernel for every product shape it meets (0.5-0.7 MiB each,
    measured), and a recurrence over batches meets every column count up to the batch size: a few sizes bound
    that memory, for at most 7 columns' extra work up to 32, where the recurrence's steps are (larger products are
    a call's last block of positions or words). One column is multiplied as two: oneDNN computes a lone column as
    a matrix-vector product, which summed in another order in some of our processes, so that a sentence read
    alone got other vectors than in a batch (0.008 in "original"'s int8 outputs). From 2 columns up, each column's
    sums were the same bit for bit whatever the count and the column's place, in every process
    (tests/test_int8.py).
    """
    if 8 < count <= 32:
        return -(-count // 8) * 8
    return max(2, 1 << (count - 1).bit_length()) if count > 0 else 0


def has_onednn_linear(weight: torch.Tensor) -> bool:
    """Whether `onednn_product` can multiply `weight`: an fp32 CPU tensor, with torch built with oneDNN (and oneDNN
    not turned off, `torch.backends.mkldnn.enabled`)."""
    return (
        weight.device.type == "cpu"
        and weight.dtype == torch.float32
        and torch.backends.mkldnn.is_available()
        and torch.backends.mkldnn.enabled
        and hasattr(torch.ops.mkldnn, "_linear_pointwise")
    )


def onednn_product(
    weight: torch.Tensor, columns: torch.Tensor, out: torch.Tensor | None = None, add: torch.Tensor | None = None
) -> torch.Tensor:
    """
    `few_column_matmul`'s function (no autograd) through oneDNN's fp32 linear, the op torch's own compiler calls
    for linear layers on a CPU (`torch.ops.mkldnn._linear_pointwise`; `torch.mm` in fp32 always goes to the BLAS).
    The roles are swapped: the tall weight goes in as the linear's input rows and the columns as its weight, so the
    product comes out feature-major, as the recurrence keeps it (computed row-major, `columns.t() @ weight.t()`,
    it took 30-50% longer at 16-32 columns, most of that in transposing the result). It is computed on
    `product_columns(n)` columns, the rest zeros whose products are discarded.
    """
    count = columns.shape[1]
    padded = nn.functional.pad(columns, (0, product_columns(count) - count))
    product = torch.ops.mkldnn._linear_pointwise(weight, padded.t(), None, "none", [], "")[:, :count]
    if out is None:
        return product.contiguous() if add is None else torch.add(add, product)
    return out.copy_(product) if add is None else torch.add(add, product, out=out)


# The ways, by name (`few_column_matmul`, `_time_products`).
_PRODUCTS_BY_WAY = {
    PLAIN: _plain_product,
    BLOCKED: _blocked_product,
    ONEDNN: onednn_product,
}


def row_blocks(weight: torch.Tensor) -> int:
    """Into how many row blocks `few_column_matmul`'s blocked product splits `weight`: 256 rows or more each."""
    return max(2, min(MAX_ROW_BLOCKS, weight.shape[0] // 256))


# (weight shape, dtype, columns, threads) -> (way, seconds), as measured in this process.
_PRODUCTS: dict[tuple, tuple[str, float]] = {}


def measured_product(weight: torch.Tensor, columns: int) -> tuple[str, float]:
    """
    How `few_column_matmul` multiplies `weight` (on a CPU) by `columns` columns, and how long that takes here: the
    way (PLAIN, BLOCKED or ONEDNN) that ran fastest in a short measurement (the best of three products each,
    interleaved, each as a step runs it; oneDNN only if `MIN_ONEDNN_SPEEDUP` times faster than the BLAS), with
    that time. Measured once per shape, column count and thread count; with `HF_ELMO_CPU_TUNING=fixed`, never:
    (PLAIN, 0.0).
    """
    key = (tuple(weight.shape), weight.dtype, columns, torch.get_num_threads())
    if key not in _PRODUCTS:
        _PRODUCTS[key] = (PLAIN, 0.0) if tuning_is_fixed() else _time_products(weight, columns)
    return _PRODUCTS[key]


def _time_products(weight: torch.Tensor, columns: int) -> tuple[str, float]:
    # Each way timed as a step runs it: into a buffer, adding to what it holds (oneDNN's add is a pass of its own,
    # the BLAS's is free: 15% of a product of "small"'s shapes).
    with torch.no_grad():
        w, x = weight.detach(), weight.new_ones(weight.shape[1], columns)
        out = w.new_zeros(w.shape[0], columns)
        candidates = [PLAIN]
        # A matrix-vector product is never worth blocking.
        if columns > 1 and w.shape[0] % row_blocks(w) == 0:
            candidates.append(BLOCKED)
        if has_onednn_linear(w) and _onednn_runs(onednn_product, w, x, out):
            candidates.append(ONEDNN)
        best = best_times({way: functools.partial(_PRODUCTS_BY_WAY[way], w, x, out, out) for way in candidates})
    way = fastest_way(best)
    return way, best[way]


def _onednn_runs(product, *operands: torch.Tensor) -> bool:
    """Whether `product(*operands)`, a product by oneDNN's op, runs here: a torch build may register the op for a
    platform where it fails (it is private to torch's compiler); such a build simply keeps the BLAS."""
    try:
        product(*operands)
    except RuntimeError as error:
        shapes = " by ".join(str(tuple(operand.shape)) for operand in operands[:2])
        logger.debug("oneDNN's fp32 linear failed on a %s product (%s); using the BLAS", shapes, error)
        return False
    return True


def best_times(runs: dict[str, Callable[[], object]]) -> dict[str, float]:
    """Each run's best time of three, the runs interleaved (a slow moment of the machine falls on all of them)."""
    best = dict.fromkeys(runs, float("inf"))
    for _ in range(3):
        for name, run in runs.items():
            start = time.perf_counter()
            run()
            best[name] = min(best[name], time.perf_counter() - start)
    return best


def fastest_way(seconds: dict[str, float]) -> str:
    """The way to keep, given each way's measured `seconds`: the fastest BLAS way, or oneDNN where it is
    `MIN_ONEDNN_SPEEDUP` times faster than that."""
    fastest_blas = min((way for way in seconds if way != ONEDNN), key=seconds.get)
    return ONEDNN if seconds.get(ONEDNN, float("inf")) * MIN_ONEDNN_SPEEDUP < seconds[fastest_blas] else fastest_blas


# (weight shapes, dtype, rows, available, threads) -> columns, as chosen in this process.
_STEP_COLUMNS: dict[tuple, int] = {}


def step_columns(weights: list[torch.Tensor], rows: int, available: int) -> int:
    """
    How many state columns a recurrence step computes when its first `rows` columns are still reading and its
    first `available` (>= rows) columns hold finite states: `rows`, or up to `MAX_EXTRA_COLUMNS` more where the
    step's products (`few_column_matmul` with each of `weights`) measure at least `MIN_STEP_SPEEDUP` times faster
    on more columns. Some BLAS builds take several times longer for some small column counts than for a larger
    one (benchmarks/README.md); the extra columns are rows that have finished, whose results are never read.
    Products quicker than `MIN_STEP_SECONDS` are never padded, nor any with `HF_ELMO_CPU_TUNING=fixed`.
    """
    if weights[0].device.type != "cpu" or rows == available:
        return rows
    key = (*(tuple(weight.shape) for weight in weights), weights[0].dtype, rows, available, torch.get_num_threads())
    if key not in _STEP_COLUMNS:
        _STEP_COLUMNS[key] = rows if tuning_is_fixed() else _fastest_step_columns(weights, rows, available)
    return _STEP_COLUMNS[key]


def _fastest_step_columns(weights: list[torch.Tensor], rows: int, available: int) -> int:
    seconds = lambda columns: sum(measured_product(weight, columns)[1] for weight in weights)  # noqa: E731
    own = seconds(rows)
    if own < MIN_STEP_SECONDS:
        return rows
    best, best_seconds = rows, own / MIN_STEP_SPEEDUP
    for columns in range(rows + 1, min(available, rows + MAX_EXTRA_COLUMNS) + 1):
        if seconds(columns) < best_seconds:
            best, best_seconds = columns, seconds(columns)
    return best


# ---------------------------------------------------------------------------------------------------------------
# Training's large products (the recurrence with its hand-written backward, the sampled softmax)
# ---------------------------------------------------------------------------------------------------------------
# MKL, torch's fp32 BLAS, runs its AVX2 kernels on AMD processors, AVX-512 ones included, where oneDNN picks its
# kernels by instruction set: on a Zen 5 (benchmarks/README.md) oneDNN ran the pretraining step's products 1.4x to
# 2.9x faster. Whether it pays is measured once per process and thread count (`onednn_trains`), on products of the
# shapes a step makes, with `MIN_ONEDNN_SPEEDUP`'s margin, so that the choice does not flip between the processes
# of one machine (a run and its resumption).
# Products of fewer multiply-adds stay on the BLAS: dispatch-bound, and a tiny model (the tests') keeps the BLAS's
# rounding in every process.
MIN_ONEDNN_MACS = 1 << 20
# The products `onednn_trains` times: (rows, inner, columns, left operand transposed), a recurrence step's, the
# input or softmax products of many positions, and a weight gradient's (positions summed, read transposed).
_TRAINING_PRODUCTS = ((64, 256, 1024, False), (1024, 256, 1024, False), (256, 1024, 1024, True))
# threads -> whether oneDNN measured `MIN_ONEDNN_SPEEDUP` times faster than the BLAS, in this process.
_ONEDNN_TRAINS: dict[int, bool] = {}


def padded_rows(count: int) -> int:
    """
    The count that a oneDNN product of training computes for `count` rows (or summed positions): up to 16 as it
    is, above that rounded up to one of 8 steps per power of 2 (at most 1/8 more work). oneDNN builds and keeps a
    kernel for every shape it meets, and a run meets nearly every count of rows and positions: unpadded, the
    recipe's pretraining held 4.8 GiB more after 250 steps (benchmarks/README.md).
    """
    if count <= 16:
        return count
    step = 1 << (count.bit_length() - 4)
    return -(-count // step) * step


def onednn_trains(tensor: torch.Tensor) -> bool:
    """Whether `matmul` hands products of tensors like `tensor` (those large enough) to oneDNN: fp32 on a CPU,
    outside `torch.compile` and CPU autocast, with oneDNN measured clearly faster in this process (never with
    `HF_ELMO_CPU_TUNING=fixed`)."""
    if torch.compiler.is_compiling() or torch.is_autocast_enabled("cpu"):
        return False
    if not has_onednn_linear(tensor) or tuning_is_fixed():  # a CPU fp32 tensor, oneDNN built in and on
        return False
    threads = torch.get_num_threads()
    if threads not in _ONEDNN_TRAINS:
        _ONEDNN_TRAINS[threads] = _onednn_is_faster_for_training()
    return _ONEDNN_TRAINS[threads]


def training_products_choice() -> dict | None:
    """This process's `onednn_trains` choice at its thread count, for a checkpoint (`{"threads": n, "onednn": bool}`),
    or None where it made none (no product large enough yet, `HF_ELMO_CPU_TUNING=fixed`, no oneDNN)."""
    threads = torch.get_num_threads()
    return {"threads": threads, "onednn": _ONEDNN_TRAINS[threads]} if threads in _ONEDNN_TRAINS else None


def keep_training_products_choice(choice: dict) -> None:
    """Take a checkpoint's `training_products_choice` instead of measuring: a resumed run then rounds its products
    as the run it continues did (measured again, the choice flipped under load between a run and its resumption on
    a 2-core Zen 4, whose BLAS and oneDNN timed 24.2 and 24.5 ms in one process, 27.4 and 12.7 ms in another)."""
    threads, onednn = choice["threads"], choice["onednn"]
    if isinstance(threads, bool) or not isinstance(threads, int) or threads < 1 or not isinstance(onednn, bool):
        raise ValueError(f"cpu_products must hold a thread count >= 1 and true or false, got {choice!r}")
    _ONEDNN_TRAINS[threads] = onednn


def onednn_multiplies(tensor: torch.Tensor, macs: int) -> bool:
    """Whether a product of `macs` multiply-adds with operands like `tensor` goes to oneDNN: at least
    `MIN_ONEDNN_MACS` of them, and `onednn_trains`."""
    return macs >= MIN_ONEDNN_MACS and onednn_trains(tensor)


def matmul(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """
    `a @ b` for 2-D operands, or 3-D ones batched over their first dim, where nothing records autograd (inside a
    hand-written forward or backward): through oneDNN's fp32 linear where `onednn_multiplies`, else `torch.bmm` or
    `torch.mm`. oneDNN computes `padded_rows` rows and positions (zeros added, and the
    extra rows dropped); callers whose operands would be costly to pad build them padded (`padded_cat`). The
    result may be a transposed view.
    """
    macs = a.shape[-2] * a.shape[-1] * b.shape[-1] * (a.shape[0] if a.dim() == 3 else 1)
    if not onednn_multiplies(a, macs) or b.dtype != torch.float32:
        # `bmm`/`mm`, not `torch.matmul`: the same kernels, without matmul's shape dispatch, which doubled the
        # host's time per product (3 against 6.5 us), paid by each step of a recurrence (benchmarks/gpu_proxies.py).
        return torch.bmm(a, b) if a.dim() == 3 else torch.mm(a, b)
    if a.dim() == 2:
        return _onednn_matmul(a, b)
    return torch.stack([_onednn_matmul(left, right) for left, right in zip(a, b)])


def padded_cat(tensors: list[torch.Tensor], dim: int, macs_per_row: int) -> torch.Tensor:
    """`torch.cat(tensors, dim)`, with zeros after them up to `padded_rows` of the total where the product that
    sums over them, of `macs_per_row` multiply-adds per row, goes to oneDNN (`onednn_multiplies`): the summed
    positions of a weight gradient, built once at the size `matmul` multiplies. Products that stay on the BLAS
    sum exactly the rows given, as they did before oneDNN was measured."""
    total = sum(t.shape[dim] for t in tensors)
    extra = padded_rows(total) - total if onednn_multiplies(tensors[0], total * macs_per_row) else 0
    if extra:
        shape = list(tensors[0].shape)
        shape[dim] = extra
        tensors = [*tensors, tensors[0].new_zeros(shape)]
    return torch.cat(tensors, dim=dim)


def _linear(x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    """`x @ w.T` by oneDNN's fp32 linear (see `onednn_product`)."""
    return torch.ops.mkldnn._linear_pointwise(x, w, None, "none", [], "")


def _onednn_matmul(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    (rows, inner), padded = a.shape, (padded_rows(a.shape[0]), padded_rows(a.shape[1]))
    if padded[1] != inner:  # zero terms in every sum
        a, b = nn.functional.pad(a, (0, padded[1] - inner)), nn.functional.pad(b, (0, 0, 0, padded[1] - inner))
    if padded[0] != rows:  # zero rows, dropped from the result
        a = nn.functional.pad(a, (0, 0, 0, padded[0] - rows))
    if a.t().is_contiguous() and a.numel() > b.numel():
        # `a` lies transposed (a weight gradient's summed positions): oneDNN would copy the larger operand to read
        # it row by row (2-5x slower there), so the product is computed transposed, `(b.T @ a.T).T`, reading `a`
        # as it lies.
        return _linear(b.t(), a).t()[:rows]
    return _linear(a, b.t())[:rows]


def _each_product(product, operands) -> None:
    for left, right in operands:
        product(left, right)


def _onednn_is_faster_for_training() -> bool:
    generator = torch.Generator().manual_seed(0)
    operands = []
    for rows, inner, columns, transposed in _TRAINING_PRODUCTS:
        left = torch.randn(inner, rows, generator=generator).t() if transposed else torch.randn(rows, inner,
                                                                                                 generator=generator)
        operands.append((left, torch.randn(inner, columns, generator=generator)))
    if not _onednn_runs(_onednn_matmul, *operands[0]):
        return False
    with torch.no_grad():
        best = best_times({way: functools.partial(_each_product, product, operands)
                            for way, product in ((PLAIN, torch.mm), (ONEDNN, _onednn_matmul))})
    faster = fastest_way(best) == ONEDNN
    logger.info("Training's fp32 products go to %s (measured here: BLAS %.2f ms, oneDNN %.2f ms)",
                "oneDNN" if faster else "the BLAS", best[PLAIN] * 1e3, best[ONEDNN] * 1e3)
    return faster
