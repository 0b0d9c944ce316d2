"""Drawing inputs (hypothesis) for every public entry point, calling them, and checking each result against
the float64 spec."""

from __future__ import annotations

import math
import warnings
from collections.abc import Callable
from typing import Any

import torch

from .report import ALLOWED, BAD_DTYPES, FLOATS, FuzzFailure, FuzzReport, error_pattern

# ------------------------------------------------------------------------------------------- drawing


def _tensor(data, shape: tuple[int, ...], dtype: torch.dtype, magnitude: float, g: torch.Generator):
    t = torch.randn(shape, generator=g, dtype=torch.float64) * magnitude
    if data.draw(_st().integers(0, 5), label="nonfinite") == 0 and t.numel():
        n = data.draw(_st().integers(1, 3), label="n_bad")
        for _ in range(n):
            idx = data.draw(_st().integers(0, t.numel() - 1), label="bad_idx")
            t.view(-1)[idx] = data.draw(_st().sampled_from([math.nan, math.inf, -math.inf]), label="bad")
    if dtype in BAD_DTYPES:
        return t.nan_to_num().to(torch.int64).to(dtype) if dtype != torch.complex64 else t.to(dtype)
    return t.to(dtype)


def _st():
    from hypothesis import strategies

    return strategies


def _draw_attention_args(data, g: torch.Generator) -> dict[str, Any]:
    st = _st()
    good = data.draw(st.integers(0, 3), label="good") > 0  # 3 in 4 inputs valid apart from values
    dtype = data.draw(st.sampled_from(FLOATS), label="dtype")
    if not good and data.draw(st.booleans(), label="bad_dtype"):
        dtype = data.draw(st.sampled_from(BAD_DTYPES), label="dtype")
    b = data.draw(st.integers(0, 2), label="B")
    hkv = data.draw(st.integers(1, 3), label="Hkv")
    gqa = data.draw(st.booleans(), label="gqa")
    h = hkv * data.draw(st.integers(1, 3), label="group") if gqa else hkv
    tq = data.draw(st.integers(0, 11), label="Tq")
    tk = data.draw(st.integers(0, 11), label="Tk")
    d = data.draw(st.integers(0, 9), label="D")
    dv = data.draw(st.integers(0, 6), label="Dv")
    lead = data.draw(st.sampled_from(["BH", "B", "none"]), label="lead")
    qshape: tuple[int, ...] = {"BH": (b, h), "B": (b,), "none": ()}[lead] + (tq, d)
    kshape: tuple[int, ...] = {"BH": (b, hkv), "B": (b,), "none": ()}[lead] + (tk, d)
    vshape: tuple[int, ...] = kshape[:-1] + (dv,)
    if not good:  # break one shape
        which = data.draw(st.sampled_from(["q", "k", "v", "rank", "none"]), label="break")
        pos = data.draw(st.integers(0, 5), label="break_pos")
        delta = data.draw(st.sampled_from([-1, 1, 2]), label="break_delta")

        def broken(s: tuple[int, ...]) -> tuple[int, ...]:
            s = list(s)
            s[pos % len(s)] = max(0, s[pos % len(s)] + delta)
            return tuple(s)

        if which == "q":
            qshape = broken(qshape)
        elif which == "k":
            kshape = broken(kshape)
        elif which == "v":
            vshape = broken(vshape)
        elif which == "rank":
            qshape = qshape[1:] if len(qshape) > 1 else (3, *qshape)
    magnitude = data.draw(st.sampled_from([1e-3, 1.0, 1.0, 4.0, 30.0, 1e4]), label="magnitude")
    q = _tensor(data, qshape, dtype, magnitude, g)
    k_dtype = dtype
    if not good and data.draw(st.integers(0, 3), label="mix") == 0:
        k_dtype = data.draw(st.sampled_from(FLOATS), label="k_dtype")
    k = _tensor(data, kshape, k_dtype, magnitude, g)
    v = _tensor(data, vshape, dtype, 1.0, g)
    if not good and data.draw(st.integers(0, 5), label="meta") == 0:
        k = torch.empty(k.shape, dtype=k.dtype, device="meta")
    args: dict[str, Any] = dict(query=q, key=k, value=v)
    mask_kind = data.draw(
        st.sampled_from(
            ["none", "none", "bool", "bool_row", "keypad", "float", "float01"]
            + (["int", "wrong", "list"] if not good else [])
        ),
        label="mask",
    )
    sshape = tuple(q.shape[:-1]) + (tk,)
    if mask_kind == "bool":
        args["attn_mask"] = torch.rand(sshape, generator=g) < data.draw(
            st.sampled_from([0.0, 0.3, 0.8]), label="p"
        )
    elif mask_kind == "bool_row":
        args["attn_mask"] = torch.rand(tq, tk, generator=g) < 0.6
    elif mask_kind == "keypad":
        args["attn_mask"] = torch.rand(tk, generator=g) < 0.7
    elif mask_kind == "float":
        m = torch.randn(tq, tk, generator=g, dtype=torch.float64) * data.draw(
            st.sampled_from([1.0, 1e3]), label="fm"
        )
        m = m.masked_fill(torch.rand(tq, tk, generator=g) < 0.3, -math.inf)
        args["attn_mask"] = m.to(dtype if dtype.is_floating_point else torch.float32)
    elif mask_kind == "float01":
        args["attn_mask"] = (torch.rand(tq, tk, generator=g) < 0.5).float()
    elif mask_kind == "int":
        args["attn_mask"] = (torch.rand(tq, tk, generator=g) < 0.5).long()
    elif mask_kind == "wrong":
        args["attn_mask"] = torch.ones(tq + 1, tk, dtype=torch.bool)
    elif mask_kind == "list":
        args["attn_mask"] = [[True] * tk] * tq
    args["is_causal"] = data.draw(st.booleans(), label="is_causal")
    args["scale"] = data.draw(
        st.sampled_from(
            [None, None, 0.0, 0.5, -1.0, 3.0] + ([math.nan, "x", math.inf, True] if not good else [])
        ),
        label="scale",
    )
    if gqa and lead == "BH":
        args["enable_gqa"] = True
    if not good:
        extra = data.draw(st.sampled_from(["none", "dropout", "causal_int", "gqa_str"]), label="extra")
        if extra == "dropout":
            args["dropout_p"] = data.draw(st.sampled_from([1.0, -0.5, "0.1"]), label="dropout")
        elif extra == "causal_int":
            args["is_causal"] = 1
        elif extra == "gqa_str":
            args["enable_gqa"] = "yes"
    return args


# ------------------------------------------------------------------------------------------- checking


def _snapshot(args: dict[str, Any]) -> dict[str, torch.Tensor]:
    return {n: t.clone() for n, t in args.items() if isinstance(t, torch.Tensor) and t.device.type != "meta"}


def _unchanged(args: dict[str, Any], before: dict[str, torch.Tensor]) -> None:
    for n, old in before.items():
        new = args[n]
        same = new.shape == old.shape and (
            torch.equal(new, old)
            if not new.is_floating_point()
            else torch.equal(torch.nan_to_num(new), torch.nan_to_num(old))
            and torch.equal(torch.isnan(new), torch.isnan(old))
        )
        if not same:
            raise FuzzFailure(f"argument {n!r} was modified in place")


def _call(report: FuzzReport, target: str, fn: Callable[[], Any]) -> tuple[bool, Any]:
    """Run ``fn``; True and the result, or False after a documented error (counted). Anything else fails."""
    report.inputs += 1
    report.by_target[target] += 1
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            return True, fn()
    except ALLOWED as e:
        msg = str(e)
        if not msg or "\n" in msg.strip():
            raise FuzzFailure(f"{target}: {type(e).__name__} without a one-line message: {msg!r}") from e
        report.errors[error_pattern(e)] += 1
        return False, None
    except FuzzFailure:
        raise
    except Exception as e:  # noqa: BLE001 — any other exception is what we are looking for
        raise FuzzFailure(f"{target}: undocumented {type(e).__name__}: {str(e)[:300]}") from e


_TOL = {torch.float64: 1e-9, torch.float32: 2e-4, torch.float16: 2e-2, torch.bfloat16: 8e-2}


def _check_against_spec(target: str, out: torch.Tensor, args: dict[str, Any]) -> None:
    from ..functional import attention_steps

    q = args["query"]
    kw = {n: args[n] for n in ("attn_mask", "is_causal", "scale", "enable_gqa") if n in args}
    mask = kw.get("attn_mask")
    if isinstance(mask, torch.Tensor) and mask.is_floating_point():
        kw["attn_mask"] = mask.double()
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            steps = attention_steps(q.double(), args["key"].double(), args["value"].double(), **kw)
    except ALLOWED as e:
        raise FuzzFailure(f"{target}: accepted an input that the spec refuses ({error_pattern(e)})") from e
    ref = steps.context
    if out.shape != ref.shape:
        raise FuzzFailure(f"{target}: shape {tuple(out.shape)}, the spec gives {tuple(ref.shape)}")
    if out.dtype != q.dtype:
        raise FuzzFailure(f"{target}: dtype {out.dtype}, expected {q.dtype}")
    o = out.double()
    fin = torch.isfinite(ref)
    if not torch.isfinite(o[fin]).all():
        raise FuzzFailure(f"{target}: NaN/inf where the float64 spec is finite")
    if torch.isfinite(o[~fin]).any():
        raise FuzzFailure(f"{target}: finite where the spec is NaN/inf (a non-finite input was hidden)")
    seen = steps.masked_scores[steps.visible]  # the scores that take part (hidden NaN/inf excluded)
    # beyond ~1e3 the float32 rounding of the scores (1e-7 relative) starts to move the weights visibly
    moderate = bool(torch.isfinite(seen).all()) and (seen.numel() == 0 or float(seen.abs().amax()) <= 2e3)
    if moderate and fin.any():
        v = args["value"].double().nan_to_num(0.0, 0.0, 0.0)
        tol = _TOL[q.dtype] * max(1.0, float(v.abs().amax()) if v.numel() else 1.0)
        err = float((o[fin] - ref[fin]).abs().max())
        if err > tol:
            raise FuzzFailure(f"{target}: differs from the float64 spec by {err:.3g} (tolerance {tol:.3g})")


def attention_example(data, report: FuzzReport, backends: list[str]) -> None:
    from .. import functional as F

    g = torch.Generator().manual_seed(data.draw(_st().integers(0, 2**31 - 1), label="seed"))
    args = _draw_attention_args(data, g)
    before = _snapshot(args)
    target = data.draw(_st().sampled_from(backends + ["attention_weights", "tiled_blocks"]), label="target")
    if target == "attention_weights":
        names = ("query", "key", "attn_mask", "is_causal", "scale", "enable_gqa")
        wargs = {n: a for n, a in args.items() if n in names}
        ok, w = _call(report, target, lambda: F.attention_weights(**wargs))
        if ok:
            _unchanged(args, before)
            fin_q = bool(torch.isfinite(args["query"]).all()) and bool(torch.isfinite(args["key"]).all())
            if fin_q and w.numel():
                sums = w.double().sum(-1)
                if not bool(((sums - 1).abs() < 1e-3).logical_or(sums == 0).all()):
                    raise FuzzFailure("attention_weights: a row sums to neither 1 nor 0")
        return
    if target == "tiled_blocks":
        try:
            from ..tiled import tiled_attention
        except ImportError:
            return
        bq = data.draw(_st().sampled_from([1, 2, 3, 5, 64, 0, -1]), label="block_q")
        bk = data.draw(_st().sampled_from([1, 2, 4, 7, 64, 0]), label="block_k")
        kernel = data.draw(
            _st().sampled_from([None, "exact"]), label="kernel"
        )  # the exact kernel on any input
        ok, out = _call(
            report,
            f"tiled_attention(block_q={bq}, block_k={bk})".split("(")[0],
            lambda: tiled_attention(**args, block_q=bq, block_k=bk, kernel=kernel),
        )
        if ok:
            if bq <= 0 or bk <= 0:
                raise FuzzFailure(f"tiled_attention accepted block_q={bq}, block_k={bk}")
            _unchanged(args, before)
            _check_against_spec("tiled_attention", out, args)
        return
    from ..backends import get_backend

    fn = get_backend(target)
    ok, out = _call(report, f"sdpa[{target}]", lambda: fn(**args))
    if not ok:
        return
    _unchanged(args, before)
    _check_against_spec(f"sdpa[{target}]", out, args)
    # gradients now and then, when the result is finite (a NaN output makes any loss NaN anyway):
    # finite wherever the spec's are
    q = args["query"]
    if (
        data.draw(_st().integers(0, 3), label="grad") == 0
        and q.dtype in (torch.float32, torch.float64)
        and out.numel()
        and bool(torch.isfinite(out).all())
    ):
        leaves = {n: args[n].detach().clone().requires_grad_() for n in ("query", "key", "value")}
        ref_leaves = {
            n: args[n].detach().double().clone().requires_grad_() for n in ("query", "key", "value")
        }
        w = torch.randn(out.shape, generator=g, dtype=torch.float64)
        kw = {n: a for n, a in args.items() if n not in leaves}
        if isinstance(kw.get("attn_mask"), torch.Tensor) and kw["attn_mask"].is_floating_point():
            kw_ref = {**kw, "attn_mask": kw["attn_mask"].double()}
        else:
            kw_ref = kw
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            (fn(**leaves, **kw).double().nan_to_num(0.0, 0.0, 0.0) * w).sum().backward()
            (F.attention_steps(**ref_leaves, **kw_ref).context.nan_to_num(0.0, 0.0, 0.0) * w).sum().backward()
        for n in leaves:
            got, ref = leaves[n].grad, ref_leaves[n].grad
            if got is None or ref is None:
                continue
            if not torch.isfinite(got.double()[torch.isfinite(ref)]).all():
                raise FuzzFailure(
                    f"sdpa[{target}]: NaN/inf in the gradient of {n} where the spec's is finite"
                )


def module_example(data, report: FuzzReport, backends: list[str]) -> None:
    from .. import masks
    from ..functional import simple_attention
    from ..modules import SelfAttention

    st = _st()
    g = torch.Generator().manual_seed(data.draw(st.integers(0, 2**31 - 1), label="seed"))
    target = data.draw(
        st.sampled_from(["masks", "simple_attention", "SelfAttention", "MultiHeadAttention"]), label="target"
    )
    ints = st.one_of(st.integers(-3, 12), st.sampled_from([2.5, True, None, "3"]))
    if target == "masks":
        which = data.draw(
            st.sampled_from(["causal", "window", "padding", "mha", "additive", "combine"]), label="mask_fn"
        )
        a, b, w = data.draw(ints, label="a"), data.draw(ints, label="b"), data.draw(ints, label="w")
        calls = {
            "causal": lambda: masks.causal_mask(a, b),
            "window": lambda: masks.sliding_window_mask(a, b, w),
            "padding": lambda: masks.padding_mask([a, b], w),
            "mha": lambda: masks.from_torch_mha(
                torch.rand(3, 3, generator=g) < 0.5 if a in (0, 1) else torch.ones(2, dtype=torch.int64)
            ),
            "additive": lambda: masks.to_additive(
                torch.rand(3, generator=g) < 0.5 if b in (0, 1) else torch.ones(3)
            ),
            "combine": lambda: masks.combine(
                masks.causal_mask(3), None, torch.ones(3, dtype=torch.bool) if a != 2 else torch.ones(3)
            ),
        }
        ok, m = _call(report, f"masks.{which}", calls[which])
        if ok and which in ("causal", "window", "padding") and m.dtype != torch.bool:
            raise FuzzFailure(f"masks.{which} returned {m.dtype}, not bool")
        return
    t = data.draw(st.integers(0, 9), label="T")
    d = data.draw(st.integers(1, 8), label="d")
    dtype = data.draw(st.sampled_from([torch.float32, torch.float64, torch.int64]), label="dtype")
    x = _tensor(data, (2, t, d), dtype, data.draw(st.sampled_from([1.0, 30.0]), label="mag"), g)
    before = _snapshot({"x": x})
    if target == "simple_attention":
        ok, out = _call(report, target, lambda: simple_attention(x))
        if ok:
            _unchanged({"x": x}, before)
            _check_against_spec(target, out, dict(query=x, key=x, value=x, scale=1.0))
        return
    backend = data.draw(st.sampled_from([None, *backends]), label="backend")
    d_in = data.draw(st.sampled_from([d, d, d + 1]), label="d_in")
    mask = data.draw(st.sampled_from([None, "causal", "bad"]), label="mmask")
    if target == "SelfAttention":
        ok, layer = _call(
            report,
            "SelfAttention()",
            lambda: SelfAttention(d_in, data.draw(ints, label="d_out"), backend=backend),
        )
        if not ok:
            return
        layer = layer.to(torch.float64 if dtype == torch.float64 else torch.float32)
        kw: dict[str, Any] = {"is_causal": mask == "causal"}
        if mask == "bad":
            kw["attn_mask"] = torch.ones(t + 1, t, dtype=torch.bool)
        ok, out = _call(report, "SelfAttention.forward", lambda: layer(x, **kw))
        if ok:
            _unchanged({"x": x}, before)
            with torch.no_grad():
                q, k, v = layer.W_query(x), layer.W_key(x), layer.W_value(x)
            _check_against_spec(
                "SelfAttention.forward",
                out.detach(),
                dict(query=q, key=k, value=v, is_causal=kw["is_causal"]),
            )
        return
    try:
        from ..mha import MultiHeadAttention
    except ImportError:
        return
    heads = data.draw(ints, label="heads")
    ok, layer = _call(
        report, "MultiHeadAttention()", lambda: MultiHeadAttention(d_in, heads, backend=backend)
    )
    if not ok:
        return
    layer = layer.to(torch.float64 if dtype == torch.float64 else torch.float32).eval()
    kw = {"is_causal": mask == "causal"}
    if mask == "bad":
        kw["attn_mask"] = torch.ones(t + 1, t, dtype=torch.bool)
    ok, out = _call(report, "MultiHeadAttention.forward", lambda: layer(x, **kw))
    if ok:
        _unchanged({"x": x}, before)
        y = out[0]
        fin_in = bool(torch.isfinite(x).all())
        if fin_in and not bool(torch.isfinite(y).all()):
            raise FuzzFailure("MultiHeadAttention.forward: NaN/inf output for finite input")
