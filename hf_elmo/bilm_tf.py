"""The bilm-tf file format, in one place: `options.json` <-> `ElmoConfig`, weights `.hdf5` <-> state dict.

Everything that is particular to bilm-tf's files lives here: dataset names, the `x @ W` layout (our
`nn.Linear` stores `W.T`), conv kernels `(1, width, char_dim, n_filters)`, the 261-row char embedding
without a padding row, LSTM `W_0` holding input rows then recurrent rows, and which parts are optional
(highway, char projection, LSTM projection). Both conversion directions use it.
"""

import json
import logging
import os
import re

import numpy as np
import torch

from .configuration_elmo import N_CHARACTERS, ElmoConfig
from . import tokenization_elmo
from .safe_output import check_room
from .text_encoding import first_line_not_utf8, foreign_encoding


logger = logging.getLogger(__name__)


class BilmTfFormatError(ValueError):
    """A bilm-tf options or weight file that does not have the expected content."""


# ------------------------------------------------------------------------------------------------
# options.json
# ------------------------------------------------------------------------------------------------
def read_options(path: str) -> dict:
    try:
        with open(path, encoding="utf-8") as f:
            return json.load(f)
    except FileNotFoundError:
        raise BilmTfFormatError(f"{path}: options file not found.") from None
    except json.JSONDecodeError as error:
        raise BilmTfFormatError(f"{path}: not valid JSON ({error}).") from None
    except UnicodeDecodeError:
        with open(path, "rb") as f:
            head = f.read(8)
        if foreign_encoding(head):  # saved as "Unicode" by an editor: text, in another encoding
            raise BilmTfFormatError(f"options file {first_line_not_utf8(path)}") from None
        # Binary: most often the weights file given as --options (the two swapped).
        hint = " It is an HDF5 file: are --options and --weights swapped?" if head == b"\x89HDF\r\n\x1a\n" else ""
        raise BilmTfFormatError(f"{path}: not an options file (binary, not UTF-8 JSON text).{hint}") from None


def config_from_options(options: dict, source: str = "options.json") -> ElmoConfig:
    """The `ElmoConfig` of a bilm-tf options dict; training-only keys are ignored."""

    def section(name: str) -> dict:
        value = options.get(name) if isinstance(options, dict) else None
        if not isinstance(value, dict):
            found = "missing" if value is None else f"a {type(value).__name__}"
            raise BilmTfFormatError(f"{source}: '{name}' must be a JSON object (section), but it is {found}.")
        return value

    def need(part: dict, name: str, key: str):
        if key not in part:
            raise BilmTfFormatError(f"{source}: missing required key '{name}.{key}'.")
        return part[key]

    char_cnn, lstm = section("char_cnn"), section("lstm")
    embedding = need(char_cnn, "char_cnn", "embedding")
    if not isinstance(embedding, dict):
        raise BilmTfFormatError(
            f"{source}: 'char_cnn.embedding' must be an object such as {{\"dim\": 16}}, got {embedding!r}."
        )
    activation = char_cnn.get("activation", "relu")
    if activation not in ("relu", "tanh"):
        raise BilmTfFormatError(f"{source}: char_cnn.activation is {activation!r}; bilm-tf supports 'relu' and 'tanh'.")
    try:
        return ElmoConfig(
            char_filters=need(char_cnn, "char_cnn", "filters"),
            n_highway=char_cnn.get("n_highway") or 0,
            char_embedding_dim=need(embedding, "char_cnn.embedding", "dim"),
            n_characters=char_cnn.get("n_characters", 262),
            max_characters_per_token=char_cnn.get("max_characters_per_token", 50),
            char_activation=activation,
            lstm_dim=need(lstm, "lstm", "dim"),
            projection_dim=need(lstm, "lstm", "projection_dim"),
            cell_clip=lstm.get("cell_clip"),
            proj_clip=lstm.get("proj_clip"),
            num_lstm_layers=lstm.get("n_layers", 1),
            use_skip_connections=bool(lstm.get("use_skip_connections", False)),
        )
    except BilmTfFormatError:
        raise
    except (ValueError, TypeError, KeyError) as error:
        raise BilmTfFormatError(f"{source}: {error}") from None


def options_from_config(config: ElmoConfig) -> dict:
    """bilm-tf `options.json` content (architecture keys only) for `config`."""
    lstm = {
        "dim": config.lstm_dim,
        "projection_dim": config.projection_dim,
        "n_layers": config.num_lstm_layers,
        "use_skip_connections": config.use_skip_connections,
    }
    if config.cell_clip is not None:
        lstm["cell_clip"] = config.cell_clip
    if config.proj_clip is not None:
        lstm["proj_clip"] = config.proj_clip
    char_cnn = {
        "activation": config.char_activation,
        "embedding": {"dim": config.char_embedding_dim},
        "filters": [list(f) for f in config.char_filters],
        "max_characters_per_token": config.max_characters_per_token,
        "n_characters": N_CHARACTERS,
        "n_highway": config.n_highway,
    }
    return {"lstm": lstm, "char_cnn": char_cnn}


# ------------------------------------------------------------------------------------------------
# weights .hdf5
# ------------------------------------------------------------------------------------------------
def _lstm_cell(direction: int, layer: int) -> str:
    return f"RNN_{direction}/RNN/MultiRNNCell/Cell{layer}/LSTMCell"


def weight_layout(config: ElmoConfig) -> list[tuple[str, tuple[int, ...], str, str]]:
    """
    Every dataset of a bilm-tf weight file for `config`: `(dataset, hdf5 shape, state-dict key, how)` where
    `how` says how the hdf5 array becomes the PyTorch tensor. LSTM `W_0` is split into two keys.
    """
    e, f, p, d = config.char_embedding_dim, config.n_filters, config.projection_dim, config.lstm_dim
    layout = [("char_embed", (N_CHARACTERS - 1, e), "char_encoder.char_embeddings.weight", "pad_row")]
    for i, (width, n) in enumerate(config.char_filters):
        layout.append((f"CNN/W_cnn_{i}", (1, width, e, n), f"char_encoder.convolutions.{i}.weight", "conv"))
        layout.append((f"CNN/b_cnn_{i}", (n,), f"char_encoder.convolutions.{i}.bias", "copy"))
    for k in range(config.n_highway):
        for part in ("carry", "transform"):
            prefix = f"char_encoder.highways.{k}.{part}"
            layout.append((f"CNN_high_{k}/W_{part}", (f, f), f"{prefix}.weight", "transpose"))
            layout.append((f"CNN_high_{k}/b_{part}", (f,), f"{prefix}.bias", "copy"))
    if f != p:
        layout.append(("CNN_proj/W_proj", (f, p), "char_encoder.projection.weight", "transpose"))
        layout.append(("CNN_proj/b_proj", (p,), "char_encoder.projection.bias", "copy"))
    for direction, stack in enumerate(("forward_layers", "backward_layers")):
        for layer in range(config.num_lstm_layers):
            cell, prefix = _lstm_cell(direction, layer), f"bilstm.{stack}.{layer}"
            layout.append((f"{cell}/W_0", (p + p, 4 * d), f"{prefix}.input_proj.weight", "w0_input"))
            layout.append((f"{cell}/W_0", (p + p, 4 * d), f"{prefix}.recurrent_proj.weight", "w0_recurrent"))
            layout.append((f"{cell}/B", (4 * d,), f"{prefix}.input_proj.bias", "copy"))
            if config.has_lstm_projection:
                layout.append((f"{cell}/W_P_0", (d, p), f"{prefix}.output_proj.weight", "transpose"))
    return layout


def dataset_to_tensor(array: np.ndarray, how: str, config: ElmoConfig) -> torch.Tensor:
    """One dataset of a weight file (an entry of `weight_layout`) as the PyTorch tensor it becomes."""
    tensor = torch.from_numpy(np.ascontiguousarray(array, dtype=np.float32))
    p = config.projection_dim
    if how == "copy":
        return tensor
    if how == "transpose":
        return tensor.t().contiguous()
    if how == "conv":  # (1, width, char_dim, n) -> (n, char_dim, width)
        return tensor[0].permute(2, 1, 0).contiguous()
    if how == "pad_row":  # ids are shifted by one: row 0 is the all-zero padded-word row
        return torch.cat([tensor.new_zeros(1, tensor.shape[1]), tensor])
    if how == "w0_input":
        return tensor[:p].t().contiguous()
    if how == "w0_recurrent":
        return tensor[p:].t().contiguous()
    raise AssertionError(how)


def read_weights(path: str, config: ElmoConfig, progress: bool = False) -> dict[str, torch.Tensor]:
    """Read a bilm-tf weight file into an `ElmoModel` state dict, checking every dataset's presence and shape."""
    import h5py
    from tqdm.auto import tqdm

    try:
        handle = h5py.File(path, "r")
    except FileNotFoundError:
        raise BilmTfFormatError(f"{path}: weight file not found.") from None
    except OSError as error:
        raise BilmTfFormatError(f"{path}: not a readable HDF5 file ({error}).") from None
    state_dict, arrays = {}, {}
    layout = weight_layout(config)
    with handle:
        for dataset, shape, key, how in tqdm(layout, desc=f"reading {os.path.basename(path)}", disable=not progress):
            if dataset not in arrays:
                node = handle.get(dataset)
                if node is None or not hasattr(node, "shape"):
                    raise BilmTfFormatError(
                        f"{path}: dataset '{dataset}' is missing (expected shape {shape}); the options file says "
                        "the model has it — do options and weights belong together?"
                    )
                if tuple(node.shape) != shape:
                    raise BilmTfFormatError(
                        f"{path}: dataset '{dataset}' has shape {tuple(node.shape)}, expected {shape} from the options."
                    )
                if not np.issubdtype(node.dtype, np.floating):
                    raise BilmTfFormatError(f"{path}: dataset '{dataset}' has dtype {node.dtype}, expected float32.")
                arrays[dataset] = node[...]
            state_dict[key] = dataset_to_tensor(arrays[dataset], how, config)
            if not torch.isfinite(state_dict[key]).all():
                raise BilmTfFormatError(f"{path}: dataset '{dataset}' contains NaN or infinite values.")
        expected = {dataset for dataset, *_ in layout}
        found = set()
        handle.visititems(lambda name, node: found.add(name) if hasattr(node, "shape") else None)
    unused = sorted(found - expected)
    # Layers, highways or filters beyond what the options describe: dropping them would write a smaller,
    # different model without a word, so it is an error. Anything else is not part of any bilm-tf model.
    dropped = [name for name in unused if _MODEL_DATASET.match(name)]
    if dropped:
        listed = ", ".join(dropped[:4]) + (f" and {len(dropped) - 4} more" if len(dropped) > 4 else "")
        raise BilmTfFormatError(
            f"{path}: holds weights the options leave out ({listed}); converting would drop them. Make the "
            "options match the weights (lstm.n_layers, char_cnn.n_highway, char_cnn.filters)."
        )
    if unused:
        logger.warning("%s: ignoring datasets the options do not describe: %s", path, ", ".join(unused))
    return state_dict


_MODEL_DATASET = re.compile(r"^(CNN/[Wb]_cnn_\d+|CNN_high_\d+/|CNN_proj/|RNN_\d+/RNN/MultiRNNCell/Cell\d+/)")


def write_weights(path: str, state_dict: dict[str, torch.Tensor], config: ElmoConfig) -> None:
    """Write an `ElmoModel` state dict as a bilm-tf weight file (float32, bilm-tf's dataset names and layouts)."""
    import h5py

    datasets: dict[str, np.ndarray] = {}
    p = config.projection_dim
    for dataset, shape, key, how in weight_layout(config):
        tensor = state_dict[key].detach().to("cpu", torch.float32)
        if not torch.isfinite(tensor).all():
            raise BilmTfFormatError(f"state dict key '{key}' contains NaN or infinite values; not exported.")
        if how == "copy":
            array = tensor.numpy()
        elif how == "transpose":
            array = tensor.t().numpy()
        elif how == "conv":
            array = tensor.permute(2, 1, 0).unsqueeze(0).numpy()
        elif how == "pad_row":
            array = tensor[1:].numpy()
        elif how in ("w0_input", "w0_recurrent"):
            w0 = datasets.setdefault(dataset, np.zeros(shape, dtype=np.float32))
            rows = slice(None, p) if how == "w0_input" else slice(p, None)
            w0[rows] = tensor.t().numpy()
            continue
        else:
            raise AssertionError(how)
        if array.shape != shape:
            raise BilmTfFormatError(f"state dict key '{key}' gives shape {array.shape} for '{dataset}', expected {shape}.")
        datasets[dataset] = array
    # HDF5 crashes (it does not raise) when the disk fills or a file-size limit is reached mid-write: check first.
    check_room(path, sum(array.size * 4 for array in datasets.values()) + (1 << 20))
    with h5py.File(path, "w") as handle:
        for dataset, array in datasets.items():
            handle.create_dataset(dataset, data=np.ascontiguousarray(array, dtype=np.float32))


def read_vocab(path: str) -> list[str]:
    """A bilm-tf vocabulary file: one word per line, most frequent first, with `<S>`, `</S>` and `<UNK>`."""
    try:
        words = tokenization_elmo.read_vocab(path)  # the file format's rules, shared with the tokenizer
    except FileNotFoundError:
        raise BilmTfFormatError(f"{path}: vocabulary file not found.") from None
    except IsADirectoryError:
        raise BilmTfFormatError(f"{path}: is a directory, expected a vocabulary file.") from None
    except UnicodeDecodeError:
        raise BilmTfFormatError(f"vocabulary file {first_line_not_utf8(path) or f'{path}: not UTF-8 text.'}") from None
    missing = tokenization_elmo.missing_special_words(words)
    if missing:
        raise BilmTfFormatError(
            f"{path}: vocabulary lacks {', '.join(missing)}; a bilm-tf vocabulary lists one word per line with "
            "<S>, </S> and <UNK> among them."
        )
    return words
