"""ELMo configuration, and the character-id scheme shared by the tokenizer and the model."""

from transformers import PreTrainedConfig


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


def _framed(inner: list[int], max_characters_per_token: int) -> list[int]:
    row = [BEGIN_WORD_CHAR, *inner, END_WORD_CHAR]
    row += [PAD_CHAR] * (max_characters_per_token - len(row))
    return [c + CHAR_ID_SHIFT for c in row]


def word_to_char_ids(word: str, max_characters_per_token: int = 50) -> list[int]:
    """The (shifted) char-id row of one word, exactly as bilm-tf builds it."""
    if word == BEGIN_SENTENCE_WORD:
        return _framed([BEGIN_SENTENCE_CHAR], max_characters_per_token)
    if word == END_SENTENCE_WORD:
        return _framed([END_SENTENCE_CHAR], max_characters_per_token)
    # A byte cut, as in bilm-tf: it may split a multi-byte character, which is what the
    # released weights were trained on. Lone surrogates cannot be encoded and are dropped.
    encoded = word.encode("utf-8", errors="ignore")[: max_characters_per_token - 2]
    return _framed(list(encoded), max_characters_per_token)


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


# The published allenai configurations (bilm-tf options), by the name users know them by.
_RELEASED_FILTERS = ((1, 32), (2, 32), (3, 64), (4, 128), (5, 256), (6, 512), (7, 1024))
ELMO_PRESETS = {
    "small": {"lstm_dim": 1024, "projection_dim": 128, "n_highway": 1},  # 2x1024_128_2048cnn_1xhighway
    "medium": {"lstm_dim": 2048, "projection_dim": 256, "n_highway": 1},  # 2x2048_256_2048cnn_1xhighway
    "original": {"lstm_dim": 4096, "projection_dim": 512, "n_highway": 2},  # 2x4096_512_2048cnn_2xhighway
}


class ElmoConfig(PreTrainedConfig):
    r"""
    Configuration of an ELMo bidirectional language model (Peters et al., 2018), field for field
    the architecture part of bilm-tf's `options.json`. The defaults are the "original"
    2x4096_512_2048cnn_2xhighway model.

    Args:
        char_filters (`tuple[tuple[int, int], ...]`): `(width, n_filters)` of each character convolution.
        n_highway (`int`): number of highway layers after the convolutions (0 = none).
        char_embedding_dim (`int`): size of each character's embedding.
        n_characters (`int`): rows of the character embedding. bilm-tf training files say 261 (no
            padding row), inference files 262; both are accepted and stored as 262, the padding row
            being all zeros.
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
        initializer_range (`float`): std of the normal initialisation of new weights.

    `hidden_size` is `2 * projection_dim`: every output layer is `[forward; backward]`.
    """

    model_type = "elmo"
    attribute_map = {"num_hidden_layers": "num_lstm_layers"}

    def __init__(
        self,
        char_filters=_RELEASED_FILTERS,
        n_highway=2,
        char_embedding_dim=16,
        n_characters=262,
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
        pad_token_id=0,
        **kwargs,
    ):
        self.char_filters = tuple(tuple(int(v) for v in f) for f in _check_filters(char_filters))
        self.n_highway = n_highway
        self.char_embedding_dim = char_embedding_dim
        self.n_characters = 262 if n_characters == 261 else n_characters
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
        super().__init__(pad_token_id=pad_token_id, **kwargs)
        self.validate_elmo()

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

    @classmethod
    def from_preset(cls, name: str, **kwargs) -> "ElmoConfig":
        """One of the published shapes: `"small"`, `"medium"` or `"original"`."""
        if name not in ELMO_PRESETS:
            raise ValueError(f"Unknown ELMo preset {name!r}; choose one of {sorted(ELMO_PRESETS)}.")
        return cls(**{**ELMO_PRESETS[name], **kwargs})

    def validate_elmo(self):
        def positive_int(field):
            value = getattr(self, field)
            if isinstance(value, bool) or not isinstance(value, int) or value <= 0:
                raise ValueError(f"ElmoConfig.{field} must be a positive integer, got {value!r}.")

        for field in ("char_embedding_dim", "max_characters_per_token", "lstm_dim", "projection_dim", "num_lstm_layers"):
            positive_int(field)
        if isinstance(self.n_highway, bool) or not isinstance(self.n_highway, int) or self.n_highway < 0:
            raise ValueError(f"ElmoConfig.n_highway must be an integer >= 0, got {self.n_highway!r}.")
        if self.n_characters != 262:
            raise ValueError(
                f"ElmoConfig.n_characters must be 261 or 262 (bilm-tf's byte alphabet plus its 5 special "
                f"characters), got {self.n_characters!r}."
            )
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
            if value is not None and value <= 0:
                raise ValueError(f"ElmoConfig.{field} must be positive or None (no clipping), got {value!r}.")
        if self.vocab_size is not None:
            positive_int("vocab_size")
        if not isinstance(self.use_skip_connections, bool):
            raise ValueError(f"ElmoConfig.use_skip_connections must be a bool, got {self.use_skip_connections!r}.")


def _check_filters(filters):
    try:
        pairs = [tuple(f) for f in filters]
        ok = bool(pairs) and all(
            len(p) == 2 and all(isinstance(v, int) and not isinstance(v, bool) and v > 0 for v in p) for p in pairs
        )
    except TypeError:
        ok = False
    if not ok:
        raise ValueError(
            f"ElmoConfig.char_filters must be a non-empty list of [width, n_filters] pairs of positive "
            f"integers, got {filters!r}."
        )
    return pairs


__all__ = ["ElmoConfig", "ELMO_PRESETS", "word_to_char_ids", "char_ids_to_word"]
