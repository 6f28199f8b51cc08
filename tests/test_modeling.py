"""ElmoModel behaviour beyond the golden numbers: output layout, state, dtypes, checkpointing, bad input."""

import pytest
import torch

from hf_elmo import ElmoConfig, ElmoModel, ElmoTokenizer


def tiny_config(**kwargs):
    return ElmoConfig(char_filters=((1, 4), (2, 8), (3, 16)), n_highway=1, char_embedding_dim=4, lstm_dim=24,
                      projection_dim=8, num_lstm_layers=2, **kwargs)


@pytest.fixture(scope="module")
def model():
    torch.manual_seed(0)
    return ElmoModel(tiny_config()).eval()


@pytest.fixture(scope="module")
def batch():
    return ElmoTokenizer()([["Hello", "world", "!"], ["Hi"], []], is_split_into_words=True, padding=True,
                           return_tensors="pt")


def test_output_layout(model, batch):
    with torch.no_grad():
        out = model(**batch, output_hidden_states=True)
    assert out.last_hidden_state.shape == (3, 3, 16)
    assert len(out.hidden_states) == 3 and out.hidden_states[-1] is out.last_hidden_state
    layer0 = out.hidden_states[0]
    assert torch.equal(layer0[..., :8], layer0[..., 8:])
    assert out.word_mask.tolist() == [[True, True, True], [True, False, False], [False, False, False]]
    # The empty sentence has no words and only zeros.
    assert out.last_hidden_state[2].abs().max() == 0
    assert out.lstm_state is None


def test_return_dict_false(model, batch):
    with torch.no_grad():
        as_tuple = model(**batch, return_dict=False, output_hidden_states=True)
        as_dict = model(**batch, output_hidden_states=True)
    assert isinstance(as_tuple, tuple)
    assert torch.equal(as_tuple[0], as_dict.last_hidden_state) and len(as_tuple[1]) == 3


def test_sentence_boundaries_kept_on_request(model, batch):
    with torch.no_grad():
        plain = model(**batch, output_hidden_states=True)
        framed = model(**batch, output_hidden_states=True, keep_sentence_boundaries=True)
    assert framed.last_hidden_state.shape == (3, 5, 16)
    assert framed.word_mask.tolist() == [[1, 1, 1, 1, 1], [1, 1, 1, 0, 0], [1, 1, 0, 0, 0]]
    assert torch.equal(framed.last_hidden_state[:, 1:4] * plain.word_mask[..., None], plain.last_hidden_state)
    # <S> and </S> are real, context-free token vectors, identical in every row.
    token = framed.hidden_states[0]
    assert torch.equal(token[0, 0], token[2, 0]) and torch.equal(token[0, 4], token[2, 1])


def test_state_is_explicit_and_continues_a_sequence():
    torch.manual_seed(0)
    model = ElmoModel(tiny_config()).eval()
    tokenizer = ElmoTokenizer()
    first, second = tokenizer(["A first sentence ."], return_tensors="pt"), tokenizer(["And a second ."], return_tensors="pt")
    with torch.no_grad():
        out1 = model(**first, return_lstm_state=True)
        cell, hidden = out1.lstm_state
        assert cell.shape == (2, 2, 1, 24) and hidden.shape == (2, 2, 1, 8)
        carried = model(**second, lstm_state=out1.lstm_state)
        fresh = model(**second)
        zero = model(**second, lstm_state=model.zero_lstm_state(1, "cpu", torch.float32))
    assert torch.equal(fresh.last_hidden_state, zero.last_hidden_state)
    assert (carried.last_hidden_state - fresh.last_hidden_state).abs().max() > 1e-4
    assert carried.lstm_state is not None
    with pytest.raises(ValueError, match=r"lstm_state cell must have shape \(2, 2, 1, 24\), got \(2, 2, 3, 24\)"):
        model(**second, lstm_state=model.zero_lstm_state(3, "cpu", torch.float32))


def test_bad_input_gets_a_clear_error(model, batch):
    with pytest.raises(ValueError, match=r"input_ids must have shape \(batch, words, 50\)"):
        model(input_ids=batch["input_ids"][..., :10])
    with pytest.raises(ValueError, match="empty batch"):
        model(input_ids=torch.zeros(0, 3, 50, dtype=torch.long))
    with pytest.raises(ValueError, match="integer char ids"):
        model(input_ids=batch["input_ids"].float())
    with pytest.raises(ValueError, match="found a word after a padded position"):
        model(input_ids=batch["input_ids"].flip(1))
    mask = batch["attention_mask"].clone()
    mask[1, 2] = 1
    with pytest.raises(ValueError, match="attention_mask marks a word whose input_ids row is all zeros"):
        model(input_ids=batch["input_ids"], attention_mask=mask)
    bad = batch["input_ids"].clone()
    bad[0, 0, 3] = 262
    with pytest.raises(ValueError, match=r"char ids outside \[0, 262\)"):
        model(input_ids=bad)


def test_bf16_runs_close_to_fp32(batch):
    torch.manual_seed(0)
    model = ElmoModel(tiny_config()).eval()
    with torch.no_grad():
        reference = model(**batch).last_hidden_state
        low = model.to(torch.bfloat16)(**batch).last_hidden_state
    assert low.dtype == torch.bfloat16
    assert (low.float() - reference).abs().max() < 0.05
    # fp32 weights under bf16 autocast (how mixed-precision training evaluates) also run.
    model.float()
    with torch.no_grad(), torch.autocast("cpu", dtype=torch.bfloat16):
        mixed = model(**batch).last_hidden_state
    assert mixed.dtype == torch.bfloat16
    assert (mixed.float() - reference).abs().max() < 0.05


def test_gradient_checkpointing_gives_the_same_gradients(batch):
    torch.manual_seed(0)
    model = ElmoModel(tiny_config()).train()
    model(**batch).last_hidden_state.square().sum().backward()
    plain = {n: p.grad.clone() for n, p in model.named_parameters()}
    model.zero_grad()
    # Newer transformers (5.23) call it activation_checkpointing_enable and warn on the old name; 5.17 has only that.
    enable_checkpointing = getattr(model, "activation_checkpointing_enable", model.gradient_checkpointing_enable)
    enable_checkpointing()
    model(**batch).last_hidden_state.square().sum().backward()
    for name, param in model.named_parameters():
        assert torch.allclose(param.grad, plain[name], atol=1e-6), name


def test_input_embeddings_and_init(model):
    embeddings = model.get_input_embeddings()
    assert embeddings.num_embeddings == 262 and embeddings.weight[0].abs().max() == 0
    # bilm-tf starts highways carrying their input through.
    assert torch.all(model.char_encoder.highways[0].carry.bias == -2.0)


def test_no_lstm_projection_when_dims_match():
    config = ElmoConfig(char_filters=((1, 4), (2, 4)), n_highway=0, char_embedding_dim=4, lstm_dim=8,
                        projection_dim=8, cell_clip=None, proj_clip=None)
    model = ElmoModel(config).eval()
    assert isinstance(model.char_encoder.projection, torch.nn.Identity)
    assert isinstance(model.bilstm.forward_layers[0].output_proj, torch.nn.Identity)
    out = model(**ElmoTokenizer()(["two words"], return_tensors="pt"))
    assert out.last_hidden_state.shape == (1, 2, 16)
