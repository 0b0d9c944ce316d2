"""The attention tasks: lecture 000's ``simple_attention``, lecture 003's ``scaled_dot_product_attention``,
the ``SelfAttention`` module with W_q/W_k/W_v, and one cached decode step.

Each task's spec path is :mod:`selfattention.functional` itself; the mutated paths (one per known mistake,
see :mod:`.mistakes`) are written here once, in :func:`attend`, in float64.
"""

from __future__ import annotations

import copy
import math
import re
from typing import Any

import torch

from .. import functional as F
from ..i18n import N_, _
from .fit import Axis, NotGradable, Probe, Task, call_watched, first_output, positional_count, required_count

__all__ = ["SIMPLE", "SDPA", "MODULE", "DECODE", "attend"]

_SCALE = Axis(
    "scale",
    (
        ("sqrt_dk", None),
        ("none", "missing_scale"),
        ("dk", "scale_d_k"),
        ("inverted", "scale_inverted"),
    ),
)
_SCALE_MODULE = Axis("scale", (*_SCALE.options, ("sqrt_dmodel", "scale_d_model")))
_SCALE_SIMPLE = Axis("scale", (("none", None), ("sqrt_d", "extra_scale")))
_AXIS = Axis("axis", (("keys", None), ("queries", "softmax_axis")))
_ORDER = Axis(
    "order",
    (
        ("qk", None),
        ("kq", "transposed_scores"),
        ("weights_t", "transposed_scores"),
        ("no_transpose", "missing_transpose"),
    ),
)
_ORDER_SIMPLE = Axis("order", (("qk", None), ("no_transpose", "missing_transpose")))
_NORM = Axis("norm", (("softmax", None), ("raw", "rows_not_normalized"), ("exp", "rows_not_normalized")))
_NORM_MASK = Axis("norm", (*_NORM.options, ("post_mask", "rows_not_normalized")))
_POLARITY = Axis("polarity", (("keep", None), ("inverted", "mask_polarity")))
_FILL = Axis(
    "fill",
    (
        ("zero_rows", None),
        ("neg_inf", "masked_row_nan"),
        ("big_negative", "masked_row_uniform"),
        ("ignored", "mask_ignored"),
        ("zero", "mask_fill_zero"),
    ),
)
_VALUE = Axis("value", (("v", None), ("x", "value_not_projected")))

_FILL_VALUE = {"zero_rows": -math.inf, "neg_inf": -math.inf, "big_negative": -1e9, "zero": 0.0}


def _factor(option: str, dk: int, dmodel: int | None = None) -> float:
    return {
        "sqrt_dk": 1 / math.sqrt(dk),
        "none": 1.0,
        "dk": 1 / dk,
        "inverted": math.sqrt(dk),
        "sqrt_dmodel": 1 / math.sqrt(dmodel or dk),
        "sqrt_d": 1 / math.sqrt(dk),
    }[option]


def attend(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    mask: torch.Tensor | None,
    config: dict[str, str],
    factor: float,
) -> torch.Tensor:
    """Attention of (Tq, D) queries over (Tk, D) keys and (Tk, Dv) values under ``config``'s mutations.

    ``config`` keys: ``order`` (qk | kq | weights_t | no_transpose: Q·K, which runs only when Tk = D),
    ``axis`` (keys | queries), ``norm`` (softmax | raw |
    exp | post_mask), ``polarity`` (keep | inverted), ``fill`` (zero_rows | neg_inf | big_negative | ignored
    | zero); missing keys take the spec option. ``mask`` is bool, True = attend. Raises what torch raises
    when a mutation cannot run on these shapes (K Qᵀ with Tq ≠ Tk, Q·K with Tk ≠ D).
    """
    order = config.get("order", "qk")
    norm = config.get("norm", "softmax")
    fill = config.get("fill", "zero_rows")
    if order == "no_transpose":
        scores = (q @ k) * factor
    else:
        scores = (k @ q.mT if order == "kq" else q @ k.mT) * factor
    keep = None
    if mask is not None and fill != "ignored":
        keep = mask if config.get("polarity", "keep") == "keep" else ~mask
    dim = -1 if config.get("axis", "keys") == "keys" else -2
    if keep is not None and norm != "post_mask":
        scores = scores.masked_fill(~keep, _FILL_VALUE[fill])
    if norm in ("softmax", "post_mask"):
        weights = torch.softmax(scores, dim=dim)
    elif norm == "exp":
        weights = torch.exp(scores)
    else:
        weights = scores
    if keep is not None:
        if norm == "post_mask":
            weights = weights * keep
        elif fill == "zero_rows":  # a query (or, along the wrong axis, a key) that sees nothing gets 0
            weights = torch.where((~keep).all(dim=dim, keepdim=True), 0.0, weights)
    if order == "weights_t":
        weights = weights.mT
    return weights @ v


def _randn(gen: torch.Generator, *shape: int, std: float = 1.0) -> torch.Tensor:
    return torch.randn(*shape, generator=gen) * std


def _gen() -> torch.Generator:
    return torch.Generator().manual_seed(20)


# ---------------------------------------------------------------------------------------------------------
# lecture 000: simple_attention(X) = softmax(X Xᵀ) X


def _simple_probes(_subject: Any) -> list[Probe]:
    gen = _gen()
    journey = torch.tensor([[0.43, 0.15, 0.89, 0.55], [0.55, 0.87, 0.66, 0.58], [0.57, 0.85, 0.64, 0.80]])
    return [
        Probe(N_("lecture 000's “Your journey starts” (3 tokens, d = 4)"), (journey,)),
        Probe(N_("5 tokens, d = 3"), (_randn(gen, 5, 3, std=0.8),)),
        Probe(N_("4 tokens, d = 6"), (_randn(gen, 4, 6, std=0.6),)),
        Probe(N_("one token (exercise 4: n = 1)"), (_randn(gen, 1, 4),)),
        Probe(N_("4 tokens, d = 4 (X X runs even without the transpose)"), (_randn(gen, 4, 4, std=0.6),)),
    ]


def _simple_reference(_subject: Any, config: dict[str, str], probe: Probe) -> torch.Tensor:
    x = probe.args[0].double()
    if config == SIMPLE.spec:
        return F.simple_attention(x)
    return attend(x, x, x, None, config, _factor(config["scale"], x.shape[-1]))


SIMPLE = Task(
    name="simple_attention",
    signature="simple_attention(X) -> Z",
    contract=N_("X (T, d) → Z = softmax(X Xᵀ) X, (T, d); no scaling, no mask"),
    lecture="000",
    names=("simple_attention",),
    axes=(_SCALE_SIMPLE, _AXIS, _ORDER_SIMPLE, _NORM),
    probes=_simple_probes,
    call=lambda fn, probe: first_output(call_watched(fn, (probe.args[0].clone(),), ("X",))),
    reference=_simple_reference,
)


# ---------------------------------------------------------------------------------------------------------
# lecture 003: scaled_dot_product_attention(q, k, v, mask=None) = softmax(Q Kᵀ/√d_k + mask) V

_SQUARE_MASK = [[1, 0, 1, 1, 0], [0, 0, 0, 0, 0], [1, 1, 1, 1, 1], [0, 1, 0, 0, 1], [1, 1, 0, 1, 0]]
_WIDE_MASK = [[0, 0, 0, 0, 0, 0], [1, 0, 0, 1, 1, 0], [1, 1, 1, 1, 1, 1], [0, 1, 1, 0, 0, 1]]
#: a fully masked row and a key no query sees (key 4): with the softmax over the wrong axis, the empty
#: column is what an unguarded −∞ fill turns into NaN
_HIDDEN_KEY_MASK = [[1, 0, 1, 0, 0], [0, 0, 0, 0, 0], [1, 1, 0, 1, 0], [0, 1, 1, 1, 0]]


def _qkv(gen: torch.Generator, tq: int, tk: int, dk: int = 6, dv: int = 4) -> tuple[torch.Tensor, ...]:
    return _randn(gen, tq, dk), _randn(gen, tk, dk), _randn(gen, tk, dv)


def _sdpa_probes(fn: Any) -> list[Probe]:
    gen = _gen()
    probes = [
        Probe(N_("Tq = Tk = 5, d_k = 6, d_v = 4, no mask"), _qkv(gen, 5, 5)),
        Probe(N_("Tq = 3, Tk = 7, no mask"), _qkv(gen, 3, 7)),
    ]
    n = positional_count(fn)
    if n is None or n >= 4:
        probes += [
            Probe(
                N_("Tq = Tk = 5, bool mask (True = attend) with a fully masked row"),
                (*_qkv(gen, 5, 5), torch.tensor(_SQUARE_MASK, dtype=torch.bool)),
            ),
            Probe(
                N_("Tq = 4, Tk = 6, bool mask with a fully masked row"),
                (*_qkv(gen, 4, 6), torch.tensor(_WIDE_MASK, dtype=torch.bool)),
            ),
            Probe(
                N_("Tq = 4, Tk = 5, bool mask with a fully masked row and a key no query sees"),
                (*_qkv(gen, 4, 5), torch.tensor(_HIDDEN_KEY_MASK, dtype=torch.bool)),
            ),
        ]
    probes.append(
        Probe(N_("Tq = 2, Tk = d_k = 6, no mask (Q K runs even without the transpose)"), _qkv(gen, 2, 6))
    )
    return probes


def _sdpa_args(fn: Any, probe: Probe) -> tuple[Any, ...]:
    """The probe's (q, k, v[, mask]) as fresh copies; ``None`` for the mask of a no-mask probe when the
    learner's function makes ``mask`` a required argument."""
    args: tuple[Any, ...] = tuple(t.clone() for t in probe.args)
    if len(args) == 3 and required_count(fn) >= 4:
        args = (*args, None)
    return args


def _sdpa_reference(_subject: Any, config: dict[str, str], probe: Probe) -> torch.Tensor:
    q, k, v = (t.double() for t in probe.args[:3])
    mask = probe.args[3] if len(probe.args) > 3 else None
    factor = _factor(config["scale"], q.shape[-1])
    if config == SDPA.spec:
        return F.scaled_dot_product_attention(q, k, v, attn_mask=mask)
    return attend(q, k, v, mask, config, factor)


SDPA = Task(
    name="scaled_dot_product_attention",
    signature="scaled_dot_product_attention(q, k, v, mask=None) -> out",
    contract=N_(
        "q (Tq, d_k), k (Tk, d_k), v (Tk, d_v), mask None or bool (Tq, Tk) with True = attend → (Tq, d_v)"
    ),
    lecture="003",
    names=("scaled_dot_product_attention",),
    axes=(_SCALE, _AXIS, _ORDER, _NORM_MASK, _POLARITY, _FILL),
    probes=_sdpa_probes,
    call=lambda fn, probe: first_output(call_watched(fn, _sdpa_args(fn, probe), ("q", "k", "v", "mask"))),
    reference=_sdpa_reference,
)


# ---------------------------------------------------------------------------------------------------------
# lecture 003: a SelfAttention(d_in, d_out) module with W_q, W_k, W_v

D_IN, D_OUT = 5, 3
_DROP = {
    "w",
    "weight",
    "weights",
    "proj",
    "projection",
    "linear",
    "lin",
    "layer",
    "fc",
    "to",
    "matrix",
    "mat",
}
_ROLES = {"q": "q", "query": "q", "k": "k", "key": "k", "v": "v", "val": "v", "value": "v"}
_FUSED = {"qkv", "inproj", "cattn", "wqkv"}


def _role(name: str) -> str | None:
    """``W_query`` → q, ``to_k`` → k, ``Wv`` → v, ``qkv``/``c_attn``/``in_proj`` → qkv; None otherwise."""
    words = [w.lower() for w in re.split(r"[_\W]+|(?<=[a-z])(?=[A-Z])", name) if w]
    key = "".join(w for w in words if w not in _DROP)
    if key in _FUSED or "".join(words) in _FUSED:
        return "qkv"
    if key.startswith("w") and key[1:] in _ROLES:
        key = key[1:]
    return _ROLES.get(key)


def _apply(obj: Any, d_in: int, width: int) -> Any:
    """x ↦ the projection ``obj`` (an nn.Module, or a (d_in, width) / (width, d_in) matrix) applies."""
    if isinstance(obj, torch.nn.Module):
        return lambda x: obj(x)
    if tuple(obj.shape) == (d_in, width):
        return lambda x: x @ obj
    if tuple(obj.shape) == (width, d_in):
        return lambda x: x @ obj.T
    return None


def projections(module: torch.nn.Module, d_in: int, d_out: int) -> dict[str, Any]:
    """The module's query/key/value projections by role (q, k, v): functions x ↦ x·W.

    Found by name among the module's direct submodules and parameters (``W_query``, ``W_q``, ``Wq``,
    ``q_proj``, ``to_q``, ``query`` …; a fused ``qkv``/``c_attn``/``in_proj`` of width 3·d_out is split
    in the order q, k, v). Raises :class:`NotGradable` naming what is missing.
    """
    found: dict[str, Any] = {}
    items = list(module.named_children()) + list(module.named_parameters(recurse=False))
    for name, obj in items:
        role = _role(name)
        if role == "qkv":
            fused = _apply(obj, d_in, 3 * d_out)
            if fused is not None:
                for i, r in enumerate("qkv"):
                    found.setdefault(r, lambda x, i=i, f=fused: f(x)[..., i * d_out : (i + 1) * d_out])
        elif role is not None and role not in found:
            applied = _apply(obj, d_in, d_out)
            if applied is not None:
                found[role] = applied
    missing = [r for r in "qkv" if r not in found]
    if missing:
        raise NotGradable(
            _(
                "no projection found for {roles} among {names}: name them W_query, W_key, W_value "
                "(nn.Linear(d_in, d_out) or (d_in, d_out) parameters)"
            ).format(roles=", ".join(f"W_{r}" for r in missing), names=[n for n, _ in items] or "nothing")
        )
    return found


def _module_prepare(obj: Any) -> dict[str, Any]:
    if isinstance(obj, torch.nn.Module):
        module = copy.deepcopy(obj)  # never change the learner's own instance
        d_in, d_out = getattr(module, "d_in", None), getattr(module, "d_out", None)
        if not (isinstance(d_in, int) and isinstance(d_out, int)):
            raise NotGradable(
                _("an instance must have int attributes d_in and d_out; pass the class instead")
            )
    else:
        d_in, d_out = D_IN, D_OUT
        try:
            module = obj(d_in, d_out)
        except Exception as e:
            raise NotGradable(
                _("SelfAttention(d_in={d_in}, d_out={d_out}) failed: {error}").format(
                    d_in=d_in, d_out=d_out, error=f"{type(e).__name__}: {e}"
                )
            ) from e
        if not isinstance(module, torch.nn.Module):
            raise NotGradable(
                _("SelfAttention(...) made a {kind}, not a torch.nn.Module").format(
                    kind=type(module).__name__
                )
            )
    gen = torch.Generator().manual_seed(3)
    with torch.no_grad():  # fresh weights, so that no initialisation hides a mistake (W_q = W_k …)
        for p in module.parameters():
            p.copy_(torch.randn(p.shape, generator=gen, dtype=p.dtype) * 0.45)
    module.eval()
    return {"module": module, "proj": projections(module, d_in, d_out), "d_in": d_in, "d_out": d_out}


def _module_probes(subject: dict[str, Any]) -> list[Probe]:
    gen = _gen()
    d = subject["d_in"]
    return [
        Probe(N_("4 tokens, d_in = 5, d_out = 3"), (_randn(gen, 4, d),)),
        Probe(N_("6 tokens, d_in = 5, d_out = 3"), (_randn(gen, 6, d),)),
        Probe(N_("2 tokens"), (_randn(gen, 2, d),)),
        Probe(N_("3 tokens (T = d_out: Q K runs even without the transpose)"), (_randn(gen, 3, d),)),
    ]


def _module_reference(subject: dict[str, Any], config: dict[str, str], probe: Probe) -> torch.Tensor:
    x = probe.args[0]
    proj = subject["proj"]
    q, k, v = (proj[r](x).double() for r in "qkv")
    if config["value"] == "x":
        v = x.double()
    factor = _factor(config["scale"], subject["d_out"], subject["d_in"])
    if config == MODULE.spec:
        return F.scaled_dot_product_attention(q, k, v)
    return attend(q, k, v, None, config, factor)


MODULE = Task(
    name="SelfAttention",
    signature="SelfAttention(d_in, d_out)(x) -> context",
    contract=N_(
        "an nn.Module with projections W_query, W_key, W_value (nn.Linear or (d_in, d_out) matrices); forward(x): x (T, d_in) → (T, d_out)"
    ),
    lecture="003",
    names=("SelfAttention",),
    axes=(_SCALE_MODULE, _AXIS, _ORDER, _NORM, _VALUE),
    probes=_module_probes,
    call=lambda subject, probe: first_output(
        call_watched(subject["module"], (probe.args[0].clone(),), ("x",))
    ),
    reference=_module_reference,
    prepare=_module_prepare,
)


# ---------------------------------------------------------------------------------------------------------
# one cached decode step: decode_step(q, k, v, k_cache, v_cache, pos)

T_MAX, D_K, D_V = 8, 6, 4
_CACHE = Axis(
    "cache",
    (
        ("ok", None),
        ("read_short", "cache_off_by_one"),
        ("read_long", "cache_off_by_one"),
        ("write_next", "cache_off_by_one"),
        ("shifted", "cache_off_by_one"),
        ("concat", "cache_not_written"),
        ("stale", "cache_not_written"),
    ),
)
#: where each cache option writes the new key/value (offset from pos; None: not written) and how many
#: entries it attends to (offset from pos); "concat" attends to cache[:pos] plus the new key itself
_WRITE = {
    "ok": 0,
    "read_short": 0,
    "read_long": 0,
    "write_next": 1,
    "shifted": 1,
    "concat": None,
    "stale": None,
}
_READ = {"ok": 1, "read_short": 0, "read_long": 2, "write_next": 1, "shifted": 2, "concat": 0, "stale": 1}


def _decode_probes(_subject: Any) -> list[Probe]:
    gen = _gen()
    probes = []
    # pos = 4, 5, 6: a cache read of pos + 2, pos + 1 or pos keys gives d_k = 6 keys, where Q·K runs
    for pos in (0, 3, 4, 5, 6):
        q, k, v = _randn(gen, 1, D_K), _randn(gen, 1, D_K), _randn(gen, 1, D_V)
        k_cache, v_cache = _randn(gen, T_MAX, D_K), _randn(gen, T_MAX, D_V)  # slots ≥ pos: garbage
        probes.append(
            Probe(
                N_("new token at pos = {pos}, cache of {size} slots (slots ≥ pos hold garbage)"),
                (q, k, v, k_cache, v_cache, pos),
                info={"pos": pos, "size": T_MAX},
            )
        )
    return probes


def _decode_call(fn: Any, probe: Probe) -> tuple[Any, torch.Tensor, torch.Tensor]:
    q, k, v, k_cache, v_cache, pos = probe.args
    k_cache, v_cache = k_cache.clone(), v_cache.clone()
    out = first_output(fn(q.clone(), k.clone(), v.clone(), k_cache, v_cache, pos))
    out = torch.as_tensor(out)
    if out.numel() == D_V:  # (d_v,) and (1, d_v) are both accepted
        out = out.reshape(1, D_V)
    return out, k_cache, v_cache


def _decode_reference(_subject: Any, config: dict[str, str], probe: Probe) -> tuple[torch.Tensor, ...]:
    q, k, v, k_cache, v_cache, pos = probe.args
    k_cache, v_cache = k_cache.double().clone(), v_cache.double().clone()
    q, k, v = q.double(), k.double(), v.double()
    option = config["cache"]
    if _WRITE[option] is not None:
        k_cache[pos + _WRITE[option]] = k[0]
        v_cache[pos + _WRITE[option]] = v[0]
    n = pos + _READ[option]
    keys, values = k_cache[:n], v_cache[:n]
    if option == "concat":
        keys, values = torch.cat([keys, k]), torch.cat([values, v])
    if config == DECODE.spec:
        out = F.scaled_dot_product_attention(q, keys, values)
    else:
        out = attend(q, keys, values, None, config, _factor(config["scale"], D_K))
    return out, k_cache, v_cache


DECODE = Task(
    name="decode_step",
    signature="decode_step(q, k, v, k_cache, v_cache, pos) -> out",
    contract=N_(
        "q, k (1, d_k), v (1, d_v) of the new token; k_cache (T_max, d_k), v_cache (T_max, d_v) hold positions 0 … pos − 1: write k, v at index pos in place, return the attention over positions 0 … pos, (1, d_v)"
    ),
    lecture="003",
    names=("decode_step",),
    axes=(_SCALE, _AXIS, _ORDER_SIMPLE, _NORM, _CACHE),
    probes=_decode_probes,
    call=_decode_call,
    reference=_decode_reference,
)
