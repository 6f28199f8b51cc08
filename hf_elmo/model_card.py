"""Model cards for hf_elmo folders, rendered from metadata with huggingface_hub's `ModelCard` / `ModelCardData`.

A card is built from what a folder knows about itself: its `ElmoConfig` (shape, architecture, labels), the SHA-256 of
the bilm-tf files it was converted from (`bilm_tf_source.json`, written by the converter), how it was checked
against bilm-tf and, for a fine-tuned head, the run's `metrics.json` and `layer_weights.png` (written by the
examples' `run_finetuning` in examples/finetuning_cli.py). The same facts go into the YAML metadata (`base_model`,
`datasets`, `model-index` and, under `hf_elmo:`, the rest) and into the prose.
"""

from huggingface_hub import EvalResult, ModelCard, ModelCardData

from .configuration_elmo import ElmoConfig


# SHA-256 of bilm-tf's own test model (`lm_weights.hdf5` in allennlp 0.9.0's tests/fixtures/elmo), the model
# for which bilm-tf's outputs exist and were compared against (tests/test_golden.py).
BILM_TF_FIXTURE_WEIGHTS_SHA256 = "dfdfd3001b5965b4b6ef857ac772b6624984f8248eaae08fb9be6d1b51ad8755"

# Max |diff| vs the outputs bilm-tf computed for its test model, as measured by tests/test_golden.py on the
# development machine (x86_64 CPU, torch 2.13, fp32, default fast path), rounded up. The tests hold every
# machine to 1e-5; float32 kernels differ across CPUs, so update these when the measurement changes.
GOLDEN_FIGURES = {
    "token_layer": 7.2e-07,
    "top_layer_batch_0_zero_state": 9.6e-07,
    "top_layer_10_batches_state_carried": 9.6e-07,
}

# Pipeline tag by the suffix of the saved architecture; anything else (the biLM, a language-model head) gives
# per-word vectors.
_PIPELINE_TAGS = {
    "ForTokenClassification": "token-classification",
    "ForSequenceClassification": "text-classification",
    "ForQuestionAnswering": "question-answering",
}

_CITATION = """@inproceedings{peters-etal-2018-deep,
    title = "Deep Contextualized Word Representations",
    author = "Peters, Matthew E. and Neumann, Mark and Iyyer, Mohit and Gardner, Matt and Clark, Christopher and
              Lee, Kenton and Zettlemoyer, Luke",
    booktitle = "Proceedings of NAACL-HLT 2018",
    year = "2018",
    pages = "2227--2237",
}"""


def shape_name(config: ElmoConfig) -> str:
    """bilm-tf's name for a model shape, e.g. `2x4096_512_2048cnn_2xhighway`."""
    highway = f"_{config.n_highway}xhighway" if config.n_highway else ""
    return f"{config.num_lstm_layers}x{config.lstm_dim}_{config.projection_dim}_{config.n_filters}cnn{highway}"


def architecture_of(config: ElmoConfig) -> str:
    return (getattr(config, "architectures", None) or ["ElmoModel"])[0]


def pipeline_tag_of(architecture: str) -> str:
    for suffix, tag in _PIPELINE_TAGS.items():
        if architecture.endswith(suffix):
            return tag
    return "feature-extraction"


def is_bilm_tf_fixture(checksums: dict | None) -> bool:
    return bool(checksums) and checksums.get("weights", {}).get("sha256") == BILM_TF_FIXTURE_WEIGHTS_SHA256


def _verification_section(checksums: dict | None, is_head: bool = False) -> tuple[str, dict]:
    """Prose and metadata about how these weights (a head's: its biLM's) were checked against bilm-tf."""
    weights = "the weights of its biLM" if is_head else "these weights"
    g = GOLDEN_FIGURES
    table = (
        "| check (bilm-tf's test model) | max abs diff vs bilm-tf |\n|---|---|\n"
        f"| token layer, 458 words of `vocab_test.txt` | {g['token_layer']:.1e} |\n"
        f"| top layer, batch 0, zero LSTM state | {g['top_layer_batch_0_zero_state']:.1e} |\n"
        f"| top layer, all 10 batches, LSTM state carried | {g['top_layer_10_batches_state_carried']:.1e} |"
    )
    if is_bilm_tf_fixture(checksums):
        text = (
            f"{weights[0].upper() + weights[1:]} are those of bilm-tf's own test model (allennlp 0.9.0 "
            "`tests/fixtures/elmo`), for which "
            "bilm-tf's outputs are published. This model reproduces them:\n\n" + table
        )
        return text, {"compared_with_bilm_tf_outputs": True, "max_abs_diff": dict(g)}
    if checksums:
        text = (
            f"bilm-tf published no outputs for {weights}, so they were not compared with bilm-tf directly. "
            "What was verified: the converter checked every dataset of the weight file for presence, shape (from "
            "the options file), float dtype and finite values, and wrote every tensor it read; the reverse export "
            "(`hf-elmo convert --to-bilm-tf`) reproduces bilm-tf's file layout bit for bit. The implementation "
            "itself matches bilm-tf on bilm-tf's own test model:\n\n" + table
        )
        return text, {"compared_with_bilm_tf_outputs": False, "implementation_max_abs_diff": dict(g)}
    text = (
        f"{'Its biLM' if is_head else 'This model'} was not converted from bilm-tf files. The implementation "
        "matches bilm-tf on bilm-tf's own "
        "test model:\n\n" + table
    )
    return text, {"compared_with_bilm_tf_outputs": False, "implementation_max_abs_diff": dict(g)}


def _usage(config: ElmoConfig, architecture: str, name: str, n_layers: int) -> str:
    width = config.max_characters_per_token
    tokenizer_note = f"""The tokenizer splits raw text into words (or takes `is_split_into_words=True`) and gives every
word {width} character ids: `input_ids` is `(batch, words, {width})`."""
    pipeline_tag = pipeline_tag_of(architecture)
    if pipeline_tag == "token-classification":
        # The stock token-classification pipeline cannot read per-word character ids; the folder names its own
        # (config.custom_pipelines), which Transformers loads only with trust_remote_code=True.
        return f"""```python
from transformers import pipeline

tagger = pipeline("token-classification", model="{name}", trust_remote_code=True, aggregation_strategy="simple")
tagger("AI2 engineer Joel lives in Seattle.")  # [{{'entity_group': ..., 'word': ..., 'start': ..., 'end': ...}}, ...]
```

`trust_remote_code=True` is required: it selects this repository's `ElmoTokenClassificationPipeline`, which reads
per-word character ids (the stock token-classification pipeline cannot).

{tokenizer_note}"""
    if pipeline_tag == "text-classification":
        return f"""```python
from transformers import pipeline

classify = pipeline("text-classification", model="{name}", trust_remote_code=True)
classify(["The bank raised rates .", "We sat on the river bank ."])  # [{{'label': ..., 'score': ...}}, ...]
```

{tokenizer_note}"""
    # The Auto class that loads this architecture, from the config's own auto_map.
    auto_class = next(
        (k for k, v in (config.auto_map or {}).items() if v == f"modeling_elmo.{architecture}"), "AutoModel"
    )
    if auto_class == "AutoModel":
        call = f"""    output = model(**batch, output_hidden_states=True)
layers = torch.stack(output.hidden_states)  # ({n_layers}, batch, words, {config.hidden_size})"""
    else:
        call = "    output = model(**batch)"
    return f"""```python
import torch
from transformers import {auto_class}, AutoTokenizer

tokenizer = AutoTokenizer.from_pretrained("{name}", trust_remote_code=True)
model = {auto_class}.from_pretrained("{name}", trust_remote_code=True).eval()
batch = tokenizer(["The bank raised rates .", "We sat on the river bank ."], padding=True, return_tensors="pt")
with torch.no_grad():
{call}
```

{tokenizer_note}
With hf_elmo installed, `hf-elmo embed sentences.txt vectors.hdf5 --model {name}` writes the vectors of every line
of a text file to HDF5."""


# ---------------------------------------------------------------------------------------------------------------
# Fine-tuned heads: labels, the run's metrics (metrics.json, from run_finetuning in examples/finetuning_cli.py) and
# the layer weights it learned.
# ---------------------------------------------------------------------------------------------------------------
def _split_summary(pipeline_tag: str, report: dict) -> dict[str, float]:
    """The headline numbers of one evaluated split, by metric name."""
    if pipeline_tag == "token-classification":
        summary = {"token accuracy": report["token_accuracy"]}
        overall = (report.get("entities") or {}).get("overall")
        if overall:
            summary.update({"entity precision": overall["precision"], "entity recall": overall["recall"],
                            "entity F1": overall["f1"]})
        return summary
    return {"accuracy": report["accuracy"], "macro F1": report["macro"]["f1"]}


def _per_class_rows(pipeline_tag: str, report: dict) -> dict[str, dict]:
    if pipeline_tag == "token-classification":
        return {k: v for k, v in (report.get("entities") or {}).items() if k != "overall"}
    return report.get("classes") or {}


# The pretraining arguments the card shows as the recipe (from the run's training_args.json).
RECIPE_ARGUMENTS = ("optimizer", "learning_rate", "batch_size", "max_steps", "dropout", "num_softmax_samples",
                    "max_sentence_words", "pre_tokenizer", "seed", "num_processes")


def _pretraining_sections(pretraining: dict, plot: str | None) -> list[str]:
    """What `hf-elmo pretrain` trained this biLM on and how (`publish.read_pretraining`'s dict)."""
    dataset = pretraining.get("dataset")
    if dataset:
        details = [f"{key} `{dataset[key]}`" for key in ("config", "split", "revision", "text_column")
                   if dataset.get(key)]
        corpus = (f"the {'dataset' if dataset.get('hub') else 'local dataset'} `{dataset['name']}`"
                  + (f" ({', '.join(details)}{', streamed' if dataset.get('streaming') else ''})" if details else ""))
    else:
        corpus = ", ".join(f"`{name}`" for name in pretraining.get("train_files") or []) or "text files"
    wall = pretraining.get("train_wall_s")
    wall = None if wall is None else f"{wall / 3600:.1f} hours" if wall >= 3600 else f"{wall / 60:.1f} minutes"
    sentences = pretraining.get("sentences_seen")
    lines = [f"Pretrained with `hf-elmo pretrain` on {corpus} for {pretraining.get('step'):,} steps, "
             + (f"{sentences:,} sentences and " if sentences else "")
             + f"{pretraining.get('tokens_seen'):,} tokens seen (words and sentence ends)"
             + (f", in {wall} of wall time (until the last logged step)" if wall else "") + "."]
    final = pretraining.get("heldout_perplexity")
    if final:
        lines.append(f"Held-out perplexity on `{pretraining.get('eval_file')}` at step {pretraining.get('step'):,}: "
                     f"forward {final['forward']:.2f}, backward {final['backward']:.2f}.")
    recipe = pretraining.get("recipe") or {}
    sections = ["## Pretraining", " ".join(lines)]
    if recipe:
        sections.append("| recipe | value |\n|---|---|\n" + "\n".join(f"| `{k}` | `{v}` |" for k, v in recipe.items()))
    if plot:
        sections.append(f"![Held-out perplexity during pretraining]({plot})")
    elif pretraining.get("curve"):
        sections.append("| step | forward perplexity | backward perplexity |\n|---|---|---|\n" + "\n".join(
            f"| {p['step']} | {p['forward']:.2f} | {p['backward']:.2f} |" for p in pretraining["curve"]))
    return sections


def plot_perplexity_curve(curve: list[dict], path: str) -> None:
    """The held-out perplexity of each direction against the step, as a PNG at `path` (needs matplotlib)."""
    import matplotlib

    matplotlib.use("Agg")
    from matplotlib import pyplot

    figure, axes = pyplot.subplots(figsize=(6, 3.5))
    steps = [point["step"] for point in curve]
    for direction in ("forward", "backward"):
        axes.plot(steps, [point[direction] for point in curve], marker="o", label=direction)
    axes.set_xlabel("step")
    axes.set_ylabel("held-out perplexity")
    axes.set_yscale("log")
    axes.legend()
    figure.tight_layout()
    figure.savefig(path, dpi=100)
    pyplot.close(figure)


def _finetuning_sections(config: ElmoConfig, pipeline_tag: str, training: dict | None, plot: str | None) -> list[str]:
    labels = {int(i): label for i, label in (config.id2label or {}).items()}
    sections = [
        "## Labels",
        "| id | label |\n|---|---|\n" + "\n".join(f"| {i} | `{labels[i]}` |" for i in sorted(labels)),
    ]
    if not training:
        return sections
    data = training.get("datasets") or []
    files = training.get("data_files") or {}
    source = (", ".join(f"[`{d}`](https://huggingface.co/datasets/{d})" for d in data)
              or ", ".join(f"`{name}` ({split})" for split, name in files.items()) or "its task's data")
    head = ("a biLSTM and " if config.head_lstm_dim else "") + (
        "a CRF" if getattr(config, "head_crf", False) else "a linear classifier")
    lines = [f"Task `{training.get('task')}`, fine-tuned from `{training.get('model')}` on {source} with hf_elmo's "
             f"example scripts (the biLM {'frozen' if config.freeze_elmo else 'fine-tuned too'}, a learned scalar "
             f"mix of its layers, {head})."]
    if training.get("train_loss") is not None:
        lines.append(f"Final training loss: {training['train_loss']:.4f}.")
    settings = training.get("training_arguments") or {}
    if settings:
        lines.append("Training arguments: " + ", ".join(f"`{k}={v}`" for k, v in settings.items()) + ".")
    sections += ["## Training", " ".join(lines)]

    splits = [split for split in ("validation", "test") if split in training]
    if splits:
        summaries = {split: _split_summary(pipeline_tag, training[split]) for split in splits}
        names = list(summaries[splits[0]])
        table = "| split | " + " | ".join(names) + " |\n|---|" + "---|" * len(names) + "\n" + "\n".join(
            f"| {split} | " + " | ".join(f"{summaries[split][n]:.4f}" for n in names) + " |" for split in splits
        )
        last = splits[-1]
        rows = _per_class_rows(pipeline_tag, training[last])
        kind = "entity type" if pipeline_tag == "token-classification" else "label"
        if rows:
            table += f"\n\nPer {kind}, {last}:\n\n| {kind} | precision | recall | F1 | support |\n"
            table += "|---|---|---|---|---|\n"
            table += "\n".join(
                f"| `{k}` | {v['precision']:.4f} | {v['recall']:.4f} | {v['f1']:.4f} | {v['support']} |"
                for k, v in rows.items()
            )
        if pipeline_tag == "token-classification":
            table += ("\n\nEntity scores are computed with seqeval (default mode: CoNLL `conlleval` chunk rules); "
                      "every metric comes from `metrics.json` of this run.")
        else:
            table += "\n\nEvery metric comes from `metrics.json` of this run."
        sections += ["## Results", table]

    weights = training.get("layer_weights")
    if weights:
        from .finetuning import layer_names

        names = layer_names(len(weights))
        text = ("The softmax-normalised weight this task learned for each biLM layer (Figure 2 of the ELMo paper): "
                + ", ".join(f"{n} {w:.3f}" for n, w in zip(names, weights))
                + (f"; scale gamma {training['gamma']:.3f}." if training.get("gamma") is not None else "."))
        if plot:
            text += f"\n\n![Learned ELMo layer weights]({plot})"
        sections += ["## Learned layer weights", text]
    return sections


def _eval_results(pipeline_tag: str, training: dict | None) -> list[EvalResult] | None:
    """model-index entries, only when the run used a Hub dataset (the Hub needs a dataset id for each result)."""
    if not training or not training.get("datasets"):
        return None
    dataset = training["datasets"][0]
    results = []
    for split in ("validation", "test"):
        if split not in training:
            continue
        for metric, value in _split_summary(pipeline_tag, training[split]).items():
            results.append(EvalResult(
                task_type=pipeline_tag, dataset_type=dataset, dataset_name=dataset,
                dataset_config=training.get("dataset_config"), dataset_split=split,
                metric_type={"token accuracy": "accuracy", "entity precision": "precision",
                             "entity recall": "recall", "entity F1": "f1", "macro F1": "f1"}.get(metric, metric),
                metric_name=metric, metric_value=round(float(value), 4),
            ))
    return results or None


def elmo_model_card(
    config: ElmoConfig,
    checksums: dict[str, dict[str, str]] | None = None,
    repo_id: str | None = None,
    license: str | None = None,
    training: dict | None = None,
    layer_weights_plot: str | None = None,
    pretraining: dict | None = None,
    perplexity_plot: str | None = None,
) -> ModelCard:
    """
    Card of any ELMo folder (base model or head). `checksums` maps role -> {"file", "sha256"} of the bilm-tf
    source files of a converted model (the content of `bilm_tf_source.json`); `repo_id` goes into the usage
    snippet; `license` is a Hub licence id (default `"other"`: the released ELMo weights state no licence).
    For a fine-tuned head, `training` is the run's `metrics.json` (metrics, layer weights, and the `base_model` and
    `datasets` Hub ids when the run had them) and `layer_weights_plot` the relative path of its plot, embedded.
    For a biLM of `hf-elmo pretrain`, `pretraining` is what the run recorded (`publish.read_pretraining`) and
    `perplexity_plot` the relative path of its held-out perplexity curve.
    """
    architecture = architecture_of(config)
    converted = bool(checksums)
    pipeline_tag = pipeline_tag_of(architecture)
    n_layers = config.num_lstm_layers + 1
    verification, verification_meta = _verification_section(checksums, pipeline_tag_of(architecture) in (
        "token-classification", "text-classification"))
    tags = ["elmo", "bilm", "hf_elmo", "custom_code"] + (["bilm-tf"] if converted else [])
    is_head = pipeline_tag in ("token-classification", "text-classification")
    eval_results = _eval_results(pipeline_tag, training) if is_head else None
    # A biLM pretrained on a Hub dataset links it; a local folder is nothing the Hub could link.
    corpus = (pretraining or {}).get("dataset") or {}
    pretrained_on = [corpus["name"]] if corpus.get("hub") else None
    data = ModelCardData(
        library_name="transformers",
        pipeline_tag=pipeline_tag,
        tags=tags,
        license=license or "other",
        base_model=(training or {}).get("base_model") if is_head else None,
        datasets=(training or {}).get("datasets") or None if is_head else pretrained_on,
        model_name=(repo_id or (training or {}).get("task") or architecture).split("/")[-1] if eval_results else None,
        eval_results=eval_results,
        hf_elmo={
            "architecture": architecture,
            "shape": shape_name(config),
            "hidden_size": config.hidden_size,
            "num_output_layers": n_layers,
            "stateless": True,
            "converted_from_bilm_tf": converted,
            **({"source_sha256": {role: c["sha256"] for role, c in checksums.items()}} if converted else {}),
            "verification": verification_meta,
            **({"labels": [config.id2label[i] for i in sorted(config.id2label)]} if is_head else {}),
            **({"task": training.get("task"),
                "layer_weights": [round(float(w), 4) for w in training.get("layer_weights") or []]}
               if is_head and training else {}),
            **({"pretraining": {key: pretraining.get(key) for key in (
                "train_files", "dataset", "step", "sentences_seen", "tokens_seen", "train_wall_s",
                "heldout_perplexity")}}
               if pretraining else {}),
        },
    )
    name = repo_id or "PATH_OR_REPO_ID"
    title = f"ELMo biLM `{shape_name(config)}`" + (" (converted from bilm-tf)" if converted else "")
    if architecture != "ElmoModel":
        title = f"{architecture} on the ELMo biLM `{shape_name(config)}`"

    sections = [
        f"# {title}",
        "Deep contextualized word representations (Peters et al., 2018) as a Transformers model, made with "
        "hf_elmo. The code is in this repository, so it loads with "
        "`trust_remote_code=True` without installing anything beyond `transformers`.",
    ]
    if converted:
        rows = "\n".join(f"| {role} | `{c['file']}` | `{c['sha256']}` |" for role, c in checksums.items())
        sections += [
            "## Source files",
            "Converted by hf_elmo from these bilm-tf files:\n\n| role | file | SHA-256 |\n|---|---|---|\n" + rows,
        ]
    sections += [
        "## Usage",
        _usage(config, architecture, name, n_layers),
        *(_finetuning_sections(config, pipeline_tag, training, layer_weights_plot) if is_head else []),
        *(_pretraining_sections(pretraining, perplexity_plot) if pretraining and not is_head else []),
        "## Outputs: the hidden-state layout",
        f"""For `W` input words, `last_hidden_state` is `(batch, W, {config.hidden_size})`: the top biLSTM layer as
`[forward; backward]`. With `output_hidden_states=True`, `hidden_states` holds {n_layers} tensors of that shape:
layer 0 is the context-free token layer (char CNN) duplicated as `[x; x]`, layer l (1..{config.num_lstm_layers})
is `[forward_l; backward_l]` of the l-th biLSTM layer. The model adds `<S>` and `</S>` itself, so output position
i is input word i; padded positions are zero (`word_mask` says which positions hold words).""",
        "## Using the layers for a task (scalar mix)",
        f"""ELMo's recipe for a downstream task is a learned scalar mix of all {n_layers} layers:
`gamma * sum_j softmax(w)_j * layer_j`, with one weight per layer (initialised to 0, so the mix starts as the
average) and a scale `gamma` (initialised to 1), trained with the task; optionally each layer is layer-normalised
over the unmasked words first. hf_elmo provides this as `ElmoScalarMix`; written out it is:

```python
weights = torch.nn.Parameter(torch.zeros({n_layers}))
gamma = torch.nn.Parameter(torch.ones(()))
mixed = gamma * (torch.softmax(weights, 0)[:, None, None, None] * layers).sum(0)  # (batch, words, {config.hidden_size})
```""",
        "## Stateless by default",
        """Every sentence starts from a zero LSTM state, so its vectors depend only on the sentence: never on the
other sentences of the batch, on padding, or on what was embedded before. bilm-tf (and AllenNLP's `Elmo`) were
stateful: each batch row's final LSTM state became the initial state of that row in the next batch. To reproduce
that, pass the state explicitly: `out = model(**batch, lstm_state=previous.lstm_state)` (request it on the first
batch with `return_lstm_state=True`).""",
        "## Fidelity to bilm-tf",
        verification,
        "## License",
        (
            f"This model is published under `{license}`. "
            if license and license != "other"
            else "The released ELMo weights carry no licence statement that we found, and none is assumed here. "
        )
        + "bilm-tf's code is Apache-2.0; hf_elmo is Apache-2.0. Check the terms of the source weights before "
        "redistributing.",
        "## Citation",
        f"```bibtex\n{_CITATION}\n```",
    ]
    return ModelCard(f"---\n{data.to_yaml()}\n---\n\n" + "\n\n".join(sections) + "\n")


def converted_model_card(config: ElmoConfig, checksums: dict[str, dict[str, str]]) -> ModelCard:
    """Card of a model converted from bilm-tf files; `checksums` maps role -> {"file", "sha256"}."""
    return elmo_model_card(config, checksums=checksums)
