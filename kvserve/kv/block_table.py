"""A sequence's block tables: one row of block ids per layer group, all rows as long as the sequence is in
blocks, held in one NumPy array that grows by doubling. The model runner copies a batch's tables from these
arrays each step, without building or padding Python lists."""
from __future__ import annotations

import numpy as np

NULL = -1  # an entry whose block a sliding group gave back


class BlockTable:
    def __init__(self, num_groups: int):
        self._ids = np.full((num_groups, 16), NULL, dtype=np.int64)
        self._len = 0

    def __len__(self) -> int:
        return self._len

    def __getitem__(self, group: int) -> np.ndarray:
        """One group's row (a view: writes go to the table)."""
        return self._ids[group, :self._len]

    def __iter__(self):
        return iter(self.ids)

    @property
    def ids(self) -> np.ndarray:
        """[groups, blocks], a view."""
        return self._ids[:, :self._len]

    def extend(self, columns: np.ndarray | list[list[int]]) -> None:
        """Append blocks: `columns` is [groups, n], each group's new block ids."""
        columns = np.asarray(columns, dtype=np.int64).reshape(len(self._ids), -1)
        end = self._len + columns.shape[1]
        if end > self._ids.shape[1]:
            grown = np.full((len(self._ids), max(end, 2 * self._ids.shape[1])), NULL, dtype=np.int64)
            grown[:, :self._len] = self.ids
            self._ids = grown
        self._ids[:, self._len:end] = columns
        self._len = end

    def truncate(self, length: int) -> list[list[int]]:
        """Keep the first `length` blocks of every group; returns each group's removed ids, in order."""
        removed = self._ids[:, length:self._len].tolist()
        self._len = min(self._len, length)
        return removed

    def assign(self, columns: np.ndarray | list[list[int]]) -> None:
        """Replace the whole table with `columns` ([groups, n])."""
        self._len = 0
        self.extend(columns)

    def num_held(self) -> int:
        """Entries that hold a block (not NULL), over all groups."""
        return int(np.count_nonzero(self.ids != NULL))
