"""The captured pretraining step (hf_elmo/captured_step.py): whole graphs on the CPU, equal to an eager step."""

import copy
import json
import os
import sys
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from hf_elmo import ElmoConfig, ElmoForPreTraining
from hf_elmo.captured_step import CapturedTrainingStep
from hf_elmo.cli import pretrain_main
from hf_elmo.pretraining import COMPILED_LENGTH_BUCKET, clip_gradient_norm
from hf_elmo.pretraining_data import BatchEncoder
from hf_elmo.testing_utils import free_port, launch_failure_report


REPO_ROOT = Path(__file__).resolve().parents[1]
TINY = {"char_filters": [[1, 4], [2, 4], [3, 8]], "n_highway": 1, "char_embedding_dim": 4, "lstm_dim": 24,
        "projection_dim": 8, "num_lstm_layers": 2, "cell_clip": 3.0, "proj_clip": 3.0}
WORDS = [f"w{i}" for i in range(297)]
VOCAB = ["<S>", "</S>", "<UNK>", *WORDS]

pytestmark = pytest.mark.usefixtures("fresh_accelerate_state")  # conftest.py


def sentences(lengths, offset=0) -> list[list[str]]:
    return [[WORDS[(offset + 7 * i + 13 * j) % len(WORDS)] for j in range(n)] for i, n in enumerate(lengths)]


def encode(lengths, rows=5, offset=0) -> dict:
    """A batch as `hf-elmo pretrain` gives the captured step: `rows` rows, a multiple of 8 words."""
    batch = BatchEncoder(VOCAB, pad_to_multiple_of=COMPILED_LENGTH_BUCKET, pad_rows_to=rows)(sentences(lengths, offset))
    del batch["num_tokens"]
    return batch


def pretraining_model(dropout=0.1, samples=64) -> ElmoForPreTraining:
    torch.manual_seed(0)
    return ElmoForPreTraining(ElmoConfig(**TINY, vocab_size=len(VOCAB), num_softmax_samples=samples,
                                         lm_dropout=dropout)).train()


def adagrad(model):
    return torch.optim.Adagrad(model.parameters(), lr=0.2, initial_accumulator_value=1.0)


def captured(model, **options) -> CapturedTrainingStep:
    return CapturedTrainingStep(model, adagrad(model), loss_scale=20.0, max_grad_norm=10.0, backend="aot_eager",
                                **options)


def eager_reference_step(model, batch):
    """What `hf-elmo pretrain` does eagerly, on the specification's own implementation."""
    model.set_elmo_implementation("reference")
    optimizer = adagrad(model)
    outputs = model(**batch)
    (outputs.loss * 20).backward()
    grads = [p.grad.clone() for p in model.parameters()]
    norm = clip_gradient_norm(model.parameters(), 10.0)
    optimizer.step()
    return outputs, grads, norm, optimizer


def graphs() -> int:
    return torch._dynamo.utils.counters["stats"]["unique_graphs"]


def relative_difference(a, b) -> float:
    return float((a - b).abs().max()) / max(1.0, float(b.abs().max()))


def test_one_captured_step_is_one_eager_step_and_compiles_whole():
    """Dropout and sampled negatives on: the same random draws, in the same order, inside the graph."""
    torch._dynamo.reset()
    base = pretraining_model()
    batch = encode([5, 3, 9, 1])  # 4 sentences padded to 5 rows and 16 words
    assert batch["input_ids"].shape == (5, 16, 50)
    eager, captured_model = copy.deepcopy(base), copy.deepcopy(base)
    torch.manual_seed(7)
    outputs, eager_grads, eager_norm, eager_optimizer = eager_reference_step(eager, batch)
    step = captured(captured_model)
    before = graphs()
    torch.manual_seed(7)
    losses = step.accumulate(batch)
    captured_grads = [g.clone() for g in step.grads]
    norm = step.update()
    # fullgraph=True: a graph break or a data-dependent shape would have raised. One graph each.
    assert graphs() - before == 2 and not torch._dynamo.utils.counters["graph_break"]

    expected = torch.stack([outputs.loss, outputs.forward_loss, outputs.backward_loss]).detach()
    assert torch.allclose(losses, expected, rtol=1e-6, atol=0), (losses, expected)
    assert relative_difference(norm, eager_norm) < 1e-5
    assert max(relative_difference(c, e) for c, e in zip(captured_grads, eager_grads)) < 1e-5
    moved = max(float((p - q).detach().abs().max()) for p, q in zip(eager.parameters(), base.parameters()))
    assert moved > 1e-2  # the step did something
    assert max(float((p - q).detach().abs().max()) for p, q in zip(captured_model.parameters(),
                                                                    eager.parameters())) < 1e-6
    sums = [eager_optimizer.state[p]["sum"] for p in eager.parameters()]
    assert max(relative_difference(c, e) for c, e in zip(step.state_sums, sums)) < 1e-5
    assert float(step.flat_grad.abs().max()) == 0.0  # zeroed for the next step
    assert step.steps_before_first_bad() is None

    # The same shape again: no new graph. Another length bucket: one more `accumulate` graph (`update` does not
    # depend on the batch).
    step.accumulate(encode([6, 2, 12, 4, 3], offset=1))
    step.update()
    assert graphs() - before == 2
    step.accumulate(encode([20, 17], offset=2))
    step.update()
    assert graphs() - before == 3


def test_gradient_accumulation_sums_the_micro_batches_as_one_step():
    torch._dynamo.reset()
    base = pretraining_model(dropout=0.0, samples=0)  # full softmax, no dropout: nothing random
    first, second = encode([5, 3, 9, 1]), encode([4, 4, 2, 7, 6], offset=3)
    eager = copy.deepcopy(base)
    eager.set_elmo_implementation("reference")
    optimizer = adagrad(eager)
    for batch in (first, second):
        (eager(**batch).loss * 20 / 2).backward()
    clip_gradient_norm(eager.parameters(), 10.0)
    optimizer.step()
    model = copy.deepcopy(base)
    step = captured(model, accumulation_steps=2)
    step.accumulate(first)
    step.accumulate(second)
    step.update()
    assert max(float((p - q).detach().abs().max()) for p, q in zip(model.parameters(), eager.parameters())) < 1e-6


def test_a_gradient_that_is_not_finite_stops_every_update_from_that_step_on():
    torch._dynamo.reset()
    model = pretraining_model()
    step = captured(model)
    batch = encode([5, 3, 9, 1])
    step.accumulate(batch)
    step.update()
    weights = [p.detach().clone() for p in model.parameters()]
    sums = [s.clone() for s in step.state_sums]
    step.accumulate(batch)
    step.flat_grad[0] = float("nan")  # as a gradient that overflowed
    assert not torch.isfinite(step.update())
    step.accumulate(batch)  # a later finite step applies nothing either: the run stops at its next logging step
    assert torch.isfinite(step.update())
    assert all(torch.equal(p, w) for p, w in zip(model.parameters(), weights))
    assert all(torch.equal(s, t) for s, t in zip(step.state_sums, sums))
    assert step.steps_before_first_bad() == 1


def test_the_captured_step_refuses_what_it_cannot_run():
    model = pretraining_model()
    with pytest.raises(TypeError, match="one torch.optim.Adagrad"):
        CapturedTrainingStep(model, torch.optim.AdamW(model.parameters()), loss_scale=1.0, max_grad_norm=1.0)
    model.softmax.sparse = True
    with pytest.raises(ValueError, match="dense gradient"):
        captured(model)


@pytest.mark.parametrize("options, reason", [
    (["--optimizer", "adamw"], "--optimizer adamw (the captured step runs Adagrad"),
    (["--lr-scheduler", "linear"], "a learning-rate schedule"),
    (["--warmup-steps", "5"], "a learning-rate schedule"),
    (["--mixed-precision", "fp16"], "--mixed-precision fp16"),
])
def test_captured_with_options_it_cannot_run_is_a_usage_error(options, reason, capsys):
    with pytest.raises(SystemExit) as exit_info:
        pretrain_main(["--train-files", "x.txt", "--config", "small", "--output-dir", "out", "--max-steps", "1",
                       "--training-step", "captured", *options])
    assert exit_info.value.code == 2
    assert f"error: --training-step captured does not support {reason}" in capsys.readouterr().err
