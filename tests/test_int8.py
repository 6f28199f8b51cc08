"""int8 weights for CPU inference (`hf_elmo/int8_weights.py`, `ElmoPreTrainedModel.quantize_int8`)."""

import json
import os
import re
import subprocess
import sys

import h5py
import numpy as np
import pytest
import torch
from torch import nn

from hf_elmo import ElmoForTokenClassification, ElmoModel, ElmoTokenizer
from hf_elmo.cli import main
from hf_elmo.cpu_tuning import product_columns
from hf_elmo.int8_weights import INT8_LEVELS, Int8CpuError, Int8Linear, RecurrenceProducts


# The largest difference int8 weights make to any layer of bilm-tf's fixture sentences (measured: 0.018 on the token
# layer, whose values reach 7.1, and 0.015-0.018 on the LSTM layers; README "int8 weights").
INT8_FIXTURE_BOUND = 0.05
KERNELS = ("bf16-dot", "int8-pack")


@pytest.fixture(params=KERNELS)
def kernel(request, monkeypatch):
    """Each int8 kernel in turn, picked as users pick it (on a CPU without bf16 dot products, "bf16-dot" runs
    oneDNN's emulation: slower, the same function)."""
    monkeypatch.setenv("HF_ELMO_INT8_KERNEL", request.param)
    return request.param


@pytest.fixture(scope="module")
def fixture_batch(elmo_fixture):
    with open(elmo_fixture / "sentences.json", encoding="utf-8") as f:
        sentences = [sentence.split() for group in json.load(f) for sentence in group]
    return ElmoTokenizer()(sentences, is_split_into_words=True, padding=True, return_tensors="pt")


def all_layers(model, batch) -> torch.Tensor:
    with torch.no_grad():
        return torch.stack(model(**batch, output_hidden_states=True).hidden_states)


def test_a_weight_is_rounded_to_half_a_level_of_its_row():
    torch.manual_seed(0)
    linear = nn.Linear(40, 24)
    with torch.no_grad():
        linear.weight[3] = 0.0  # an all-zero row keeps zeros
        # Values on the levels of scale 2^-8 (exact in bf16), the largest 127 levels: reproduced exactly.
        linear.weight[5] = torch.tensor([-127.0, 127.0, *range(-19, 19)]) * 2.0**-8
    int8 = Int8Linear.from_linear(linear)
    # Each row's scale is the bf16 number nearest max |w| / 127: the largest value is 127 levels, none clipped.
    exact = linear.weight.abs().amax(dim=1) / INT8_LEVELS
    scale = int8.weight_scale.float()
    assert int8.weight_scale.dtype == torch.bfloat16
    rows = exact > 0
    assert bool(((scale[rows] / exact[rows] - 1).abs() <= 2.0**-8).all())
    assert int8.weight_int8.abs().amax(dim=1)[rows].tolist() == [INT8_LEVELS] * int(rows.sum())
    assert scale[5] == 2.0**-8
    # Quantizing the values the int8 ones stand for gives them back, scales included (how they are saved).
    again = Int8Linear.from_linear(nn.Linear(40, 24).requires_grad_(False))
    again.load_state_dict(int8.state_dict())
    assert torch.equal(again.weight_int8, int8.weight_int8) and torch.equal(again.weight_scale, int8.weight_scale)
    error = (int8.dequantized_weight() - linear.weight).abs()
    assert bool((error <= scale[:, None] / 2 * (1 + 1e-6)).all())
    assert int8.weight_int8.dtype == torch.int8 and int8.weight_int8.abs().max() <= INT8_LEVELS
    assert error[3].max() == 0 and error[5].max() == 0
    # The inner dimension is stored padded to the kernel's multiple of 16, with zero columns.
    assert tuple(int8.weight_int8.shape) == (24, 48) and int8.weight_int8[:, 40:].abs().max() == 0


@pytest.mark.parametrize("in_features", [40, 64])
def test_the_product_is_the_dequantized_weights_on_bf16_inputs_rounded_once(in_features, kernel):
    torch.manual_seed(1)
    linear = nn.Linear(in_features, 48).requires_grad_(False)
    int8 = Int8Linear.from_linear(linear)
    assert int8.kernel == kernel and f"kernel={kernel!r}" in repr(int8)
    inputs = torch.randn(2, 5, in_features)
    expected = inputs.bfloat16().float() @ int8.dequantized_weight().t()
    # Accumulated in fp32 from the same operands, then the output is rounded to bf16 once: at most half a bf16
    # step (2^-9 relative) off, plus the fp32 accumulation's rounding.
    bound = expected.abs() * 2.0**-8 + 1e-5
    assert bool(((int8(inputs) - linear.bias - expected).abs() <= bound).all())
    # The unscaled sums are integers times bf16 numbers: the scale is applied after their rounding, exactly.
    sums = (inputs.bfloat16().float() @ int8.weight_int8[:, :in_features].float().t()).bfloat16().float()
    assert (int8(inputs) - linear.bias - sums * int8.weight_scale.float()).abs().max() <= 1e-5 * sums.abs().max()
    columns = inputs.reshape(-1, in_features).t()
    out = torch.full((48, 10), float("nan"))
    assert int8.columns_product(columns, out=out, add=linear.bias[:, None]) is out
    assert torch.equal(out, int8(inputs).reshape(-1, 48).t())
    # `add` may be `out` itself (a recurrence step adds into its gates).
    start = torch.randn(48, 10)
    gates = start.clone()
    assert int8.columns_product(columns, out=gates, add=gates) is gates
    assert (gates - start - (out - linear.bias[:, None])).abs().max() <= 1e-5


def test_both_kernels_compute_one_function_up_to_the_order_of_each_sum(monkeypatch):
    torch.manual_seed(2)
    linear = nn.Linear(96, 64).requires_grad_(False)
    columns = torch.randn(96, 7)
    products = {}
    for name in KERNELS:
        monkeypatch.setenv("HF_ELMO_INT8_KERNEL", name)
        products[name] = Int8Linear.from_linear(linear).columns_product(columns)
    # Both round the same fp32 sums to bf16, scaled after: a different order of summing can move a sum by one bf16
    # step (2^-8 relative) at most, and moves most by none.
    difference = (products["bf16-dot"] - products["int8-pack"]).abs()
    assert bool((difference <= products["int8-pack"].abs() * 2.0**-8 + 1e-6).all())
    assert (difference == 0).float().mean() > 0.9


def test_an_unknown_kernel_is_one_clear_error(converted_dir, elmo_fixture, monkeypatch, tmp_path, capsys):
    monkeypatch.setenv("HF_ELMO_INT8_KERNEL", "avx512")
    message = "HF_ELMO_INT8_KERNEL='avx512': expected one of bf16-dot, int8-pack, or unset."
    with pytest.raises(Int8CpuError, match=f"^{re.escape(message)}$"):
        ElmoModel.from_pretrained(converted_dir, int8_weights=True)
    source = tmp_path / "in.txt"
    source.write_text("One line .\n", encoding="utf-8")
    assert main(["embed", str(source), str(tmp_path / "out.hdf5"), "--model", str(converted_dir), "--int8",
                 "--no-progress"]) == 1
    err = capsys.readouterr().err
    assert err.strip().splitlines()[-1] == f"error: {message}" and "Traceback" not in err
    assert not (tmp_path / "out.hdf5").exists()


def test_the_kernel_is_the_one_measured_faster_on_this_cpu(converted_dir, monkeypatch, caplog):
    from hf_elmo import int8_weights

    assert int8_weights.faster_kernel({"fp32": 1.0, "bf16-dot": 2.0, "int8-pack": 1.5}) == "int8-pack"
    assert int8_weights.faster_kernel({"fp32": 1.0, "bf16-dot": 0.5, "int8-pack": 0.5}) == "bf16-dot"
    monkeypatch.delenv("HF_ELMO_INT8_KERNEL", raising=False)
    monkeypatch.delenv("HF_ELMO_CPU_TUNING", raising=False)
    monkeypatch.setattr(int8_weights, "_MEASURED_KERNEL", [])
    with caplog.at_level("INFO", logger="hf_elmo.int8_weights"):
        model = ElmoModel.from_pretrained(converted_dir, int8_weights=True)
    # One line with the three timings on the largest map; the warning exactly when no int8 kernel beat fp32.
    lines = [r for r in caplog.records if r.name == "hf_elmo.int8_weights"]
    assert len(lines) == 1, [r.getMessage() for r in lines]
    seconds = dict(re.findall(r"(fp32|bf16-dot|int8-pack) ([\d.]+) ms", lines[0].getMessage()))
    assert sorted(seconds) == ["bf16-dot", "fp32", "int8-pack"]
    kernel = min(KERNELS, key=lambda name: float(seconds[name]))
    assert {linear.kernel for linear in model.modules() if isinstance(linear, Int8Linear)} == {kernel}
    slower = float(seconds[kernel]) >= float(seconds["fp32"])
    assert (lines[0].levelname == "WARNING") == slower
    assert ("slower than fp32 on this CPU" in lines[0].getMessage()) == slower
    # Measured once per process; not at all where the kernel is named, or the tuning fixed.
    small = nn.Linear(8, 8)
    assert int8_weights.measure_kernels(small.weight, Int8Linear.from_linear(small)) is None
    assert int8_weights.product_kernel() == kernel
    monkeypatch.setattr(int8_weights, "_MEASURED_KERNEL", [])
    monkeypatch.setenv("HF_ELMO_CPU_TUNING", "fixed")
    assert int8_weights.measure_kernels(small.weight, Int8Linear.from_linear(small)) is None
    assert int8_weights.product_kernel() == ("bf16-dot" if int8_weights.has_bf16_dot_products() else "int8-pack")


def test_bf16_dot_rounds_column_counts_to_a_few_sizes_never_one():
    assert [product_columns(n) for n in range(0, 12)] == [0, 2, 2, 4, 4, 8, 8, 8, 8, 16, 16, 16]
    assert [product_columns(n) for n in (17, 24, 25, 32, 33, 64, 65, 129, 256)] == [24, 24, 32, 32, 64, 64, 128, 256, 256]


def test_a_column_gets_the_same_bits_whatever_the_count_and_its_place(monkeypatch):
    """What keeps a sentence's vectors independent of its batch on "bf16-dot": each column's sums do not depend on
    the other columns (at "original"'s projection shape; a lone column is multiplied as two, `product_columns`)."""
    monkeypatch.setenv("HF_ELMO_INT8_KERNEL", "bf16-dot")
    torch.manual_seed(3)
    linear = Int8Linear.from_linear(nn.Linear(4096, 512).requires_grad_(False))
    column = torch.randn(4096, 1)

    def buffer(name, numel, dtype, zeroed=False):
        return torch.zeros(numel, dtype=dtype) if zeroed else torch.full((numel,), float("nan"), dtype=dtype)

    prepared = RecurrenceProducts(linear, 17, buffer)
    # Each way on its own: a weight is multiplied one way only (the recurrence's `RecurrenceProducts`, every other
    # product `columns_product`), and the two need not sum alike (torch's bf16 matmul without oneDNN does not).
    alone = linear.columns_product(column)
    prepared_alone = prepared.columns_product(column, torch.empty(512, 1))
    for count in (1, 2, 3, 9, 17):
        for place in {0, count // 2, count - 1}:
            columns = torch.randn(4096, count)
            columns[:, place] = column[:, 0]
            assert torch.equal(linear.columns_product(columns)[:, place], alone[:, 0])
            out = torch.empty(512, count)
            assert torch.equal(prepared.columns_product(columns, out)[:, place], prepared_alone[:, 0])
            # The step's in-place form (gates += product) adds the same product.
            start = torch.randn(512, count)
            gates = prepared.columns_product(columns, start.clone(), add=None).add_(start)
            assert torch.allclose(prepared.columns_product(columns, start, add=start), gates, rtol=0, atol=1e-6)
    # Both ways compute one function: equal up to the order of each sum (one bf16 step at most).
    assert bool(((prepared_alone - alone).abs() <= alone.abs() * 2.0**-8 + 1e-6).all())


def test_int8_outputs_stay_within_the_bound_of_fp32_on_the_bilm_tf_fixture(converted_dir, fixture_batch, kernel):
    fp32 = all_layers(ElmoModel.from_pretrained(converted_dir), fixture_batch)
    model = ElmoModel.from_pretrained(converted_dir, int8_weights=True)
    assert model.has_int8_weights and not model.training
    assert not any(p.requires_grad for p in model.parameters())
    int8 = all_layers(model, fixture_batch)
    difference = (int8 - fp32).abs().amax(dim=(1, 2, 3))
    assert bool((difference <= INT8_FIXTURE_BOUND).all()), difference
    # Every layer really computed with int8 weights, and padding stays exactly zero.
    assert bool((difference > 1e-4).all()), difference
    mask = fixture_batch["attention_mask"].bool()
    assert int8[:, ~mask].abs().max() == 0
    # The same result as quantizing a model in hand.
    assert torch.equal(all_layers(ElmoModel.from_pretrained(converted_dir).quantize_int8(), fixture_batch), int8)


def test_int8_vectors_do_not_depend_on_batch_or_padding(converted_dir, kernel):
    model = ElmoModel.from_pretrained(converted_dir, int8_weights=True)
    tokenizer = ElmoTokenizer()
    target = "The virus spread quickly through the schools .".split()
    others = [["Short", "."], "A much longer sentence that forces a lot of padding onto the target one".split()]
    alone = all_layers(model, tokenizer([target], is_split_into_words=True, return_tensors="pt"))
    mixed = all_layers(model, tokenizer(others + [target], is_split_into_words=True, padding=True,
                                        return_tensors="pt"))
    assert (alone[:, 0] - mixed[:, 2, : len(target)]).abs().max() <= 1e-6


def test_a_model_with_int8_weights_saves_the_values_they_stand_for(converted_dir, fixture_batch, tmp_path):
    model = ElmoModel.from_pretrained(converted_dir, int8_weights=True)
    fp32 = ElmoModel.from_pretrained(converted_dir)
    state = model.state_dict()
    assert set(state) == set(fp32.state_dict()) and all(v.dtype == torch.float32 for v in state.values())
    model.save_pretrained(tmp_path / "int8")
    again = ElmoModel.from_pretrained(tmp_path / "int8", int8_weights=True)
    buffers = dict(model.named_buffers())
    for name, buffer in again.named_buffers():
        assert torch.equal(buffer, buffers[name]), name
    with torch.no_grad():
        assert torch.equal(again(**fixture_batch).last_hidden_state, model(**fixture_batch).last_hidden_state)
    # Loading quantizes what it is given, and a weight of the wrong shape is an error naming it.
    linear = model.bilstm.forward_layers[0].input_proj
    prefix = "bilstm.forward_layers.0.input_proj."
    model.load_state_dict(fp32.state_dict())
    assert torch.equal(linear.weight_int8, Int8Linear.from_linear(fp32.bilstm.forward_layers[0].input_proj).weight_int8)
    with pytest.raises(RuntimeError, match=f"size mismatch for {re.escape(prefix)}weight: copying a param with shape"):
        model.load_state_dict({**state, prefix + "weight": state[prefix + "weight"][:, 1:]})


def test_the_token_cache_follows_int8_weights_loaded_in_place(converted_dir, fixture_batch):
    # Loading a state dict writes int8 weights into buffers, which the cache did not watch: it kept old vectors.
    model = ElmoModel.from_pretrained(converted_dir, int8_weights=True)
    model.char_encoder.enable_token_cache()
    name = "char_encoder.highways.0.carry.weight"
    halved = {name: model.state_dict()[name] * 0.5}
    with torch.no_grad():
        before = model(**fixture_batch).last_hidden_state
        model.load_state_dict(halved, strict=False)  # the weight alone: no parameter changes
        after = model(**fixture_batch).last_hidden_state
        fresh = ElmoModel.from_pretrained(converted_dir, int8_weights=True)
        fresh.load_state_dict(halved, strict=False)
        expected = fresh(**fixture_batch).last_hidden_state
    assert torch.equal(after, expected) and not torch.equal(after, before)


def test_bad_uses_of_int8_weights_get_one_clear_error(converted_dir, fixture_batch):
    model = ElmoModel.from_pretrained(converted_dir, int8_weights=True)
    for name in ("reference", "cuda"):
        model.set_elmo_implementation(name)
        with pytest.raises(ValueError, match=f"run on the 'cpu' implementation only .*, not on '{name}'"):
            model(**fixture_batch)
    model.set_elmo_implementation(None)
    with pytest.raises(ValueError, match="int8 weights, which cannot be trained"):
        model(**fixture_batch, lstm_dropout=0.1)
    model.bilstm.forward_layers[0].input_proj.bias.requires_grad_(True)
    with pytest.raises(ValueError, match="int8 weights, which cannot be trained"):
        model(**fixture_batch)
    with pytest.raises(ValueError, match="works on an fp32 model"):
        ElmoModel.from_pretrained(converted_dir, dtype=torch.bfloat16).quantize_int8()
    # Moved to bf16 after quantizing: refused (it ran silently, against the README).
    model.bilstm.forward_layers[0].input_proj.bias.requires_grad_(False)
    model.to(torch.bfloat16)
    with pytest.raises(ValueError, match="int8 weights, whose other weights and activations are fp32: it was moved to "
                                         "torch.bfloat16"):
        model(**fixture_batch)


def test_int8_weights_from_a_folder_saved_in_bf16(converted_dir, fixture_batch, tmp_path):
    # They are made from fp32 weights: the bf16 folder is read into fp32 (it was refused with a message about a
    # torch_dtype nobody passed), and gives what the fp32 folder's bf16-rounded weights give.
    ElmoModel.from_pretrained(converted_dir, dtype=torch.bfloat16).save_pretrained(tmp_path / "bf16")
    model = ElmoModel.from_pretrained(tmp_path / "bf16", int8_weights=True)
    assert model.has_int8_weights and model.char_encoder.char_embeddings.weight.dtype == torch.float32
    rounded = ElmoModel.from_pretrained(converted_dir)
    rounded.load_state_dict({k: v.to(torch.bfloat16).float() for k, v in rounded.state_dict().items()})
    with torch.no_grad():
        assert torch.equal(model(**fixture_batch).last_hidden_state,
                           rounded.quantize_int8()(**fixture_batch).last_hidden_state)


def test_a_head_learns_over_a_frozen_int8_bilm(converted_dir, fixture_batch):
    head = ElmoForTokenClassification.from_pretrained(converted_dir, num_labels=3, freeze_elmo=False,
                                                      int8_weights=True)
    assert head.config.freeze_elmo and head.elmo.has_int8_weights
    head.train()
    labels = torch.where(fixture_batch["attention_mask"].bool(), 1, -100)
    head(**fixture_batch, labels=labels).loss.backward()
    assert head.classifier.weight.grad.abs().sum() > 0
    assert not any(p.requires_grad for p in head.elmo.parameters())
    head.freeze_base_model(False)
    with pytest.raises(ValueError, match="int8 weights, which cannot be trained"):
        head(**fixture_batch, labels=labels)


def test_embed_int8_writes_vectors_within_the_bound(converted_dir, elmo_fixture, tmp_path, capsys):
    with open(elmo_fixture / "sentences.json", encoding="utf-8") as f:
        lines = [sentence for group in json.load(f) for sentence in group][:6]
    source = tmp_path / "in.txt"
    source.write_text("".join(line + "\n" for line in lines), encoding="utf-8")
    outputs = {}
    for name, options in (("fp32", []), ("int8", ["--int8"])):
        outputs[name] = tmp_path / f"{name}.hdf5"
        assert main(["embed", str(source), str(outputs[name]), "--model", str(converted_dir), "--tokenized",
                     "--no-progress", *options]) == 0
    with h5py.File(outputs["fp32"]) as fp32, h5py.File(outputs["int8"]) as int8:
        differences = [np.abs(fp32[key][...] - int8[key][...]).max() for key in fp32]
    assert len(differences) == 6 and 1e-4 < max(differences) <= INT8_FIXTURE_BOUND
    if torch.cuda.is_available():
        assert main(["embed", str(source), str(tmp_path / "gpu.hdf5"), "--model", str(converted_dir), "--int8",
                     "--device", "cuda"]) == 1
        assert "error: --int8 runs on the CPU only; drop --device cuda or --int8." in capsys.readouterr().err
    else:  # a device the machine lacks is a usage error first
        with pytest.raises(SystemExit) as exit_info:
            main(["embed", str(source), str(tmp_path / "gpu.hdf5"), "--model", str(converted_dir), "--int8",
                  "--device", "cuda"])
        assert exit_info.value.code == 2 and "this machine has 0 CUDA GPU(s)" in capsys.readouterr().err
    assert not (tmp_path / "gpu.hdf5").exists()


def test_embed_int8_on_a_cpu_without_vector_kernels_says_so_in_one_line(converted_dir, tmp_path):
    source = tmp_path / "in.txt"
    source.write_text("One line .\n", encoding="utf-8")
    # torch runs its scalar kernels when told to: a CPU without AVX2, for real.
    env = dict(os.environ, ATEN_CPU_CAPABILITY="default")
    result = subprocess.run(
        [sys.executable, "-m", "hf_elmo.cli", "embed", str(source), str(tmp_path / "out.hdf5"), "--model",
         str(converted_dir), "--int8"], capture_output=True, text=True, env=env, timeout=300,
    )
    assert result.returncode == 1, result.stderr
    assert result.stderr.strip().splitlines() == [
        "error: int8 weights need a CPU on which torch runs AVX2 or AVX-512 kernels; this one runs 'DEFAULT', "
        "where torch's int8 kernel is scalar code, slower than the fp32 model. Load the model without int8."
    ]
    assert not (tmp_path / "out.hdf5").exists()
