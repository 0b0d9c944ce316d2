"""Pages of a KV cache: a pool of fixed-size pages, a block table per sequence, reference counts.

The memory layout of vLLM's PagedAttention (Kwon et al. 2023) and of flash-attn's ``block_table``: keys
and values live in a pool ``(num_pages, page_size, kv_heads, head_dim)``; sequence b's position p is in
page ``block_table[b, p // page_size]`` at slot ``p % page_size``. Pages are handed out on demand, so a
sequence holds ⌈length / page_size⌉ pages instead of a whole ``capacity`` row; a page may be referenced by
several sequences (a shared prompt prefix, beams after :meth:`PageTable.reorder`) and is copied before a
sequence appends to it (copy-on-write). Two sequences sharing their first page after a fork, page size 4::

    block_table           pool pages (reference counts)
    seq 0:  [3, 7]        page 3: "The " (2)   page 7: "ca" (1)
    seq 1:  [3, 5]        page 5: "do" (1)  ← was page 7 until seq 1 appended: copied first

This module keeps the bookkeeping on the host (Python lists: a page table is small) and mirrors it into
an int32 ``block_table`` tensor (−1 = no page) for :func:`selfattention.flash_kvcache.flash_attn_with_kvcache`.
"""

from __future__ import annotations

import torch

__all__ = ["PageTable", "PoolExhaustedError"]


class PoolExhaustedError(RuntimeError):
    """The page pool has no free page left for an append (nothing was changed)."""


class PageTable:
    """Block tables of ``batch_size`` sequences over a pool of ``num_pages`` pages of ``page_size``.

    >>> t = PageTable(batch_size=2, num_pages=4, page_size=2, max_pages=2)
    >>> t.plan([3, 1])          # pages to add for 3 and 1 more tokens (nothing changes yet)
    [(0, 0), (0, 1), (1, 0)]
    >>> _ = t.apply(t.plan([3, 1]))
    >>> t.rows, t.pages_used
    ([[0, 1], [2]], 3)
    """

    def __init__(self, batch_size: int, num_pages: int, page_size: int, max_pages: int, device=None) -> None:
        self.page_size = page_size
        self.num_pages = num_pages
        self.max_pages = max_pages
        self.rows: list[list[int]] = [[] for _ in range(batch_size)]
        self.refs = [0] * num_pages
        self.lengths = [0] * batch_size
        self._free = list(range(num_pages - 1, -1, -1))  # a stack: the lowest page first
        self.tensor = torch.full((batch_size, max_pages), -1, dtype=torch.int32, device=device)

    @property
    def pages_used(self) -> int:
        return sum(1 for r in self.refs if r > 0)

    @property
    def free_pages(self) -> int:
        return len(self._free)

    def shuffle(self, seed: int = 0) -> None:
        """Hand out the free pages in a random order from now on (tests and benchmarks: scattered pages)."""
        g = torch.Generator().manual_seed(seed)
        perm = torch.randperm(len(self._free), generator=g).tolist()
        self._free = [self._free[i] for i in perm]

    def plan(self, new: list[int]) -> list[tuple[int, int]]:
        """The (sequence, page slot) pairs that need a fresh page before ``new[b]`` tokens are appended to
        each sequence: new pages past the end, and shared partial pages to copy (copy-on-write). Raises
        :class:`PoolExhaustedError` if the pool cannot serve them; changes nothing."""
        need = []
        for b, n in enumerate(new):
            if n == 0:
                continue
            length, row = self.lengths[b], self.rows[b]
            first = length // self.page_size
            if length % self.page_size and self.refs[row[first]] > 1:
                need.append((b, first))  # shared page written to: copy it
            need += [(b, j) for j in range(len(row), -(-(length + n) // self.page_size))]
        if len(need) > len(self._free):
            raise PoolExhaustedError(
                f"the page pool has {len(self._free)} free pages of {self.num_pages} (page_size "
                f"{self.page_size}); this append needs {len(need)}: create the cache with more num_pages, "
                "or release finished sequences"
            )
        return need

    def apply(self, need: list[tuple[int, int]]) -> list[tuple[int, int]]:
        """Take the pages :meth:`plan` asked for; returns (source page, new page) pairs whose contents the
        caller must copy (copy-on-write)."""
        copies = []
        for b, j in need:
            page = self._free.pop()
            self.refs[page] = 1
            row = self.rows[b]
            if j < len(row):  # copy-on-write of a shared page
                old = row[j]
                self.refs[old] -= 1
                row[j] = page
                copies.append((old, page))
            else:
                row.append(page)
            self.tensor[b, j] = page
        return copies

    def release(self, b: int) -> None:
        """Drop sequence b's pages (a page goes back to the pool when no sequence references it)."""
        for page in self.rows[b]:
            self._unref(page)
        self.rows[b] = []
        self.lengths[b] = 0
        self.tensor[b] = -1

    def _unref(self, page: int) -> None:
        self.refs[page] -= 1
        if self.refs[page] == 0:
            self._free.append(page)

    def share(self, src: int, dst: int) -> None:
        """Sequence ``dst`` (released first) references the pages of ``src``: nothing is copied."""
        self.release(dst)
        self.rows[dst] = list(self.rows[src])
        for page in self.rows[dst]:
            self.refs[page] += 1
        self.lengths[dst] = self.lengths[src]
        self.tensor[dst] = self.tensor[src]

    def reorder(self, indices: list[int]) -> None:
        """Row b becomes old row ``indices[b]`` (beam search): pages referenced by several new rows are
        shared, pages no new row references go back to the pool."""
        rows = [list(self.rows[i]) for i in indices]
        for row in rows:
            for page in row:
                self.refs[page] += 1
        for row in self.rows:
            for page in row:
                self._unref(page)
        self.rows = rows
        self.lengths = [self.lengths[i] for i in indices]
        self.tensor = self.tensor[torch.tensor(indices, device=self.tensor.device)].clone()
