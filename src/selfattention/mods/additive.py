"""Whether a user's ``score_mod`` is ``score + bias(b, h, q_idx, kv_idx)``, proved from its code.

The fused kernel takes an additive bias tile, so an additive score_mod runs at the fused kernel's speed;
any other score_mod must see the real scores (the score-mod kernel). Telling them apart by calling the
mod on sample scores is unsound: ``score.clamp(-50, 50)`` or ``torch.where(q_idx == kv_idx, 3 * score,
score)`` agree with ``score + mod(0)`` on most samples and differ where it matters. Here the mod is traced
with ``torch.fx.symbolic_trace`` (Python-level operations on proxies; no value is looked at), and it is
additive only when its result is the score itself plus or minus terms that do not depend on the score::

    score + slopes[h] * (kv_idx - q_idx)          additive (ALiBi)
    table[h, q_idx - kv_idx] + score              additive (a relative-position bias)
    score - bias[b, h, q_idx, kv_idx]             additive
    score.clamp(-50, 50),  score * 2,  softcap    not additive: the score-mod kernel
    torch.where(mask, score + 1, score)           not additive

A mod that cannot be traced (control flow on a value, ``.item()``, an unsupported callable) counts as not
additive — correct either way, only slower. Results are cached per function object.
"""

from __future__ import annotations

import operator
import weakref
from collections.abc import Callable

import torch
import torch.fx

__all__ = ["is_additive"]

_CACHE: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()

_ADD = {operator.add, torch.add, "add"}
_SUB = {operator.sub, torch.sub, torch.subtract, "sub", "subtract"}


def is_additive(score_mod: Callable) -> bool:
    """True when ``score_mod(score, b, h, q_idx, kv_idx)`` is provably ``score ± terms free of score``.

    >>> slopes = torch.tensor([0.5, 0.25])
    >>> is_additive(lambda s, b, h, q, kv: s + slopes[h] * (kv - q))
    True
    >>> is_additive(lambda s, b, h, q, kv: s.clamp(-50.0, 50.0))
    False
    >>> is_additive(lambda s, b, h, q, kv: torch.where(q == kv, 3 * s, s))
    False
    """
    try:
        return _CACHE[score_mod]
    except (KeyError, TypeError):
        pass
    result = _traced_additive(score_mod)
    try:
        _CACHE[score_mod] = result
    except TypeError:  # not weak-referenceable: no cache
        pass
    return result


def _traced_additive(score_mod: Callable) -> bool:
    try:
        gm = torch.fx.symbolic_trace(lambda score, b, h, q_idx, kv_idx: score_mod(score, b, h, q_idx, kv_idx))
    except Exception:
        return False
    nodes = list(gm.graph.nodes)
    placeholders = [n for n in nodes if n.op == "placeholder"]
    if len(placeholders) != 5:
        return False
    score = placeholders[0]
    depends: set[torch.fx.Node] = {score}  # nodes whose value depends on the score
    for n in nodes:
        if n.op in ("placeholder", "output"):
            continue
        if any(a in depends for a in n.all_input_nodes):
            depends.add(n)
    outputs = [n for n in nodes if n.op == "output"]
    if len(outputs) != 1 or not isinstance(outputs[0].args[0], torch.fx.Node):
        return False
    return _unit(outputs[0].args[0], score, depends)


def _unit(n: torch.fx.Node, score: torch.fx.Node, depends: set) -> bool:
    """Whether node ``n`` is the score plus or minus score-free terms (coefficient exactly 1)."""
    while True:
        if n is score:
            return True
        if n.op not in ("call_function", "call_method") or n.kwargs.get("alpha", 1) != 1:
            return False
        args = n.args
        if len(args) != 2:
            return False
        a, c = (x in depends if isinstance(x, torch.fx.Node) else False for x in args)
        if n.target in _ADD and a != c:  # score-dependent + score-free, in either order
            n = args[0] if a else args[1]
        elif n.target in _SUB and a and not c:
            n = args[0]
        else:
            return False
