"""Every ELMo implementation computes the function that the modules specify.

`ElmoCharacterEncoder.forward` and `ElmoBiLstm.forward` are the specification (the "reference" implementation);
"cpu" (elmo_cpu.py) and "cuda" (elmo_cuda.py) are held to it here, on CPU tensors, on random weights scaled so
that cell and projection clipping are active, with variable lengths, carried LSTM state, gradients, bf16, the
token cache and a long sentence. The "cuda" implementation's CUDA run is tested where a GPU is present.
"""

import copy
import json
import logging
import math
import random
import shutil
import weakref

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode

from hf_elmo.configuration_elmo import ElmoConfig, word_to_char_ids
from hf_elmo import cpu_tuning, elmo_cpu
from hf_elmo.cpu_tuning import few_column_matmul, onednn_product
from hf_elmo.int8_weights import has_bf16_dot_products
from hf_elmo import modeling_elmo
from hf_elmo.modeling_elmo import ELMO_IMPLEMENTATIONS, ElmoModel, elmo_implementation_for
from hf_elmo.testing_utils import HostDataReads


# The implementations held to the reference.
TUNED = ["cpu", "cuda"]


FILTERS = ((1, 4), (2, 4), (3, 8), (5, 8), (7, 16))


def make_model(seed=0, lstm_dim=24, projection_dim=8, recurrent_std=0.2, **kwargs) -> ElmoModel:
    """
    A tiny model with released-style filter widths and random weights chosen so that clipping bites: open forget
    gates and biased candidates make cells run into cell_clip, a large projection makes outputs hit proj_clip.
    The recurrence stays contractive (small recurrent weights), as in trained models, so that rounding
    differences between two correct implementations do not grow without bound over long sentences.
    """
    torch.manual_seed(seed)
    config = ElmoConfig(
        char_filters=FILTERS, n_highway=2, char_embedding_dim=4, lstm_dim=lstm_dim, projection_dim=projection_dim,
        cell_clip=3.0, proj_clip=3.0, num_lstm_layers=2, **kwargs,
    )
    model = ElmoModel(config)
    with torch.no_grad():
        for name, parameter in model.named_parameters():
            std = {"input_proj": 0.3, "recurrent_proj": recurrent_std, "output_proj": 1.5}.get(name.split(".")[-2], 0.2)
            parameter.normal_(0.0, std)
        model.char_encoder.char_embeddings.weight[0] = 0
        for layer in [*model.bilstm.forward_layers, *model.bilstm.backward_layers]:
            layer.input_proj.bias[lstm_dim : 2 * lstm_dim] += 2.0 * torch.randn(lstm_dim).sign()
            layer.input_proj.bias[2 * lstm_dim : 3 * lstm_dim] += 3.0
    return model.eval()


def use(model: ElmoModel, implementation: str | None):
    model.set_elmo_implementation(implementation)


def random_word(rng: random.Random) -> str:
    length = rng.choice([1, 1, 2, 3, 5, 8, 13, 30, 48, 60])  # 60 bytes: cut to 48, no padding char at all
    return "".join(rng.choice("abcdefghijklmnopqrstuvwxyzé日😀,.") for _ in range(length))


def make_batch(lengths, seed=0, vocabulary=None) -> torch.Tensor:
    rng = random.Random(seed)
    ids = torch.zeros(len(lengths), max(lengths), 50, dtype=torch.long)
    for row, length in enumerate(lengths):
        for position in range(length):
            word = rng.choice(vocabulary) if vocabulary else random_word(rng)
            ids[row, position] = torch.tensor(word_to_char_ids(word))
    return ids


def run(model, ids, implementation, **kwargs):
    use(model, implementation)
    try:
        return model(ids, output_hidden_states=True, return_lstm_state=True, **kwargs)
    finally:
        use(model, None)


def max_diff(a, b) -> float:
    return max((x.float() - y.float()).abs().max().item() for x, y in zip(a, b))


@pytest.fixture(scope="module")
def model():
    return make_model()


def test_the_implementation_is_chosen_by_device_unless_set(model, monkeypatch):
    config = model.config
    assert elmo_implementation_for(config, torch.device("cpu")) is ELMO_IMPLEMENTATIONS["cpu"]
    assert elmo_implementation_for(config, torch.device("cuda")) is ELMO_IMPLEMENTATIONS["cuda"]
    assert elmo_implementation_for(config, torch.device("meta")) is ELMO_IMPLEMENTATIONS["reference"]
    use(model, "reference")
    try:
        assert elmo_implementation_for(config, torch.device("cuda")) is ELMO_IMPLEMENTATIONS["reference"]

        def boom(*args, **kwargs):
            raise AssertionError("cpu implementation used")

        monkeypatch.setattr(elmo_cpu, "_layer", boom)
        monkeypatch.setattr(elmo_cpu, "_pooled_convolutions", boom)
        with torch.no_grad():
            model(make_batch([3, 1]))
    finally:
        use(model, None)
    with torch.no_grad(), pytest.raises(AssertionError, match="cpu implementation used"):
        model(make_batch([3, 1]))
    with pytest.raises(ValueError, match="elmo_implementation must be one of"):
        model.set_elmo_implementation("fast")


def test_the_implementation_is_a_run_time_choice_never_saved(model, tmp_path):
    from transformers import AutoModel

    model.set_elmo_implementation("reference")
    try:
        model.save_pretrained(tmp_path)
    finally:
        use(model, None)
    saved = json.loads((tmp_path / "config.json").read_text())
    assert not any("implementation" in key for key in saved)
    assert AutoModel.from_pretrained(tmp_path).config.elmo_implementation is None
    loaded = AutoModel.from_pretrained(tmp_path, elmo_implementation="cuda")
    assert loaded.config.elmo_implementation == "cuda"
    assert elmo_implementation_for(loaded.config, torch.device("cpu")) is ELMO_IMPLEMENTATIONS["cuda"]


@pytest.mark.parametrize("implementation", TUNED)
def test_outputs_and_state_match_reference_with_clipping_active(model, implementation):
    ids = make_batch([7, 1, 12, 4, 12, 2])
    with torch.no_grad():
        reference = run(model, ids, "reference")
        fast = run(model, ids, implementation)
        reference_kept = run(model, ids, "reference", keep_sentence_boundaries=True)
        fast_kept = run(model, ids, implementation, keep_sentence_boundaries=True)
    # Clipping really happens: many cells end at exactly +-cell_clip, many outputs at +-proj_clip.
    cell, hidden = reference.lstm_state
    assert (cell.abs() == 3.0).float().mean().item() > 0.05
    assert (reference.hidden_states[1].abs() == 3.0).float().mean().item() > 0.1
    assert len(fast.hidden_states) == 3
    assert max_diff(fast.hidden_states, reference.hidden_states) <= 1e-5
    assert max_diff(fast.lstm_state, reference.lstm_state) <= 1e-5
    assert max_diff(fast_kept.hidden_states, reference_kept.hidden_states) <= 1e-5
    assert torch.equal(fast.word_mask, reference.word_mask)
    # Padded words are exactly zero on both paths.
    assert fast.last_hidden_state[1, 1:].abs().max() == 0


@pytest.mark.parametrize("keep_sentence_boundaries", [False, True])
@pytest.mark.parametrize("implementation", ["reference", *TUNED])
def test_top_layer_alone_is_the_last_of_all_layers(model, implementation, keep_sentence_boundaries):
    ids = make_batch([7, 1, 12, 4], seed=21)
    with torch.no_grad():
        every = run(model, ids, implementation, keep_sentence_boundaries=keep_sentence_boundaries)
        use(model, implementation)
        try:
            top = model(ids, keep_sentence_boundaries=keep_sentence_boundaries)
        finally:
            use(model, None)
    assert top.hidden_states is None
    assert top.last_hidden_state.shape == (4, 12 + 2 * keep_sentence_boundaries, 2 * model.config.projection_dim)
    assert torch.equal(top.last_hidden_state, every.hidden_states[-1])
    assert top.last_hidden_state.is_contiguous()
    # Zero exactly where there is no word (or boundary), non-zero where there is one.
    assert torch.equal(top.last_hidden_state.abs().amax(dim=-1) > 0, top.word_mask)


def test_bilstm_lays_out_only_the_layers_asked_for(model):
    tokens = torch.randn(3, 6, model.config.projection_dim)
    mask = torch.arange(6) < torch.tensor([6, 2, 4])[:, None]
    state = model.zero_lstm_state(3, "cpu", torch.float32)
    with torch.no_grad():
        every, _ = model.bilstm(tokens, mask, state)
        top, _ = model.bilstm(tokens, mask, state, output_layers=(1,))
        words, _ = model.bilstm(tokens, mask, state, output_layers=(0,), words_only=True)
    assert len(every) == 2 and len(top) == 1 and torch.equal(top[0], every[1])
    # words_only: positions 1 .. length - 2 of each row, zero after.
    assert words[0].shape == (3, 4, 2 * model.config.projection_dim)
    assert torch.equal(words[0], every[0][:, 1:-1] * mask[:, 2:, None])
    assert words[0][1].abs().max() == 0  # a row of length 2 is <S> </S> only


@pytest.mark.parametrize("table_values, block_positions", [(1 << 22, 5), (0, 5), (0, 2)])
def test_small_work_blocks_give_the_same_result(table_values, block_positions):
    # Force many input-gate blocks in the LSTM, many convolution chunks and highway chunks (one short) in the char
    # encoder; with and without the first layer's table of distinct words; blocks that would hold fewer positions
    # than a step's 4 rows hold a step's.
    model = make_model(seed=17)
    ids = make_batch([13, 5, 9, 1], seed=18)
    with torch.no_grad(), pytest.MonkeyPatch.context() as patch:
        reference = run(model, ids, "reference")
        patch.setattr(elmo_cpu, "INPUT_GATES_BLOCK_VALUES", 4 * 24 * block_positions)
        patch.setattr(elmo_cpu, "INPUT_GATES_TABLE_VALUES", table_values)
        patch.setattr(elmo_cpu, "CONV_CHUNK_POSITIONS", 16)
        patch.setattr(elmo_cpu, "HIGHWAY_CHUNK_WORDS", 4)
        blocked = run(model, ids, "cpu")
    assert max_diff(blocked.hidden_states, reference.hidden_states) <= 1e-5
    assert max_diff(blocked.lstm_state, reference.lstm_state) <= 1e-5


@pytest.mark.parametrize("extra", ["all", 1])
def test_steps_that_compute_finished_rows_too_give_the_same_result(model, extra, monkeypatch):
    # Where a BLAS is faster on more columns, a step also computes rows that have finished (`step_columns`): force
    # that on every step (all columns that hold a state, or one more than the rows reading), with clipping active
    # and a carried state.
    ids = make_batch([7, 1, 12, 4, 12, 2, 9], seed=31)
    # Random states of this chaotic model leave the two implementations up to 3e-5 apart (11 of 200 draws above
    # 1e-5 with AVX-512 kernels, 15 with AVX2), by the order of fp32 sums alone: each is as far from a float64 run
    # as the other. This draw: 4e-6 with AVX-512, 7e-6 with AVX2.
    generator = torch.Generator().manual_seed(31)
    state = tuple(torch.randn(2, 2, 7, size, generator=generator) for size in (24, 8))
    with torch.no_grad():
        reference = run(model, ids, "reference", lstm_state=state)
        chosen = []

        def padded(weights, rows, available):
            chosen.append((rows, available if extra == "all" else min(available, rows + 1)))
            return chosen[-1][1]

        monkeypatch.setattr(elmo_cpu, "step_columns", padded)
        fast = run(model, ids, "cpu", lstm_state=state)
    assert any(columns > rows for rows, columns in chosen)
    assert max_diff(fast.hidden_states, reference.hidden_states) <= 1e-5
    assert max_diff(fast.lstm_state, reference.lstm_state) <= 1e-5
    assert fast.last_hidden_state[1, 1:].abs().max() == 0


def test_step_columns_pads_only_for_a_clear_gain_on_products_worth_timing(monkeypatch):
    weights = [torch.empty(4096, 128), torch.empty(128, 1024)]
    threads = torch.get_num_threads()
    monkeypatch.setattr(cpu_tuning, "_STEP_COLUMNS", {})

    def products(milliseconds):
        # Made-up timings (ms per column count, the two products together), as if measured on some machine.
        times = {}
        for columns, total in milliseconds.items():
            for weight in weights:
                times[(tuple(weight.shape), weight.dtype, columns, threads)] = (1, total / 2e3)
        monkeypatch.setattr(cpu_tuning, "_PRODUCTS", times)
        cpu_tuning._STEP_COLUMNS.clear()

    products({3: 1.0, 4: 0.9, 5: 0.5, 6: 0.45, 7: 1.0, 8: 0.3})
    assert cpu_tuning.step_columns(weights, 3, 8) == 8  # the fastest within reach
    assert cpu_tuning.step_columns(weights, 3, 6) == 6  # never past the columns that hold a state
    assert cpu_tuning.step_columns(weights, 8, 8) == 8
    assert cpu_tuning.step_columns(weights, 6, 8) == 8
    products({3: 1.0, 4: 0.85, 5: 0.9, 6: 1.2})
    assert cpu_tuning.step_columns(weights, 3, 6) == 3  # 1.18x is within timing noise
    products({3: 0.04, 4: 0.01})
    assert cpu_tuning.step_columns(weights, 3, 4) == 3  # 40 us: dispatch-bound, never padded
    products({1: 1.0, **{columns: 0.1 for columns in range(2, 40)}})
    assert cpu_tuning.step_columns(weights, 1, 39) == 2  # the smallest of equals
    products({1: 1.0, **{columns: 1.0 for columns in range(2, 17)}, 17: 0.1, 18: 0.01})
    assert cpu_tuning.step_columns(weights, 1, 18) == 17  # at most MAX_EXTRA_COLUMNS more
    assert cpu_tuning.step_columns([w.to("meta") for w in weights], 1, 18) == 1  # GPUs: never


@pytest.mark.parametrize(
    "shape",
    [
        # No LSTM projection, no clipping, no skip connections, one layer; no highway and no char projection.
        dict(lstm_dim=16, projection_dim=16, cell_clip=None, proj_clip=None, num_lstm_layers=1,
             use_skip_connections=False, n_highway=0, char_filters=((1, 4), (3, 12))),
        # Three layers, tanh activation.
        dict(lstm_dim=12, projection_dim=4, num_lstm_layers=3, char_activation="tanh"),
    ],
)
@pytest.mark.parametrize("implementation", TUNED)
def test_other_shapes_match_reference(shape, implementation):
    torch.manual_seed(19)
    config = ElmoConfig(**{"char_filters": FILTERS, "n_highway": 1, "char_embedding_dim": 4, **shape})
    model = ElmoModel(config).eval()
    with torch.no_grad():
        for parameter in model.parameters():
            parameter.normal_(0.0, 0.3)
    ids = make_batch([4, 8, 1], seed=20)
    with torch.no_grad():
        reference, fast = run(model, ids, "reference"), run(model, ids, implementation)
    assert max_diff(fast.hidden_states, reference.hidden_states) <= 1e-5
    assert max_diff(fast.lstm_state, reference.lstm_state) <= 1e-5
    # With autograd.
    reference, fast = run(model, ids, "reference"), run(model, ids, implementation)
    assert max_diff(fast.hidden_states, reference.hidden_states) <= 1e-5
    grads = [torch.autograd.grad(out.last_hidden_state.sum(), list(model.parameters())) for out in (reference, fast)]
    for a, b in zip(*grads):
        assert (a - b).abs().max().item() <= 1e-5 * max(1.0, a.abs().max().item())


@pytest.mark.parametrize("implementation", TUNED)
def test_carried_state_matches_reference(model, implementation):
    first, second = make_batch([5, 9, 2], seed=1), make_batch([3, 3, 8], seed=2)
    with torch.no_grad():
        state = run(model, first, "reference").lstm_state
        reference = run(model, second, "reference", lstm_state=state)
        fast = run(model, second, implementation, lstm_state=state)
    assert max_diff(fast.hidden_states, reference.hidden_states) <= 1e-5
    assert max_diff(fast.lstm_state, reference.lstm_state) <= 1e-5
    # The carried state matters (otherwise this test would prove nothing).
    with torch.no_grad():
        fresh = run(model, second, implementation)
    assert max_diff(fresh.hidden_states[1:], fast.hidden_states[1:]) > 1e-2


@pytest.mark.parametrize("products", ["measured", "onednn"])
@pytest.mark.parametrize("implementation", TUNED)
def test_gradients_match_reference(implementation, products, request):
    onednn = request.getfixturevalue("onednn_products") if products == "onednn" else None
    model = make_model(seed=3).train()
    ids = make_batch([6, 2, 9], seed=4)
    generator = torch.Generator().manual_seed(0)
    state = tuple(
        torch.randn(s.shape, generator=generator).requires_grad_() for s in model.zero_lstm_state(3, "cpu", torch.float32)
    )
    weights = [torch.randn(3, 9, 16, generator=torch.Generator().manual_seed(i)) for i in range(3)]

    def gradients(implementation):
        model.zero_grad()
        out = run(model, ids, implementation, lstm_state=state)
        loss = sum((h * w).sum() for h, w in zip(out.hidden_states, weights))
        loss = loss + out.lstm_state[0].sum() * 0.3 + (out.lstm_state[1] ** 2).sum()
        grads = torch.autograd.grad(loss, [*model.parameters(), *state], allow_unused=True)
        return [torch.zeros(()) if g is None else g for g in grads]

    reference, fast = gradients("reference"), gradients(implementation)
    names = [n for n, _ in model.named_parameters()] + ["initial_cell", "initial_hidden"]
    for name, a, b in zip(names, reference, fast):
        scale = max(a.abs().max().item(), 1.0)
        assert (a - b).abs().max().item() <= 1e-5 * scale, name
    # Every parameter gets a gradient, the LSTM ones are not trivial.
    assert reference[names.index("bilstm.backward_layers.1.recurrent_proj.weight")].abs().max() > 1e-3
    if onednn is not None:
        # Each step's products, forward and backward (3 rows by a recurrent weight of 8 x 96), and the weight
        # gradients over the positions the steps computed, zeros added up to `padded_rows`: packed ("cpu"), the 23
        # read, as 24; static ("cuda"), 3 rows x 11 steps, as 36.
        # The input products, forward and backward, have every position of 3 rows x 11 steps as a row (36 with
        # the padding).
        summed = {"cpu": 24, "cuda": 36}[implementation]
        shapes = {(tuple(x), tuple(w)) for x, w in onednn}
        assert {((3, 8), (96, 8)), ((3, 96), (8, 96)), ((8, summed), (96, summed)), ((36, 8), (96, 8)),
                ((36, 96), (8, 96))} <= shapes, shapes


@pytest.mark.parametrize("implementation", ["reference", *TUNED])
def test_gradient_checkpointing_gives_the_same_gradients(implementation):
    model = make_model(seed=5).train()
    use(model, implementation)
    ids = make_batch([4, 7], seed=6)

    def gradients():
        model.zero_grad()
        model(ids).last_hidden_state.square().sum().backward()
        return [p.grad.clone() for p in model.parameters()]

    plain = gradients()
    # Newer transformers (5.23) call it activation_checkpointing_enable and warn on the old name; 5.17 has only that.
    enable_checkpointing = getattr(model, "activation_checkpointing_enable", model.gradient_checkpointing_enable)
    enable_checkpointing()
    calls = []
    for layer in model.bilstm.forward_layers:
        checkpoint = layer._gradient_checkpointing_func
        layer._gradient_checkpointing_func = lambda *args, f=checkpoint: calls.append(1) or f(*args)
    checkpointed = gradients()
    assert len(calls) == 2  # one checkpoint per layer (both directions)
    assert max_diff(plain, checkpointed) <= 1e-6


@pytest.mark.parametrize("way", [None, cpu_tuning.PLAIN, cpu_tuning.BLOCKED, cpu_tuning.ONEDNN])
def test_results_do_not_depend_on_batch_composition(way, monkeypatch):
    # A sentence alone, and in the middle of a batch with longer and shorter rows, gets the same vectors up to
    # float rounding (~1e-6 relative): matmul kernels differ with the number of rows, on the reference path too.
    # Each way of the CPU recurrence's products is forced in turn (None: whichever this machine measures fastest).
    if way == cpu_tuning.ONEDNN and not cpu_tuning.has_onednn_linear(torch.empty(1)):
        pytest.skip("torch built without oneDNN")
    if way is not None:
        monkeypatch.setattr(cpu_tuning, "measured_product", lambda weight, columns: (way, 1e-3))
    model = make_model(seed=0, recurrent_std=0.1)
    vocabulary = ["the", "cat", "sat", "on", "a", "mat", "internationalization", ",", "日本語", "x"]
    target = make_batch([9], seed=7, vocabulary=vocabulary)[0]
    batch = torch.zeros(6, 14, 50, dtype=torch.long)
    batch[:5] = make_batch([3, 14, 1, 9, 6], seed=8, vocabulary=vocabulary)
    batch[3, :9] = target
    batch[5, :9] = target
    with torch.no_grad():
        alone = model(target[None], output_hidden_states=True).hidden_states
        together = model(batch, output_hidden_states=True).hidden_states
    for layer_alone, layer_together in zip(alone, together):
        tolerance = 1e-6 * max(1.0, layer_alone.abs().max().item())
        assert (layer_alone[0] - layer_together[3, :9]).abs().max() <= tolerance
        assert (layer_alone[0] - layer_together[5, :9]).abs().max() <= tolerance


def test_char_encoder_edge_rows(model):
    encoder = model.char_encoder
    rng = random.Random(9)
    rows = [word_to_char_ids(w) for w in ["a", "x" * 48, "é" * 30, "<S>", "</S>"]]
    rows += [[rng.randrange(1, 262) for _ in range(50)] for _ in range(3)]  # no trailing run at all
    rows += [[0] * 50, [5] * 50]  # an empty row, a row that is one run
    ids = torch.tensor(rows)
    with torch.no_grad():
        reference = encoder(ids)
        fast = elmo_cpu.token_vectors(encoder, ids)
        assert elmo_cpu.token_vectors(encoder, ids[:0]).shape == (0, 8)
    assert (fast - reference).abs().max() <= 1e-5


def test_pooled_convolutions_give_the_references_vectors_and_truer_gradients(model):
    # The static-shape char CNN of the "cuda" implementation (one product, one max) on rows with ties: a long word,
    # Unicode, the boundaries, random rows without a trailing run, an empty row and a row that is one run. Token
    # vectors and every gradient within fp32 rounding of float64's; the filters' and embeddings' gradients 5x closer
    # to them than the reference's own fp32 ones (14x measured): `amax`'s backward divides the gradient between tied
    # windows and sums it back, a rounding the one max does not make. The empty batch keeps its width.
    from hf_elmo.elmo_ops import pooled_convolutions

    encoder = copy.deepcopy(model.char_encoder)
    rng = random.Random(9)
    rows = [word_to_char_ids(w) for w in ["a", "x" * 48, "é" * 30, "<S>", "</S>", "cat", "the"]]
    rows += [[rng.randrange(1, 262) for _ in range(50)] for _ in range(3)] + [[0] * 50, [5] * 50]
    ids = torch.tensor(rows * 6)
    weights = torch.linspace(-1, 1, 8, dtype=torch.float64)

    def vectors_and_gradients(token_vectors, dtype):
        encoder.to(dtype).zero_grad()
        vectors = token_vectors(encoder, ids)
        (vectors * weights.to(dtype)).sum().backward()
        return vectors.detach().double(), {n: p.grad.double() for n, p in encoder.named_parameters()}

    one_max = lambda encoder, ids: encoder.from_pooled(pooled_convolutions(encoder, ids))  # noqa: E731
    truth, truth_grads = vectors_and_gradients(modeling_elmo.char_encoder_reference, torch.float64)
    fp32, fp32_grads = vectors_and_gradients(modeling_elmo.char_encoder_reference, torch.float32)
    vectors, grads = vectors_and_gradients(one_max, torch.float32)
    assert (vectors - truth).abs().max() <= 2e-6 and (fp32 - truth).abs().max() <= 2e-6
    convolutions = [n for n in truth_grads if n.startswith(("char_embeddings.", "convolutions."))]
    assert len(convolutions) == 1 + 2 * len(FILTERS)
    errors, reference_errors = (
        {name: float((found[name] - e).abs().max() / e.abs().max()) for name, e in truth_grads.items()}
        for found in (grads, fp32_grads)
    )
    assert max(errors.values()) <= 1e-6, errors
    assert 5 * sum(errors[n] for n in convolutions) <= sum(reference_errors[n] for n in convolutions)
    with torch.no_grad():
        assert pooled_convolutions(encoder, ids[:0]).shape == (0, sum(n for _, n in FILTERS))


def _grouping(rows, inverse):
    """Which rows share an index, as a set of frozensets of row numbers."""
    groups = {}
    for row, index in enumerate(inverse.tolist()):
        groups.setdefault(index, set()).add(row)
    return {frozenset(group) for group in groups.values()}


@pytest.mark.parametrize("kind", ["char_ids", "vectors"])
def test_distinct_rows_groups_rows_as_torch_unique(kind, monkeypatch):
    generator = torch.Generator().manual_seed(3)
    if kind == "char_ids":
        pool = torch.randint(0, 262, (40, 50), generator=generator)
    else:
        pool = torch.randn(40, 16, generator=generator)
        pool[2, :] = 0.0
        pool[3, :] = -0.0  # equal to row 2, as in torch.unique
    # More rows than one hashing chunk, most of them repeats.
    monkeypatch.setattr(elmo_cpu, "HASH_CHUNK_ROWS", 64)
    rows = pool[torch.randint(0, 40, (300,), generator=generator)]
    distinct, inverse = elmo_cpu.distinct_rows(rows)
    expected_distinct, expected_inverse = torch.unique(rows, dim=0, return_inverse=True)
    assert distinct.shape == expected_distinct.shape
    assert torch.equal(distinct[inverse], rows)
    assert _grouping(rows, inverse) == _grouping(rows, expected_inverse)
    empty, empty_inverse = elmo_cpu.distinct_rows(rows[:0])
    assert empty.shape == (0, rows.shape[1]) and empty_inverse.shape == (0,)


def test_distinct_rows_falls_back_to_torch_unique_when_different_rows_share_a_hash(monkeypatch):
    rows = torch.tensor([[1, 2, 3], [3, 2, 1], [1, 2, 3], [0, 0, 0]])
    # A hash vector that sends every row to one hash: only the exact check can tell them apart.
    monkeypatch.setitem(elmo_cpu._ROW_HASH_VECTORS, 3, torch.zeros(3, dtype=torch.float64))
    distinct, inverse = elmo_cpu.distinct_rows(rows)
    assert distinct.tolist() == [[0, 0, 0], [1, 2, 3], [3, 2, 1]]
    assert inverse.tolist() == [1, 2, 1, 0]
    # NaN equals nothing, itself included: rows holding one stay apart.
    nan_rows = torch.tensor([[float("nan"), 1.0], [float("nan"), 1.0]])
    assert elmo_cpu.distinct_rows(nan_rows)[1].tolist() == [0, 1]


@pytest.mark.parametrize("implementation", TUNED)
def test_bf16_runs_close_to_fp32(model, implementation):
    ids = make_batch([6, 3, 10], seed=10)
    with torch.no_grad():
        reference = run(model, ids, "reference")
        half = make_model().to(torch.bfloat16)
        fast = run(half, ids, implementation)
    assert fast.last_hidden_state.dtype == torch.bfloat16
    assert all(torch.isfinite(h.float()).all() for h in fast.hidden_states)
    # bf16 keeps ~3 significant digits; outputs are O(1) (clipped at 3).
    assert max_diff(fast.hidden_states, reference.hidden_states) < 0.5


def test_bf16_on_a_cpu_that_emulates_it_is_warned_about_once(model, caplog):
    elmo_cpu._warn_about_emulated_bf16.cache_clear()
    half = make_model().to(torch.bfloat16)
    with caplog.at_level("WARNING", logger="hf_elmo.elmo_cpu"), torch.no_grad():
        run(model, make_batch([3]), "cpu")  # fp32: never
        run(half, make_batch([3]), "cpu")
        run(half, make_batch([4]), "cpu")
    warnings = [r.getMessage() for r in caplog.records if "bf16" in r.getMessage()]
    emulated = not has_bf16_dot_products()
    assert len(warnings) == int(emulated)
    if emulated:
        assert warnings[0].startswith("ELMo runs in bf16 on a CPU without bf16 matrix instructions (AVX512-BF16 or AMX)")


def test_token_cache_is_exact_bounded_and_invalidated():
    model = make_model(seed=11)
    encoder = model.char_encoder
    vocabulary = ["a", "b", "cc", "ddd", "eeee", "the", "of"]
    first, second = make_batch([5, 3], seed=12, vocabulary=vocabulary), make_batch([4, 6], seed=13, vocabulary=vocabulary)
    with torch.no_grad():
        uncached = [model(ids, output_hidden_states=True).hidden_states for ids in (first, second)]
        encoder.enable_token_cache(max_words=3)
        cached = [model(ids, output_hidden_states=True).hidden_states for ids in (first, second)]
    cache = encoder.token_cache
    assert len(cache) == 3  # bounded: least recently used words were dropped
    assert cache.hits > 0 and cache.misses > 3
    for a, b in zip(uncached, cached):
        # Cached vectors were computed with other words: equal up to float rounding, as with batch composition.
        assert max_diff(a[:1], b[:1]) <= 1e-6
        assert max_diff(a, b) <= 1e-6 * max(h.abs().max().item() for h in a)
    # Changing the weights in place invalidates every entry.
    with torch.no_grad():
        encoder.projection.weight.mul_(2)
        changed = model(first).last_hidden_state
        encoder.disable_token_cache()
        expected = model(first).last_hidden_state
    assert (changed - expected).abs().max() <= 1e-6
    assert (changed - uncached[0][-1]).abs().max() > 1e-3
    # When gradients are needed the cache is bypassed, so they flow into the char encoder.
    encoder.enable_token_cache(max_words=10)
    model(first).last_hidden_state.sum().backward()
    assert encoder.projection.weight.grad.abs().max() > 0
    with pytest.raises(ValueError, match="max_words must be a positive integer"):
        encoder.enable_token_cache(max_words=0)


class PeakLiveBytes(TorchDispatchMode):
    """Tracks the peak bytes of tensor storages alive at once (outputs of every op, freed when collected)."""

    def __init__(self):
        super().__init__()
        self.live, self.peak, self.storages = 0, 0, {}

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        for tensor in out if isinstance(out, (tuple, list)) else [out]:
            if isinstance(tensor, torch.Tensor):
                self._track(tensor)
        return out

    def _track(self, tensor):
        key = tensor.untyped_storage().data_ptr()
        if key not in self.storages:
            self.storages[key] = [tensor.untyped_storage().nbytes(), 0]
            self.live += self.storages[key][0]
            self.peak = max(self.peak, self.live)
        self.storages[key][1] += 1
        weakref.finalize(tensor, self._release, key)

    def _release(self, key):
        entry = self.storages[key]
        entry[1] -= 1
        if entry[1] == 0:
            self.live -= entry[0]
            del self.storages[key]


def test_long_sentence_runs_with_memory_linear_in_words():
    model = make_model(seed=14, lstm_dim=64, projection_dim=16, recurrent_std=0.1)
    vocabulary = ["w%d" % i for i in range(50)]
    peaks = {}
    with torch.no_grad():
        for words in (500, 2000):
            ids = make_batch([words], seed=15, vocabulary=vocabulary)
            with PeakLiveBytes() as tracker:
                out = model(ids)
            peaks[words] = tracker.peak
            assert out.last_hidden_state.shape == (1, words, 32)
            assert torch.isfinite(out.last_hidden_state).all()
        use(model, "reference")
        reference = model(ids).last_hidden_state
        truth_model = copy.deepcopy(model).double()
        truth = truth_model(ids).last_hidden_state
        use(model, None)
    # Over 2000 steps each fp32 implementation rounds differently, and a clip boundary crossed on one side and not the
    # other turns a rounding into a visible step, so the two are not within a fixed bound of each other. What holds
    # on any CPU: against the float64 run of the reference maths, the fast path is as accurate as the fp32 reference
    # (a summation order is no better or worse than another, up to a small factor).
    fast_error = float((out.last_hidden_state.double() - truth).abs().max())
    reference_error = float((reference.double() - truth).abs().max())
    assert fast_error <= 4 * reference_error + 16 * torch.finfo(torch.float32).eps * float(truth.abs().max())
    # Four times the words, about four times the memory (quadratic growth would be sixteen times).
    assert peaks[2000] < 5 * peaks[500]


def test_a_short_sentence_allocates_for_its_own_positions_not_a_whole_block():
    # The "cpu" path computes input gates in blocks of up to INPUT_GATES_BLOCK_VALUES values (8 MB); a batch of
    # fewer positions used to allocate the whole block anyway.
    model = make_model(seed=16, lstm_dim=256, projection_dim=128)
    ids = make_batch([10], seed=17, vocabulary=["w%d" % i for i in range(20)])
    use(model, "cpu")
    with torch.no_grad():
        expected = model(ids).last_hidden_state
        with PeakLiveBytes() as tracker:
            out = model(ids).last_hidden_state
    use(model, None)
    assert torch.equal(out, expected)
    # Its 12 positions' input gates, both directions, are 96 KiB; the block would be 8 MiB.
    assert tracker.peak < 1 << 20


needs_cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
DEVICES = ["cpu", pytest.param("cuda", marks=needs_cuda)]


@pytest.fixture
def exact_cuda_matmuls():
    """fp32 matmuls in fp32 on the GPU (TF32 off), for comparisons at 1e-5."""
    previous = torch.backends.cuda.matmul.allow_tf32, torch.backends.cudnn.allow_tf32
    torch.backends.cuda.matmul.allow_tf32 = torch.backends.cudnn.allow_tf32 = False
    yield
    torch.backends.cuda.matmul.allow_tf32, torch.backends.cudnn.allow_tf32 = previous


@needs_cuda
def test_on_cuda_the_default_is_the_cuda_implementation_and_matches_reference(exact_cuda_matmuls):
    model = make_model(seed=3).to("cuda").train()
    ids = make_batch([6, 2, 9, 1], seed=4).to("cuda")
    assert elmo_implementation_for(model.config, ids.device) is ELMO_IMPLEMENTATIONS["cuda"]
    weights = [torch.randn(4, 9, 16, generator=torch.Generator().manual_seed(i)).cuda() for i in range(3)]

    def outputs_and_gradients(implementation):
        model.zero_grad()
        out = run(model, ids, implementation)
        loss = sum((h * w).sum() for h, w in zip(out.hidden_states, weights)) + out.lstm_state[0].sum() * 0.3
        loss.backward()
        return out, [p.grad.clone() for p in model.parameters()]

    (reference, reference_grads), (cuda, cuda_grads) = outputs_and_gradients("reference"), outputs_and_gradients(None)
    assert max_diff(cuda.hidden_states, reference.hidden_states) <= 1e-5
    assert max_diff(cuda.lstm_state, reference.lstm_state) <= 1e-5
    for (name, _), a, b in zip(model.named_parameters(), reference_grads, cuda_grads):
        assert float((a - b).abs().max()) <= 1e-4 * max(1.0, float(a.abs().max())), name


def assert_within_matmul_rounding(product, weight, states, add=None):
    """
    `product` is `weight @ states (+ add)` up to fp32 rounding, in any summation order: each entry within
    n * u * (|weight| @ |states| + |add|) of the exact (float64) value, with n the terms summed and u the unit roundoff
    (the standard bound for a dot product; fused multiply-adds only tighten it).
    """
    exact = weight.double() @ states.double()
    magnitude = weight.double().abs() @ states.double().abs()
    terms = weight.shape[1]
    if add is not None:
        exact, magnitude, terms = exact + add.double(), magnitude + add.double().abs(), terms + 1
    unit_roundoff = torch.finfo(torch.float32).eps / 2
    error = (product.double() - exact).abs()
    assert (error <= 1.01 * terms * unit_roundoff * magnitude).all(), float((error / magnitude).max())


@pytest.mark.parametrize("rows", [1024, 100, 99])
@pytest.mark.parametrize("columns", [1, 5, 32])
@pytest.mark.parametrize("way", [cpu_tuning.PLAIN, cpu_tuning.BLOCKED, cpu_tuning.ONEDNN])
def test_few_column_matmul_equals_addmm(rows, columns, way, monkeypatch):
    generator = torch.Generator().manual_seed(rows + columns)
    weight, states = torch.randn(rows, 64, generator=generator), torch.randn(64, columns, generator=generator)
    # Every way this machine can run, whichever it measures fastest.
    chosen, seconds = cpu_tuning.measured_product(weight, columns)
    assert seconds > 0
    blockable = columns > 1 and rows % 2 == 0
    assert chosen in {cpu_tuning.PLAIN, cpu_tuning.ONEDNN} | ({cpu_tuning.BLOCKED} if blockable else set())
    if way == cpu_tuning.BLOCKED and not blockable:
        pytest.skip("a matrix-vector product, or rows that do not split evenly, are never blocked")
    if way == cpu_tuning.ONEDNN and not cpu_tuning.has_onednn_linear(weight):
        pytest.skip("torch built without oneDNN")
    key = (tuple(weight.shape), weight.dtype, columns, torch.get_num_threads())
    monkeypatch.setitem(cpu_tuning._PRODUCTS, key, (way, seconds))
    onednn_calls = []
    monkeypatch.setitem(cpu_tuning._PRODUCTS_BY_WAY, cpu_tuning.ONEDNN,
                        lambda *args: onednn_calls.append(1) or onednn_product(*args))
    add = torch.randn(columns, rows, generator=generator).t()  # a transposed view, as the steps pass it
    out = torch.full((rows, columns), float("nan"))
    assert few_column_matmul(weight, states, out, add=add) is out
    assert_within_matmul_rounding(out, weight, states, add)
    # Into a transposed view of a bigger result, without `add`.
    result = torch.full((columns + 3, rows), float("nan"))
    few_column_matmul(weight, states, result[1 : columns + 1].t())
    assert_within_matmul_rounding(result[1 : columns + 1].t(), weight, states)
    assert result[0].isnan().all() and result[columns + 1 :].isnan().all()
    # Without `out` (the autograd step): a new tensor, and the gradients of addmm.
    leaves = [t.clone().requires_grad_() for t in (weight, states, add)]
    product = few_column_matmul(leaves[0], leaves[1], add=leaves[2])
    assert product.shape == (rows, columns)
    assert_within_matmul_rounding(product.detach(), weight, states, add)
    upstream = torch.randn(rows, columns, generator=generator)
    ours = torch.autograd.grad(product, leaves, upstream)
    # d/dweight = upstream @ states^T, d/dstates = weight^T @ upstream, d/dadd = upstream.
    assert_within_matmul_rounding(ours[0], upstream, states.t())
    assert_within_matmul_rounding(ours[1], weight.t(), upstream)
    assert torch.equal(ours[2], upstream)
    # oneDNN ran the two products without autograd; the one with autograd went to the BLAS.
    assert len(onednn_calls) == (2 if way == cpu_tuning.ONEDNN else 0)


def test_onednn_is_kept_only_where_it_is_clearly_faster():
    # Made-up timings (seconds per product), as if measured on some machine.
    plain, blocked, onednn = cpu_tuning.PLAIN, cpu_tuning.BLOCKED, cpu_tuning.ONEDNN
    assert cpu_tuning.fastest_way({plain: 1.0}) == plain
    assert cpu_tuning.fastest_way({plain: 1.0, blocked: 0.7}) == blocked
    assert cpu_tuning.fastest_way({plain: 1.0, onednn: 0.9}) == plain  # 1.11x: within timing noise
    assert cpu_tuning.fastest_way({plain: 1.0, blocked: 0.7, onednn: 0.6}) == blocked  # 1.17x the best BLAS way
    assert cpu_tuning.fastest_way({plain: 1.0, blocked: 0.7, onednn: 0.5}) == onednn  # 1.4x
    assert cpu_tuning.fastest_way({plain: 0.3, onednn: 1.0}) == plain


@pytest.mark.skipif(not cpu_tuning.has_onednn_linear(torch.empty(1)), reason="torch built without oneDNN")
def test_onednn_product_returns_and_broadcasts_like_addmm():
    generator = torch.Generator().manual_seed(7)
    weight = torch.randn(48, 16, generator=generator)
    for columns in (1, 3, 9, 40):  # multiplied as 2, 4, 16 and 64 columns (`product_columns`)
        states = torch.randn(16, columns, generator=generator)
        product = onednn_product(weight, states)
        assert product.shape == (48, columns) and product.is_contiguous()
        assert_within_matmul_rounding(product, weight, states)
        bias = torch.randn(48, 1, generator=generator)  # broadcast over the columns
        with_bias = onednn_product(weight, states, add=bias)
        assert_within_matmul_rounding(with_bias, weight, states, bias.expand(48, columns))
    # Only fp32 CPU weights go to oneDNN; bf16 ones are never measured on it.
    assert not cpu_tuning.has_onednn_linear(weight.bfloat16())
    assert cpu_tuning.measured_product(weight.bfloat16(), 4)[0] != cpu_tuning.ONEDNN


def test_turning_onednn_off_keeps_the_products_on_the_blas(monkeypatch):
    weight, states = torch.randn(48, 16), torch.randn(16, 5)
    calls = []
    monkeypatch.setitem(cpu_tuning._PRODUCTS_BY_WAY, cpu_tuning.ONEDNN, lambda *args: calls.append(1))
    # As if this process had measured oneDNN fastest for the shape.
    key = ((48, 16), torch.float32, 5, torch.get_num_threads())
    monkeypatch.setitem(cpu_tuning._PRODUCTS, key, (cpu_tuning.ONEDNN, 1e-3))
    few_column_matmul(weight, states)
    assert calls == [1]
    with monkeypatch.context() as off:
        off.setattr(torch.backends.mkldnn, "enabled", False)
        assert not cpu_tuning.has_onednn_linear(weight)
        assert_within_matmul_rounding(few_column_matmul(weight, states), weight, states)
    assert calls == [1] and torch.backends.mkldnn.enabled


def test_a_onednn_that_fails_leaves_the_blas_ways(monkeypatch):
    # A torch build may register oneDNN's op for a platform where it cannot run this product.
    def failing(*args, **kwargs):
        raise RuntimeError("no oneDNN kernel for this platform")

    monkeypatch.setattr(cpu_tuning, "onednn_product", failing)
    assert cpu_tuning._time_products(torch.randn(48, 16), 3)[0] in (cpu_tuning.PLAIN, cpu_tuning.BLOCKED)


def test_padded_rows_bounds_the_shapes_a_run_meets_for_at_most_an_eighth_more_work():
    assert [cpu_tuning.padded_rows(n) for n in (0, 1, 9, 16, 17, 33, 64, 65, 1000, 3524, 8192)] == [
        0, 1, 9, 16, 18, 36, 64, 72, 1024, 3584, 8192]
    padded = [cpu_tuning.padded_rows(n) for n in range(1, 8193)]
    assert all(n <= p <= n * 9 / 8 for n, p in zip(range(1, 8193), padded))
    assert len(set(padded)) == 88  # 16 counts as they are, then 8 per power of 2


@pytest.mark.parametrize("layout", ["rows", "transposed", "batched"])
def test_training_matmul_on_onednn_equals_the_product(layout, onednn_products):
    generator = torch.Generator().manual_seed(3)
    if layout == "rows":  # 37 rows and 100 terms, computed as 40 and 104 (zeros added)
        a, b = torch.randn(37, 100, generator=generator), torch.randn(100, 48, generator=generator)
    elif layout == "transposed":  # a weight gradient's 160 positions (built padded), the larger operand transposed
        a, b = torch.randn(160, 64, generator=generator).t(), torch.randn(160, 24, generator=generator)
    else:  # both directions at once, the right operand a transposed view as the recurrence passes its weights
        a, b = torch.randn(2, 19, 24, generator=generator), torch.randn(2, 40, 24, generator=generator).transpose(1, 2)
    product = cpu_tuning.matmul(a, b)
    assert product.shape == (*a.shape[:-1], b.shape[-1])
    for index in range(2 if layout == "batched" else 1):
        pair = (a[index], b[index]) if layout == "batched" else (a, b)
        assert_within_matmul_rounding(product[index] if layout == "batched" else product, *pair)
    # The transposed product is computed as (b.T @ a.T).T, reading `a` as it lies.
    expected = {"rows": [((40, 104), (48, 104))], "transposed": [((24, 160), (64, 160))],
                "batched": [((20, 24), (40, 24))] * 2}[layout]
    assert [(tuple(x), tuple(w)) for x, w in onednn_products] == expected


def test_training_matmul_stays_on_the_blas_where_onednn_does_not_pay(onednn_products, monkeypatch):
    a, b = torch.randn(8, 16), torch.randn(16, 32)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        cpu_tuning.matmul(a, b)  # autocast's products are torch's
    cpu_tuning.matmul(a.double(), b.double())
    cpu_tuning.matmul(a.to("meta"), b.to("meta"))
    monkeypatch.setenv(cpu_tuning.TUNING_VARIABLE, "fixed")
    assert torch.equal(cpu_tuning.matmul(a, b), a @ b)
    monkeypatch.delenv(cpu_tuning.TUNING_VARIABLE)
    monkeypatch.setitem(cpu_tuning._ONEDNN_TRAINS, torch.get_num_threads(), False)  # measured no faster here
    cpu_tuning.matmul(a, b)
    assert onednn_products == []
    monkeypatch.setitem(cpu_tuning._ONEDNN_TRAINS, torch.get_num_threads(), True)
    monkeypatch.setattr(cpu_tuning, "MIN_ONEDNN_MACS", 8 * 16 * 32 + 1)  # one multiply-add short
    cpu_tuning.matmul(a, b)
    assert onednn_products == []
    # A weight gradient's positions are built padded only where its product goes to oneDNN: 17 summed rows of 241
    # multiply-adds each make the 4,097 above, of 240 they do not.
    parts = [torch.ones(2, 9, 3), torch.ones(2, 8, 3)]
    padded = cpu_tuning.padded_cat(parts, 1, 241)
    assert padded.shape == (2, 18, 3) and padded[:, :17].eq(1).all() and padded[:, 17:].eq(0).all()
    assert torch.equal(cpu_tuning.padded_cat(parts, 1, 240), torch.cat(parts, dim=1))
    monkeypatch.setitem(cpu_tuning._ONEDNN_TRAINS, torch.get_num_threads(), False)
    assert torch.equal(cpu_tuning.padded_cat(parts, 1, 241), torch.cat(parts, dim=1))


def test_training_products_stay_on_the_blas_where_onednn_fails(monkeypatch):
    def failing(*args, **kwargs):
        raise RuntimeError("no oneDNN kernel for this platform")

    monkeypatch.setattr(cpu_tuning, "_linear", failing)
    assert cpu_tuning._onednn_is_faster_for_training() is False


def test_a_training_step_compiles_into_one_graph():
    # No graph break means no host sync and no data-dependent shape anywhere in the forward, the sampled softmax
    # or the loss; AOT autograd then traces the backward, the fused recurrence's hand-written one included.
    from hf_elmo import ElmoForPreTraining

    torch.manual_seed(0)
    config = ElmoConfig(char_filters=FILTERS, n_highway=1, char_embedding_dim=4, lstm_dim=24, projection_dim=8,
                        cell_clip=3.0, proj_clip=3.0, vocab_size=300, num_softmax_samples=64)
    model = ElmoForPreTraining(config).train()
    ids = make_batch([3, 1, 2], seed=4)  # few steps: the trace unrolls the recurrence
    labels = torch.randint(0, 300, ids.shape[:2]).masked_fill(ids[..., 0] == 0, -100)

    def loss(ids, labels):
        return model(ids, labels=labels).loss

    torch._dynamo.reset()
    compiled = torch.compile(loss, fullgraph=True, backend="aot_eager")
    torch.manual_seed(1)
    value = compiled(ids, labels)
    value.backward()
    compiled_grads = [p.grad.clone() for p in model.parameters()]
    # The same step in eager mode (the same draws: the sampler's only randomness is the generator's state).
    model.zero_grad()
    model.set_elmo_implementation("cuda")
    torch.manual_seed(1)
    eager = loss(ids, labels)
    eager.backward()
    value, eager = float(value.detach()), float(eager.detach())
    assert math.isfinite(value) and abs(value - eager) <= 1e-5 * abs(eager)
    for (name, parameter), compiled_grad in zip(model.named_parameters(), compiled_grads):
        scale = max(1.0, float(parameter.grad.abs().max()))
        assert float((compiled_grad - parameter.grad).abs().max()) <= 1e-5 * scale, name


class OperatorNames(TorchDispatchMode):
    """The names of the operators dispatched under it, in order."""

    def __init__(self):
        super().__init__()
        self.names = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        self.names.append(func.__name__)
        return func(*args, **(kwargs or {}))


def test_packed_recurrence_equals_the_static_one_with_a_row_that_reads_nothing():
    # Rows sorted longest first, the last one empty: its final state is its initial one, its gradient passes through.
    from hf_elmo.elmo_ops import ClippedLstmRecurrence

    generator = torch.Generator().manual_seed(7)
    lengths, steps, lstm_dim, projection_dim = [5, 3, 0], 5, 8, 4
    leaves = [torch.randn(*shape, generator=generator) for shape in (
        (steps, 2, 3, 4 * lstm_dim), (2, 3, lstm_dim), (2, 3, projection_dim), (2, projection_dim, 4 * lstm_dim),
        (2, lstm_dim, projection_dim))]
    active = (torch.arange(steps)[:, None] < torch.tensor(lengths))[:, None, :, None]
    upstream = [torch.randn(steps, 2, 3, projection_dim, generator=generator) * active,
                torch.randn(2, 3, lstm_dim, generator=generator), torch.randn(2, 3, projection_dim, generator=generator)]

    def run_recurrence(recurrence):
        inputs = [t.clone().requires_grad_() for t in leaves]
        outputs = recurrence(*inputs)
        loss = sum((o * u).sum() for o, u in zip(outputs, upstream))
        return [o.detach() for o in outputs], torch.autograd.grad(loss, inputs)

    def packed_reading(rows_at):
        return lambda gates, *rest: ClippedLstmRecurrence.apply(gates, None, *rest, 1.0, 1.5, rows_at)

    with OperatorNames() as static_operators:  # every row every step: a GPU's training
        static = run_recurrence(lambda gates, *rest: ClippedLstmRecurrence.apply(gates, active, *rest, 1.0, 1.5, None))
    # The final state is the last step's, and the gradient arriving for it is read as it is: besides the inputs'
    # copies made here, the only copies are the state's own two, which the steps read (a view would recompile their
    # kernels), where there were 4 more and 4 clones in the backward.
    assert static_operators.names.count("clone.default") == len(leaves) + 2
    assert "copy_.default" not in static_operators.names
    packed = run_recurrence(packed_reading((2, 2, 2, 1, 1)))
    for a, b in zip(static[0] + list(static[1]), packed[0] + list(packed[1])):
        assert (a - b).abs().max() <= 1e-5 * max(1.0, a.abs().max())
    assert torch.equal(packed[0][1][:, 2], leaves[1][:, 2]) and torch.equal(packed[1][1][:, 2], upstream[1][:, 2])
    # No row reads any step: the state passes through, the weights get zero gradients.
    outputs, grads = run_recurrence(packed_reading(()))
    assert not outputs[0].any() and torch.equal(outputs[1], leaves[1]) and not grads[3].any()
    # No step at all, every row reading (static shapes): the same, with an empty gradient for the empty gates.
    no_steps = torch.zeros(0, 1, 3, 1, dtype=torch.bool)
    leaves[0], upstream[0] = leaves[0][:0], upstream[0][:0]
    outputs, grads = run_recurrence(lambda gates, *rest: ClippedLstmRecurrence.apply(gates, no_steps, *rest, 1.0, 1.5,
                                                                                     None))
    assert grads[0].shape == (0, 2, 3, 4 * lstm_dim) and torch.equal(outputs[2], leaves[2])
    assert torch.equal(grads[1], upstream[1]) and torch.equal(grads[2], upstream[2]) and not grads[4].any()


@pytest.mark.parametrize("implementation", ["reference", *TUNED])
def test_submodules_dispatch_themselves_and_their_hooks_fire(model, implementation):
    # Calling the char encoder or the biLSTM directly computes with the model's setting, as the whole model does,
    # and forward hooks on them see every call.
    ids = make_batch([5, 2, 7], seed=40)
    seen = []
    handles = [module.register_forward_hook(lambda module, args, output, name=name: seen.append(name))
               for name, module in (("char_encoder", model.char_encoder), ("bilstm", model.bilstm))]
    use(model, implementation)
    try:
        with torch.no_grad():
            whole = model(ids, keep_sentence_boundaries=True, output_hidden_states=True)
            assert seen == ["char_encoder", "bilstm"]
            flat = ids.flatten(0, 1)
            tokens = model.char_encoder(flat)
            reference_tokens = modeling_elmo.char_encoder_reference(model.char_encoder, flat)
            mask = whole.word_mask
            layer_input = whole.hidden_states[0][..., : model.config.projection_dim]
            state = model.zero_lstm_state(3, "cpu", torch.float32)
            layers, _ = model.bilstm(layer_input, mask, state)
            reference_layers, _ = modeling_elmo.bilstm_reference(model.bilstm, layer_input, mask, state, (0, 1), False)
    finally:
        use(model, None)
        for handle in handles:
            handle.remove()
    assert seen == ["char_encoder", "bilstm", "char_encoder", "bilstm"]
    assert (tokens - reference_tokens).abs().max() <= 1e-5
    for direct, from_model, reference in zip(layers, whole.hidden_states[1:], reference_layers):
        assert torch.equal(direct, from_model)  # the submodule alone gives what the whole model gives
        assert (direct - reference).abs().max() <= 1e-5


@pytest.mark.parametrize("implementation", ["reference", *TUNED])
def test_bad_input_gets_the_same_error_on_every_implementation(model, implementation):
    ids = make_batch([3, 2], seed=41)
    gap = torch.tensor([[1, 0, 1], [1, 1, 0]])  # a word after a padded position
    use(model, implementation)
    try:
        with pytest.raises(ValueError, match="Each row's words must come first and padding last"):
            model(ids, attention_mask=gap)
        with pytest.raises(ValueError, match=r"input_ids hold char ids outside \[0, 262\)"):
            model(ids.masked_fill(ids == 99, 400))
    finally:
        use(model, None)


def test_fixed_cpu_tuning_measures_nothing_and_gives_the_same_function(model, monkeypatch):
    ids = make_batch([7, 1, 12, 4, 12, 2], seed=42)
    with torch.no_grad():
        measured = run(model, ids, "cpu")

        def no_timing(*args):
            raise AssertionError("a product was timed")

        monkeypatch.setenv(cpu_tuning.TUNING_VARIABLE, "fixed")
        monkeypatch.setattr(cpu_tuning, "_time_products", no_timing)
        monkeypatch.setattr(cpu_tuning, "_PRODUCTS", {})
        monkeypatch.setattr(cpu_tuning, "_STEP_COLUMNS", {})
        fixed = run(model, ids, "cpu")
    assert max_diff(fixed.hidden_states, measured.hidden_states) <= 1e-5
    # Every choice was made, and each is the plain one: BLAS without row blocks, exactly the rows still reading.
    assert cpu_tuning._PRODUCTS and set(cpu_tuning._PRODUCTS.values()) == {(cpu_tuning.PLAIN, 0.0)}
    assert cpu_tuning._STEP_COLUMNS and all(columns == key[-3] for key, columns in cpu_tuning._STEP_COLUMNS.items())


@pytest.mark.parametrize("implementation", ["reference", "cuda"])
def test_the_device_paths_copy_nothing_between_host_and_device(implementation):
    # On the meta device, where nothing is computed, as a GPU would run it: inference and a training step of the
    # sampled-softmax objective, forward and backward.
    from hf_elmo import ElmoForPreTraining

    config = ElmoConfig(char_filters=FILTERS, n_highway=1, char_embedding_dim=4, lstm_dim=24, projection_dim=8,
                        cell_clip=3.0, proj_clip=3.0, vocab_size=300, num_softmax_samples=64)
    model = ElmoForPreTraining(config).to("meta").train()
    model.set_elmo_implementation(implementation)
    ids = make_batch([3, 1, 2], seed=4)
    labels = torch.randint(0, 300, ids.shape[:2]).masked_fill(ids[..., 0] == 0, -100)
    ids, labels = ids.to("meta"), labels.to("meta")
    with HostDataReads() as recorded:
        model(ids, labels=labels).loss.backward()
        with torch.no_grad():
            hidden = model.elmo.eval()(ids, output_hidden_states=True).hidden_states
    assert recorded.calls == []
    assert hidden[-1].device.type == "meta" and hidden[-1].shape == (3, 3, 16)


@pytest.mark.parametrize("device", DEVICES)
def test_cuda_inference_packs_rows_and_encodes_each_distinct_word_once(device, monkeypatch, exact_cuda_matmuls):
    # Without autograd the "cuda" implementation computes only the rows still reading at each step (longest first)
    # and each distinct word once; where autograd records (training), every row reads every step and the char CNN
    # every word, the static shapes a recorded step needs. Both ways give the reference's vectors.
    from hf_elmo import elmo_cuda, elmo_ops

    schedules, encoded_words = [], []
    recurrence, encode = elmo_ops.ClippedLstmRecurrence.apply, elmo_cuda.char_encoder_reference
    monkeypatch.setattr(elmo_ops.ClippedLstmRecurrence, "apply", lambda gates, active, *rest: schedules.append((
        "every row" if active is not None else rest[-1], int(gates.any(-1).sum()))) or recurrence(gates, active, *rest))
    monkeypatch.setattr(elmo_cuda, "char_encoder_reference", lambda encoder, ids: encoded_words.append(
        ("distinct", ids.shape[0])) or encode(encoder, ids))
    pool = elmo_cuda.pooled_convolutions
    monkeypatch.setattr(elmo_cuda, "pooled_convolutions", lambda encoder, ids: encoded_words.append(
        ("every position", ids.shape[0])) or pool(encoder, ids))
    model = make_model(seed=6).to(device)
    ids = make_batch([5, 2, 5, 3], seed=3, vocabulary=["the", "cat", "sat", "on", "a"]).to(device)
    with torch.no_grad():
        reference = run(model, ids, "reference")
        packed = run(model, ids, "cuda")
    static = run(model, ids, "cuda")  # grad mode on, the weights require grad
    # Lengths 7, 4, 7, 5 with the sentence boundaries: 4 rows read steps 0-3, then 3, then 2; the input gates are
    # computed at those 23 positions per direction alone, the static shapes' at all 4 x 7.
    assert schedules == [((4, 4, 4, 4, 3, 2, 2), 2 * 23)] * 2 + [("every row", 2 * 4 * 7)] * 2
    # 8 distinct words (the 5 of the vocabulary, the two boundaries and the padding word), then 4 rows of 7 positions
    # with the convolutions as one product.
    assert encoded_words == [("distinct", 8), ("every position", 4 * 7)]
    for outputs in (packed, static):
        assert max_diff(outputs.hidden_states, reference.hidden_states) <= 1e-5
        assert max_diff(outputs.lstm_state, reference.lstm_state) <= 1e-5


def test_the_compiled_steps_do_not_recompile_for_new_row_counts_or_lengths(monkeypatch):
    # Compiled on the CPU with the "eager" backend, which guards and recompiles as inductor does on a GPU. After one
    # training batch and one evaluation batch, batches of other row counts and padded lengths compile nothing more
    # (before sizes were symbolic, each new row count or length recompiled every kernel). Batches of one sentence
    # are left out: Dynamo specialises a size of 1, so the first such batch compiles once more.
    from hf_elmo import elmo_ops

    monkeypatch.setattr(elmo_ops, "COMPILED_DEVICE_TYPES", ("cpu", "cuda"))
    monkeypatch.setattr(elmo_ops, "COMPILE_BACKEND", "eager")
    torch._dynamo.reset()
    graphs = torch._dynamo.utils.counters["stats"]
    model = make_model(seed=5)

    def train_on(lengths, seed):
        run(model.train(), make_batch(lengths, seed=seed), "cuda").last_hidden_state.sum().backward()

    def evaluate(lengths, seed):
        with torch.no_grad():
            run(model.eval(), make_batch(lengths, seed=seed), "cuda")

    train_on([5, 3, 4], 0)
    evaluate([4, 2, 7, 1, 3], 1)
    warm = graphs["unique_graphs"]
    for seed, lengths in enumerate([[9, 2, 7, 1], [6, 6], [3, 8, 1, 2, 5, 2, 2], [2, 11]]):
        train_on(lengths, seed)
    evaluate([10, 3], 7)
    evaluate([2, 2, 2, 2, 2, 2, 2, 2], 8)
    assert graphs["unique_graphs"] == warm
    torch._dynamo.reset()


@pytest.mark.skipif(shutil.which("g++") is None, reason="inductor compiles C++ on the CPU")
def test_training_and_inference_in_one_process_keep_every_step_kernel_compiled(monkeypatch):
    # Inductor itself, generating C++ here as it generates Triton on a GPU: its guards, not the eager backend's.
    # A process that trains (static rows, fp32 and bf16) and runs inference (packed rows) meets more layouts of the
    # step kernels' inputs than torch's default recompile limit of 8 lets one function compile; past it Dynamo
    # warns and runs the new layout eagerly (dozens of kernels a step on a GPU). Each graph computes what the
    # reference does in fp32.
    # The C++ is scalar (no SIMD): torch 2.13's vectorised CPU code for these kernels under dynamic shapes is wrong.
    # Its AVX2 code takes a broadcast bool mask wrongly (`torch.where(mask (1, n, 1), a, b)` on (2, n, h): NaN or
    # values off by up to 1e13), and its AVX-512 code for `_step_forward` corrupted the heap ("free(): invalid
    # pointer"). Scalar code still goes through the guards and recompilations this test is about. On a GPU inductor
    # generates Triton, and on a CPU hf_elmo never compiles these kernels.
    from hf_elmo import elmo_ops

    graphs, warnings = [], []

    def inductor(graph_module, example_inputs):
        from torch._inductor.compile_fx import compile_fx

        graphs.append({node.target for node in graph_module.graph.nodes if node.op == "placeholder"})
        return compile_fx(graph_module, example_inputs)

    class Warnings(logging.Handler):
        def emit(self, record):
            warnings.append(record.getMessage())

    monkeypatch.setattr(elmo_ops, "COMPILED_DEVICE_TYPES", ("cpu", "cuda"))
    monkeypatch.setattr(elmo_ops, "COMPILE_BACKEND", inductor)
    monkeypatch.setattr(torch._inductor.config.cpp, "simdlen", 1)  # no vector ISA has 1 bit: scalar code
    torch._dynamo.reset()
    dynamo_log, handler = logging.getLogger("torch._dynamo"), Warnings(logging.WARNING)
    dynamo_log.addHandler(handler)
    model = make_model(seed=5)
    try:
        for seed, (lengths, dtype) in enumerate([([5, 3, 4], None), ([9, 2, 7, 1], torch.bfloat16),
                                                 ([4, 2, 7, 1, 3], None), ([3, 8, 1, 2, 5, 2, 2], torch.bfloat16),
                                                 ([12, 11, 1], None)]):
            ids = make_batch(lengths, seed=seed)
            with torch.autocast("cpu", dtype=dtype or torch.float32, enabled=dtype is not None):
                with torch.no_grad():
                    reference = run(model, ids, "reference").hidden_states
                    packed = run(model, ids, "cuda").hidden_states
                model.zero_grad()
                static = run(model, ids, "cuda").hidden_states
                sum(layer.float().square().sum() for layer in static).backward()
            if dtype is None:  # (bf16's errors: test_cuda_bf16_is_no_worse_than_the_reference_in_bf16)
                assert max_diff(packed, reference) <= 1e-5 and max_diff(static, reference) <= 1e-5
    finally:
        dynamo_log.removeHandler(handler)
        torch._dynamo.reset()
    assert [w for w in warnings if "recompile_limit" in w] == []
    # The five step kernels, told apart by their arguments' names (the backward's by its first activation), each
    # compiled.
    kernels = ("input_gates", "activations_0", "grad_output", "projected", "through_gates")
    assert {next(name for name in kernels if f"L_{name}_" in graph) for graph in graphs} == set(kernels)


def test_a_step_kernel_that_runs_eagerly_can_call_the_kernels_inside_it(monkeypatch):
    # Under a dispatch mode (as benchmarks/gpu_proxies.py counts operators), or past its recompile limit, Dynamo runs
    # a compiled kernel's Python as it is, and `_hidden_and_projection_backward` then calls two compiled kernels of
    # its own while the recompile limit is raised. torch 2.11 (the floor: the GPU image's torch) raised there with a
    # shared `config.patch` object: "prior should be empty when entering ConfigPatch". The results are the plain
    # functions' and the limit is Dynamo's own again afterwards.
    from hf_elmo import elmo_ops

    generator = torch.Generator().manual_seed(3)
    grad_hidden, through_gates, projected, grad_output = (torch.randn(2, 5, 4, generator=generator) * 4
                                                          for _ in range(4))
    active = torch.tensor([True, False, True, True, False])[None, :, None]
    arguments = (grad_hidden, through_gates, active, projected, grad_output, active, 3.0)
    expected = elmo_ops._hidden_and_projection_backward(*arguments)  # plain calls: the CPU compiles none of them
    monkeypatch.setattr(elmo_ops, "COMPILED_DEVICE_TYPES", ("cpu",))
    monkeypatch.setattr(elmo_ops, "COMPILE_BACKEND", "eager")
    limits = []

    class SeesTheLimit(TorchDispatchMode):
        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            limits.append(torch._dynamo.config.recompile_limit)
            return func(*args, **(kwargs or {}))

    default_limit = torch._dynamo.config.recompile_limit
    torch._dynamo.reset()
    try:
        with SeesTheLimit():
            got = elmo_ops._hidden_and_projection_backward(*arguments)
    finally:
        torch._dynamo.reset()
    assert all(torch.equal(a, b) for a, b in zip(got, expected))
    assert set(limits) == {elmo_ops.KERNEL_GRAPHS} and torch._dynamo.config.recompile_limit == default_limit == 8



@pytest.mark.parametrize("device", DEVICES)
def test_cuda_bf16_is_no_worse_than_the_reference_in_bf16(device, exact_cuda_matmuls):
    # Issue 26's bar for bf16 outputs. On one model either implementation can round luckier (the H200 run of
    # gpu_report found a single draw failing), so the errors against fp32 are summed over eight models: per biLSTM
    # layer the cuda implementation's sum is at most the reference's (it adds the input bias and does the gate maths
    # in fp32; each reference gate rounds to bf16), and the token layer, computed alike, errs identically.
    sums = {"reference": torch.zeros(3, dtype=torch.float64), "cuda": torch.zeros(3, dtype=torch.float64)}
    for seed in range(3, 11):
        model = make_model(seed=seed).to(device).eval()
        ids = make_batch([12, 5, 9, 1], seed=19 + seed).to(device)
        with torch.no_grad():
            truth = run(model, ids, "reference").hidden_states
            for implementation, total in sums.items():
                with torch.autocast(device, dtype=torch.bfloat16):
                    states = run(model, ids, implementation).hidden_states
                total += torch.tensor([float((s.float() - u).abs().max()) for s, u in zip(states, truth)])
    reference, cuda = sums["reference"], sums["cuda"]
    assert cuda[0] == reference[0] and 0 < reference[0] < 0.1, (cuda, reference)
    assert (cuda[1:] <= reference[1:]).all() and (reference < 8 * 0.5).all(), (cuda, reference)


def pretraining_case(device, seed: int, lengths: list[int], batch_seed: int):
    """A small ElmoForPreTraining (sampled softmax, no dropout) in training mode, a batch and its word labels."""
    from hf_elmo import ElmoForPreTraining

    torch.manual_seed(seed)
    config = ElmoConfig(char_filters=FILTERS, n_highway=2, char_embedding_dim=4, lstm_dim=24, projection_dim=8,
                        cell_clip=3.0, proj_clip=3.0, vocab_size=500, num_softmax_samples=64, lm_dropout=0.0)
    model = ElmoForPreTraining(config).to(device).train()
    ids = make_batch(lengths, seed=batch_seed)
    labels = torch.randint(0, 500, ids.shape[:2]).masked_fill(ids[..., 0] == 0, -100)
    return model, ids.to(device), labels.to(device)


def pretraining_gradients(model, ids, labels, implementation, autocast_dtype=None):
    """The loss and every parameter's gradient of one sampled-softmax step (the same negatives each call)."""
    model.set_elmo_implementation(implementation)
    model.zero_grad()
    torch.manual_seed(11)
    with torch.autocast(ids.device.type, dtype=autocast_dtype, enabled=autocast_dtype is not None):
        loss = model(ids, labels=labels).loss
    (loss * 20).backward()
    return loss.item(), {name: p.grad.to_dense().float().clone() for name, p in model.named_parameters()
                         if p.grad is not None}


@pytest.mark.parametrize("device", DEVICES)
def test_a_pretraining_step_on_the_cuda_implementation_matches_the_reference(device, exact_cuda_matmuls):
    # ElmoForPreTraining as hf-elmo pretrain runs it (sampled softmax, sparse softmax gradients, gradient x 20),
    # with the compiled kernels on a GPU: loss and every gradient against the reference implementation, fp32.
    model, ids, labels = pretraining_case(device, seed=0, lengths=[7, 3, 9, 1], batch_seed=5)
    model.softmax.sparse = True
    reference_loss, reference = pretraining_gradients(model, ids, labels, "reference")
    loss, fast = pretraining_gradients(model, ids, labels, "cuda")
    assert abs(loss - reference_loss) <= 1e-5 * abs(reference_loss)
    assert reference.keys() == fast.keys() and len(reference) == len(list(model.parameters()))
    for name, expected in reference.items():
        scale = max(1.0, float(expected.abs().max()))
        assert float((fast[name] - expected).abs().max()) <= 1e-4 * scale, name


@pytest.mark.parametrize("device", DEVICES)
def test_bf16_gradients_of_the_cuda_implementation_are_no_worse_than_the_references(device, exact_cuda_matmuls):
    # Issue 26's bar for bf16 gradients, against the fp32 ones, summed over eight models (one draw is a coin toss
    # between two roundings): over the biLSTM's parameters, where the implementations differ, the cuda
    # implementation errs no more than the reference under autocast (its gate maths and cell state stay in fp32).
    # The filters and char embeddings: in bf16, distinct windows of a word tie at a filter's max; the reference's
    # `amax` splits the gradient between them, the cuda implementation's one max (`elmo_ops.pooled_convolutions`)
    # gives it to one. Against fp32 (one window, the true max) either errs; the sums measured 1.19x (embeddings)
    # and 1.26x (filters) the reference's. Every other parameter (highways, projection, biases, softmax: computed
    # alike, fed by the two biLSTMs' outputs) within 10% of it.
    errors = {"reference": {}, "cuda": {}}
    for seed in range(1, 9):
        model, ids, labels = pretraining_case(device, seed=seed, lengths=[12, 5, 9, 1], batch_seed=22 + seed)
        _, truth = pretraining_gradients(model, ids, labels, "reference")
        for implementation, totals in errors.items():
            _, grads = pretraining_gradients(model, ids, labels, implementation, torch.bfloat16)
            for name, expected in truth.items():
                error = float((grads[name] - expected).abs().max()) / max(1.0, float(expected.abs().max()))
                totals[name] = totals.get(name, 0.0) + error
    reference, cuda = errors["reference"], errors["cuda"]
    bilstm = [name for name in reference if ".bilstm." in name]
    assert len(bilstm) == 16 and len(reference) == len(list(model.parameters()))
    assert 0 < sum(cuda[n] for n in bilstm) <= sum(reference[n] for n in bilstm)
    ties = [name for name in reference
            if name.endswith("char_embeddings.weight") or (".convolutions." in name and name.endswith(".weight"))]
    assert len(ties) == 6
    for group in (ties[:1], ties[1:]):
        assert sum(cuda[n] for n in group) <= 1.5 * sum(reference[n] for n in group), (group, cuda, reference)
    assert all(cuda[n] <= 1.1 * reference[n] for n in reference if n not in bilstm + ties), (cuda, reference)
    assert max(reference.values()) < 8 * 0.25  # bf16 keeps 8 bits; an error of a quarter would be a broken gradient
