#!/usr/bin/env python
"""hf_elmo end to end: convert bilm-tf ELMo files, load them with the Auto classes, embed sentences.

With no arguments it uses bilm-tf's own small test model (fetched once with pip from the allennlp 0.9.0
wheel, nothing else is downloaded), converts it to a Hugging Face folder, embeds a few sentences, and checks
the vectors against the outputs bilm-tf itself computed for that model.

    python examples/quickstart.py
    python examples/quickstart.py --options elmo_options.json --weights elmo_weights.hdf5 --output elmo-original \\
        --sentence "The bank raised rates ." --sentence "We sat on the river bank ."
"""

import argparse
import json
import logging
import os

import h5py
import numpy as np
import torch
from transformers import AutoModel, AutoTokenizer

import hf_elmo  # noqa: F401  (registers the ELMo Auto classes)
from hf_elmo.convert import convert_bilm_tf_to_hf
from hf_elmo.testing_utils import bilm_tf_fixture_dir


DEFAULT_SENTENCES = [
    "The bank raised its interest rates on Monday .",
    "They had a picnic on the river bank .",
    "Deep contextualized word representations , naïvely tokenized — with Unicode too .",
]


def check_against_bilm_tf(model, tokenizer, fixture) -> float:
    """Max |diff| of the top layer vs the outputs bilm-tf computed for its fixture model (10 batches, state carried)."""
    with open(fixture / "sentences.json", encoding="utf-8") as f:
        lists = json.load(f)
    expected = [h5py.File(fixture / f"lm_embeddings_{k}.hdf5", "r") for k in range(3)]
    state, worst = None, 0.0
    for i in range(10):
        words = [lists[k][i].split() for k in range(3)]
        batch = tokenizer(words, is_split_into_words=True, padding=True, return_tensors="pt")
        with torch.no_grad():
            output = model(**batch, lstm_state=state, return_lstm_state=True)
        state = output.lstm_state
        for k in range(3):
            target = np.concatenate([expected[k][str(i)][0], expected[k][str(i)][1]], axis=-1)
            worst = max(worst, float(np.abs(output.last_hidden_state[k, : len(words[k])].numpy() - target).max()))
    for handle in expected:
        handle.close()
    return worst


def main():
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--options", help="bilm-tf options.json (default: bilm-tf's test model)")
    parser.add_argument("--weights", help="bilm-tf weights .hdf5 (default: bilm-tf's test model)")
    parser.add_argument("--output", default=os.path.join("out", "elmo-bilm-tf-fixture"),
                        help="where to write the converted Hugging Face folder (default: %(default)s); an existing "
                        "conversion there is reused")
    parser.add_argument("--sentence", action="append", help="a sentence to embed (repeatable)")
    args = parser.parse_args()
    logging.basicConfig(level=logging.INFO, format="%(message)s")
    log = logging.getLogger("quickstart")

    fixture = None
    if not args.options:
        fixture = bilm_tf_fixture_dir()
        args.options, args.weights = str(fixture / "options.json"), str(fixture / "lm_weights.hdf5")
    elif not args.weights:
        parser.error("--weights is required with --options")
    if not os.path.exists(os.path.join(args.output, "model.safetensors")):
        convert_bilm_tf_to_hf(args.options, args.weights, args.output)
        log.info("Converted %s + %s -> %s", args.options, args.weights, args.output)

    tokenizer = AutoTokenizer.from_pretrained(args.output)
    model = AutoModel.from_pretrained(args.output).eval()
    config = model.config
    log.info("Loaded %s: %d LSTM layers of %d cells, projection %d, %d parameters",
             type(model).__name__, config.num_lstm_layers, config.lstm_dim, config.projection_dim, model.num_parameters())

    sentences = args.sentence or DEFAULT_SENTENCES
    batch = tokenizer(sentences, padding=True, return_offsets_mapping=True, return_tensors="pt")
    offsets = batch.pop("offset_mapping")
    with torch.no_grad():
        output = model(**batch, output_hidden_states=True)
    layers = torch.stack(output.hidden_states)  # (layers, batch, words, 2 * projection_dim)
    log.info("input_ids %s -> %d layers of %s", tuple(batch["input_ids"].shape), layers.shape[0],
             tuple(layers.shape[1:]))
    words = []
    for row, sentence in enumerate(sentences):
        n = int(batch["attention_mask"][row].sum())
        words.append([sentence[s:e] for s, e in offsets[row, :n].tolist()])
        log.info("sentence %d: %d words %s", row, n, words[-1])

    # ELMo's point: the token layer is context-free, the LSTM layers are not. Compare a word shared by two
    # sentences, layer by layer (cosine similarity 1.0 = identical vectors).
    shared = [w for w in dict.fromkeys(words[0]) if len(sentences) > 1 and w in words[1] and w.isalpha()]
    if shared:
        log.info("\ncosine similarity of the same word in sentences 0 and 1, per layer:")
        for word in shared:
            a, b = layers[:, 0, words[0].index(word)], layers[:, 1, words[1].index(word)]
            sims = torch.nn.functional.cosine_similarity(a, b, dim=-1).tolist()
            log.info("  %-12s %s", word, "  ".join(f"layer {j}: {v:.3f}" for j, v in enumerate(sims)))

    if fixture is not None:
        worst = check_against_bilm_tf(model, tokenizer, fixture)
        log.info("\nTop layer vs bilm-tf's own outputs for its test model: max |diff| = %.2e (%s)", worst,
                 "OK" if worst <= 1e-5 else "MISMATCH")
        if worst > 1e-5:
            raise SystemExit(1)


if __name__ == "__main__":
    main()
