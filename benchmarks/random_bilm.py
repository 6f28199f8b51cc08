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
    """Draw every dataset bilm-tf's dump_weights writes, with fan-in scaled normals and zero biases."""
    import h5py
    import numpy as np

    rng = np.random.default_rng(seed)
    cnn, lstm = options["char_cnn"], options["lstm"]
    char_dim = cnn["embedding"]["dim"]
    n_filters = sum(n for _, n in cnn["filters"])
    cell, proj = lstm["dim"], lstm["projection_dim"]

    def scaled(shape, fan_in, gain=1.0):
        return (rng.standard_normal(shape, dtype=np.float32) * np.float32(gain / fan_in**0.5)).astype(np.float32)

    def zeros(n):
        return np.zeros(n, np.float32)

    partial = f"{path}.partial-{os.getpid()}"
    with h5py.File(partial, "w") as f:
        # 261 rows: the file has no padding row (the model prepends it).
        f["char_embed"] = rng.uniform(-1.0, 1.0, (cnn["n_characters"] - 1, char_dim)).astype(np.float32)
        for i, (width, n) in enumerate(cnn["filters"]):
            f[f"CNN/W_cnn_{i}"] = scaled((1, width, char_dim, n), width * char_dim, gain=2**0.5)
            f[f"CNN/b_cnn_{i}"] = zeros(n)
        for k in range(cnn["n_highway"]):
            f[f"CNN_high_{k}/W_carry"] = scaled((n_filters, n_filters), n_filters)
            f[f"CNN_high_{k}/b_carry"] = zeros(n_filters)
            f[f"CNN_high_{k}/W_transform"] = scaled((n_filters, n_filters), n_filters)
            f[f"CNN_high_{k}/b_transform"] = zeros(n_filters)
        if n_filters != proj:
            f["CNN_proj/W_proj"] = scaled((n_filters, proj), n_filters)
            f["CNN_proj/b_proj"] = zeros(proj)
        for direction in range(2):
            for layer in range(lstm["n_layers"]):
                prefix = f"RNN_{direction}/RNN/MultiRNNCell/Cell{layer}/LSTMCell"
                # Rows: the layer's input (proj wide: the token embedding or the layer below), then m_prev.
                f[f"{prefix}/W_0"] = scaled((2 * proj, 4 * cell), 2 * proj)
                f[f"{prefix}/B"] = zeros(4 * cell)
                if proj < cell:
                    f[f"{prefix}/W_P_0"] = scaled((cell, proj), cell)
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
