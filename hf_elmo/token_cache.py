"""`ElmoTokenCache`: token-layer vectors memoised across calls, for CPU inference on fixed weights."""

import itertools
from collections import OrderedDict
from collections.abc import Callable

import torch


class ElmoTokenCache:
    """
    A bounded least-recently-used memo of token-layer vectors, keyed by a word's char-id row. Valid because the
    token layer is context-free: a word's vector depends on its characters and the char-encoder weights only.
    Entries are dropped whenever those weights change (in place, or replaced, or cast), so it never serves stale
    vectors; it is bypassed whenever gradients are needed. Memory: `max_words * projection_dim` values.
    """

    def __init__(self, max_words: int):
        if isinstance(max_words, bool) or not isinstance(max_words, int) or max_words <= 0:
            raise ValueError(f"max_words must be a positive integer, got {max_words!r}.")
        self.max_words = max_words
        self.hits = self.misses = 0
        self._entries: OrderedDict[tuple, torch.Tensor] = OrderedDict()
        self._weights_key = None

    def __len__(self) -> int:
        return len(self._entries)

    def clear(self):
        self._entries.clear()

    def vectors(self, encoder: torch.nn.Module, char_ids: torch.Tensor, compute: Callable) -> torch.Tensor:
        """
        Token vectors of distinct `char_ids` rows from the char encoder `encoder` (an `ElmoCharacterEncoder`),
        computing only the rows not cached, with `compute(char_ids)`.
        """
        # Buffers too: int8 weights are buffers (`Int8Linear`), which loading a state dict writes in place.
        weights_key = tuple((p.data_ptr(), p._version, p.dtype, p.device)
                            for p in itertools.chain(encoder.parameters(), encoder.buffers()))
        if weights_key != self._weights_key:
            self._entries.clear()
            self._weights_key = weights_key
        keys = [tuple(row) for row in char_ids.tolist()]
        found = [self._entries.get(key) for key in keys]
        missing = [i for i, vector in enumerate(found) if vector is None]
        self.hits += len(keys) - len(missing)
        self.misses += len(missing)
        for key, vector in zip(keys, found):
            if vector is not None:
                self._entries.move_to_end(key)
        if missing:
            # Each entry is its own copy, so evicting it frees it (a view would keep the whole batch alive).
            computed = compute(char_ids[missing])
            for i, vector in zip(missing, computed.unbind()):
                found[i] = vector
                self._entries[keys[i]] = vector.clone()
            while len(self._entries) > self.max_words:
                self._entries.popitem(last=False)
        return torch.stack(found)
