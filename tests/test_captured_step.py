"""The captured pretraining step (hf_elmo/captured_step.py): whole graphs on the CPU, equal to an eager step."""

import copy
import json
import logging
import math
import os
import re
import subprocess
import sys
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

import captured_training
from captured_training import adagrad, encode, pretraining_model
from hf_elmo.captured_step import CapturedTrainingStep
from hf_elmo.cli import pretrain_main
from hf_elmo.pretraining import clip_gradient_norm
from hf_elmo.testing_utils import free_port, launch_failure_report


REPO_ROOT = Path(__file__).resolve().parents[1]

pytestmark = pytest.mark.usefixtures("fresh_accelerate_state")  # conftest.py


def captured(model, **options) -> CapturedTrainingStep:
    """The tests' batches: 5 rows, up to 16 words."""
    return CapturedTrainingStep(model, adagrad(model), loss_scale=20.0, max_grad_norm=10.0, largest_batch=(5, 16),
                                backend="aot_eager", **options)


def optimizer_sums(step) -> list[torch.Tensor]:
    return [step.optimizer.state[p]["sum"] for p in step.params]


def eager_step(model, optimizer, batch):
    """What `hf-elmo pretrain` does eagerly: the outputs, the gradients before clipping and their norm."""
    outputs = model(**batch)
    (outputs.loss * 20).backward()
    grads = [p.grad.clone() for p in model.parameters()]
    norm = clip_gradient_norm(model.parameters(), 10.0)
    optimizer.step()
    optimizer.zero_grad()
    return outputs, grads, norm


def eager_reference_step(model, batch):
    """One eager step on the specification's own implementation, with a new optimizer."""
    model.set_elmo_implementation("reference")
    optimizer = adagrad(model)
    return *eager_step(model, optimizer, batch), optimizer


def graphs() -> int:
    return torch._dynamo.utils.counters["stats"]["unique_graphs"]


def relative_difference(a, b) -> float:
    return float((a - b).abs().max()) / max(1.0, float(b.abs().max()))


def test_one_captured_step_is_one_eager_step_and_compiles_whole():
    """Dropout and sampled negatives on: the same random draws, in the same order, inside the graph."""
    torch._dynamo.reset()
    base = pretraining_model()
    # 4 sentences padded to 5 rows and 8 words (with <S> and </S>): the trace unrolls the recurrence over the words,
    # and each 8 more cost about 4 s of this test.
    batch = encode([5, 3, 6, 1])
    assert batch["input_ids"].shape == (5, 8, 50)
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
    assert max(relative_difference(c, e) for c, e in zip(optimizer_sums(step), sums)) < 1e-5
    # Zeroed for the next step: the table's rows and the mask (the other gradients the next step writes whole).
    assert float(step.flat_grad[step.dense_flat_grad.numel():].abs().max()) == 0.0
    assert step.steps_before_first_bad() is None

    # The same shape again: no new graph. Another length bucket: one more `accumulate` graph (`update` does not
    # depend on the batch).
    step.accumulate(encode([6, 2, 5, 4, 3], offset=1))
    step.update()
    assert graphs() - before == 2
    step.accumulate(encode([12, 9], offset=2))
    step.update()
    assert graphs() - before == 3


def test_gradient_accumulation_sums_the_micro_batches_as_one_step():
    torch._dynamo.reset()
    base = pretraining_model(dropout=0.0, samples=0)  # full softmax, no dropout: nothing random
    first, second = encode([5, 3, 6, 1]), encode([4, 4, 2, 6, 5], offset=3)  # one length bucket: 8 words
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
    batch = encode([5, 3, 6, 1])
    step.accumulate(batch)
    step.update()
    weights = [p.detach().clone() for p in model.parameters()]
    sums = [s.clone() for s in optimizer_sums(step)]
    step.accumulate(batch)
    step.flat_grad[0] = float("nan")  # as a gradient that overflowed
    assert not torch.isfinite(step.update())
    step.accumulate(batch)  # a later finite step applies nothing either: the run stops at its next logging step
    assert torch.isfinite(step.update())
    assert all(torch.equal(p, w) for p, w in zip(model.parameters(), weights))
    assert all(torch.equal(s, t) for s, t in zip(optimizer_sums(step), sums))
    assert step.steps_before_first_bad() == 1


def test_the_update_reads_and_writes_only_the_softmax_rows_the_step_read():
    """bilm-tf's sparse update in fixed shapes: a row no target and no negative read is left as it was, bit for bit
    (NaN put in its Adagrad sum stays out of every weight; the dense update wrote NaN there), and the rows read get
    the eager step's update."""
    torch._dynamo.reset()
    base = pretraining_model()  # 300 words, 64 negatives
    batch = encode([5, 3, 6, 1])
    eager, model = copy.deepcopy(base), copy.deepcopy(base)
    torch.manual_seed(7)
    eager_reference_step(eager, batch)
    step = captured(model)
    assert step.rows_per_update == 2 * 5 * (16 + 2) + 64  # the largest batch's positions and the negatives
    torch.manual_seed(7)
    step.accumulate(batch)
    read = step.rows_read > 0
    assert 64 < int(read.sum()) < 300
    step.optimizer.state[model.softmax.weight]["sum"][~read] = float("nan")
    step.optimizer.state[model.softmax.bias]["sum"][~read] = float("nan")
    before = [model.softmax.weight.detach().clone(), model.softmax.bias.detach().clone()]
    step.update()
    for after, old, expected in zip((model.softmax.weight, model.softmax.bias), before,
                                    (eager.softmax.weight, eager.softmax.bias)):
        assert torch.equal(after[~read], old[~read]) and bool(torch.isfinite(after).all())
        assert float((after[read] - expected[read]).detach().abs().max()) < 1e-6
        assert float((after[read] - old[read]).detach().abs().max()) > 1e-3
    assert float(step.flat_grad[step.dense_flat_grad.numel():].abs().max()) == 0.0  # the mask too, for the next step
    with pytest.raises(ValueError, match=r"a batch of 5 rows x 24 words is larger than the captured step's "
                                         r"largest_batch \(5, 16\) \(rows, words\)"):
        step.accumulate(encode([20, 3]))


def test_the_softmax_rows_updated_over_processes_are_those_any_process_read():
    """What the all-reduce hands `update` (the buffers summed, masks of rows read included), without processes: two
    steps of world size 2, each given the sum of both buffers, equal one step accumulating both micro-batches, with
    the sampled softmax (each micro-batch reads other rows, and the rows either read are updated)."""
    base = pretraining_model(dropout=0.0, samples=16)  # 2 x 5 x (8 + 2) + 16 rows a micro-batch: 232 of 300 for two
    halves = [encode([5, 3, 6, 1]), encode([4, 4, 2, 6, 5], offset=3)]

    def step_of(model, **options):
        return CapturedTrainingStep(model, adagrad(model), loss_scale=20.0, max_grad_norm=10.0, largest_batch=(5, 8),
                                    backend=None, **options)

    one = copy.deepcopy(base)
    whole = step_of(one, accumulation_steps=2)
    assert whole.rows_per_update == 232
    for seed, batch in enumerate(halves):
        torch.manual_seed(seed)
        whole.accumulate(batch)
    whole.update()
    models = [copy.deepcopy(base) for _ in halves]
    steps = [step_of(model, world_size=2) for model in models]
    for seed, (step, batch) in enumerate(zip(steps, halves)):
        torch.manual_seed(seed)
        step.accumulate(batch)
    read = [step.rows_read > 0 for step in steps]
    assert int((read[0] ^ read[1]).sum()) > 10  # rows one half read and the other did not
    summed = steps[0].flat_grad + steps[1].flat_grad  # torch.distributed.all_reduce's sum
    for step in steps:
        step.flat_grad.copy_(summed)
        step.update()
    for model in models:
        assert max(float((p - q).detach().abs().max()) for p, q in zip(model.parameters(), one.parameters())) < 1e-6
    moved = (models[0].softmax.weight - base.softmax.weight).detach().abs().amax(dim=1) > 0
    assert torch.equal(moved, read[0] | read[1])


@pytest.mark.parametrize("device", ["cpu", pytest.param("cuda", marks=pytest.mark.skipif(
    not torch.cuda.is_available(), reason="CUDA graphs need a GPU (gpu_report.py's cuda_tests run this)"))])
def test_the_step_without_whole_compilation_is_one_eager_step_twice(device, monkeypatch):
    """backend=None: the same two functions, plain calls on the CPU, recorded CUDA graphs on a GPU (where the
    warm-up runs before recording must leave no trace: each step is the eager step once). Two steps, the second
    replaying the graphs recorded by the first, each against an eager step: of the reference implementation on the
    CPU; on a GPU of the same ("cuda") implementation, so that only the recording is under test."""
    torch._dynamo.reset()
    if device == "cuda":  # fp32 as stated: no TF32 in the char CNN's convolutions or the matmuls
        monkeypatch.setattr(torch.backends.cudnn, "allow_tf32", False)
        monkeypatch.setattr(torch.backends.cuda.matmul, "allow_tf32", False)
    base = pretraining_model().to(device)
    batches = [{k: v.to(device) for k, v in encode(lengths, offset=offset).items()}
               for lengths, offset in (([5, 3, 9, 1], 0), ([9, 2, 4, 6], 3))]
    assert batches[0]["input_ids"].shape == batches[1]["input_ids"].shape == (5, 16, 50)
    eager, model = copy.deepcopy(base), copy.deepcopy(base)
    if device == "cpu":
        eager.set_elmo_implementation("reference")
    eager_optimizer = adagrad(eager)
    step = CapturedTrainingStep(model, adagrad(model), loss_scale=20.0, max_grad_norm=10.0, largest_batch=(5, 16),
                                backend=None)
    weight_tolerance = 1e-6 if device == "cpu" else 1e-5  # a GPU's kernels may sum in another order
    for batch in batches:
        torch.manual_seed(7)
        outputs, _, eager_norm = eager_step(eager, eager_optimizer, batch)
        torch.manual_seed(7)
        losses = step.accumulate(batch)
        norm = step.update()
        expected = torch.stack([outputs.loss, outputs.forward_loss, outputs.backward_loss]).detach()
        assert torch.allclose(losses, expected, rtol=1e-5, atol=0), (losses, expected)
        assert relative_difference(norm, eager_norm) < 1e-5
        assert max(float((p - q).detach().abs().max())
                   for p, q in zip(model.parameters(), eager.parameters())) < weight_tolerance
        assert max(float((step.optimizer.state[p]["sum"] - eager_optimizer.state[q]["sum"]).abs().max())
                   for p, q in zip(model.parameters(), eager.parameters())) < 1e-4
    assert [float(step.optimizer.state[p]["step"]) for p in list(model.parameters())[:2]] == [2.0, 2.0]
    assert float(step.flat_grad[step.dense_flat_grad.numel():].abs().max()) == 0.0
    if device == "cuda":
        assert step.cuda_graphs.failed is None and len(step.cuda_graphs.accumulate_graphs) == 1


def test_the_graphs_take_every_buffer_they_change_as_a_static_input():
    """torch.compile's CUDA graphs (inductor, reduce-overhead) skip a graph that changes an input whose address is
    not marked static: both graphs, on an H100 on 2026-11-28 ("mutated inputs"), when the gradient buffer was
    marked and its views were not. What Dynamo and AOTAutograd decided, from their own log on the CPU: every input
    is static but the batch (copied into the graph's own tensors at each replay)."""
    torch._dynamo.reset()
    decisions = []
    handler = logging.Handler()
    handler.emit = lambda record: decisions.append(record.getMessage())
    loggers = [logging.getLogger(f"torch.{module}.__cudagraph_static_inputs")
               for module in ("_dynamo.variables.builder", "_functorch._aot_autograd.frontend_utils")]
    torch._logging.set_logs(cudagraph_static_inputs=True)
    for logger in loggers:
        logger.addHandler(handler)
    try:
        step = captured(pretraining_model())
        step.accumulate(encode([5, 3, 6, 1]))
        step.update()
    finally:
        torch._logging.set_logs()
        for logger in loggers:
            logger.removeHandler(handler)
    static = [m for m in decisions if m.startswith("Adding static input")]
    others = sorted(re.sub(r"pos \d+ ", "", m) for m in decisions if m.startswith("Non-static input"))
    assert any("grads[" in m for m in static) and any("rows_read" in m for m in static)
    assert others == [f"Non-static input for source L['{name}']" for name in ("attention_mask", "input_ids", "labels")]


def test_the_captured_step_refuses_what_it_cannot_run():
    model = pretraining_model()
    with pytest.raises(TypeError, match="one torch.optim.Adagrad"):
        CapturedTrainingStep(model, torch.optim.AdamW(model.parameters()), loss_scale=1.0, max_grad_norm=1.0,
                             largest_batch=(5, 16))
    with pytest.raises(TypeError, match="without lr_decay, weight_decay or maximize"):
        CapturedTrainingStep(model, torch.optim.Adagrad(model.parameters(), lr_decay=0.1), loss_scale=1.0,
                             max_grad_norm=1.0, largest_batch=(5, 16))
    model.softmax.sparse = True
    with pytest.raises(ValueError, match="dense gradient"):
        captured(model)


def test_the_eager_compile_backend_is_refused(capsys):
    # torch 2.13's "eager" backend kept each captured step's saved tensors in reference cycles (RSS grew 150-200 MB
    # a step on the recipe config, and the 300-step comparison was killed at 23.8 GB).
    with pytest.raises(SystemExit) as exit_info:
        pretrain_main(["--train-files", "x.txt", "--config", "small", "--output-dir", "out", "--max-steps", "1",
                       "--compile-backend", "eager"])
    assert exit_info.value.code == 2
    assert ("--compile-backend: invalid choice: 'eager' (choose from 'none', 'inductor', 'aot_eager')"
            in capsys.readouterr().err)


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


def test_two_processes_all_reduce_between_the_graphs_to_one_processs_weights(tmp_path):
    """gloo, each process half of every global batch; one process accumulates both halves."""
    torch._dynamo.reset()
    command = [sys.executable, "-m", "accelerate.commands.accelerate_cli", "launch", "--multi_gpu", "--num_processes",
               "2", "--num_machines", "1", "--main_process_port", str(free_port()), "--dynamo_backend", "no",
               captured_training.__file__, str(tmp_path)]
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(REPO_ROOT), os.path.dirname(captured_training.__file__)]),
           "HF_HUB_OFFLINE": "1", "ACCELERATE_USE_CPU": "1", "OMP_NUM_THREADS": "1", "PYTHONFAULTHANDLER": "1"}
    with ThreadPoolExecutor(max_workers=1) as pool:  # the two processes start while this one trains the reference
        launched = pool.submit(subprocess.run, command, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                               env=env, timeout=300)
        reference = captured_training.train()
        result = launched.result()
    assert result.returncode == 0, launch_failure_report(result.stdout)
    two = load_file(tmp_path / "weights-2.safetensors")
    assert two.keys() == reference.keys()
    moved = max(float((two[k] - pretraining_model(0.0, 0).state_dict()[k]).abs().max()) for k in two)
    assert moved > 1e-2
    assert max(float((two[k] - reference[k]).abs().max()) for k in two) < 1e-6


# ------------------------------------------------------------------------------------------------ hf-elmo pretrain
def _pretrain(corpus, output, *extra) -> int:
    from accelerate.state import AcceleratorState, GradientState

    AcceleratorState._reset_state(True)
    GradientState._reset_state()
    (corpus / "captured-tiny.json").write_text(json.dumps(captured_training.TINY), encoding="utf-8")
    return pretrain_main([
        "--train-files", str(corpus / "train.txt"), "--config", str(corpus / "captured-tiny.json"),
        "--output-dir", str(output), "--max-sentence-words", "8", "--seed", "1", "--build-vocab", "--min-count", "2",
        "--num-softmax-samples", "256", "--batch-size", "6", "--num-workers", "0", "--report-to", "none",
        "--training-step", "captured", "--compile-backend", "aot_eager", *extra,
    ])


def test_inductor_on_a_cpu_is_refused_before_training(english_corpus, tmp_path, capsys):
    # torch 2.13's inductor wrote wrong vectorised C++ for this step with AVX2 code (simulated on an AVX-512 host
    # with ATEN_CPU_CAPABILITY=avx2): the run aborted from inside the step.
    assert _pretrain(english_corpus, tmp_path / "out", "--max-steps", "1", "--compile-backend", "inductor") == 1
    error = capsys.readouterr().err.strip().splitlines()[-1]
    assert error == ("error: --compile-backend inductor compiles the captured step for a GPU, and this run trains on "
                     "cpu: use --compile-backend none (the default) or aot_eager there (torch 2.13's inductor writes "
                     "wrong vectorised C++ for this step on CPUs without AVX-512).")
    assert not (tmp_path / "out").exists()


@pytest.mark.parametrize("backend, how", [
    ("aot_eager", "two graphs compiled by torch.compile, backend aot_eager"),
    ("none", "two functions, run as plain calls on the CPU"),  # what a GPU records as CUDA graphs
])
def test_a_resumed_captured_run_ends_bit_exactly_as_an_uninterrupted_one(english_corpus, tmp_path, caplog, backend,
                                                                         how):
    caplog.set_level(logging.INFO, logger="hf_elmo")

    def pretrain(output, *extra):
        return _pretrain(english_corpus, output, "--logging-steps", "2", "--save-steps", "2", "--mixed-precision",
                         "bf16", "--compile-backend", backend, *extra)

    assert pretrain(tmp_path / "whole", "--max-steps", "4") == 0
    # The update's softmax rows: the most a batch of 6 rows x 8 words reads, 2 x 6 x (8 + 2) targets and 256
    # negatives (below the vocabulary's size).
    assert f"Training step: captured ({how}; batches of 6 rows, lengths padded to a multiple of 8 words; dense " \
           "softmax gradient, updated over 376 rows a step)" in caplog.text
    assert "sampled (256 negatives) softmax in training (dense gradient)" in caplog.text
    # Sentences of at most 8 words: one length, one graph to compile, and the log says when it does.
    builds = backend != "none"  # plain calls on the CPU build nothing
    assert caplog.text.count("Building the training step's graph for batches of 6 rows x 8 words") == builds
    assert bool(re.search(r"Built the training step's graph for 8 words in [\d.]+ s \(1 length\(s\) so far\)",
                          caplog.text)) == builds
    assert pretrain(tmp_path / "split", "--max-steps", "2") == 0
    caplog.clear()
    assert pretrain(tmp_path / "split", "--max-steps", "4", "--resume") == 0
    assert f"Resumed from {tmp_path / 'split' / 'checkpoint-2'}: step 2" in caplog.text
    whole = load_file(tmp_path / "whole" / "model.safetensors")
    split = load_file(tmp_path / "split" / "model.safetensors")
    assert all(torch.equal(whole[k], split[k]) for k in whole)
    metrics = [json.loads(line) for line in (tmp_path / "whole" / "metrics.jsonl").read_text().splitlines()]
    assert [m["step"] for m in metrics] == [2, 4] and all(math.isfinite(m["train/grad_norm"]) for m in metrics)


def test_a_gradient_that_is_not_finite_stops_the_run_at_the_next_logging_step(english_corpus, tmp_path, capsys):
    # Adagrad at lr 1e30: step 1 throws the weights to ~1e30, and step 2's gradient is not finite.
    output = tmp_path / "diverged"
    assert _pretrain(english_corpus, output, "--learning-rate", "1e30", "--max-steps", "6", "--logging-steps", "3",
                     "--save-steps", "6") == 1
    message = [line for line in capsys.readouterr().err.splitlines() if line.startswith("error:")][-1]
    assert "step 2: the gradient norm is not finite; training stopped (found at step 3's logging: the captured " \
           "step applied nothing from step 2 on)" in message
    assert "checkpoint-1 holds the model and optimizer from before step 2, with the data position after step 3's " \
           "batches" in message
    state = json.loads((output / "checkpoint-1" / "training_state.json").read_text())
    assert state["progress"]["step"] == 1 and not os.path.exists(output / "model.safetensors")
