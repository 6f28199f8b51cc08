"""The pretraining step as two captured graphs: what a GPU replays without the host in the loop.

An eager step launches thousands of kernels from Python (4,409 for "original" at 128 rows on an H200, where the GPU
was busy 36% of the step). Here the step is two functions with fixed shapes and nothing read back to the host
(`torch.compile` traces each whole, `fullgraph=True`: no graph break, no data-dependent shape), replayed as CUDA
graphs on a GPU:

- `accumulate(batch)`: the forward pass, the loss x `loss_scale` / `accumulation_steps` and its gradient
  (`torch.autograd.grad`), added into one flat fp32 gradient buffer (written, with one micro-batch a step);
  returns the (loss, forward loss, backward loss) of the batch, on the device. Once per micro-batch.
- `update()`: bilm-tf's global-norm clip and Adagrad's update on the optimizer's own state, then the buffer zeroed
  where the next step adds to it; returns the norm, on the device. Once per optimizer step.

With several processes the buffer is all-reduced once between the two (gradients summed, then divided by the number
of processes inside `update`: the mean over processes that DDP takes). So each step is two graph replays, one
collective and the batch's copies to the device.

The softmax's gradient has no sparse tensor here (its shape depends on the data; on the CPU the eager step keeps
the sparse update, `hf_elmo.pretraining.sparse_softmax_gradients`), but the step still touches only the rows a
batch reads, as the sparse update does. `accumulate` takes the gradient of the rows the softmax gathered
(`sampled_softmax.rows_for_training`), adds it into those rows of the buffer and marks them in a mask
(all-reduced with the gradients); `update` takes a fixed number of rows (`torch.topk` of the mask: the most a
step can read, bounded by `largest_batch`; rows not read fill the rest and are written back as they were) and
clips, updates and zeroes those. At bilm-tf's 793,471 words the passes over every row of the softmax's 406M
parameters took 9 ms of a 39 ms step on an H200 (2026-11-27), for the 20k or so rows a step reads. With the full
softmax every row is read.

A gradient that is not finite cannot stop the run from inside a graph. `update` then applies nothing, neither at
that step nor at any after it, and records the first such step in `first_bad_step` (0 while every step was finite).
The loop reads it with the losses, every `--logging-steps`, and stops there: the weights and optimizer state are
those from before the bad step.

Shapes come from a small fixed set (`BatchEncoder`'s `pad_rows_to` and `pad_to_multiple_of`): every batch has the
same rows, rows without words predict nothing (`ElmoForPreTraining.lm_targets`), and a run compiles one
`accumulate` graph per length bucket and one `update` graph.

Two ways to make the graphs (`backend`):
- a `torch.compile` backend ("inductor", "aot_eager"): each function traced whole and compiled, on a GPU replayed
  through torch.compile's CUDA graphs ("reduce-overhead"). Inductor fuses the whole step, but compiling it takes
  minutes per length for "original" (more than 3.5 minutes for one length on an H100, 2026-11-27): the recurrence
  is unrolled over the words, forward and backward.
- None: the two functions as they are (the "cuda" implementation's recurrence keeps its own compiled kernels,
  seconds to build), recorded once per shape with `torch.cuda.CUDAGraph` and replayed (`CudaGraphs`). On the
  CPU, which has no graphs, they run as plain calls: the code the GPU records is the code the CPU tests.
"""

import logging
import time

import torch

from .elmo_ops import with_dynamo_settings
from .gradient_norm import global_norm

logger = logging.getLogger(__name__)

# Graphs kept per function: one per length bucket (13 at `--max-sentence-words` 100 in multiples of 8 words), for
# every step object of the process (they share the functions' code, on which torch.compile keeps its graphs).
# torch's default of 8 would make a run with long sentences fail once it met its ninth length.
GRAPHS_PER_FUNCTION = 64


# Dynamo traces `torch.autograd.grad` into the graph (off by default: torch 2.13 graph-breaks on it) and keeps
# `GRAPHS_PER_FUNCTION` graphs per function (applied at each call of the compiled functions: `with_dynamo_settings`).
COMPILE_SETTINGS = dict(trace_autograd_ops=True, recompile_limit=GRAPHS_PER_FUNCTION)


def softmax_rows_read(config, rows: int, words: int) -> int:
    """The most softmax rows a training batch of `rows` x `words` words reads: every scored position's target
    (`ElmoForPreTraining.forward` scores `words` + 2 positions a row, both directions) and the sampled negatives; with
    the full softmax, every row."""
    if not config.samples_softmax:
        return config.vocab_size
    return min(config.vocab_size, 2 * rows * (words + 2) + config.num_softmax_samples)


class CapturedTrainingStep:
    """
    `model`'s optimizer steps as two compiled graphs (module docstring). What it supports is
    `hf_elmo.pretraining_args.captured_step_unsupported`'s rule. `model` is the `ElmoForPreTraining` itself
    (not a DDP wrapper), with a dense softmax gradient; `optimizer` a `torch.optim.Adagrad` over its parameters,
    whose state (`sum`, `step`) the graphs update in place, so that checkpoints save and load it as usual.
    `autocast_dtype` (bf16 or None) is the forward's autocast. `backend` and `mode` are `torch.compile`'s; on a
    GPU the default mode replays CUDA graphs. `backend=None` compiles nothing whole: on a GPU the two functions are
    recorded as they are (`CudaGraphs`), on the CPU they are called as they are. `largest_batch` (rows, words) is
    the largest batch `accumulate` will be given: it bounds the softmax rows an update passes over.
    """

    def __init__(self, model, optimizer, *, loss_scale: float, max_grad_norm: float | None,
                 largest_batch: tuple[int, int], accumulation_steps: int = 1, world_size: int = 1,
                 autocast_dtype: torch.dtype | None = None, backend: str | None = "inductor", mode: str | None = None):
        if type(optimizer) is not torch.optim.Adagrad or len(optimizer.param_groups) != 1:
            raise TypeError("the captured step runs one torch.optim.Adagrad parameter group.")
        group = optimizer.param_groups[0]
        if group["lr_decay"] or group["weight_decay"] or group["maximize"]:
            raise TypeError("the captured step runs Adagrad without lr_decay, weight_decay or maximize (bilm-tf's).")
        if getattr(model.softmax, "sparse", False):
            raise ValueError("the captured step needs the softmax's dense gradient (model.softmax.sparse = False).")
        self.model, self.optimizer = model, optimizer
        self.params = [p for p in model.parameters() if p.requires_grad]
        softmax = model.softmax
        if not (softmax.weight.requires_grad and softmax.bias.requires_grad):
            raise ValueError("the captured step trains the softmax (its weight and bias must require grad).")
        self.device = self.params[0].device
        self.loss_scale, self.max_grad_norm = float(loss_scale), float(max_grad_norm or float("inf"))
        self.accumulation_steps, self.world_size = accumulation_steps, world_size
        self.autocast_dtype = autocast_dtype
        self.largest_batch = tuple(largest_batch)
        # The softmax's parameters (its "table": weight rows and biases), updated by rows; the others whole.
        self.table_params = [softmax.weight, softmax.bias]
        self.dense_params = [p for p in self.params if all(p is not t for t in self.table_params)]
        vocab_size = softmax.num_embeddings
        self.rows_per_update = min(vocab_size, world_size * accumulation_steps * softmax_rows_read(
            model.config, *self.largest_batch))
        # One buffer, so that several processes all-reduce it in one call: the other parameters' gradients, then the
        # table's, then the mask of the rows read (summed over processes: a row any of them read is > 0).
        sizes = [p.numel() for p in (*self.dense_params, *self.table_params)] + [vocab_size]
        self.flat_grad = torch.zeros(sum(sizes), device=self.device)
        views = [part.view_as(p) for part, p in zip(self.flat_grad.split(sizes), (*self.dense_params,
                                                                                 *self.table_params))]
        self.dense_grads, self.table_grads = views[: len(self.dense_params)], views[len(self.dense_params) :]
        self.dense_sizes = sizes[: len(self.dense_params)]
        self.dense_flat_grad = self.flat_grad[: sum(self.dense_sizes)]
        by_param = dict(zip(map(id, (*self.dense_params, *self.table_params)), views))
        self.grads = [by_param[id(p)] for p in self.params]
        # With the full softmax every row is read, each step: the update takes all of them, and nothing is marked.
        self.every_row = (torch.arange(vocab_size, device=self.device) if self.rows_per_update == vocab_size
                          else None)
        self.rows_read = self.flat_grad[-vocab_size:]
        softmax.keep_gathered = self.every_row is None
        self.shapes_compiled = set()
        self.steps_done = torch.zeros((), dtype=torch.long, device=self.device)
        self.first_bad_step = torch.zeros((), dtype=torch.long, device=self.device)
        self.bind_optimizer_state()
        self.builds_graphs = backend is not None or self.device.type == "cuda"  # the CPU's plain calls build none
        if backend is None:
            self.cuda_graphs = CudaGraphs(self) if self.device.type == "cuda" else None
            self._accumulate, self._update = ((self.cuda_graphs.accumulate, self.cuda_graphs.update)
                                              if self.cuda_graphs is not None
                                              else (self._accumulate_eager, self._update_eager))
            return
        self.cuda_graphs = None
        if mode is None and self.device.type == "cuda":
            mode = "reduce-overhead"
        # Static shapes: a new length bucket is a graph of its own, never a symbolic one (the recurrence is unrolled
        # over the words, so its length cannot be a symbol).
        compile_options = dict(fullgraph=True, dynamic=False, backend=backend, mode=mode)
        self._accumulate = with_dynamo_settings(torch.compile(self._accumulate_eager, **compile_options),
                                                **COMPILE_SETTINGS)
        self._update = with_dynamo_settings(torch.compile(self._update_eager, **compile_options), **COMPILE_SETTINGS)

    def bind_optimizer_state(self) -> None:
        """Point the graphs at the optimizer's state tensors, as they are when the step is built (a run builds it
        after --resume has loaded them). The step counts move to the device: a host tensor would stop CUDA-graph
        capture."""
        state = self.optimizer.state
        for p in self.params:
            state[p]["step"] = state[p]["step"].to(self.device)
        self.dense_sums = [state[p]["sum"] for p in self.dense_params]
        self.table_sums = [state[p]["sum"] for p in self.table_params]
        self.state_steps = [state[p]["step"] for p in self.params]
        # Tensors the graphs mutate keep their addresses across replays (CUDA graphs copy any other input). The
        # buffer's views too: each reaches a graph as an input of its own, unmarked by the buffer's mark (torch.compile
        # then skipped CUDA graphs for both graphs, "mutated inputs", on an H100 on 2026-11-28).
        for tensor in (*self.dense_sums, *self.table_sums, *self.state_steps, self.flat_grad, *self.grads,
                       self.dense_flat_grad, self.rows_read, self.steps_done, self.first_bad_step):
            torch._dynamo.mark_static_address(tensor)

    # -- the two graphs, as eager functions (what torch.compile traces) ---------------------------------------------
    def _accumulate_eager(self, input_ids, attention_mask, labels):
        with torch.autocast(self.device.type, dtype=self.autocast_dtype or torch.float32,
                            enabled=self.autocast_dtype is not None):
            outputs = self.model(input_ids, attention_mask=attention_mask, labels=labels)
        loss = outputs.loss * (self.loss_scale / self.accumulation_steps)
        if self.every_row is not None:  # the full softmax: every row's gradient
            grads = torch.autograd.grad(loss, [*self.dense_params, *self.table_params])
            with torch.no_grad():
                self._store(grads, [*self.dense_grads, *self.table_grads], self.flat_grad[: -len(self.rows_read)])
        else:
            softmax = self.model.softmax
            (ids, *gathered), softmax.gathered = softmax.gathered, None  # it holds the step's autograd graph
            *grads, weight_rows, bias_rows = torch.autograd.grad(loss, [*self.dense_params, *gathered])
            with torch.no_grad():
                self._store(grads, self.dense_grads, self.dense_flat_grad)
                # index_put_ sums a row read twice; unlike index_add_, deterministically on CUDA too.
                for table_grad, rows_grad in zip(self.table_grads, (weight_rows, bias_rows)):
                    table_grad.index_put_((ids,), rows_grad, accumulate=True)
                self.rows_read.index_fill_(0, ids, 1.0)
        return torch.stack([outputs.loss, outputs.forward_loss, outputs.backward_loss]).detach()

    def _store(self, grads, views, span):
        """
        Put `grads` into the buffer's `views` (`span`: the part of the buffer they make up, in order): added, or,
        with one micro-batch a step, written in one kernel, which `update` then need not zero: half the memory
        traffic of zeroing and adding. The H100 run of 2026-11-28 lists 17 fp32 adds a step, most likely this
        `_foreach_add_`: 0.62 ms of small's step and 1.78 ms of original's, slower than a copy of the same bytes.
        """
        if self.accumulation_steps == 1:
            torch.cat([grad.reshape(-1) for grad in grads], out=span)
        else:
            torch._foreach_add_(views, grads)

    @torch.no_grad()
    def _update_eager(self):
        # The table's rows read since the last update (distinct: topk's indices), then rows not read, whose
        # gradient is zero, to the fixed count.
        rows = (self.every_row if self.every_row is not None
                else torch.topk(self.rows_read, self.rows_per_update, sorted=False).indices)
        # Which of those were read: the others are written back as they were, bit for bit (with Adagrad a zero
        # gradient changes no finite weight or sum, but the sparse update leaves even a NaN as it is).
        read = None if self.every_row is not None else (self.rows_read.index_select(0, rows) > 0)
        # The gradients as three flat tensors, the other parameters' one span of the buffer and the table's rows:
        # clipping them is a few kernels, where per parameter it was two each (85 of a small step's 165 on the CPU).
        table_rows = [g.index_select(0, rows) for g in self.table_grads]
        flat = [self.dense_flat_grad, *(g.reshape(-1) for g in table_rows)]
        if self.world_size > 1:  # the all-reduce summed them
            torch._foreach_mul_(flat, 1.0 / self.world_size)
        norm = global_norm(flat)
        self.steps_done += 1
        bad = ~torch.isfinite(norm)
        self.first_bad_step.copy_(torch.where(bad & (self.first_bad_step == 0), self.steps_done, self.first_bad_step))
        # Zero gradients leave Adagrad's weights and sums as they are: a step after a bad one applies nothing
        # (where(), not a product: 0 x NaN is NaN).
        applied = self.first_bad_step == 0
        clip = (self.max_grad_norm / (norm + 1e-6)).clamp(max=1.0)
        dense, *table = (torch.where(applied, g * clip, 0.0) for g in flat)
        clipped = [*(part.view_as(p) for part, p in zip(dense.split(self.dense_sizes), self.dense_params)),
                   *(part.view_as(g) for part, g in zip(table, table_rows))]
        group = self.optimizer.param_groups[0]
        # torch.optim.Adagrad's update without lr_decay (refused in __init__), written out: torch's own reads each
        # step count to the host for the decay (`.item()`), which a CUDA graph cannot record. The tests hold it
        # equal to torch's.
        tables = [*self.table_params, *self.table_sums]
        before = [table.index_select(0, rows) for table in tables]
        table_params, table_sums = [b.clone() for b in before[:2]], [b.clone() for b in before[2:]]
        params, sums = [*self.dense_params, *table_params], [*self.dense_sums, *table_sums]
        torch._foreach_add_(self.state_steps, 1)
        torch._foreach_addcmul_(sums, clipped, clipped)
        denominators = torch._foreach_sqrt(sums)
        torch._foreach_add_(denominators, group["eps"])
        torch._foreach_addcdiv_(params, clipped, denominators, value=-group["lr"])
        for table, old, new in zip(tables, before, (*table_params, *table_sums)):
            if read is not None:
                new = torch.where(read.view(-1, *(1,) * (new.dim() - 1)), new, old)
            table.index_copy_(0, rows, new)
        # Zero what was used and the next step only adds to: the other gradients, the table's rows (its other rows
        # are zero), the mask. With one micro-batch a step, `_store` writes the other gradients whole, and the
        # table's too with the full softmax.
        if self.accumulation_steps > 1:
            self.dense_flat_grad.zero_()
        if self.accumulation_steps > 1 or self.every_row is None:
            for grad in self.table_grads:
                grad.index_fill_(0, rows, 0.0)
        self.rows_read.zero_()
        return norm

    # -- what the training loop calls -----------------------------------------------------------------------------
    def accumulate(self, batch: dict) -> torch.Tensor:
        """One micro-batch: its gradient added to the buffer; its (loss, forward, backward) losses, on the device."""
        shape = tuple(batch["input_ids"].shape[:2])
        if shape[0] > self.largest_batch[0] or shape[1] > self.largest_batch[1]:
            raise ValueError(f"a batch of {shape[0]} rows x {shape[1]} words is larger than the captured step's "
                             f"largest_batch {self.largest_batch} (rows, words), which bounds its softmax update.")
        new_shape = self.builds_graphs and shape not in self.shapes_compiled
        if new_shape:  # making a graph takes seconds to minutes: say so, rather than seem to hang
            logger.info("Building the training step's graph for batches of %d rows x %d words", *shape)
            began = time.perf_counter()
        losses = self._accumulate(batch["input_ids"], batch["attention_mask"], batch["labels"])
        if new_shape:
            self.shapes_compiled.add(shape)
            logger.info("Built the training step's graph for %d words in %.1f s (%d length(s) so far)", shape[1],
                        time.perf_counter() - began, len(self.shapes_compiled))
        return losses.clone()  # a CUDA graph's output is overwritten by its next replay

    def all_reduce(self) -> None:
        """Sum the gradient buffer over the processes (between the micro-batches and `update`)."""
        if self.world_size > 1:
            torch.distributed.all_reduce(self.flat_grad)

    def update(self) -> torch.Tensor:
        """Clip, apply Adagrad, zero the buffer where the next step adds to it; the gradient norm before clipping,
        on the device."""
        return self._update().clone()

    def steps_before_first_bad(self) -> int | None:
        """Read back (a sync: at logging steps only): None while every step was finite, else how many steps had
        been applied before the first one whose gradient was not."""
        first = int(self.first_bad_step)
        return None if first == 0 else first - 1


class CudaGraphs:
    """
    A `CapturedTrainingStep`'s two eager functions recorded as CUDA graphs (`torch.cuda.CUDAGraph`): one
    `accumulate` graph per batch shape, one `update` graph, all in one memory pool (they never run at once, and
    what one returns is copied out before the next replays). Before recording a function runs eagerly on a side
    stream, as torch's documentation asks (lazy initialisation, the recurrence's own compilation); what those runs
    add to the gradient buffer, the optimizer state and the step counters is put back, and the random state too, so
    a recorded step is the eager step once. Where recording fails, the reason is logged once and every later call
    runs the function eagerly.
    """

    def __init__(self, step: "CapturedTrainingStep"):
        self.step = step
        self.pool = torch.cuda.graph_pool_handle()
        self.accumulate_graphs = {}  # shape -> (graph, static inputs, static losses)
        self.update_graph = None  # (graph, static norm)
        self.failed = None  # why recording failed, once it has

    def _kept_state(self) -> list[torch.Tensor]:
        step = self.step
        return [step.flat_grad, step.steps_done, step.first_bad_step, *step.state_steps]

    def _warm_up_and_record(self, function, *static_inputs, zero_gradient: bool = False):
        """`zero_gradient`: the warm-ups see a zero gradient (Adagrad then changes no weight and no sum, which are
        not among what is put back); the gradient itself is put back with the rest."""
        kept, random_state = [t.clone() for t in self._kept_state()], torch.cuda.get_rng_state()
        if zero_gradient:
            self.step.flat_grad.zero_()
        side = torch.cuda.Stream()
        side.wait_stream(torch.cuda.current_stream())
        try:
            with torch.cuda.stream(side):
                for _ in range(2):
                    function(*static_inputs)
        finally:
            torch.cuda.current_stream().wait_stream(side)
            for tensor, value in zip(self._kept_state(), kept):
                tensor.copy_(value)
            torch.cuda.set_rng_state(random_state)  # the recorded step draws what the eager step would have
        graph = torch.cuda.CUDAGraph()
        # "thread_local": the DataLoader's pin-memory thread keeps allocating pinned host memory meanwhile, which the
        # default ("global") would count as an unsafe call made during the recording.
        with torch.cuda.graph(graph, pool=self.pool, capture_error_mode="thread_local"):
            output = function(*static_inputs)
        return graph, output

    def _record_or_fall_back(self, name, record):
        if self.failed is None:
            try:
                return record()
            except Exception as error:  # an op that cannot be recorded: the same function, eagerly
                self.failed = f"{type(error).__name__}: {error}".splitlines()[0]
                logger.warning("Recording the %s step as a CUDA graph failed (%s); the step runs eagerly from now "
                               "on", name, self.failed)
        return None

    def accumulate(self, input_ids, attention_mask, labels) -> torch.Tensor:
        shape = tuple(input_ids.shape)
        if shape not in self.accumulate_graphs and self.failed is None:
            def record():
                inputs = (input_ids.clone(), attention_mask.clone(), labels.clone())
                graph, losses = self._warm_up_and_record(self.step._accumulate_eager, *inputs)
                return graph, inputs, losses
            recorded = self._record_or_fall_back("accumulate", record)
            if recorded is not None:
                self.accumulate_graphs[shape] = recorded
        if shape not in self.accumulate_graphs:
            return self.step._accumulate_eager(input_ids, attention_mask, labels)
        graph, inputs, losses = self.accumulate_graphs[shape]
        for static, value in zip(inputs, (input_ids, attention_mask, labels)):
            static.copy_(value)
        graph.replay()
        return losses

    def update(self) -> torch.Tensor:
        if self.update_graph is None and self.failed is None:
            self.update_graph = self._record_or_fall_back(
                "update", lambda: self._warm_up_and_record(self.step._update_eager, zero_gradient=True))
        if self.update_graph is None:
            return self.step._update_eager()
        graph, norm = self.update_graph
        graph.replay()
        return norm
