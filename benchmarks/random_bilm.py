"""Random ELMo weights of the published shapes, written as bilm-tf writes weights (options.json + .hdf5).

Speed does not depend on what the weights are, only on their shapes, so the benchmarks need no download of
the released models. Written in bilm-tf's own layout, one file serves both sides of a comparison: AllenNLP
reads it with its loaders, hf_elmo converts it with its converter. The values come from numpy's PCG64 with a
fixed seed, so every machine writes the same file.

    python benchmarks/random_bilm.py --config small [--dir DIR]    # prints the two paths
"""

import argparse
import json
import os


# The published architectures (bilm-tf's options.json, "lstm" and "char_cnn" parts), plus "tiny" for smoke tests.
PUBLISHED_FILTERS = [[1, 32], [2, 32], [3, 64], [4, 128], [5, 256], [6, 512], [7, 1024]]


def _options(lstm_dim: int, projection_dim: int, n_highway: int, filters=PUBLISHED_FILTERS, char_dim: int = 16):
    return {
        "lstm": {"n_layers": 2, "dim": lstm_dim, "projection_dim": projection_dim, "cell_clip": 3, "proj_clip": 3,
                 "use_skip_connections": True},
        "char_cnn": {"filters": filters, "n_highway": n_highway, "activation": "relu",
                     "embedding": {"dim": char_dim}, "n_characters": 262, "max_characters_per_token": 50},
    }


CONFIGS = {
    "tiny": _options(32, 16, 1, filters=[[1, 8], [2, 8], [3, 16]], char_dim=4),  # 2x32_16_32cnn_1xhighway
    "small": _options(1024, 128, 1),  # elmo_2x1024_128_2048cnn_1xhighway
    "medium": _options(2048, 256, 1),  # elmo_2x2048_256_2048cnn_1xhighway
    "original": _options(4096, 512, 2),  # elmo_2x4096_512_2048cnn_2xhighway (also the 5.5B retrain)
}

# Bump when the way values are drawn changes, so that cached files of the old kind are not reused.
FORMAT_VERSION = 1


def default_dir() -> str:
    """$HF_ELMO_BENCH_CACHE, default ~/.cache/hf_elmo_bench."""
    return os.environ.get("HF_ELMO_BENCH_CACHE", os.path.join(os.path.expanduser("~"), ".cache", "hf_elmo_bench"))


def write_weights(path: str, options: dict, seed: int = 0):
    """
    Draw every dataset of bilm-tf's weight file (`hf_elmo.bilm_tf.weight_layout`, in its order): fan-in scaled
    normals (gain sqrt(2) for the char convolutions), uniform char embeddings and zero biases; written with
    hf_elmo's own bilm-tf writer, into a partial file renamed into place.
    """
    import numpy as np

    from hf_elmo import bilm_tf

    config = bilm_tf.config_from_options(options)
    rng = np.random.default_rng(seed)
    arrays, state_dict = {}, {}
    for dataset, shape, key, how in bilm_tf.weight_layout(config):
        if dataset not in arrays:  # W_0 is two entries (input and recurrent rows), drawn once
            if dataset == "char_embed":
                arrays[dataset] = rng.uniform(-1.0, 1.0, shape).astype(np.float32)
            elif len(shape) == 1:
                arrays[dataset] = np.zeros(shape, np.float32)
            else:
                fan_in = int(np.prod(shape[:-1]))
                gain = 2**0.5 if dataset.startswith("CNN/W_cnn") else 1.0
                arrays[dataset] = (rng.standard_normal(shape, dtype=np.float32) * np.float32(gain / fan_in**0.5)).astype(np.float32)
        state_dict[key] = bilm_tf.dataset_to_tensor(arrays[dataset], how, config)
    partial = f"{path}.partial-{os.getpid()}"
    bilm_tf.write_weights(partial, state_dict, config)
    os.replace(partial, path)


def ensure(config: str, directory: str | None = None, seed: int = 0) -> tuple[str, str]:
    """(options.json, weights.hdf5) of `config`'s random weights under `directory`, written on first use."""
    directory = directory or default_dir()
    os.makedirs(directory, exist_ok=True)
    stem = os.path.join(directory, f"{config}_random_seed{seed}_v{FORMAT_VERSION}")
    options_path, weights_path = stem + "_options.json", stem + "_weights.hdf5"
    if not os.path.exists(weights_path):
        write_weights(weights_path, CONFIGS[config], seed)
    text = json.dumps(CONFIGS[config], indent=1)
    if not os.path.exists(options_path) or open(options_path, encoding="utf-8").read() != text:
        partial = f"{options_path}.partial-{os.getpid()}"
        with open(partial, "w", encoding="utf-8") as handle:
            handle.write(text)
        os.replace(partial, options_path)
    return options_path, weights_path


def add_weights_arguments(parser, default: str = "small", cache_dir: bool = True) -> None:
    """The options that pick a benchmark's random weights: --config, and where they are kept (--cache-dir)."""
    parser.add_argument("--config", choices=sorted(CONFIGS), default=default,
                        help=f"random weights of this published shape: small 2x1024_128, medium 2x2048_256, original "
                             f"2x4096_512 (all 2048cnn), tiny for smoke tests (default {default})")
    if cache_dir:
        parser.add_argument("--cache-dir", default=default_dir(),
                            help="random weights and converted folders (default $HF_ELMO_BENCH_CACHE or "
                                 "~/.cache/hf_elmo_bench)")


def architecture_name(options: dict) -> str:
    """bilm-tf's naming: 2x4096_512_2048cnn_2xhighway."""
    lstm, cnn = options["lstm"], options["char_cnn"]
    n_filters = sum(n for _, n in cnn["filters"])
    return f"{lstm['n_layers']}x{lstm['dim']}_{lstm['projection_dim']}_{n_filters}cnn_{cnn.get('n_highway', 0)}xhighway"


def main():
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--config", choices=sorted(CONFIGS), default="small")
    parser.add_argument("--dir", default=None, help="where to write (default $HF_ELMO_BENCH_CACHE or ~/.cache/hf_elmo_bench)")
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args()
    print(*ensure(args.config, args.dir, args.seed))


if __name__ == "__main__":
    main()
