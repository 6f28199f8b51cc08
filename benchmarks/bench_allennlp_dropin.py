#!/usr/bin/env python
"""`hf_elmo.allennlp.ElmoEmbedder.embed_file` against AllenNLP 0.9.0's, on the same weights and words. ONE JSON line.

    python benchmarks/bench_allennlp_dropin.py --config original --n-sentences 256 --batch-size 64 --rounds 3

Both sides write `allennlp elmo`'s file (every layer, one dataset per sentence, `sentence_to_index`) for the same
sentences (real running text by default: the Wikipedia sample, split by the "ptb" pre-tokenizer, one sentence per
line) with the same random weights of a published shape (`random_bilm.py`), stateful as AllenNLP was:

- hf_elmo: `ElmoEmbedder(options, weights).embed_file(...)`, as a user calls it (the bilm-tf pair converted into
  its cache before timing);
- AllenNLP: its own `_ElmoBiLm` and `remove_sentence_boundaries` loaded from the 0.9.0 wheel (`allennlp_peer.py`),
  batched and written as its `ElmoEmbedder.embed_file` does (that method itself cannot run here: its
  `batch_to_ids` goes through AllenNLP's data classes, which the peer does not load), with the peer's char ids.

The sides alternate over --rounds rounds in one process (each side's state reset before each of its rounds);
tokens/s = words / the wall time of writing the whole file. The files' largest difference (every dataset) shows
that both computed the same numbers. Timings compare only within one run.
"""

import argparse
import atexit
import json
import os
import shutil
import statistics
import sys
import tempfile
import time

HERE = os.path.dirname(os.path.abspath(__file__))
REPO = os.path.dirname(HERE)
for _path in (HERE, REPO):
    if _path not in sys.path:
        sys.path.insert(0, _path)

import bench_utils  # noqa: E402
import random_bilm  # noqa: E402
import workload  # noqa: E402


def allennlp_embed_file(bilm, peer, sentences: list[list[str]], path: str, batch_size: int) -> None:
    """What AllenNLP's `ElmoEmbedder.embed_file` does with `--all`: its biLM, its boundary removal, its layout."""
    import h5py
    import torch
    from allennlp.nn.util import remove_sentence_boundaries

    index = {}
    with h5py.File(path, "w") as out, torch.no_grad():
        for start in range(0, len(sentences), batch_size):
            batch = sentences[start : start + batch_size]
            output = bilm(peer.char_ids(batch))
            layers = [remove_sentence_boundaries(layer, output["mask"]) for layer in output["activations"]]
            activations, mask = torch.cat([layer.unsqueeze(1) for layer, _ in layers], dim=1), layers[0][1]
            for row, sentence in enumerate(batch):
                key, length = str(start + row), int(mask[row].sum())
                vectors = activations[row, :, :length].numpy()
                out.create_dataset(key, vectors.shape, dtype="float32", data=vectors)
                index[" ".join(sentence)] = key
        out.create_dataset("sentence_to_index", (1,), dtype=h5py.special_dtype(vlen=str))[0] = json.dumps(index)


def largest_difference(ours: str, theirs: str) -> float:
    import h5py
    import numpy as np

    with h5py.File(ours, "r") as a, h5py.File(theirs, "r") as b:
        assert sorted(a.keys()) == sorted(b.keys())
        assert json.loads(a["sentence_to_index"][0]) == json.loads(b["sentence_to_index"][0])
        return max(float(np.abs(a[k][...] - b[k][...]).max(initial=0.0)) for k in a if k != "sentence_to_index")


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], epilog=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    random_bilm.add_weights_arguments(parser, default="original")
    workload.add_workload_arguments(parser)
    parser.add_argument("--rounds", type=int, default=3, help="alternated rounds per side (default: %(default)s)")
    parser.add_argument("--threads", type=int, default=2, help="torch threads (default: %(default)s)")
    args = parser.parse_args(argv)
    import torch

    torch.set_num_threads(args.threads)
    import allennlp_peer

    allennlp_peer.install(allennlp_peer.wheel_path())
    from allennlp.modules.elmo import _ElmoBiLm

    from hf_elmo.allennlp import ElmoEmbedder

    sentences, source = workload.sentences_from_args(parser, args)
    options, weights = random_bilm.ensure(args.config, args.cache_dir)
    work = tempfile.mkdtemp(prefix="bench_allennlp_dropin-")  # the text and both sides' files
    atexit.register(shutil.rmtree, work, True)
    os.environ.setdefault("HF_ELMO_CACHE", os.path.join(args.cache_dir, "hf_elmo_cache"))
    text = os.path.join(work, "sentences.txt")
    with open(text, "w", encoding="utf-8") as handle:
        handle.write("".join(" ".join(sentence) + "\n" for sentence in sentences))
    ours, theirs = ElmoEmbedder(options, weights), _ElmoBiLm(options, weights)
    words = sum(map(len, sentences))
    rates = {"hf_elmo": [], "allennlp": []}
    for round_index in range(args.rounds):
        order = ("allennlp", "hf_elmo") if round_index % 2 == 0 else ("hf_elmo", "allennlp")
        for side in order:
            path = os.path.join(work, f"{side}.hdf5")
            start = time.perf_counter()
            if side == "hf_elmo":
                ours.reset_states()
                ours.embed_file(text, path, batch_size=args.batch_size)
            else:
                theirs._elmo_lstm.reset_states()
                allennlp_embed_file(theirs, allennlp_peer, sentences, path, args.batch_size)
            rates[side].append(round(words / (time.perf_counter() - start), 1))
    ratios = [round(a / b, 2) for a, b in zip(rates["hf_elmo"], rates["allennlp"])]
    print(json.dumps({
        "benchmark": "allennlp_dropin_embed_file", "date_utc": time.strftime("%Y-%m-%d %H:%M", time.gmtime()),
        "config": args.config, "workload": source, "n_sentences": len(sentences), "n_words": words,
        "workload_sha1": workload.digest(sentences), "batch_size": args.batch_size, "threads": args.threads,
        "tokens_per_s": rates, "ratio_per_round": ratios,
        "ratio_of_medians": round(statistics.median(rates["hf_elmo"]) / statistics.median(rates["allennlp"]), 2),
        "max_abs_diff_vs_allennlp": largest_difference(os.path.join(work, "hf_elmo.hdf5"),
                                                       os.path.join(work, "allennlp.hdf5")),
        "cpu": bench_utils.cpu_description(), "torch": torch.__version__,
        "load_average_1min": round(os.getloadavg()[0], 2),
    }))


if __name__ == "__main__":
    main()
