"""bilm-tf's training recipe (bilm/training.py): a new model's initialisers, the dropout on every LSTM layer's input,
and the gradient scale; and that a random biLM built this way gives features worth comparing against."""

import json
import math

import pytest
import torch

from hf_elmo import ElmoConfig, ElmoForPreTraining, ElmoForTokenClassification, ElmoModel, ElmoTokenizer
from hf_elmo.cli import pretrain_main
from hf_elmo.elmo_presets import CPU_PRETRAINING_CONFIG
from hf_elmo.modeling_elmo import ElmoLstmLayer
from hf_elmo.testing_utils import english_text_sample



pytestmark = pytest.mark.usefixtures("fresh_accelerate_state")  # conftest.py


def assert_uniform(tensor: torch.Tensor, bound: float, name: str):
    """All values in [-bound, bound], reaching near both ends, with the uniform's mean and std."""
    values = tensor.detach().double().flatten()
    assert values.abs().max() <= bound, name
    assert values.max() > 0.99 * bound and values.min() < -0.99 * bound, name
    assert abs(values.mean()) < 0.05 * bound, name
    assert values.std() == pytest.approx(bound / math.sqrt(3), rel=0.05), name


def assert_normal(tensor: torch.Tensor, std: float, name: str):
    values = tensor.detach().double().flatten()
    assert abs(values.mean()) < 0.05 * std, name
    assert values.std() == pytest.approx(std, rel=0.05), name
    # A normal, not a uniform of the same std: about 0.3% of the values lie beyond 3 std (a uniform has none).
    assert (values.abs() > 3 * std).double().mean() == pytest.approx(0.0027, abs=0.002), name


@pytest.mark.parametrize("activation", ["relu", "tanh"])
def test_a_new_model_starts_from_bilm_tf_initialisers(activation):
    torch.manual_seed(0)
    config = ElmoConfig(**{**CPU_PRETRAINING_CONFIG, "char_activation": activation}, vocab_size=3000, initializer_range=0.02)
    model = ElmoForPreTraining(config)
    encoder = model.elmo.char_encoder
    embeddings = encoder.char_embeddings.weight
    assert torch.equal(embeddings[0], torch.zeros(16))  # the padded-word row
    assert_uniform(embeddings[1:], 1.0, "char_embed")
    for (width, n_filters), conv in zip(CPU_PRETRAINING_CONFIG["char_filters"], encoder.convolutions):
        if activation == "relu":
            assert_uniform(conv.weight, 0.05, f"W_cnn width {width}")
        elif n_filters * width * 16 >= 1000:  # enough values for the statistics
            assert_normal(conv.weight, (1 / (width * 16)) ** 0.5, f"W_cnn width {width}")
        assert torch.equal(conv.bias, torch.zeros(n_filters))
    highway = encoder.highways[0]
    assert_normal(highway.carry.weight, 512**-0.5, "W_carry")
    assert_normal(highway.transform.weight, 512**-0.5, "W_transform")
    assert torch.equal(highway.carry.bias, torch.full((512,), -2.0))
    assert torch.equal(highway.transform.bias, torch.zeros(512))
    assert_normal(encoder.projection.weight, 512**-0.5, "W_proj")
    assert torch.equal(encoder.projection.bias, torch.zeros(128))
    kernel_bound = (6 / (128 + 128 + 4 * 512)) ** 0.5  # Glorot over W_0: [input; previous output] x 4 * lstm_dim
    for layer in model.elmo.bilstm.modules():
        if isinstance(layer, ElmoLstmLayer):
            assert_uniform(layer.input_proj.weight, kernel_bound, "W_0 (input rows)")
            assert_uniform(layer.recurrent_proj.weight, kernel_bound, "W_0 (recurrent rows)")
            assert torch.equal(layer.input_proj.bias, torch.zeros(4 * 512))
            assert_uniform(layer.output_proj.weight, (6 / (512 + 128)) ** 0.5, "W_P_0")
    assert_normal(model.softmax.weight, 128**-0.5, "softmax/W")
    assert torch.equal(model.softmax.bias, torch.zeros(3000))


def test_the_softmax_table_is_drawn_once():
    # One pass of the random stream over a table that is 793k x 512 for bilm-tf's vocabulary: nn.Embedding's own
    # draw and Transformers' default before ours took two more (about 3 s of a model's start on a 2-core CPU).
    config = ElmoConfig(**CPU_PRETRAINING_CONFIG, vocab_size=3000)
    model = ElmoForPreTraining(config)
    torch.manual_seed(5)
    built = torch.get_rng_state()
    softmax = type(model.softmax)(3000, 128)
    assert torch.equal(torch.get_rng_state(), built)  # constructing it draws nothing
    model._init_weights(softmax)
    torch.manual_seed(5)
    assert torch.equal(softmax.weight, torch.empty(3000, 128).normal_(0.0, 128**-0.5))
    assert torch.equal(softmax.bias, torch.zeros(3000))


def test_heads_keep_transformers_init_and_loaded_weights_are_untouched(converted_dir):
    torch.manual_seed(0)
    config = ElmoConfig(**CPU_PRETRAINING_CONFIG, num_labels=300, head_lstm_dim=64, initializer_range=0.02)
    head = ElmoForTokenClassification(config)
    assert_normal(head.classifier.weight, 0.02, "classifier")
    assert torch.equal(head.encoder.mix.scalar_weights, torch.zeros(3))
    # ... while its biLM starts as bilm-tf's.
    assert torch.equal(head.elmo.char_encoder.highways[0].carry.bias, torch.full((512,), -2.0))

    from safetensors.torch import load_file

    loaded = ElmoModel.from_pretrained(converted_dir)
    for name, tensor in load_file(converted_dir / "model.safetensors").items():
        assert torch.equal(loaded.state_dict()[name], tensor), name


def test_a_random_bilm_gives_features_a_tagger_can_use():
    # With Transformers' N(0, 0.02) the layers' RMS was 1.9e-3 / 1.5e-4 / 1.5e-4 and the spread between tokens
    # 7e-4 / 3e-5 / 3e-5: a tagger on such features learnt nothing (F1 0.000).
    torch.manual_seed(0)
    model = ElmoModel(ElmoConfig(**CPU_PRETRAINING_CONFIG)).eval()
    sentences = english_text_sample().read_text(encoding="utf-8").splitlines()[:64]
    batch = ElmoTokenizer()(sentences, padding=True, return_tensors="pt")
    with torch.no_grad():
        output = model(**batch, output_hidden_states=True)
    for index, layer in enumerate(output.hidden_states):
        words = layer[output.word_mask]
        assert words.pow(2).mean().sqrt() > 1e-2, f"layer {index}"
        assert words.std(dim=0).mean() > 3e-3, f"layer {index}"


def _recorded_lstm_inputs(model, run):
    """The input each ElmoLstmLayer received and what it returned, in call order (reference implementation)."""
    calls = []
    hooks = [layer.register_forward_hook(lambda module, args, output: calls.append((args[0], output[0])))
             for layer in model.modules() if isinstance(layer, ElmoLstmLayer)]
    try:
        run()
    finally:
        for hook in hooks:
            hook.remove()
    return calls


def test_dropout_hits_every_lstm_input_in_pretraining_only():
    torch.manual_seed(0)
    config = ElmoConfig(**CPU_PRETRAINING_CONFIG, vocab_size=500, num_softmax_samples=0, lm_dropout=0.25)
    model = ElmoForPreTraining(config)
    model.set_elmo_implementation("reference")
    sentences = english_text_sample().read_text(encoding="utf-8").splitlines()[:16]
    batch = dict(ElmoTokenizer()(sentences, padding=True, return_tensors="pt"))
    labels = torch.randint(3, 500, batch["attention_mask"].shape).masked_fill(batch["attention_mask"] == 0, -100)
    real = (batch["attention_mask"].sum(1) + 2)[:, None] > torch.arange(batch["input_ids"].shape[1] + 2)

    def kept_or_dropped(seen: torch.Tensor, values: torch.Tensor, what: str):
        """Each value of `values` at a real position is either 0 or scaled by 1 / 0.75; about 25% are 0."""
        seen, values = seen[real], values[real]
        zeroed = (seen == 0) & (values != 0)
        assert zeroed.double().mean() == pytest.approx(0.25, abs=0.01), what
        torch.testing.assert_close(seen[~zeroed], values[~zeroed] / 0.75, msg=what)

    model.eval()
    clean = _recorded_lstm_inputs(model, lambda: model(**batch, labels=labels))
    model.train()
    torch.manual_seed(1)
    outputs = []
    dropped = _recorded_lstm_inputs(
        model, lambda: outputs.append(model(**batch, labels=labels, output_hidden_states=True)))
    # Layers run direction by direction: forward layer 0 then 1, then backward 0 and 1.
    assert len(clean) == len(dropped) == 4
    for direction in (0, 1):
        (token_input, first_output), (second_input, second_output) = dropped[2 * direction : 2 * direction + 2]
        # Layer 0 reads the token layer (as its direction reads it), layer 1 reads layer 0's output: both dropped.
        kept_or_dropped(token_input, clean[2 * direction][0], f"direction {direction}, layer 0")
        kept_or_dropped(second_input, first_output, f"direction {direction}, layer 1")
    # The skip connection adds the dropped input, as bilm-tf's DropoutWrapper wraps its ResidualWrapper.
    top_forward = outputs[0].hidden_states[2][..., :128]
    torch.testing.assert_close(top_forward, dropped[1][1] + dropped[1][0])

    # The task heads, and ElmoModel itself, never drop anything inside the biLM, in training mode too.
    head = ElmoForTokenClassification(ElmoConfig(**CPU_PRETRAINING_CONFIG, num_labels=3, freeze_elmo=False, lm_dropout=0.25))
    head.set_elmo_implementation("reference")
    with torch.no_grad():
        training = head.train().elmo(**batch, output_hidden_states=True).hidden_states
        evaluating = head.eval().elmo(**batch, output_hidden_states=True).hidden_states
    assert all(torch.equal(a, b) for a, b in zip(training, evaluating))


@pytest.mark.parametrize("implementation", ["cpu", "cuda"])
def test_every_implementation_drops_the_same_values(implementation):
    torch.manual_seed(0)
    config = ElmoConfig(char_filters=[[1, 8], [2, 8]], n_highway=1, char_embedding_dim=8, lstm_dim=32,
                        projection_dim=8, num_lstm_layers=2, vocab_size=50, num_softmax_samples=0, lm_dropout=0.3)
    model = ElmoForPreTraining(config).train()
    input_ids = torch.randint(1, 200, (3, 6, 50))
    input_ids[1, 4:] = 0
    input_ids[2, 2:] = 0
    labels = torch.randint(0, 50, (3, 6)).masked_fill(input_ids[..., 0] == 0, -100)
    results = {}
    for name in ("reference", implementation):
        model.set_elmo_implementation(name)
        model.zero_grad()
        torch.manual_seed(5)
        loss = model(input_ids=input_ids, labels=labels).loss
        loss.backward()
        results[name] = (loss.detach(), [p.grad.clone() for p in model.parameters()])
    torch.testing.assert_close(results[implementation][0], results["reference"][0], rtol=1e-6, atol=1e-6)
    for mine, reference in zip(results[implementation][1], results["reference"][1]):
        torch.testing.assert_close(mine, reference, rtol=1e-4, atol=1e-6)
    # And dropout did act: another draw gives another loss.
    torch.manual_seed(6)
    assert model(input_ids=input_ids, labels=labels).loss != results["reference"][0]


def _run(corpus_dir, output, *extra):
    return pretrain_main([
        "--train-files", str(corpus_dir / "train.txt"), "--eval-file", str(corpus_dir / "heldout.txt"),
        "--config", str(corpus_dir / "recipe.json"), "--output-dir", str(output), "--seed", "1",
        "--max-sentence-words", "30", "--num-workers", "0", "--report-to", "none", *extra,
    ])


@pytest.fixture(scope="module")
def small_corpus(english_corpus):
    """The shared Wikipedia corpus (conftest.py), with a 1.3M-parameter version of the recipe config beside it."""
    (english_corpus / "recipe.json").write_text(json.dumps({**CPU_PRETRAINING_CONFIG, "lstm_dim": 256, "projection_dim": 64}))
    return english_corpus


def test_the_gradient_scale_reaches_the_gradient_not_the_logged_loss(small_corpus, tmp_path):
    logged = {}
    for scale in ("1", "20"):
        assert _run(small_corpus, tmp_path / scale, "--build-vocab", "--max-steps", "1", "--logging-steps", "1",
                    "--batch-size", "8", "--loss-scale", scale, "--max-grad-norm", "0") == 0
        # metrics.jsonl holds the full floats (the log line rounds the norm to 3 digits, too coarse for 1e-3).
        [record] = [json.loads(line) for line in (tmp_path / scale / "metrics.jsonl").read_text().splitlines()
                    if '"train/loss"' in line]
        assert record["step"] == 1
        logged[scale] = (record["train/loss"], record["train/grad_norm"])
        from accelerate.state import AcceleratorState, GradientState

        AcceleratorState._reset_state(True)
        GradientState._reset_state()
    # The same first batch from the same weights: the same loss, and 20 times the gradient.
    assert logged["20"][0] == logged["1"][0]
    assert logged["20"][1] == pytest.approx(20 * logged["1"][1], rel=1e-3)
    assert json.loads((tmp_path / "20" / "training_args.json").read_text())["loss_scale"] == 20


def test_a_short_run_of_the_recipe_learns(small_corpus, tmp_path, caplog):
    # 60 Adagrad steps with bilm-tf's defaults (initialisers, x20, dropout 0.1) on 3,600 Wikipedia sentences, a
    # 6,261-word vocabulary. The recipe before them (Transformers' init, no gradient scale, c290f4f) ended at
    # held-out perplexity 4,436 / 4,461 (forward / backward, seed 1); bilm-tf's recipe at 354 / 439.
    caplog.set_level("INFO", logger="hf_elmo")
    assert _run(small_corpus, tmp_path / "run", "--build-vocab", "--min-count", "2", "--max-steps", "60",
                "--batch-size", "16", "--eval-steps", "60", "--eval-max-sentences", "200") == 0
    results = json.loads((tmp_path / "run" / "eval_results.json").read_text())
    assert results["step"] == 60
    assert results["eval/forward_perplexity"] < 1000 and results["eval/backward_perplexity"] < 1000
