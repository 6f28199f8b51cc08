"""AllenNLP 0.9's ELMo API on hf_elmo: change the import, keep the code and the numbers.

    from allennlp.modules.elmo import Elmo, batch_to_ids     ->  from hf_elmo.allennlp import Elmo, batch_to_ids
    from allennlp.commands.elmo import ElmoEmbedder          ->  from hf_elmo.allennlp import ElmoEmbedder

Every argument means what it meant in AllenNLP 0.9, and the numbers are AllenNLP's, quirks included:

- the biLM is stateful by default: each batch row starts from the LSTM state that the same row ended the previous
  batch with (the state kept for as many rows as the largest batch so far, new rows starting from zeros), so a
  sentence's vectors depend on what the object read before. `stateful=False` gives every sentence a zero state
  (deterministic vectors, hf_elmo's default elsewhere); `reset_states()` starts over;
- `do_layer_norm` normalises each layer over the whole batch (every unmasked element of every row, sentence
  boundaries included), not per sentence as `ElmoScalarMix(layer_norm=True)` does;
- each output representation mixes the layers with the `<S>`/`</S>` positions and then drops them
  (`keep_sentence_boundaries=False`); dropout applies in training mode only;
- `ElmoEmbedder` returns numpy `(3, words, dim)` per sentence and writes `allennlp elmo`'s HDF5 layout.

The computation is hf_elmo's own (`ElmoModel`, on whichever implementation the device selects), loaded from a
bilm-tf `options.json` + `.hdf5` pair (converted once into a cache, see `load_bilm`), a converted hf_elmo folder or
a Hub id.
"""

import hashlib
import json
import logging
import os
import urllib.request
from collections.abc import Iterable

import numpy as np
import torch
from torch import nn

from .configuration_elmo import char_id_rows
from .text_encoding import CONVERT_LATIN1, first_line_not_utf8, not_utf8_message


logger = logging.getLogger(__name__)

# The released "original" model, as AllenNLP named its files.
DEFAULT_OPTIONS_FILE = ("https://allennlp.s3.amazonaws.com/models/elmo/2x4096_512_2048cnn_2xhighway/"
                        "elmo_2x4096_512_2048cnn_2xhighway_options.json")
DEFAULT_WEIGHT_FILE = ("https://allennlp.s3.amazonaws.com/models/elmo/2x4096_512_2048cnn_2xhighway/"
                       "elmo_2x4096_512_2048cnn_2xhighway_weights.hdf5")
DEFAULT_BATCH_SIZE = 64
CHARACTERS_PER_TOKEN = 50  # AllenNLP's ELMoCharacterMapper.max_word_length


class ConfigurationError(ValueError):
    """What AllenNLP raised as `allennlp.common.checks.ConfigurationError` (blank input lines, duplicate keys), and an
    absent `cuda_device`."""


def cache_dir() -> str:
    """Where downloaded and converted bilm-tf files go: `$HF_ELMO_CACHE/allennlp` (`user_cache.user_cache_dir`), by
    default `~/.cache/hf_elmo/allennlp`. Move the folder and set HF_ELMO_CACHE to use it elsewhere."""
    from .user_cache import user_cache_dir

    return user_cache_dir("allennlp")


# ---------------------------------------------------------------------------------------------------------------
# Loading: bilm-tf files (local or URL), a converted folder or a Hub id
# ---------------------------------------------------------------------------------------------------------------
def _local_file(path_or_url: str) -> str:
    """A local path as it is; a URL downloaded once into `cache_dir()/downloads` (what AllenNLP's cached_path did),
    never with HF_HUB_OFFLINE set."""
    if not path_or_url.startswith(("http://", "https://")):
        if not os.path.isfile(path_or_url):
            raise FileNotFoundError(f"{path_or_url}: no such file.")
        return path_or_url
    target = os.path.join(cache_dir(), "downloads", path_or_url.rsplit("/", 1)[-1])
    if os.path.isfile(target):
        return target
    advice = (f"Download it yourself (curl -fLO {path_or_url}) and put it in {os.path.dirname(target)}, or pass the "
              "local path.")
    from huggingface_hub import constants

    if constants.is_offline_mode():  # HF_HUB_OFFLINE=1: no network request at all
        raise FileNotFoundError(f"{path_or_url}: not downloaded (HF_HUB_OFFLINE is set). {advice}")
    os.makedirs(os.path.dirname(target), exist_ok=True)
    partial = f"{target}.{os.getpid()}.partial"
    try:
        with urllib.request.urlopen(path_or_url, timeout=30) as response, open(partial, "wb") as out:
            for block in iter(lambda: response.read(1 << 20), b""):
                out.write(block)
        os.replace(partial, target)
    except OSError as error:
        if os.path.exists(partial):
            os.remove(partial)
        raise FileNotFoundError(
            f"{path_or_url}: cannot download it ({getattr(error, 'reason', None) or error}). {advice}") from None
    return target


def load_bilm(options_file: str | None, weight_file: str | None = None):
    """
    The `ElmoModel` that `options_file` and `weight_file` name: a bilm-tf pair (paths or URLs), converted once into
    `cache_dir()/converted-SHA` (keyed by both files' SHA-256) and loaded from its safetensors afterwards; or, with
    `weight_file` None, a converted hf_elmo folder or a Hub id in `options_file`.
    """
    from .convert import convert_bilm_tf_to_hf
    from .model_source import resolve_model
    from .modeling_elmo import ElmoModel
    from .run_record import sha256_of
    from .safe_output import fill_cache_once

    if options_file is None:
        raise ValueError("options_file is required (a bilm-tf options.json, a converted folder or a Hub id), "
                         "unless a module is given.")
    if weight_file is None:
        name, extra = resolve_model(options_file)
        return ElmoModel.from_pretrained(name, **extra)
    options, weights = _local_file(options_file), _local_file(weight_file)
    key = hashlib.sha256((sha256_of(options) + sha256_of(weights)).encode()).hexdigest()[:32]
    folder = os.path.join(cache_dir(), f"converted-{key}")

    def convert():
        logger.info("Converting %s and %s into %s (once)", options_file, weight_file, folder)
        convert_bilm_tf_to_hf(options, weights, folder, progress=False)

    # A second process converting the same files waits for the first, then loads what it wrote.
    fill_cache_once(cache_dir(), lambda: os.path.isfile(os.path.join(folder, "model.safetensors")), convert)
    return ElmoModel.from_pretrained(folder)


# ---------------------------------------------------------------------------------------------------------------
# Character ids
# ---------------------------------------------------------------------------------------------------------------
def batch_to_ids(batch: list[list[str]]) -> torch.Tensor:
    """
    AllenNLP's character ids of a batch of tokenised sentences, `(batch, longest sentence, 50)` int64: each word's
    UTF-8 bytes cut to 48, between begin- and end-of-word marks, padded, every id + 1 (ELMoCharacterMapper's
    scheme, which is bilm-tf's); shorter sentences are padded with all-zero rows. Tensors saved from AllenNLP's
    `batch_to_ids` feed `Elmo` unchanged.
    """
    if not isinstance(batch, (list, tuple)) or not all(isinstance(s, (list, tuple)) for s in batch):
        raise TypeError("batch_to_ids takes a list of sentences, each a list of words (strings).")
    for row, sentence in enumerate(batch):
        for position, word in enumerate(sentence):
            if not isinstance(word, str):
                raise TypeError(f"batch_to_ids: sentence {row}, word {position} is {word!r} ({type(word).__name__}), "
                                "not a string; each sentence is a list of words (strings).")
    longest = max((len(sentence) for sentence in batch), default=0)
    ids = np.zeros((len(batch), longest, CHARACTERS_PER_TOKEN), dtype=np.int64)
    for row, sentence in enumerate(batch):
        if sentence:
            ids[row, : len(sentence)] = char_id_rows(sentence, CHARACTERS_PER_TOKEN)
    return torch.from_numpy(ids)


# ---------------------------------------------------------------------------------------------------------------
# The biLM with AllenNLP's state, and its scalar mix
# ---------------------------------------------------------------------------------------------------------------
class StatefulBiLm(nn.Module):
    """
    `ElmoModel` as AllenNLP's `_ElmoBiLm` returned it: `{"activations": [token layer, LSTM layers...], "mask"}`,
    each `(batch, timesteps + 2, 2 * projection_dim)` with the `<S>`/`</S>` positions, and (stateful) the LSTM
    state carried from one call to the next, row by row.
    """

    def __init__(self, elmo, stateful: bool = True, requires_grad: bool = False,
                 vocab_to_cache: list[str] | None = None):
        super().__init__()
        self.elmo = elmo
        self.stateful = stateful
        self.elmo.requires_grad_(requires_grad)
        self._states = None  # (cell, hidden), (layers, 2, rows, dim): the rows of the largest batch so far
        # vocab_to_cache: AllenNLP looked `word_inputs` up in precomputed char-CNN vectors; the same vectors come
        # from the words' char ids (the "cpu" implementation computes each distinct word once a batch).
        self._vocab_char_ids = None
        if vocab_to_cache is not None:
            rows = char_id_rows(list(vocab_to_cache), CHARACTERS_PER_TOKEN)
            rows[0] = 0  # index 0 is padding, as in AllenNLP's vocabularies
            self._vocab_char_ids = torch.from_numpy(rows)

    @property
    def num_layers(self) -> int:
        return self.elmo.config.num_lstm_layers + 1

    def get_output_dim(self) -> int:
        return 2 * self.elmo.config.projection_dim

    def reset_states(self, mask: torch.Tensor | None = None) -> None:
        """Forget the carried state: of every row, or of the rows where `mask` (one entry per kept row) is true."""
        if mask is None or self._states is None:
            self._states = None
            return
        if mask.shape[0] != self._states[0].shape[2]:
            raise ValueError(f"reset_states: the mask has {mask.shape[0]} rows, the state {self._states[0].shape[2]}.")
        keep = (~mask.bool()).to(self._states[0].dtype).view(1, 1, -1, 1).to(self._states[0].device)
        self._states = tuple(state * keep for state in self._states)

    def char_ids_of(self, inputs: torch.Tensor, word_inputs: torch.Tensor | None) -> torch.Tensor:
        if word_inputs is None or self._vocab_char_ids is None:
            return inputs
        if int(word_inputs.min()) < 0 or int(word_inputs.max()) >= len(self._vocab_char_ids):
            return inputs  # as AllenNLP: words outside the cache are read from their characters
        return self._vocab_char_ids.to(word_inputs.device)[word_inputs]

    def forward(self, inputs: torch.Tensor, word_inputs: torch.Tensor | None = None) -> dict:
        char_ids = self.char_ids_of(inputs, word_inputs)
        rows = char_ids.shape[0]
        initial = None
        if self.stateful and self._states is not None:
            kept = self._states[0].shape[2]
            if rows > kept:  # new rows start from zeros, and are kept from now on
                self._states = tuple(torch.cat([s, s.new_zeros(*s.shape[:2], rows - kept, s.shape[3])], dim=2)
                                     for s in self._states)
            initial = tuple(s[:, :, :rows] for s in self._states)
        output = self.elmo(char_ids, attention_mask=char_ids.ne(0).any(-1).long(), output_hidden_states=True,
                           keep_sentence_boundaries=True, lstm_state=initial, return_lstm_state=self.stateful)
        if self.stateful:
            final = tuple(s.detach() for s in output.lstm_state)
            if self._states is None or self._states[0].shape[2] == rows:
                self._states = final
            else:  # rows past this batch keep their state
                self._states = tuple(torch.cat([new, old[:, :, rows:]], dim=2) for new, old in zip(final, self._states))
        return {"activations": list(output.hidden_states), "mask": output.word_mask.long()}


class ScalarMix(nn.Module):
    """
    AllenNLP's `ScalarMix`: `gamma * sum_k softmax(s)_k * layer_k`; with `do_layer_norm`, each layer is first
    normalised with one mean and variance over all its unmasked elements in the batch. Parameters named as
    AllenNLP's (`gamma`, `scalar_parameters.K`), so a task model's saved mix loads.
    """

    def __init__(self, mixture_size: int, do_layer_norm: bool = False,
                 initial_scalar_parameters: list[float] | None = None, trainable: bool = True):
        super().__init__()
        initial = [0.0] * mixture_size if initial_scalar_parameters is None else list(initial_scalar_parameters)
        if len(initial) != mixture_size:
            raise ConfigurationError(f"scalar_mix_parameters has {len(initial)} values for {mixture_size} layers.")
        self.do_layer_norm = do_layer_norm
        self.scalar_parameters = nn.ParameterList(
            [nn.Parameter(torch.tensor([float(value)]), requires_grad=trainable) for value in initial])
        self.gamma = nn.Parameter(torch.tensor([1.0]), requires_grad=trainable)

    def forward(self, tensors: list[torch.Tensor], mask: torch.Tensor | None = None) -> torch.Tensor:
        weights = torch.softmax(torch.cat(list(self.scalar_parameters)), dim=0)
        if self.do_layer_norm:
            mask = mask.to(tensors[0].dtype).unsqueeze(-1)
            count = mask.sum() * tensors[0].shape[-1]
            normed = []
            for tensor in tensors:
                mean = (tensor * mask).sum() / count
                variance = (((tensor * mask) - mean) * mask).pow(2).sum() / count
                normed.append((tensor - mean) / torch.sqrt(variance + 1e-12))
            tensors = normed
        return self.gamma * sum(weight * tensor for weight, tensor in zip(weights, tensors))


def remove_sentence_boundaries(tensor: torch.Tensor, mask: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """`(batch, timesteps + 2, dim)` with `<S>`/`</S>` -> `(batch, timesteps, dim)` of the words alone, zero past each
    sentence, and its mask."""
    lengths = mask.sum(dim=1, keepdim=True) - 2
    word_mask = (torch.arange(tensor.shape[1] - 2, device=tensor.device) < lengths).long()
    return tensor[:, 1:-1] * word_mask.unsqueeze(-1).to(tensor.dtype), word_mask


# ---------------------------------------------------------------------------------------------------------------
# Elmo and ElmoEmbedder
# ---------------------------------------------------------------------------------------------------------------
class Elmo(nn.Module):
    """
    AllenNLP 0.9's `Elmo`: `num_output_representations` scalar mixes of the biLM's layers, for a task model.
    `forward(inputs, word_inputs=None)` takes `batch_to_ids` output `(batch, timesteps, 50)` (or 4-D `(batch, n,
    timesteps, 50)`) and returns `{"elmo_representations": [(batch, timesteps, dim)] * n, "mask": (batch,
    timesteps)}`. `options_file`/`weight_file`: a bilm-tf pair (paths or URLs), or a converted folder or Hub id in
    `options_file` with `weight_file` None; `module`: an `ElmoModel` instead (both files None). `stateful` (True, as
    AllenNLP) carries the LSTM state between calls.
    """

    def __init__(self, options_file: str | None, weight_file: str | None, num_output_representations: int,
                 requires_grad: bool = False, do_layer_norm: bool = False, dropout: float = 0.5,
                 vocab_to_cache: list[str] | None = None, keep_sentence_boundaries: bool = False,
                 scalar_mix_parameters: list[float] | None = None, module: nn.Module | None = None,
                 stateful: bool = True):
        super().__init__()
        if module is not None and (options_file is not None or weight_file is not None):
            raise ConfigurationError("Don't provide options_file or weight_file with module.")
        elmo = module if module is not None else load_bilm(options_file, weight_file)
        self._elmo_lstm = StatefulBiLm(elmo, stateful=stateful, requires_grad=requires_grad,
                                       vocab_to_cache=vocab_to_cache)
        self._has_cached_vocab = vocab_to_cache is not None
        self._keep_sentence_boundaries = keep_sentence_boundaries
        self._dropout = nn.Dropout(p=dropout)
        self._scalar_mixes = []
        for k in range(num_output_representations):
            mix = ScalarMix(self._elmo_lstm.num_layers, do_layer_norm=do_layer_norm,
                            initial_scalar_parameters=scalar_mix_parameters, trainable=scalar_mix_parameters is None)
            self.add_module(f"scalar_mix_{k}", mix)
            self._scalar_mixes.append(mix)

    def get_output_dim(self) -> int:
        return self._elmo_lstm.get_output_dim()

    def reset_states(self, mask: torch.Tensor | None = None) -> None:
        self._elmo_lstm.reset_states(mask)

    def forward(self, inputs: torch.Tensor, word_inputs: torch.Tensor | None = None) -> dict:
        shape = inputs.shape
        if inputs.dim() > 3:
            inputs = inputs.reshape(-1, *shape[-2:])
        if word_inputs is not None and word_inputs.dim() > 2:
            word_inputs = word_inputs.reshape(-1, word_inputs.shape[-1])
        bilm = self._elmo_lstm(inputs, word_inputs)
        layers, mask_with_boundaries = bilm["activations"], bilm["mask"]
        representations, mask = [], mask_with_boundaries
        for mix in self._scalar_mixes:
            mixed = mix(layers, mask_with_boundaries)
            if not self._keep_sentence_boundaries:
                mixed, mask = remove_sentence_boundaries(mixed, mask_with_boundaries)
            representations.append(self._dropout(mixed))
        if len(shape) > 3:
            mask = mask.view(*shape[:-2], -1)
            representations = [r.view(*shape[:-2], -1, r.shape[-1]) for r in representations]
        return {"elmo_representations": representations, "mask": mask}


def read_sentences(input_file) -> list[str]:
    """`embed_file`'s input: the stripped lines of an open text file (closed after) or a path (UTF-8); a blank line
    is a `ConfigurationError`, as in AllenNLP, and so is text that is not UTF-8 (naming the line, for a file)."""
    if isinstance(input_file, (str, os.PathLike)):
        sentences = []
        with open(input_file, "rb") as handle:
            for number, raw in enumerate(handle, start=1):
                try:
                    sentences.append(raw.decode("utf-8").strip())
                except UnicodeDecodeError as error:
                    raise ConfigurationError(
                        not_utf8_message(os.fspath(input_file), f"{input_file}, line {number}", raw, error)) from None
    else:
        try:
            sentences = [line.strip() for line in input_file]
        except UnicodeDecodeError as error:
            name = getattr(input_file, "name", None)  # an open file names its path: find the line there
            found = first_line_not_utf8(name) if isinstance(name, str) and os.path.isfile(name) else None
            raise ConfigurationError(found or f"{name or 'the input'}: not UTF-8 text ({error.reason}); "
                                     f"{CONVERT_LATIN1}") from None
        finally:
            input_file.close()
    blank = [i for i, sentence in enumerate(sentences) if sentence == ""]
    if blank:
        raise ConfigurationError(f"Your input file contains empty lines at indexes {blank}. Please remove them.")
    return sentences


def _device(cuda_device: int) -> torch.device:
    if cuda_device < 0:
        return torch.device("cpu")
    available = torch.cuda.device_count() if torch.cuda.is_available() else 0
    if cuda_device >= available:
        raise ConfigurationError(f"cuda_device {cuda_device}: this machine has {available} CUDA GPU(s) that torch can "
                                 "use; pass -1 for the CPU.")
    return torch.device("cuda", cuda_device)


class ElmoEmbedder:
    """
    AllenNLP 0.9's `ElmoEmbedder` (`allennlp.commands.elmo`): every biLM layer of tokenised sentences, as numpy
    `(3, words, dim)` arrays, stateful as there. `cuda_device` -1 is the CPU, N the N-th GPU.
    """

    def __init__(self, options_file: str = DEFAULT_OPTIONS_FILE, weight_file: str | None = DEFAULT_WEIGHT_FILE,
                 cuda_device: int = -1, stateful: bool = True):
        self.device = _device(cuda_device)
        self.cuda_device = cuda_device
        self.elmo_bilm = StatefulBiLm(load_bilm(options_file, weight_file), stateful=stateful).to(self.device)

    def reset_states(self) -> None:
        self.elmo_bilm.reset_states()

    def empty_embedding(self) -> np.ndarray:
        return np.zeros((self.elmo_bilm.num_layers, 0, self.elmo_bilm.get_output_dim()))

    def batch_to_embeddings(self, batch: list[list[str]]) -> tuple[torch.Tensor, torch.Tensor]:
        """`(batch, 3, timesteps, dim)` activations without the sentence boundaries, and the `(batch, timesteps)`
        mask."""
        with torch.no_grad():
            bilm = self.elmo_bilm(batch_to_ids(batch).to(self.device))
        layers = [remove_sentence_boundaries(layer, bilm["mask"]) for layer in bilm["activations"]]
        return torch.stack([layer for layer, _ in layers], dim=1), layers[0][1]

    def embed_sentence(self, sentence: list[str]) -> np.ndarray:
        return self.embed_batch([sentence])[0]

    def embed_batch(self, batch: list[list[str]]) -> list[np.ndarray]:
        if batch == [[]]:
            return [self.empty_embedding()]
        embeddings, mask = self.batch_to_embeddings(batch)
        lengths = mask.sum(dim=1).tolist()
        return [embeddings[i, :, :length].cpu().numpy() if length else self.empty_embedding()
                for i, length in enumerate(lengths)]

    def embed_sentences(self, sentences: Iterable[list[str]], batch_size: int = DEFAULT_BATCH_SIZE):
        batch = []
        for sentence in sentences:
            batch.append(sentence)
            if len(batch) == batch_size:
                yield from self.embed_batch(batch)
                batch = []
        if batch:
            yield from self.embed_batch(batch)

    def embed_file(self, input_file, output_file_path: str, output_format: str = "all",
                   batch_size: int = DEFAULT_BATCH_SIZE, forget_sentences: bool = False,
                   use_sentence_keys: bool = False) -> None:
        """
        `allennlp elmo`'s output: one dataset per line of `input_file` (an open text file or a path; one sentence per
        line, split on whitespace), named by its 0-based line index (or by the sentence with
        `use_sentence_keys`), holding `(3, words, dim)` (`output_format` "all"), the top layer or the layers'
        average; and, unless `forget_sentences` or `use_sentence_keys`, a `sentence_to_index` dataset holding the
        JSON map of each sentence to its key. A blank line is an error. The file appears only when complete.
        """
        import h5py
        from tqdm.auto import tqdm

        from .safe_output import ALLENNLP_LAYOUT_MARK, atomic_output_file

        if output_format not in ("all", "top", "average"):
            raise ConfigurationError(f"output_format must be 'all', 'top' or 'average', got {output_format!r}.")
        sentences = read_sentences(input_file)
        embedded = self.embed_sentences([sentence.split() for sentence in sentences], batch_size)
        if use_sentence_keys:
            logger.warning("Using sentences as keys can fail if sentences contain forward slashes or colons. Use "
                           "with caution.")
            keyed = zip(sentences, embedded)
        else:
            keyed = ((str(i), vectors) for i, vectors in enumerate(embedded))
        sentence_to_index = {}
        with atomic_output_file(output_file_path, replace=True) as partial, h5py.File(partial, "w") as out:
            for key, vectors in tqdm(keyed, total=len(sentences), desc="embedding", unit="sentence"):
                if use_sentence_keys and key in out:
                    raise ConfigurationError(f"Key already exists in {output_file_path}. To encode duplicate "
                                             "sentences, do not pass the --use-sentence-keys flag.")
                if not forget_sentences and not use_sentence_keys:
                    sentence_to_index[sentences[int(key)]] = key
                if output_format == "top":
                    vectors = vectors[-1]
                elif output_format == "average":
                    vectors = np.average(vectors, axis=0)
                out.create_dataset(str(key), vectors.shape, dtype="float32", data=vectors)
            if not forget_sentences and not use_sentence_keys:
                index = out.create_dataset("sentence_to_index", (1,), dtype=h5py.special_dtype(vlen=str))
                index[0] = json.dumps(sentence_to_index)
            out.attrs["written_by"] = ALLENNLP_LAYOUT_MARK  # lets --overwrite replace it; no dataset of the layout


__all__ = ["DEFAULT_OPTIONS_FILE", "DEFAULT_WEIGHT_FILE", "ConfigurationError", "Elmo", "ElmoEmbedder", "ScalarMix",
           "batch_to_ids", "load_bilm", "remove_sentence_boundaries"]
