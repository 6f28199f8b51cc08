"""ELMo configuration: the character-id scheme shared by the tokenizer and the model, the config, and the registry
of implementations its `elmo_implementation` names."""

import functools
import importlib
from collections.abc import Callable
from dataclasses import dataclass

import numpy as np
import torch
from transformers import PreTrainedConfig


def package_module(name: str):
    """
    The module `name` of the package this file is in (hf_elmo, or the copy `benchmarks/ab_cpu_implementation.py`
    loads), or None where it lacks it: a saved folder's copy of the code, loaded with trust_remote_code=True.
    Transformers copies into a saved folder only the files that relative `import` statements reach, so a folder
    ships what loading and the reference computation need (this file, the model, the tokenizer, the pipeline);
    what is imported this way comes with `pip install hf-elmo`. (tests/test_import_graph.py counts these imports.)
    """
    try:
        return importlib.import_module(f".{name}", __package__)
    except ModuleNotFoundError:
        return None


def require_hf_elmo(feature: str, present) -> None:
    """One line where a feature that comes with `pip install hf-elmo` is asked of a copy that lacks it."""
    if present is None:
        raise ImportError(f"{feature}: part of the hf_elmo package, not of a saved folder's code. `pip install "
                          "hf-elmo`, then load the model after `import hf_elmo` and without trust_remote_code.")


# ---------------------------------------------------------------------------------------------
# The character-id scheme of bilm-tf. A word is its UTF-8 bytes (ids 0-255) cut to
# `max_characters_per_token - 2` bytes, wrapped in begin/end-of-word marks and padded. Every id
# is then shifted by +1 so that an all-zero row can mean "no word here" (a padded position).
# ---------------------------------------------------------------------------------------------
BEGIN_SENTENCE_CHAR = 256
END_SENTENCE_CHAR = 257
BEGIN_WORD_CHAR = 258
END_WORD_CHAR = 259
PAD_CHAR = 260
CHAR_ID_SHIFT = 1
# bilm-tf maps these literal words to the sentence-boundary rows (its vocab files contain them).
BEGIN_SENTENCE_WORD = "<S>"
END_SENTENCE_WORD = "</S>"


# The sentence-boundary words' rows hold one special character instead of their bytes.
_BOUNDARY_CHARS = {BEGIN_SENTENCE_WORD: BEGIN_SENTENCE_CHAR, END_SENTENCE_WORD: END_SENTENCE_CHAR}


def word_byte_limit(max_characters_per_token: int = 50) -> int:
    """How many UTF-8 bytes of a word its char row holds: all but the begin- and end-of-word marks (48 of 50)."""
    return max_characters_per_token - 2


def word_is_cut(word: str, max_characters_per_token: int = 50) -> bool:
    """Whether `word` has more UTF-8 bytes than its char row holds (at most 4 a character: few words are encoded)."""
    limit = word_byte_limit(max_characters_per_token)
    return 4 * len(word) > limit and len(word.encode("utf-8", errors="ignore")) > limit


def quoted_word(word: str) -> str:
    """How messages show a word, maybe a cut one: its first 40 characters, then "..." where it has more."""
    return repr(word if len(word) <= 40 else word[:40] + "...")


def char_id_rows(words, max_characters_per_token: int = 50) -> np.ndarray:
    """
    The (shifted) char-id rows of `words`, `(len(words), max_characters_per_token)` int64, exactly as bilm-tf
    builds them: each word's UTF-8 bytes cut to `max_characters_per_token - 2` (a byte cut, as in bilm-tf: it may
    split a multi-byte character, which is what the released weights were trained on; lone surrogates cannot be
    encoded and are dropped), framed by begin/end-of-word marks and padded; `<S>` and `</S>` get the
    sentence-boundary rows. Built with array operations, so that a batch's words cost one call.
    """
    words = list(words)
    encoded = [word.encode("utf-8", errors="ignore")[: word_byte_limit(max_characters_per_token)] for word in words]
    lengths = np.fromiter(map(len, encoded), dtype=np.int64, count=len(encoded))
    rows = np.full((len(encoded), max_characters_per_token), PAD_CHAR, dtype=np.int64)
    rows[:, 0] = BEGIN_WORD_CHAR
    flat = np.frombuffer(b"".join(encoded), dtype=np.uint8).astype(np.int64)
    which_word = np.repeat(np.arange(len(encoded)), lengths)
    first_byte = np.repeat(np.cumsum(lengths) - lengths, lengths)
    rows[which_word, np.arange(flat.size) - first_byte + 1] = flat
    rows[np.arange(len(encoded)), lengths + 1] = END_WORD_CHAR
    for index, word in enumerate(words):
        if word in _BOUNDARY_CHARS:
            rows[index, 1:3] = (_BOUNDARY_CHARS[word], END_WORD_CHAR)
            rows[index, 3:] = PAD_CHAR
    return rows + CHAR_ID_SHIFT


def word_to_char_ids(word: str, max_characters_per_token: int = 50) -> list[int]:
    """The (shifted) char-id row of one word (`char_id_rows` of one word)."""
    return char_id_rows([word], max_characters_per_token)[0].tolist()


def char_ids_to_word(row, max_characters_per_token: int = 50) -> str:
    """Inverse of `word_to_char_ids` (lossy past the byte cut); an all-zero row gives ''."""
    ids = [int(c) - CHAR_ID_SHIFT for c in row]
    if not ids or ids[0] != BEGIN_WORD_CHAR:
        return ""
    inner = []
    for c in ids[1:]:
        if c == END_WORD_CHAR:
            break
        inner.append(c)
    if inner == [BEGIN_SENTENCE_CHAR]:
        return BEGIN_SENTENCE_WORD
    if inner == [END_SENTENCE_CHAR]:
        return END_SENTENCE_WORD
    return bytes(c for c in inner if c < 256).decode("utf-8", errors="replace")


# The character filters of every published allenai configuration (2048 in all).
_RELEASED_FILTERS = ((1, 32), (2, 32), (3, 64), (4, 128), (5, 256), (6, 512), (7, 1024))


# ---------------------------------------------------------------------------------------------
# Which code computes ELMo's char CNN and biLSTM. As Transformers' attention implementations, an implementation
# changes speed, never the function: `ElmoCharacterEncoder` and `ElmoBiLstm` look theirs up on every call, and the
# tests hold every implementation to "reference", the model's own plain computation (`modeling_elmo.py`). "cpu"
# (`elmo_cpu.py`: each distinct word once, a packed in-place recurrence) and "cuda" (`elmo_cuda.py`: static
# shapes in training, packed rows in inference) come with `pip install hf-elmo` and register themselves.
# ---------------------------------------------------------------------------------------------
@dataclass(frozen=True)
class ElmoImplementation:
    """
    `bilstm(module, tokens, mask, state, output_layers, words_only, dropout_masks)` computes what `ElmoBiLstm`
    specifies, with `module`'s parameters. `token_vectors(encoder, char_ids)` computes what `ElmoCharacterEncoder`
    specifies; None keeps the encoder's own (reference) computation.
    """

    bilstm: Callable
    token_vectors: Callable | None = None


BUILT_IN_NAMES = ("reference", "cpu", "cuda")
ELMO_IMPLEMENTATIONS: dict[str, ElmoImplementation] = {}


def register(name: str, implementation: ElmoImplementation) -> None:
    """Make `implementation` selectable as `name` (`ElmoConfig.elmo_implementation`, `from_pretrained(...,
    elmo_implementation=name)`); registering a name again replaces it."""
    if not isinstance(implementation, ElmoImplementation):
        raise TypeError(f"register({name!r}, ...) takes an ElmoImplementation, got {type(implementation).__name__}.")
    ELMO_IMPLEMENTATIONS[name] = implementation


def implementation_names() -> tuple:
    """What `ElmoConfig.elmo_implementation` accepts: None (chosen per call by the inputs' device) or a name."""
    return (None, *BUILT_IN_NAMES, *(name for name in ELMO_IMPLEMENTATIONS if name not in BUILT_IN_NAMES))


def implementation_name(configured: str | None, device: torch.device) -> str:
    """
    The selection rule, in one place: `configured` when set, else by the inputs' device, "cuda" on a GPU and "cpu"
    on a CPU ("reference" elsewhere). Inside `torch.compile`, which traces static graphs, the default is "cuda" on
    any device (the "cpu" implementation reads lengths back to the host).
    """
    if configured is not None:
        return configured
    if device.type == "cuda" or torch.compiler.is_compiling():
        return "cuda"
    return "cpu" if device.type == "cpu" else "reference"


@functools.cache
def import_built_in_implementations() -> None:
    """Import "cpu" and "cuda" where the package has them (each registers itself), once per process: a saved
    folder's copy lacks them, and looking again at every forward would cost two failed imports a call. Called when a
    model is built, so that nothing is imported inside `torch.compile`; the model itself never imports them (they
    import its maths)."""
    for name in ("cpu", "cuda"):
        package_module(f"elmo_{name}")


def elmo_implementation_for(config, device: torch.device) -> ElmoImplementation:
    """The implementation that computes a model with `config` (its `elmo_implementation`) on `device`. Where the
    rule's choice is not there (a saved folder's copy of the code has "reference" only), "reference" unless the
    config names it."""
    name = implementation_name(config.elmo_implementation, device)
    if name not in ELMO_IMPLEMENTATIONS and not torch.compiler.is_compiling():
        import_built_in_implementations()  # for modules used without a model (an `ElmoBiLstm` of its own)
    if name in ELMO_IMPLEMENTATIONS:
        return ELMO_IMPLEMENTATIONS[name]
    if config.elmo_implementation is None:
        return ELMO_IMPLEMENTATIONS["reference"]
    raise ValueError(f"elmo_implementation {name!r} is not available here: the 'cpu' and 'cuda' implementations "
                     "come with the hf_elmo package (`pip install hf-elmo`, then `import hf_elmo`).")


# Every class a saved folder can be loaded as with `trust_remote_code=True` (where hf_elmo is not installed).
# Saved into each config so that any Auto class works on any ELMo checkpoint, base model or head.
ELMO_AUTO_MAP = {
    "AutoConfig": "configuration_elmo.ElmoConfig",
    "AutoModel": "modeling_elmo.ElmoModel",
    "AutoTokenizer": ["tokenization_elmo.ElmoTokenizer", None],
    "AutoModelForTokenClassification": "modeling_elmo.ElmoForTokenClassification",
    "AutoModelForSequenceClassification": "modeling_elmo.ElmoForSequenceClassification",
    "AutoModelForPreTraining": "modeling_elmo.ElmoForPreTraining",
}


# Rows of the character embedding: bilm-tf's alphabet of 256 bytes and 5 special characters, plus the all-zero
# padding row (id 0). Not a configuration field: no other value is possible. bilm-tf's options.json says 261 (its
# training files, without the padding row) or 262, and config.json files written before this was a constant say
# 262; both are still accepted (and checked), neither is written any more.
N_CHARACTERS = 262


def _check_n_characters(value) -> None:
    """An `n_characters` from an older config.json or a bilm-tf options.json: 261 or 262, or absent."""
    if value is not None and value not in (N_CHARACTERS - 1, N_CHARACTERS):
        raise ValueError(
            f"ElmoConfig.n_characters must be 261 or 262 (bilm-tf's byte alphabet plus its 5 special "
            f"characters), got {value!r}."
        )


class ElmoConfig(PreTrainedConfig):
    r"""
    Configuration of an ELMo bidirectional language model (Peters et al., 2018), field for field
    the architecture part of bilm-tf's `options.json`. The defaults are the "original"
    2x4096_512_2048cnn_2xhighway model.

    Args:
        char_filters (`tuple[tuple[int, int], ...]`): `(width, n_filters)` of each character convolution.
        n_highway (`int`): number of highway layers after the convolutions (0 = none).
        char_embedding_dim (`int`): size of each character's embedding.
        max_characters_per_token (`int`): length of a word's char-id row; words keep at most this
            minus 2 UTF-8 bytes.
        char_activation (`str`): `"relu"` or `"tanh"`, applied after the max-pool.
        lstm_dim (`int`): LSTM cell size.
        projection_dim (`int`): size of the token layer and of each LSTM output. When it equals
            `lstm_dim` the LSTM has no projection.
        cell_clip (`float` or `None`): clip the LSTM cell to `[-cell_clip, cell_clip]`; `None` = off.
        proj_clip (`float` or `None`): clip the projected LSTM output likewise; `None` = off.
        num_lstm_layers (`int`): LSTM layers per direction.
        use_skip_connections (`bool`): add each LSTM layer's input to its output (layers >= 1).
        vocab_size (`int` or `None`): size of the word vocabulary of a language-model head; the
            biLM itself reads characters and does not use it.
        initializer_range (`float`): std of the normal initialisation of a task head's new weights. A new biLM
            starts from bilm-tf's own initialisers instead (see `ElmoPreTrainedModel._init_weights`).

    Task heads (`ElmoForTokenClassification`, `ElmoForSequenceClassification`; the biLM ignores these):
        freeze_elmo (`bool`, defaults to `True`): keep the biLM's weights fixed and train only the layer mix and
            the head, as in the paper. `False` fine-tunes the biLM too.
        mix_layer_norm (`bool`, defaults to `False`): layer-normalise each biLM layer before mixing, per
            sentence over its own words (so a sentence's result never depends on the rest of the batch).
        mix_l2_coef (`float`, defaults to `0.0`): weight of an L2 penalty on the layer-mix weights' distance from
            their mean, added to the loss; large values push the mix toward a plain average of the layers.
        mix_dropout (`float`, defaults to `0.5`): dropout on the mixed ELMo vectors (and on the output of the
            contextual layer, if any).
        head_lstm_dim (`int` or `None`, defaults to `None`): hidden size per direction of a biLSTM run over the
            mixed vectors before the classifier (the paper's task-model set-up); `None` = a linear classifier
            straight on the mix.
        head_lstm_layers (`int`, defaults to 1): layers of that biLSTM.
        head_crf (`bool`, defaults to `False`): `ElmoForTokenClassification` scores whole label sequences with a
            linear-chain CRF (the paper's NER model: biLSTM-CRF) and decodes with Viterbi; with IOB2 labels, the
            transitions IOB2 forbids are never taken.
        classifier_pooling (`str`, defaults to `"mean"`): how `ElmoForSequenceClassification` turns word vectors
            into one sentence vector: `"mean"` or `"max"` over the words, or `"final"` (the forward half at the
            last word joined with the backward half at the first word, i.e. each direction's final state).

    Pretraining (`ElmoForPreTraining`, the forward and backward language-model losses; other models ignore these):
        bos_word_id (`int`, defaults to 0): index of `<S>` in the word vocabulary (`vocab_size` entries), the target
            of the backward LM before each sentence's first word.
        eos_word_id (`int`, defaults to 1): index of `</S>`, the target of the forward LM after the last word.
        num_softmax_samples (`int`, defaults to 8192): in training, a sampled softmax over this many log-uniform
            negatives (bilm-tf's recipe; needs a frequency-sorted vocabulary) instead of the full softmax. `0`, or
            a value not smaller than `vocab_size`, means the full softmax; evaluation always uses the full one.
        lm_dropout (`float`, defaults to 0.1): dropout in training, where bilm-tf has it: on the input of every
            LSTM layer and on the top biLM layer before the softmax.

    Run time (never saved with the config or the weights):
        elmo_implementation (`str` or `None`, defaults to `None`): which implementation computes the char CNN and
            the biLSTM: `"reference"` (the modules' own readable maths), `"cpu"` (tuned for CPUs, inference and
            training) or `"cuda"` (fused recurrence: static shapes in training, packed rows in inference). `None`
            chooses by the device of the inputs on every call (the rule and registry: `elmo_implementation_for`
            above). All compute the same function; set it with `from_pretrained(..., elmo_implementation=...)` or
            `model.set_elmo_implementation(...)`.

    `hidden_size` is `2 * projection_dim`: every output layer is `[forward; backward]`.
    """

    model_type = "elmo"
    attribute_map = {"num_hidden_layers": "num_lstm_layers"}

    def __init__(
        self,
        char_filters=_RELEASED_FILTERS,
        n_highway=2,
        char_embedding_dim=16,
        max_characters_per_token=50,
        char_activation="relu",
        lstm_dim=4096,
        projection_dim=512,
        cell_clip=3.0,
        proj_clip=3.0,
        num_lstm_layers=2,
        use_skip_connections=True,
        vocab_size=None,
        initializer_range=0.02,
        freeze_elmo=True,
        mix_layer_norm=False,
        mix_l2_coef=0.0,
        mix_dropout=0.5,
        head_lstm_dim=None,
        head_lstm_layers=1,
        head_crf=False,
        classifier_pooling="mean",
        bos_word_id=0,
        eos_word_id=1,
        num_softmax_samples=8192,
        lm_dropout=0.1,
        pad_token_id=0,
        **kwargs,
    ):
        self.char_filters = tuple(tuple(int(v) for v in f) for f in _check_filters(char_filters))
        self.n_highway = n_highway
        self.char_embedding_dim = char_embedding_dim
        self.max_characters_per_token = max_characters_per_token
        self.char_activation = char_activation
        self.lstm_dim = lstm_dim
        self.projection_dim = projection_dim
        self.cell_clip = None if cell_clip is None else float(cell_clip)
        self.proj_clip = None if proj_clip is None else float(proj_clip)
        self.num_lstm_layers = num_lstm_layers
        self.use_skip_connections = use_skip_connections
        self.vocab_size = vocab_size
        self.initializer_range = initializer_range
        self.freeze_elmo = freeze_elmo
        self.mix_layer_norm = mix_layer_norm
        self.mix_l2_coef = mix_l2_coef
        self.mix_dropout = mix_dropout
        self.head_lstm_dim = head_lstm_dim
        self.head_lstm_layers = head_lstm_layers
        self.head_crf = head_crf
        self.classifier_pooling = classifier_pooling
        self.bos_word_id = bos_word_id
        self.eos_word_id = eos_word_id
        self.num_softmax_samples = num_softmax_samples
        self.lm_dropout = lm_dropout
        self.elmo_implementation = kwargs.pop("elmo_implementation", None)
        _check_n_characters(kwargs.pop("n_characters", None))
        super().__init__(pad_token_id=pad_token_id, **kwargs)
        self.auto_map = {**ELMO_AUTO_MAP, **(getattr(self, "auto_map", None) or {})}
        self.validate_elmo()

    @property
    def elmo_implementation(self) -> str | None:
        return self._elmo_implementation

    @elmo_implementation.setter
    def elmo_implementation(self, name: str | None):
        if name not in implementation_names():
            raise ValueError(
                f"elmo_implementation must be one of {implementation_names()} (None chooses by device), got {name!r}."
            )
        self._elmo_implementation = name

    def to_dict(self) -> dict:
        # The implementation is a choice of this process (which device it runs on), not part of the model.
        output = super().to_dict()
        output.pop("_elmo_implementation", None)
        return output

    @property
    def n_characters(self) -> int:
        """Rows of the character embedding: always `N_CHARACTERS` (kept for code that reads it from the config)."""
        return N_CHARACTERS

    @n_characters.setter
    def n_characters(self, value):
        # `from_pretrained(..., n_characters=262)` sets it: a legal value changes nothing, another one is an error.
        _check_n_characters(value)

    @property
    def hidden_size(self) -> int:
        return 2 * self.projection_dim

    @property
    def n_filters(self) -> int:
        """Width of the concatenated max-pooled convolutions (F)."""
        return sum(n for _, n in self.char_filters)

    @property
    def has_lstm_projection(self) -> bool:
        return self.projection_dim < self.lstm_dim

    @property
    def samples_softmax(self) -> bool:  # pretraining's softmax: sampled (`num_softmax_samples`) or full
        return 0 < self.num_softmax_samples < self.vocab_size

    @classmethod
    def from_preset(cls, name: str, **kwargs) -> "ElmoConfig":
        """One of the published shapes: `"small"`, `"medium"` or `"original"` (`elmo_presets.py`)."""
        presets = package_module("elmo_presets")
        require_hf_elmo("ElmoConfig.from_preset", presets)
        if name not in presets.ELMO_PRESETS:
            raise ValueError(f"Unknown ELMo preset {name!r}; choose one of {sorted(presets.ELMO_PRESETS)}.")
        return cls(**{**presets.ELMO_PRESETS[name], **kwargs})

    def validate_elmo(self):
        def positive_int(field):
            if not _is_int_from(getattr(self, field), 1):
                raise ValueError(f"ElmoConfig.{field} must be a positive integer, got {getattr(self, field)!r}.")

        for field in ("char_embedding_dim", "max_characters_per_token", "lstm_dim", "projection_dim", "num_lstm_layers"):
            positive_int(field)
        if not _is_int_from(self.n_highway, 0):
            raise ValueError(f"ElmoConfig.n_highway must be an integer >= 0, got {self.n_highway!r}.")
        if self.char_activation not in ("relu", "tanh"):
            raise ValueError(f"ElmoConfig.char_activation must be 'relu' or 'tanh', got {self.char_activation!r}.")
        widest = max(w for w, _ in self.char_filters)
        if widest > self.max_characters_per_token:
            raise ValueError(
                f"ElmoConfig.char_filters has a filter of width {widest}, wider than "
                f"max_characters_per_token={self.max_characters_per_token}."
            )
        if self.max_characters_per_token < 3:
            raise ValueError("ElmoConfig.max_characters_per_token must be at least 3 (begin, end and one byte).")
        if self.projection_dim > self.lstm_dim:
            raise ValueError(
                f"ElmoConfig.projection_dim ({self.projection_dim}) must not exceed lstm_dim ({self.lstm_dim}): "
                "the LSTM output is projected down to projection_dim, never up."
            )
        for field in ("cell_clip", "proj_clip"):
            value = getattr(self, field)
            # Written so that NaN fails too: a NaN clip turns every LSTM state into NaN.
            if value is not None and not 0 < value < float("inf"):
                raise ValueError(
                    f"ElmoConfig.{field} must be a positive finite number or None (no clipping), got {value!r}."
                )
        if self.vocab_size is not None:
            positive_int("vocab_size")
        if not isinstance(self.use_skip_connections, bool):
            raise ValueError(f"ElmoConfig.use_skip_connections must be a bool, got {self.use_skip_connections!r}.")
        self._validate_task_head_fields()
        self._validate_pretraining_fields()

    def _validate_task_head_fields(self):
        for field in ("freeze_elmo", "mix_layer_norm", "head_crf"):
            if not isinstance(getattr(self, field), bool):
                raise ValueError(f"ElmoConfig.{field} must be a bool, got {getattr(self, field)!r}.")
        if not _is_number(self.mix_l2_coef) or not self.mix_l2_coef >= 0:
            raise ValueError(f"ElmoConfig.mix_l2_coef must be a number >= 0, got {self.mix_l2_coef!r}.")
        if not _is_number(self.mix_dropout) or not 0 <= self.mix_dropout < 1:
            raise ValueError(f"ElmoConfig.mix_dropout must be a probability in [0, 1), got {self.mix_dropout!r}.")
        if self.head_lstm_dim is not None and not _is_int_from(self.head_lstm_dim, 1):
            raise ValueError(f"ElmoConfig.head_lstm_dim must be a positive integer or None, got {self.head_lstm_dim!r}.")
        if not _is_int_from(self.head_lstm_layers, 1):
            raise ValueError(f"ElmoConfig.head_lstm_layers must be a positive integer, got {self.head_lstm_layers!r}.")
        if self.classifier_pooling not in ("mean", "max", "final"):
            raise ValueError(
                f"ElmoConfig.classifier_pooling must be 'mean', 'max' or 'final', got {self.classifier_pooling!r}."
            )

    # ---- Pretraining (ElmoForPreTraining) ----
    def _validate_pretraining_fields(self):
        for field in ("bos_word_id", "eos_word_id", "num_softmax_samples"):
            if not _is_int_from(getattr(self, field), 0):
                raise ValueError(f"ElmoConfig.{field} must be an integer >= 0, got {getattr(self, field)!r}.")
        if self.vocab_size is not None:
            for field in ("bos_word_id", "eos_word_id"):
                if getattr(self, field) >= self.vocab_size:
                    raise ValueError(
                        f"ElmoConfig.{field} ({getattr(self, field)}) must be an index into the word vocabulary "
                        f"(vocab_size={self.vocab_size})."
                    )
        if self.bos_word_id == self.eos_word_id:
            raise ValueError(f"ElmoConfig.bos_word_id and eos_word_id must differ, both are {self.bos_word_id}.")
        if not _is_number(self.lm_dropout) or not 0 <= self.lm_dropout < 1:
            raise ValueError(f"ElmoConfig.lm_dropout must be a probability in [0, 1), got {self.lm_dropout!r}.")


def _is_number(value) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool)


def _is_int_from(value, least: int) -> bool:
    """Whether a config value is an int (a bool is not one, though Python says it is) of at least `least`."""
    return isinstance(value, int) and not isinstance(value, bool) and value >= least


def _check_filters(filters):
    try:
        pairs = [tuple(f) for f in filters]
        ok = bool(pairs) and all(len(p) == 2 and all(_is_int_from(v, 1) for v in p) for p in pairs)
    except TypeError:
        ok = False
    if not ok:
        raise ValueError(
            f"ElmoConfig.char_filters must be a non-empty list of [width, n_filters] pairs of positive "
            f"integers, got {filters!r}."
        )
    return pairs


__all__ = ["ElmoConfig", "word_to_char_ids", "char_ids_to_word"]
