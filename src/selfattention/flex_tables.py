"""What a BlockMask was when it was looked at, and how a call reads a mask made for fewer heads.

:class:`Snapshot` copies a BlockMask's tables and the tensors its mask_mod reads (:func:`captured`); what
:mod:`selfattention.flex_masks` recognised from them holds only while the snapshot still matches.
:func:`table_entries` is torch's rule, per device, for the table entry each batch entry / query head of a
call reads when the mask was made for fewer (docs/flex.md).
"""

from __future__ import annotations

import collections
import functools
import inspect
import numbers
import sys
from collections.abc import Mapping

import torch
from torch.nn.attention.flex_attention import BlockMask

__all__ = [
    "CAPTURED_COPY_MAX",
    "WALK_BUDGET",
    "WALK_DEPTH",
    "WALK_ITEMS_MAX",
    "Snapshot",
    "captured",
    "table_entries",
]


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
        bound: list[tuple] = []  # (holder, key, value): see captured
        tensors = captured(bm.mask_mod, bound=bound)
        # only what can be compared again: a dense tensor (not sparse, meta or nested)
        self.captured = [(t, _version(t), _copy(t)) for t in tensors if _comparable(t)]
        self.bound = bound

    def match(self, bm: BlockMask) -> bool:
        try:
            return (
                all(
                    a is b or (a is not None and b is not None and a.shape == b.shape and torch.equal(a, b))
                    for a, b in zip(self.tables, _tables_of(bm), strict=True)
                )
                and all(
                    _version(t) == version and (copy is None or (t.shape == copy.shape and _equal(t, copy)))
                    for t, version, copy in self.captured
                )
                and all(_safe_same(_now(holder, name), v) for holder, name, v in self.bound)
            )
        except Exception:  # a value that can no longer be read or compared: look again
            return False


def _version(t: torch.Tensor) -> int | None:
    """``t``'s version counter, or None for an inference tensor (it has none: its copy decides)."""
    try:
        return t._version
    except RuntimeError:
        return None


def _copy(t: torch.Tensor) -> torch.Tensor | None:
    return t.detach().clone() if t.numel() <= CAPTURED_COPY_MAX else None


def _comparable(t: torch.Tensor) -> bool:
    return t.layout == torch.strided and not t.is_meta and not t.is_nested


def _equal(t: torch.Tensor, copy: torch.Tensor) -> bool:
    """Equal, NaN where NaN (an unchanged tensor holding NaN is unchanged)."""
    if torch.equal(t, copy):
        return True
    if not t.is_floating_point() and not t.is_complex():
        return False
    return bool(((t == copy) | (t.isnan() & copy.isnan())).all())


CAPTURED_COPY_MAX = 1 << 20
"""Elements up to which a tensor a mask_mod reads is copied and compared on every call (beyond: its
version counter only, which misses writes through ``.data``)."""


def captured(fn, depth: int = 0, seen: _Seen | None = None, bound: list | None = None) -> list[torch.Tensor]:
    """The tensors ``fn`` reads besides its arguments: its closure cells, defaults and the globals its code
    names (nested functions' code too); a ``functools.partial``'s arguments; a callable object's
    attributes (this library's ready mods) and its ``__call__``'s; a bound method's object's; and,
    recursively (:data:`WALK_DEPTH` levels), what is found there — the entries of dicts, lists, tuples and
    deques, the attributes of objects and their classes (``ns.doc``; ``__slots__``; an ``nn.Module``'s
    buffers, submodules and attributes that the walked code or a method it calls names, not its
    parameters), a user's config module's named attributes, numpy arrays (as tensors on their memory),
    the callables inside (``and_masks``' list of mods). ``bound`` (a list) receives (holder, key, value) for what a
    closure cell (key None), a dict or an object (key a name) or a list (key an index) holds — tensors,
    numbers, strings, containers, objects — which a later assignment can rebind (``nonlocal offset``,
    ``cfg["inner"]["doc"] = …``, ``self.ids = …``, ``DOCS = [new]``), and a dict's or list's length
    (key :data:`SIZE`: a key added later).

    Not walked: containers over :data:`WALK_ITEMS_MAX` entries, anything past :data:`WALK_BUDGET` values in
    all, a property that reads a global, ``__getattr__``, what a cached function returns (docs/flex.md, "What differs"). An
    object whose attributes cannot be read (a dead weak proxy, a ``__getattr__`` that raises) is skipped.

    >>> ids = {"doc": torch.tensor([0, 0, 1])}
    >>> [t.tolist() for t in captured(lambda b, h, q, kv: ids["doc"][q] == ids["doc"][kv])]
    [[0, 0, 1]]
    """
    if seen is None:  # the names all the reachable code reads first: they decide which attributes count
        names: set[str] = set()
        for _ in range(3):
            first = _Seen(names)
            captured(fn, 0, first, None)
            if first.names == names:
                break
            names = first.names
        seen = _Seen(names)
    if id(fn) in seen or depth > WALK_DEPTH or seen.spent > WALK_BUDGET:
        return []
    seen.add(id(fn))
    found: list = []
    try:
        if isinstance(fn, functools.partial):  # its keywords as a dict: an entry changed is seen
            found += [fn.func, fn.args, fn.keywords]
        code = getattr(fn, "__code__", None)
        if code is not None:
            cells = [c for c in (fn.__closure__ or ()) if _filled(c)]
            glob = getattr(fn, "__globals__", {})
            read = _names(code)
            names = [n for n in read if n in glob]
            if not _library_code(code):
                seen.names.update(read)
            if bound is not None:
                bound += [(c, None, c.cell_contents) for c in cells]
                bound += [(glob, n, glob[n]) for n in names]
            found += [c.cell_contents for c in cells]
            found += list(fn.__defaults__ or ()) + list((fn.__kwdefaults__ or {}).values())
            found += [glob[n] for n in names]
            if getattr(fn, "__dict__", None):  # a function's own attributes (``mod.window = 70``)
                found.append(fn.__dict__)
            owner = getattr(fn, "__self__", None)  # a bound method: its object's attributes
            if owner is not None and not inspect.ismodule(owner):
                found.append(owner)
        elif not isinstance(fn, type) and not inspect.ismodule(fn):
            call = getattr(type(fn), "__call__", None)  # noqa: B004 — its code, not whether it is callable
            if getattr(call, "__code__", None) is not None:
                found.append(call)
                if not _library_code(call.__code__):
                    seen.names.update(_names(call.__code__))
            found += [v for _, _, v in _members(fn, seen, bound)]
    except Exception:  # an object that refuses to be looked at: what was found so far
        pass
    out: list[torch.Tensor] = []
    for x in found:
        out += _walk(x, depth, seen, bound)
    return out


WALK_DEPTH = 4
"""How many levels of callables, containers and objects :func:`captured` walks from the mask function."""

WALK_ITEMS_MAX = 256
"""Entries beyond which a dict, list, tuple or object's attributes are not walked (a model's state)."""

ABSENT_MAX = 64
"""Names a module's code reads that it does not have yet, watched per module (set or registered later)."""

WALK_BUDGET = 1024
"""Values :func:`captured` reads from containers and objects in all (each one watched is compared on every
call: about 0.3 µs each)."""


def _walk(x, depth: int, seen: _Seen, bound: list | None) -> list[torch.Tensor]:
    """The tensors in ``x``, a value a mask function reaches: itself, or what it holds (see :func:`captured`);
    [] for what cannot be looked at (a dead weak proxy raises on ``isinstance``)."""
    try:
        return _walk_value(x, depth, seen, bound)
    except Exception:
        return []


def _walk_value(x, depth: int, seen: _Seen, bound: list | None) -> list[torch.Tensor]:
    if isinstance(x, torch.Tensor):
        if id(x) in seen:
            return []
        seen.add(id(x))
        return [x]
    if inspect.ismodule(x) and not _atom_module(x) and depth < WALK_DEPTH:
        # a user's config module (``cfg.WINDOW``): the attributes the walked code names
        if id(x) in seen:
            return []
        seen.add(id(x))
        attrs = vars(x)
        members = [(attrs, k, attrs[k]) for k in sorted(seen.names) if k in attrs]
        if bound is not None:
            bound += members
        return [t for _, _, v in members for t in _walk(v, depth + 1, seen, bound)]
    if _atom(x) or id(x) in seen or seen.spent > WALK_BUDGET:
        return []
    if type(x).__module__ == "numpy" and type(x).__name__ == "ndarray":  # watched as a tensor on its memory
        seen.add(id(x))
        if not x.flags.writeable:  # cannot change in place (torch would warn on it)
            return []
        return [torch.from_numpy(x)]  # (an object array raises: not watched)
    if callable(x) and not isinstance(x, type | torch.nn.Module):  # a module: its state, not its forward
        return captured(x, depth + 1, seen, bound)
    if depth >= WALK_DEPTH:
        return []
    seen.add(id(x))
    members = _members(x, seen, bound)
    out: list[torch.Tensor] = []
    for _, _, v in members:
        out += _walk(v, depth + 1, seen, bound)
    return out


def _members(x, seen: _Seen, bound: list | None) -> list[tuple]:
    """(holder, key, value) for what container or object ``x`` holds, [] for more than
    :data:`WALK_ITEMS_MAX` entries or past the walk's :data:`WALK_BUDGET`; those a later assignment can
    rebind go to ``bound`` as well."""
    if isinstance(x, type):  # a class the function names (``C.doc``): its attributes and its bases'
        members = _class_members(x)
    elif isinstance(x, dict):
        members = [(x, k, v) for k, v in x.items()]
    elif isinstance(x, list | tuple | collections.deque):
        members = [(x, i, v) for i, v in enumerate(x)]
    elif isinstance(x, torch.nn.Module):
        # the buffers, submodules and plain attributes (``self._doc`` too) that the code walked so far names,
        # or the module's methods it calls — not the parameters, not torch's bookkeeping, not what other
        # methods use (a step counter, a cache buffer, BatchNorm's running statistics change every step)
        names = _method_names(type(x), seen.names)
        seen.names |= names
        every = isinstance(x, torch.nn.ModuleList | torch.nn.Sequential | torch.nn.ModuleDict)  # layers[0]
        members = [(x._modules, k, v) for k, v in x._modules.items() if every or k in names]
        members += [(x._buffers, k, v) for k, v in x._buffers.items() if k in names]
        members += [(vars(x), k, v) for k, v in vars(x).items() if k in names and k not in _MODULE_FIELDS]
        members += [m for m in _class_members(type(x)) if m[1] in names]  # a class-level default
        # a named attribute or buffer that does not exist yet (set or registered later: getattr(self, "pad",
        # None), a class-level default shadowed) — absent now, watched as None
        absent = sorted(n for n in names if n not in vars(x) and n not in x._buffers and n not in x._modules)
        if bound is not None:
            bound += [(d, n, None) for n in absent[:ABSENT_MAX] for d in (vars(x), x._buffers)]
    else:
        try:
            attrs = vars(x)
        except Exception:  # no __dict__ (or a __getattr__ that raises for it)
            attrs = None
        if isinstance(attrs, dict):  # with its length: an attribute added later (a getattr default)
            members = [(attrs, k, v) for k, v in attrs.items()] + [(attrs, SIZE, len(attrs))]
        else:  # an object with __slots__ (a dataclass(slots=True)): its filled slots, read by name
            members = [(x, n, v) for n in _slots(x) if (v := _slot(x, n)) is not _EMPTY]
        members += _class_members(type(x))  # ``self.doc`` where doc is class-level, or a base's
    if len(members) > WALK_ITEMS_MAX or seen.spent + len(members) > WALK_BUDGET:
        return []
    seen.spent += len(members)
    if bound is not None and not isinstance(x, tuple):  # a tuple's entries cannot be rebound
        bound += members
        if isinstance(x, dict | list | collections.deque):  # a key added or an entry appended
            bound.append((x, SIZE, len(x)))
    return [m for m in members if m[1] is not SIZE]


def _class_members(cls: type) -> list[tuple]:
    """The data attributes of ``cls`` and its bases (not builtins', torch's or numpy's), as members."""
    return [
        (c.__dict__, k, v)
        for c in cls.__mro__
        if not _atom(c)
        for k, v in vars(c).items()
        if _class_value(k, v)
    ]


def _method_names(cls: type, names: set[str]) -> set[str]:
    """``names`` with those read by the methods and properties of ``cls`` and its user bases that
    ``names`` calls (every class's version: ``super().helper()``), and by those they call: the attributes a
    mask method reaches through ``self.helper()`` or ``self.ids_property``."""
    names = set(names)
    methods: dict[str, list] = {}
    for c in cls.__mro__:
        if _atom(c) or c is torch.nn.Module:
            continue
        for k, v in vars(c).items():
            fns = [v.fget, v.fset] if isinstance(v, property) else [getattr(v, "__func__", v)]
            codes = [f.__code__ for f in fns if getattr(f, "__code__", None) is not None]
            methods.setdefault(k, []).extend(codes)
    todo = [k for k in methods if k in names]
    done: set[str] = set()
    while todo:
        k = todo.pop()
        if k in done:
            continue
        done.add(k)
        for code in methods[k]:
            found = set(_names(code))
            names |= found
            todo += [m for m in found if m in methods and m not in done]
    return names


_MODULE_FIELDS = frozenset(vars(torch.nn.Module()))
"""The attributes every nn.Module has (training, the parameter / buffer / hook dicts): not user state."""


class _Seen(set):
    """The ids a walk has looked at, how many values it has read (:data:`WALK_BUDGET`) and the names the
    code it walked reads (the attributes of a module that count)."""

    def __init__(self, names: set[str] | None = None) -> None:
        super().__init__()
        self.spent = 0
        self.names: set[str] = set(names or ())


SIZE = object()
"""The key under which ``bound`` records a dict's or list's length (a key added later: ``cfg.get``)."""

_EMPTY = object()


def _slot(x, name: str):
    """The value in slot ``name`` of ``x``, or _EMPTY when it is unset or cannot be read."""
    try:
        return getattr(x, name)
    except Exception:  # unset (AttributeError), or a __getattr__ that raises something else
        return _EMPTY


def _class_value(name: str, v) -> bool:
    """Whether a class attribute is data a function may read (not a dunder, a method or a descriptor)."""
    return not name.startswith("__") and not inspect.isroutine(v) and not hasattr(type(v), "__get__")


def _names(code) -> list[str]:
    """The names ``code`` reads — globals and attributes, and the identifier-like string constants
    (``getattr(self, "doc")``, ``self.__dict__["doc"]``) — with those of the functions and lambdas defined
    inside it."""
    names = list(code.co_names)
    for const in code.co_consts:
        if inspect.iscode(const):
            names += _names(const)
        elif isinstance(const, str) and const.isidentifier():
            names.append(const)
    return names


def _atom(x) -> bool:
    """A value with nothing inside to walk: a number, string, bytes, None, a module or a built-in class."""
    if isinstance(x, type):
        home = str(getattr(x, "__module__", None) or "builtins").split(".")[0]
        return home in ("builtins", "torch", "numpy", "typing", "collections", "enum", "abc")
    return isinstance(x, numbers.Number | str | bytes | type(None)) or inspect.ismodule(x)


def _library_code(code) -> bool:
    """Code of torch or an installed package (its names — BatchNorm's running_mean — are not the user's)."""
    path = code.co_filename
    return "site-packages" in path or "dist-packages" in path or path.startswith("<frozen")


def _atom_module(m) -> bool:
    """A module whose attributes are not user state: the standard library's, torch's, numpy's, this
    library's, or any installed package's."""
    top = m.__name__.split(".")[0]
    path = str(getattr(m, "__file__", None) or "")
    return (
        top in sys.stdlib_module_names
        or top in ("torch", "numpy", "selfattention", "transformers", "builtins")
        or "site-packages" in path
        or "dist-packages" in path
        or not path
    )


def _slots(x) -> list[str]:
    """The slot names of ``x``'s class and its bases."""
    names = []
    for cls in type(x).__mro__:
        slots = cls.__dict__.get("__slots__", ())
        names += (
            [slots] if isinstance(slots, str) else [n for n in slots if n not in ("__dict__", "__weakref__")]
        )
    return names


def _safe_same(a, b) -> bool:
    """:func:`_same`, False (changed) when the comparison itself raises (a dead weak proxy, an ``__eq__``
    that raises)."""
    try:
        return bool(_same(a, b))
    except Exception:
        return False


def _same(a, b) -> bool:
    """``==`` for numbers and strings of the same type, ``is`` for everything else."""
    if a is b:
        return True
    if type(a) is type(b) and isinstance(a, numbers.Number | str):
        return bool(a == b) or bool(a != a and b != b)  # a NaN number stays the same NaN
    return False


def _now(holder, name):
    """What a closure cell (``name`` None), a dict, a list or an object's slot holds now (None once emptied
    or deleted)."""
    if name is None:
        return holder.cell_contents if _filled(holder) else None
    if name is SIZE:
        return len(holder)
    if isinstance(holder, list | collections.deque):
        return holder[name] if name < len(holder) else None
    if isinstance(holder, Mapping):  # a dict, an object's __dict__, a class's mappingproxy
        return holder.get(name)
    v = _slot(holder, name)
    return None if v is _EMPTY else v


def _filled(cell) -> bool:
    try:
        cell.cell_contents  # noqa: B018 — an empty cell raises ValueError
    except ValueError:
        return False
    return True


def _tables_of(bm: BlockMask) -> tuple:
    return (bm.kv_num_blocks, bm.kv_indices, bm.full_kv_num_blocks, bm.full_kv_indices)
