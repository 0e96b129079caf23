"""Per-row token lists of the persistent batch (stop ids, allowed ids, logit bias, bad words),
stored padded so a step gathers them at once.

Padding never needs a validity mask: a short row repeats its own first id (with value 0), so
masking a padded id bans nothing new and adding a padded value adds nothing.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence

import numpy as np


class TokenTable:
    """Variable-length token-id lists per row (with an optional float per id)."""

    def __init__(self, num_rows: int, with_values: bool = False) -> None:
        self.has = np.zeros(num_rows, dtype=bool)
        self.ids = np.zeros((num_rows, 0), dtype=np.int64)
        self.values = np.zeros((num_rows, 0), dtype=np.float32) if with_values else None

    def set(self, row: int, ids: Sequence[int] | Mapping[int, float] | None) -> None:
        """A row's ids; a table with values takes {id: value} (logit_bias)."""
        self.has[row] = bool(ids)
        if not ids:
            return
        id_list = list(ids)
        self._ensure_width(len(id_list))
        self.ids[row] = id_list[0]
        self.ids[row, : len(id_list)] = id_list
        if self.values is not None:
            assert isinstance(ids, Mapping), "a table with values takes {id: value}"
            self.values[row] = 0.0
            self.values[row, : len(id_list)] = list(ids.values())

    def move(self, src: int, dst: int) -> None:
        self.has[dst] = self.has[src]
        self.ids[dst] = self.ids[src]
        if self.values is not None:
            self.values[dst] = self.values[src]

    def _ensure_width(self, width: int) -> None:
        old = self.ids.shape[1]
        if width <= old:
            return
        new = max(width, 2 * old)
        self.ids = _widen(self.ids, new, repeat_first=True)
        if self.values is not None:
            self.values = _widen(self.values, new, repeat_first=False)


class BadWordsTable:
    """Bad words per row as [num_rows, num_words, word_len] int64, right-aligned.

    -1 fills the left of shorter words (no constraint at that offset); rows with fewer words
    repeat their first word.
    """

    def __init__(self, num_rows: int) -> None:
        self.has = np.zeros(num_rows, dtype=bool)
        self.words = np.full((num_rows, 0, 0), -1, dtype=np.int64)

    def set(self, row: int, words: list[list[int]] | None) -> None:
        self.has[row] = bool(words)
        if not words:
            return
        self._ensure_shape(len(words), max(len(w) for w in words))
        length = self.words.shape[2]
        self.words[row] = -1
        for i, word in enumerate(words):
            self.words[row, i, length - len(word) :] = word
        self.words[row, len(words) :] = self.words[row, 0]

    def move(self, src: int, dst: int) -> None:
        self.has[dst] = self.has[src]
        self.words[dst] = self.words[src]

    def _ensure_shape(self, num_words: int, length: int) -> None:
        rows, old_words, old_len = self.words.shape
        if num_words <= old_words and length <= old_len:
            return
        new_words = max(num_words, old_words)
        new_len = max(length, old_len)
        words = np.full((rows, new_words, new_len), -1, dtype=np.int64)
        words[:, :old_words, new_len - old_len :] = self.words
        words[:, old_words:] = words[:, :1]  # keep "repeat the first word" in new slots
        self.words = words


def _widen(arr: np.ndarray, width: int, repeat_first: bool) -> np.ndarray:
    """Copy of `arr` [rows, w] widened to `width`: new columns repeat column 0, or hold 0."""
    out = np.zeros((arr.shape[0], width), dtype=arr.dtype)
    out[:, : arr.shape[1]] = arr
    if repeat_first and arr.shape[1]:
        out[:, arr.shape[1] :] = arr[:, :1]
    return out


class TokenMaskTable:
    """A token-id set per row as packed bits: a 45k-id whitelist costs 6 KB a row, and a step
    unpacks the complement of the rows it needs into a [rows, vocab] bool mask in one call."""

    def __init__(self, num_rows: int) -> None:
        self.has = np.zeros(num_rows, dtype=bool)
        self.bits = np.zeros((num_rows, 0), dtype=np.uint8)

    def set(self, row: int, ids: list[int] | None) -> None:
        self.has[row] = bool(ids)
        if not ids:
            return
        width = max(ids) // 8 + 1
        if width > self.bits.shape[1]:
            self.bits = _widen(self.bits, max(width, 2 * self.bits.shape[1]), repeat_first=False)
        members = np.zeros(self.bits.shape[1] * 8, dtype=bool)
        members[ids] = True
        self.bits[row] = np.packbits(members)

    def move(self, src: int, dst: int) -> None:
        self.has[dst] = self.has[src]
        self.bits[dst] = self.bits[src]

    def non_members(self, rows: np.ndarray, vocab: int) -> np.ndarray:
        """[r, vocab] bool, True where an id is not in the row's set (ids past the stored
        width are not), unpacked from the inverted bits: no second pass to negate."""
        out = np.unpackbits(~self.bits[rows], axis=1, count=vocab).view(bool)
        out[:, 8 * self.bits.shape[1] :] = True
        return out
