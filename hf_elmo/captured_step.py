"""The pretraining step as two captured graphs: what a GPU replays without the host in the loop.

An eager step launches thousands of kernels from Python (4,409 for "original" at 128 rows on an H200, where the GPU
was busy 36% of the step). Here the step is two functions that `torch.compile` traces whole (`fullgraph=True`: no
graph break, no data-dependent shape, nothing read back to the host), replayed as CUDA graphs on a GPU
("reduce-overhead" mode):

- `accumulate(batch)`: the forward pass, the loss x `loss_scale` / `accumulation_steps` and its gradient
  (`torch.autograd.grad`, traced into the graph), added into one flat fp32 gradient buffer; returns the
  (loss, forward loss, backward loss) of the batch, on the device. Once per micro-batch.
- `update()`: bilm-tf's global-norm clip and torch's own functional Adagrad on the optimizer's own state, then the
  buffer zeroed; returns the norm, on the device. Once per optimizer step.

With several processes the buffer is all-reduced once between the two (gradients summed, then divided by the number
of processes inside `update`: the mean over processes that DDP takes). So each step is two graph replays, one
collective and the batch's copies to the device.

The softmax's gradient is dense here (a sparse tensor's shape depends on the data); on the CPU the eager step keeps
the sparse update, which pays there (`hf_elmo.pretraining.sparse_softmax_gradients`).

A gradient that is not finite cannot stop the run from inside a graph. `update` then applies nothing, neither at
that step nor at any after it, and records the first such step in `first_bad_step` (0 while every step was finite).
The loop reads it with the losses, every `--logging-steps`, and stops there: the weights and optimizer state are
those from before the bad step.

Shapes come from a small fixed set (`BatchEncoder`'s `pad_rows_to` and `pad_to_multiple_of`): every batch has the
same rows, rows without words predict nothing (`ElmoForPreTraining.lm_targets`), and a run compiles one
`accumulate` graph per length bucket and one `update` graph.
"""

import contextlib
import logging
import time

import torch


logger = logging.getLogger(__name__)

# Graphs kept per function: one per length bucket (13 at `--max-sentence-words` 100 in multiples of 8 words), for
# every step object of the process (they share the functions' code, on which torch.compile keeps its graphs).
# torch's default of 8 would make a run with long sentences fail once it met its ninth length.
GRAPHS_PER_FUNCTION = 64


@contextlib.contextmanager
def compile_settings():
    """Dynamo traces `torch.autograd.grad` into the graph (off by default: torch 2.13 graph-breaks on it) and keeps
    `GRAPHS_PER_FUNCTION` graphs per function."""
    with torch._dynamo.config.patch(trace_autograd_ops=True, recompile_limit=GRAPHS_PER_FUNCTION):
        yield


class CapturedTrainingStep:
    """
    `model`'s optimizer steps as two compiled graphs (module docstring). What it supports is
    `hf_elmo.pretraining_args.captured_step_unsupported`'s rule. `model` is the `ElmoForPreTraining` itself
    (not a DDP wrapper), with a dense softmax gradient; `optimizer` a `torch.optim.Adagrad` over its parameters,
    whose state (`sum`, `step`) the graphs update in place, so that checkpoints save and load it as usual.
    `autocast_dtype` (bf16 or None) is the forward's autocast. `backend` and `mode` are `torch.compile`'s; on a
    GPU the default mode replays CUDA graphs.
    """

    def __init__(self, model, optimizer, *, loss_scale: float, max_grad_norm: float | None,
                 accumulation_steps: int = 1, world_size: int = 1, autocast_dtype: torch.dtype | None = None,
                 backend: str = "inductor", mode: str | None = None):
        if type(optimizer) is not torch.optim.Adagrad or len(optimizer.param_groups) != 1:
            raise TypeError("the captured step runs one torch.optim.Adagrad parameter group.")
        if getattr(model.softmax, "sparse", False):
            raise ValueError("the captured step needs the softmax's dense gradient (model.softmax.sparse = False).")
        self.model, self.optimizer = model, optimizer
        self.params = [p for p in model.parameters() if p.requires_grad]
        self.device = self.params[0].device
        self.loss_scale, self.max_grad_norm = float(loss_scale), float(max_grad_norm or float("inf"))
        self.accumulation_steps, self.world_size = accumulation_steps, world_size
        self.autocast_dtype = autocast_dtype
        # One buffer, so that several processes all-reduce it in one call.
        self.flat_grad = torch.zeros(sum(p.numel() for p in self.params), device=self.device)
        self.grads, offset = [], 0
        for p in self.params:
            self.grads.append(self.flat_grad[offset : offset + p.numel()].view_as(p))
            offset += p.numel()
        self.shapes_compiled = set()
        self.steps_done = torch.zeros((), dtype=torch.long, device=self.device)
        self.first_bad_step = torch.zeros((), dtype=torch.long, device=self.device)
        self.bind_optimizer_state()
        if mode is None and self.device.type == "cuda":
            mode = "reduce-overhead"
        # Static shapes: a new length bucket is a graph of its own, never a symbolic one (the recurrence is unrolled
        # over the words, so its length cannot be a symbol).
        compile_options = dict(fullgraph=True, dynamic=False, backend=backend, mode=mode)
        self._accumulate = torch.compile(self._accumulate_eager, **compile_options)
        self._update = torch.compile(self._update_eager, **compile_options)

    def bind_optimizer_state(self) -> None:
        """Point the graphs at the optimizer's state tensors, as they are when the step is built (a run builds it
        after --resume has loaded them). The step counts move to the device: a host tensor would stop CUDA-graph
        capture."""
        state = self.optimizer.state
        for p in self.params:
            state[p]["step"] = state[p]["step"].to(self.device)
        self.state_sums = [state[p]["sum"] for p in self.params]
        self.state_steps = [state[p]["step"] for p in self.params]
        # Tensors the graphs mutate keep their addresses across replays (CUDA graphs copy any other input).
        for tensor in (*self.state_sums, *self.state_steps, self.flat_grad, self.steps_done, self.first_bad_step):
            torch._dynamo.mark_static_address(tensor)

    # -- the two graphs, as eager functions (what torch.compile traces) ---------------------------------------------
    def _accumulate_eager(self, input_ids, attention_mask, labels):
        with torch.autocast(self.device.type, dtype=self.autocast_dtype or torch.float32,
                            enabled=self.autocast_dtype is not None):
            outputs = self.model(input_ids, attention_mask=attention_mask, labels=labels)
        scale = self.loss_scale / self.accumulation_steps
        grads = torch.autograd.grad(outputs.loss * scale, self.params)
        with torch.no_grad():
            torch._foreach_add_(self.grads, grads)
        return torch.stack([outputs.loss, outputs.forward_loss, outputs.backward_loss]).detach()

    @torch.no_grad()
    def _update_eager(self):
        from torch.optim.adagrad import adagrad

        grads = self.grads
        if self.world_size > 1:  # the all-reduce summed them
            torch._foreach_mul_(grads, 1.0 / self.world_size)
        norm = torch.linalg.vector_norm(torch.stack(torch._foreach_norm(grads)))
        self.steps_done += 1
        bad = ~torch.isfinite(norm)
        self.first_bad_step.copy_(torch.where(bad & (self.first_bad_step == 0), self.steps_done, self.first_bad_step))
        # Zero gradients leave Adagrad's weights and sums as they are: a step after a bad one applies nothing
        # (where(), not a product: 0 x NaN is NaN).
        applied = self.first_bad_step == 0
        clip = (self.max_grad_norm / (norm + 1e-6)).clamp(max=1.0)
        clipped = [torch.where(applied, g * clip, 0.0) for g in grads]
        group = self.optimizer.param_groups[0]
        adagrad(self.params, clipped, self.state_sums, self.state_steps, lr=group["lr"],
                weight_decay=group["weight_decay"], lr_decay=group["lr_decay"], eps=group["eps"],
                maximize=group["maximize"])
        self.flat_grad.zero_()
        return norm

    # -- what the training loop calls -----------------------------------------------------------------------------
    def accumulate(self, batch: dict) -> torch.Tensor:
        """One micro-batch: its gradient added to the buffer; its (loss, forward, backward) losses, on the device."""
        shape = tuple(batch["input_ids"].shape[:2])
        new_shape = shape not in self.shapes_compiled
        if new_shape:  # compiling a graph takes seconds to minutes: say so, rather than seem to hang
            logger.info("Compiling the training step for batches of %d rows x %d words", *shape)
            began = time.perf_counter()
        with compile_settings():
            losses = self._accumulate(batch["input_ids"], batch["attention_mask"], batch["labels"])
        if new_shape:
            self.shapes_compiled.add(shape)
            logger.info("Compiled the training step for %d words in %.1f s (%d length(s) so far)", shape[1],
                        time.perf_counter() - began, len(self.shapes_compiled))
        return losses.clone()  # a CUDA graph's output is overwritten by its next replay

    def all_reduce(self) -> None:
        """Sum the gradient buffer over the processes (between the micro-batches and `update`)."""
        if self.world_size > 1:
            torch.distributed.all_reduce(self.flat_grad)

    def update(self) -> torch.Tensor:
        """Clip, apply Adagrad, zero the buffer; the gradient norm before clipping, on the device."""
        with compile_settings():
            return self._update().clone()

    def steps_before_first_bad(self) -> int | None:
        """Read back (a sync: at logging steps only): None while every step was finite, else how many steps had
        been applied before the first one whose gradient was not."""
        first = int(self.first_bad_step)
        return None if first == 0 else first - 1

