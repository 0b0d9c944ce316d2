"""The layout tasks: a causal mask builder, and multi-head split/merge.

The spec paths are :func:`selfattention.masks.causal_mask` (bottom-right aligned, True = attend) and the
(B, T, H·D) ↔ (B, H, T, D) layout of :class:`selfattention.mha.MultiHeadAttention`.
"""

from __future__ import annotations

from typing import Any

import torch

from ..i18n import N_, _
from ..masks import causal_mask
from .fit import Axis, NotGradable, Probe, Task, positional_count

__all__ = ["CAUSAL", "HEADS", "as_keep_mask"]


def as_keep_mask(value: Any) -> torch.Tensor:
    """A learner's mask as bool True = attend: bool as is, 0/1 numbers (1 = attend), or an additive float
    mask of 0 / −∞ (0 = attend). Raises ValueError for anything else."""
    m = value if isinstance(value, torch.Tensor) else torch.as_tensor(value)
    if m.dtype == torch.bool:
        return m
    m = m.to(torch.float64)
    if bool(((m == 0) | (m == 1)).all()):
        return m == 1
    if bool(((m == 0) | torch.isneginf(m) | (m <= -1e4)).all()):
        return m == 0
    raise ValueError(_("the mask holds values other than 0/1 or 0/−∞"))


def _causal_call(fn: Any, args: tuple[Any, ...]) -> torch.Tensor:
    """The learner's mask for ``args`` as a keep-mask. An all-zero float mask (every key visible, as
    (1, 5) gives) reads the same as a 0/1 mask with nothing visible; the learner's own mask for a 3 × 3
    problem (a hidden entry under every causal variant) tells which convention the zeros are written in."""
    value = fn(*args)
    m = value if isinstance(value, torch.Tensor) else torch.as_tensor(value)
    if m.dtype != torch.bool and m.numel() and bool((m == 0).all()):
        other = torch.as_tensor(fn(*((3,) * len(args)))).to(torch.float64)
        if bool((torch.isneginf(other) | (other <= -1e4)).any()):
            return torch.ones(m.shape, dtype=torch.bool)  # additive: 0 = attend
    return as_keep_mask(value)


# ---------------------------------------------------------------------------------------------------------
# causal_mask(q_len, k_len) -> (Tq, Tk) bool, True = attend, bottom-right aligned

_CAUSAL_AXES = (
    Axis("polarity", (("keep", None), ("inverted", "mask_polarity"))),
    Axis("align", (("bottom_right", None), ("top_left", "causal_top_left"))),
    Axis(
        "diagonal", (("self", None), ("excludes_self", "causal_diagonal"), ("sees_next", "causal_diagonal"))
    ),
    Axis("direction", (("past", None), ("future", "causal_future"))),
)
_SIZES = ((4, 4), (3, 6), (1, 5), (6, 6), (2, 7))


def _causal_probes(fn: Any) -> list[Probe]:
    n = positional_count(fn)
    one_length = n == 1
    probes = []
    for tq, tk in _SIZES:
        if one_length and tq != tk:
            continue
        args = (tq,) if one_length else (tq, tk)
        probes.append(Probe(N_("Tq = {tq}, Tk = {tk}"), args, info={"tq": tq, "tk": tk}))
    return probes


def _causal_reference(_subject: Any, config: dict[str, str], probe: Probe) -> torch.Tensor:
    tq, tk = probe.info["tq"], probe.info["tk"]
    if config == CAUSAL.spec:
        return causal_mask(tq, tk)
    offset = tk - tq if config["align"] == "bottom_right" else 0
    shift = {"self": 0, "excludes_self": -1, "sees_next": 1}[config["diagonal"]]
    i = torch.arange(tq).unsqueeze(1)
    j = torch.arange(tk).unsqueeze(0)
    if config["direction"] == "past":
        keep = j <= i + offset + shift
    else:  # the upper triangle: keys at or after the query's position
        keep = j >= i + offset - shift
    return keep if config["polarity"] == "keep" else ~keep


CAUSAL = Task(
    name="causal_mask",
    signature="causal_mask(q_len, k_len) -> mask",
    contract=N_("bool (Tq, Tk), True = attend; query i sits at key position Tk − Tq + i (bottom-right)"),
    lecture="003",
    names=("causal_mask",),
    axes=_CAUSAL_AXES,
    probes=_causal_probes,
    call=lambda fn, probe: _causal_call(fn, probe.args),
    reference=_causal_reference,
)


# ---------------------------------------------------------------------------------------------------------
# split_heads(x, num_heads): (B, T, H·D) → (B, H, T, D); merge_heads(x): (B, H, T, D) → (B, T, H·D)

_HEADS_AXES = (
    Axis(
        "split",
        (
            ("ok", None),
            ("view_bhtd", "heads_split_order"),
            ("interleaved", "heads_split_order"),
            ("no_transpose", "heads_split_order"),
        ),
    ),
    Axis(
        "merge",
        (
            ("ok", None),
            ("view_btd", "heads_merge_order"),
            ("interleaved", "heads_merge_order"),
            ("swap_td", "heads_merge_order"),
        ),
    ),
)


def _split(x: torch.Tensor, heads: int, option: str) -> torch.Tensor:
    b, t, dm = x.shape
    d = dm // heads
    if option == "ok":
        return x.reshape(b, t, heads, d).transpose(1, 2)
    if option == "view_bhtd":
        return x.reshape(b, heads, t, d)
    if option == "interleaved":
        return x.reshape(b, t, d, heads).permute(0, 3, 1, 2)
    return x.reshape(b, t, heads, d)  # no_transpose


def _merge(x: torch.Tensor, option: str) -> torch.Tensor:
    b, h, t, d = x.shape
    if option == "ok":
        return x.transpose(1, 2).reshape(b, t, h * d)
    if option == "view_btd":
        return x.reshape(b, t, h * d)
    if option == "interleaved":
        return x.permute(0, 2, 3, 1).reshape(b, t, d * h)
    return x.transpose(2, 3).reshape(b, t, h * d)  # swap_td


def _heads_prepare(obj: Any) -> dict[str, Any]:
    """The learner's (split_heads, merge_heads): from a pair, a mapping or a module-like namespace."""
    if isinstance(obj, tuple | list) and len(obj) == 2:
        split, merge = obj
    else:
        get = obj.get if isinstance(obj, dict) else lambda name: getattr(obj, name, None)
        split, merge = get("split_heads"), get("merge_heads")
    if not (callable(split) and callable(merge)):
        raise NotGradable(_("the heads task needs both split_heads(x, num_heads) and merge_heads(x)"))
    return {"split": split, "merge": merge, "merge_takes_heads": (positional_count(merge) or 2) >= 2}


def _heads_probes(_subject: Any) -> list[Probe]:
    gen = torch.Generator().manual_seed(20)
    probes = []
    for b, t, h, d in ((2, 5, 3, 4), (1, 7, 2, 5)):
        x = torch.randn(b, t, h * d, generator=gen)
        heads = torch.randn(b, h, t, d, generator=gen)
        probes.append(
            Probe(
                N_("B = {b}, T = {t}, H = {h}, head_dim = {d}"),
                (x, h, heads),
                info={"b": b, "t": t, "h": h, "d": d},
            )
        )
    return probes


def _heads_call(subject: dict[str, Any], probe: Probe) -> tuple[Any, Any]:
    x, h, heads = probe.args
    split = subject["split"](x.clone(), h)
    merge_args = (heads.clone(), h) if subject["merge_takes_heads"] else (heads.clone(),)
    merged = subject["merge"](*merge_args)
    return split, merged


def _heads_reference(_subject: Any, config: dict[str, str], probe: Probe) -> tuple[torch.Tensor, ...]:
    x, h, heads = probe.args
    return _split(x, h, config["split"]), _merge(heads, config["merge"])


HEADS = Task(
    name="heads",
    signature="split_heads(x, num_heads), merge_heads(x)",
    contract=N_("split_heads: (B, T, H·D) → (B, H, T, D); merge_heads: (B, H, T, D) → (B, T, H·D)"),
    lecture="003",
    names=("split_heads", "merge_heads"),
    axes=_HEADS_AXES,
    probes=_heads_probes,
    call=_heads_call,
    reference=_heads_reference,
    prepare=_heads_prepare,
)
