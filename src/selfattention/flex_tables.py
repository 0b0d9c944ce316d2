"""What a BlockMask was when it was looked at, and how a call reads a mask made for fewer heads.

:class:`Snapshot` copies a BlockMask's tables and the tensors its mask_mod reads (:func:`captured`); what
:mod:`selfattention.flex_masks` recognised from them holds only while the snapshot still matches.
:func:`table_entries` is torch's rule, per device, for the table entry each batch entry / query head of a
call reads when the mask was made for fewer (docs/flex.md).
"""

from __future__ import annotations

import functools
import inspect

import torch
from torch.nn.attention.flex_attention import BlockMask

__all__ = ["CAPTURED_COPY_MAX", "WALK_DEPTH", "WALK_ITEMS_MAX", "Snapshot", "captured", "table_entries"]


def table_entries(n: int, entries: int, device_type: str) -> torch.Tensor:
    """Which of a BlockMask's ``entries`` table entries (along batch or heads) each of a call's ``n`` batch
    entries / query heads reads, as torch's own kernel on that device reads them (torch 2.13): on CPU,
    consecutive groups of n / entries share an entry (``cpp_flex_attention_template.py``: z // (B / B'),
    h // (H / H') — a GQA call's mask made for its key/value heads gives each query head its own key/value
    head's tables); on CUDA and elsewhere, entry z % B', h % H' (the Triton templates). A mask made for
    more entries than the call, or for a count that does not divide it, is read z % B' on every device.

    >>> table_entries(4, 2, "cpu").tolist(), table_entries(4, 2, "cuda").tolist()
    ([0, 0, 1, 1], [0, 1, 0, 1])
    """
    i = torch.arange(n)
    if device_type == "cpu" and entries < n and n % entries == 0:
        return i // (n // entries)
    return i % entries


class Snapshot:
    """A copy of a BlockMask's tables (a few K integers) and of the tensors its mask_mod reads
    (:func:`captured`), compared on every call: what was recognised from them is used only while they are
    unchanged — tables written to in place, through ``.data`` or numpy, or replaced by other tensors (the
    version counters alone miss the last two), document ids or an offset the mod reads changed in place
    or rebound (:func:`captured`'s ``bound``). Then the mask is looked at again, as torch's kernels would
    read it: its (old) tables with the mod as it is now."""

    def __init__(self, bm: BlockMask) -> None:
        self.tables = tuple(None if t is None else t.detach().clone() for t in _tables_of(bm))
        self.bound: list[tuple] = []  # (cell, dict or list; None, name or index; the tensor or number there)
        self.captured = [
            (t, t._version, t.detach().clone() if t.numel() <= CAPTURED_COPY_MAX else None)
            for t in captured(bm.mask_mod, bound=self.bound)
        ]

    def match(self, bm: BlockMask) -> bool:
        return (
            all(
                a is b or (a is not None and b is not None and a.shape == b.shape and torch.equal(a, b))
                for a, b in zip(self.tables, _tables_of(bm), strict=True)
            )
            and all(
                t._version == version and (copy is None or (t.shape == copy.shape and torch.equal(t, copy)))
                for t, version, copy in self.captured
            )
            and all(_same(_now(holder, name), t) for holder, name, t in self.bound)
        )


CAPTURED_COPY_MAX = 1 << 20
"""Elements up to which a tensor a mask_mod reads is copied and compared on every call (beyond: its
version counter only, which misses writes through ``.data``)."""


def captured(fn, depth: int = 0, seen: set | None = None, bound: list | None = None) -> list[torch.Tensor]:
    """The tensors ``fn`` reads besides its arguments: its closure cells, defaults and the globals its code
    names; a ``functools.partial``'s arguments; a callable object's attributes (this library's ready mods)
    or a bound method's object's; and, recursively (:data:`WALK_DEPTH` levels), what is found there — the
    entries of dicts, lists and tuples, the attributes of plain objects (``ns.doc``, slots too), the callables inside
    (``and_masks``' list of mods). ``bound`` (a list) receives (holder, key, value) for the tensors and
    numbers held by a closure cell (key None), a dict or an object's attributes (key a name) or a list
    (key an index), which a later assignment can rebind (``nonlocal offset``, ``cfg["inner"]["doc"] = …``,
    ``self.ids = …``, ``ids[0] = …``). Containers over :data:`WALK_ITEMS_MAX` entries are not walked."""
    seen = set() if seen is None else seen
    if id(fn) in seen or depth > WALK_DEPTH:
        return []
    seen.add(id(fn))
    found: list = []
    if isinstance(fn, functools.partial):
        found += [fn.func, *fn.args, *fn.keywords.values()]
    code = getattr(fn, "__code__", None)
    if code is not None:
        cells = [c for c in (fn.__closure__ or ()) if _filled(c)]
        glob = getattr(fn, "__globals__", {})
        names = [n for n in code.co_names if n in glob]
        if bound is not None:
            bound += [(c, None, c.cell_contents) for c in cells if _watched(c.cell_contents)]
            bound += [(glob, n, glob[n]) for n in names if _watched(glob[n])]
        found += [c.cell_contents for c in cells]
        found += list(fn.__defaults__ or ()) + list((fn.__kwdefaults__ or {}).values())
        found += [glob[n] for n in names]
        owner = getattr(fn, "__self__", None)  # a bound method: its object's attributes
        if owner is not None and _plain(owner):
            found.append(vars(owner))
    elif _plain(fn):
        found.append(vars(fn))
    out: list[torch.Tensor] = []
    for x in found:
        out += _walk(x, depth, seen, bound)
    return out


WALK_DEPTH = 3
"""How many levels of callables, containers and objects :func:`captured` walks from the mask function."""

WALK_ITEMS_MAX = 256
"""Entries beyond which a dict, list, tuple or object's attributes are not walked (a model's state)."""


def _walk(x, depth: int, seen: set, bound: list | None) -> list[torch.Tensor]:
    """The tensors in ``x``, a value a mask function reaches: itself, or what it holds (see :func:`captured`)."""
    if isinstance(x, torch.Tensor):
        if id(x) in seen:
            return []
        seen.add(id(x))
        return [x]
    if isinstance(x, type) or inspect.ismodule(x) or isinstance(x, int | float | str | bytes | None):
        return []
    if callable(x):
        return captured(x, depth + 1, seen, bound)
    if isinstance(x, dict | list | tuple) or _plain(x) or _slots(x):
        if id(x) in seen or depth >= WALK_DEPTH:
            return []
        seen.add(id(x))
        if isinstance(x, dict | list | tuple):
            holder, items = x, list(x.items()) if isinstance(x, dict) else list(enumerate(x))
        elif _plain(x):
            holder, items = vars(x), list(vars(x).items())
        else:  # an object with __slots__ (a dataclass(slots=True)): its filled slots, read by name
            holder, items = x, [(n, getattr(x, n)) for n in _slots(x) if hasattr(x, n)]
        if len(items) > WALK_ITEMS_MAX:
            return []
        if bound is not None and not isinstance(holder, tuple):  # a tuple's entries cannot be rebound
            bound += [(holder, key, v) for key, v in items if _watched(v)]
        out: list[torch.Tensor] = []
        for _, v in items:
            out += _walk(v, depth + 1, seen, bound)
        return out
    return []


def _plain(x) -> bool:
    """Whether ``x`` is an object whose attributes :func:`captured` reads (not a module or a class)."""
    return hasattr(x, "__dict__") and not inspect.ismodule(x) and not isinstance(x, type)


def _slots(x) -> list[str]:
    """The slot names of ``x``'s class and its bases (an object without ``__dict__``), else []."""
    if hasattr(x, "__dict__") or isinstance(x, type):
        return []
    names = []
    for cls in type(x).__mro__:
        slots = cls.__dict__.get("__slots__", ())
        names += (
            [slots] if isinstance(slots, str) else [n for n in slots if n not in ("__dict__", "__weakref__")]
        )
    return names


def _watched(x) -> bool:
    """Whether a value held by a cell, a global or a dict is re-checked on every call: a tensor (by
    identity) or a number / string (by value; an offset a closure changes with ``nonlocal``)."""
    return isinstance(x, torch.Tensor | int | float | str)


def _same(a, b) -> bool:
    """``a is b`` for tensors and other objects, ``==`` for numbers and strings."""
    if isinstance(a, torch.Tensor) or isinstance(b, torch.Tensor):
        return a is b
    return type(a) is type(b) and a == b


def _now(holder, name):
    """What a closure cell (``name`` None), a dict, a list or an object's slot holds now (None once emptied
    or deleted)."""
    if name is None:
        return holder.cell_contents if _filled(holder) else None
    if isinstance(holder, list):
        return holder[name] if name < len(holder) else None
    if isinstance(holder, dict):
        return holder.get(name)
    return getattr(holder, name, None)  # a slot


def _filled(cell) -> bool:
    try:
        cell.cell_contents  # noqa: B018 — an empty cell raises ValueError
    except ValueError:
        return False
    return True


def _tables_of(bm: BlockMask) -> tuple:
    return (bm.kv_num_blocks, bm.kv_indices, bm.full_kv_num_blocks, bm.full_kv_indices)
