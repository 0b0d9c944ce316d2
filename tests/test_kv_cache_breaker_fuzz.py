"""flash_attn_with_kvcache against a float64 oracle that recomputes each sequence alone (the breaker's fuzz):
random ragged/paged caches, lengths at 0 and at capacity, several queries with causal and windows (also wider
than the cache), GQA/MQA, head_dim not a power of two, page size 1, shuffled pages, transposed (non-contiguous)
q/k and caches, cache_batch_idx permutations, leftpad + rotary, softcap, ALiBi; the cache after the call equals
the oracle's (written in place at cache_seqlens, nothing else touched), q and k unchanged."""

import math
import random

import pytest
import torch

from selfattention.flash_kvcache import flash_attn_with_kvcache


def rot(x, cos, sin, pos, inter):
    # x (T, H, D) float64, pos (T,)
    half = cos.shape[1]
    rd = 2 * half
    x = x.clone()
    for t in range(x.shape[0]):
        c = cos[pos[t]].double()
        s = sin[pos[t]].double()
        if inter:
            a, b = x[t, :, 0:rd:2].clone(), x[t, :, 1:rd:2].clone()
            x[t, :, 0:rd:2] = a * c - b * s
            x[t, :, 1:rd:2] = a * s + b * c
        else:
            a, b = x[t, :, :half].clone(), x[t, :, half:rd].clone()
            x[t, :, :half] = a * c - b * s
            x[t, :, half:rd] = a * s + b * c
    return x


def oracle(
    q, kc_rows, vc_rows, k, v, seqlens, leftpad, causal, window, scale, softcap, slopes, cos, sin, inter
):
    B, Tq, H, D = q.shape
    outs = torch.zeros(B, Tq, H, vc_rows[0].shape[-1], dtype=torch.float64)
    lses = torch.full((B, H, Tq), math.inf, dtype=torch.float64)
    left, right = window
    KS = []
    if causal:
        right = 0
    for b in range(B):
        n = seqlens[b]
        new = 0 if k is None else k.shape[1]
        K = kc_rows[b].double().clone()
        V = vc_rows[b].double().clone()
        qb = q[b].double()
        if new:
            kn = k[b].double()
            if cos is not None:
                kn = rot(kn, cos, sin, [n + i for i in range(new)], inter)
                # flash-attn (mha_fwd_kvcache): a window side as long as the cache counts as infinite, and
                # only a causal or local call places q at its own positions
                local = any(0 <= w < K.shape[0] for w in window)
                if causal or local:
                    qb = rot(qb, cos, sin, [n + i for i in range(Tq)], inter)
                else:
                    qb = rot(qb, cos, sin, [n] * Tq, inter)
            K[n : n + new] = kn
            V[n : n + new] = v[b].double()
        end = n + new
        KS.append((K, V))
        Hk = K.shape[1]
        g = H // Hk
        for h in range(H):
            for i in range(Tq):
                p = end - Tq + i
                logits = []
                js = []
                for j in range(leftpad[b], end):
                    if right >= 0 and j > p + right:
                        continue
                    if left >= 0 and j < p - left:
                        continue
                    s = float((qb[i, h] * K[j, h // g]).sum()) * scale
                    if softcap > 0:
                        s = softcap * math.tanh(s / softcap)
                    if slopes is not None:
                        sl = slopes[h] if slopes.dim() == 1 else slopes[b, h]
                        s += -float(sl) * abs(p - j)
                    logits.append(s)
                    js.append(j)
                if not js:
                    outs[b, i, h] = 0
                    continue
                m = max(logits)
                w = [math.exp(x - m) for x in logits]
                z = sum(w)
                lses[b, h, i] = m + math.log(z)
                o = sum(wi / z * V[j, h // g] for wi, j in zip(w, js, strict=True))
                outs[b, i, h] = o
    return outs, lses, KS


def trial(rng, seed):
    torch.manual_seed(seed)
    B = rng.choice([1, 2, 3])
    Hk = rng.choice([1, 2])
    H = Hk * rng.choice([1, 2, 3])
    D = rng.choice([3, 5, 8, 12])
    Dv = D
    paged = rng.random() < 0.5
    page = rng.choice([1, 2, 3, 4]) if paged else 0
    cap = rng.choice([4, 6, 12]) if not paged else page * rng.choice([2, 3, 5])
    new = rng.choice([0, 0, 1, 2, 3])
    new = min(new, cap)
    Tq = rng.choice([1, 1, 2, 3, 5])
    seqlens = [rng.randint(0, cap - new) for _ in range(B)]
    if rng.random() < 0.3:
        seqlens[0] = cap - new
    if rng.random() < 0.3:
        seqlens[-1] = 0
    causal = rng.random() < 0.5
    window = rng.choice([(-1, -1), (-1, -1), (1, -1), (2, 0), (100, -1), (0, 0), (3, 1), (-1, 2)])
    softcap = rng.choice([0.0, 0.0, 0.0, 2.0])
    dtype = rng.choice([torch.float32, torch.float32, torch.float64])
    use_lp = (not paged or True) and rng.random() < 0.3
    leftpad = [rng.randint(0, n) for n in seqlens] if use_lp else [0] * B
    use_rot = new > 0 and rng.random() < 0.3
    use_alibi = rng.random() < 0.2
    use_bidx = (not paged) and rng.random() < 0.3
    rows = None
    if paged:
        P = cap // page
        num = B * P + rng.randint(0, 3)
        perm = list(range(num))
        rng.shuffle(perm) if rng.random() < 0.5 else None
        table = torch.tensor([perm[b * P : (b + 1) * P] for b in range(B)], dtype=torch.int32)
        kc = torch.randn(num, page, Hk, D, dtype=dtype)
        vc = torch.randn(num, page, Hk, Dv, dtype=dtype)
        kc_rows = [kc[table[b].long()].flatten(0, 1) for b in range(B)]
        vc_rows = [vc[table[b].long()].flatten(0, 1) for b in range(B)]
    else:
        Bc = B + rng.randint(0, 2)
        layout = rng.random() < 0.3
        if layout:
            kc = torch.randn(Bc, Hk, cap, D, dtype=dtype).transpose(1, 2)
            vc = torch.randn(Bc, Hk, cap, Dv, dtype=dtype).transpose(1, 2)
        else:
            kc = torch.randn(Bc, cap, Hk, D, dtype=dtype)
            vc = torch.randn(Bc, cap, Hk, Dv, dtype=dtype)
        if use_bidx:
            rows = list(range(Bc))
            rng.shuffle(rows)
            rows = rows[:B]
        r = rows if rows is not None else list(range(B))
        kc_rows = [kc[i] for i in r]
        vc_rows = [vc[i] for i in r]
        table = None
    q = torch.randn(B, Tq, H, D, dtype=dtype)
    if rng.random() < 0.3:
        q = torch.randn(B, H, Tq, D, dtype=dtype).transpose(1, 2)
    k = v = None
    if new:
        k = torch.randn(B, new, Hk, D, dtype=dtype)
        v = torch.randn(B, new, Hk, Dv, dtype=dtype)
        if rng.random() < 0.3:
            k = torch.randn(B, Hk, new, D, dtype=dtype).transpose(1, 2)
    cos = sin = None
    inter = rng.random() < 0.5
    if use_rot:
        rd = 2 * rng.randint(1, D // 2)
        ang = torch.rand(cap + Tq + 2, rd // 2, dtype=torch.float64) * 6
        cos, sin = ang.cos().to(dtype), ang.sin().to(dtype)
    slopes = None
    if use_alibi:
        slopes = (
            torch.rand(H, dtype=torch.float32)
            if rng.random() < 0.5
            else torch.rand(B, H, dtype=torch.float32)
        )
    scale = rng.choice([None, 0.3, 0.0])
    sc = (1 / math.sqrt(D)) if scale is None else scale
    ref_o, ref_l, KS = oracle(
        q, kc_rows, vc_rows, k, v, seqlens, leftpad, causal, window, sc, softcap, slopes, cos, sin, inter
    )
    kw = dict(
        k=k,
        v=v,
        rotary_cos=cos,
        rotary_sin=sin,
        cache_seqlens=torch.tensor(seqlens, dtype=torch.int32),
        cache_batch_idx=None if rows is None else torch.tensor(rows, dtype=torch.int32),
        cache_leftpad=torch.tensor(leftpad, dtype=torch.int32) if use_lp else None,
        block_table=table,
        softmax_scale=scale,
        causal=causal,
        window_size=window,
        softcap=softcap,
        rotary_interleaved=inter,
        alibi_slopes=slopes,
        return_softmax_lse=True,
    )
    desc = dict(
        B=B,
        H=H,
        Hk=Hk,
        D=D,
        paged=paged,
        page=page,
        cap=cap,
        new=new,
        Tq=Tq,
        seqlens=seqlens,
        causal=causal,
        window=window,
        softcap=softcap,
        dtype=dtype,
        lp=leftpad if use_lp else None,
        rot=use_rot,
        alibi=use_alibi,
        rows=rows,
        scale=scale,
    )
    snap = (kc.clone(), vc.clone(), q.clone(), None if k is None else k.clone())
    try:
        out, lse = flash_attn_with_kvcache(q, kc, vc, **kw)
    except Exception as e:
        return f"EXC {type(e).__name__}: {e} | {desc}"
    if not torch.equal(q, snap[2]) or (k is not None and not torch.equal(k, snap[3])):
        return f"INPUT MUTATED | {desc}"
    exp_k = snap[0].clone()
    exp_v = snap[1].clone()
    for b in range(B):
        n = seqlens[b]
        for t in range(n, n + new):
            if paged:
                exp_k[table[b, t // page], t % page] = KS[b][0][t].to(dtype)
                exp_v[table[b, t // page], t % page] = KS[b][1][t].to(dtype)
            else:
                r = b if rows is None else rows[b]
                exp_k[r, t] = KS[b][0][t].to(dtype)
                exp_v[r, t] = KS[b][1][t].to(dtype)
    if not (torch.allclose(exp_k, kc, atol=1e-6, rtol=1e-6) and torch.equal(exp_v, vc)):
        return f"CACHE WRONG {(exp_k - kc).abs().max().item()} | {desc}"
    tol = 1e-9 if dtype == torch.float64 else 2e-5
    err = (out.double() - ref_o).abs().max().item()
    fin = torch.isfinite(ref_l)
    lerr = 0.0
    if fin.any():
        lerr = (lse.double()[fin] - ref_l[fin]).abs().max().item()
    if not torch.equal(torch.isinf(lse), ~fin):
        lerr = 999
    if err > tol * 10 or lerr > 2e-6 * (1 + ref_l[fin].abs().max().item() if fin.any() else 1):
        return f"MISMATCH err={err:.2e} lerr={lerr:.2e} | {desc}"
    return None


@pytest.mark.parametrize("seed", range(150))
def test_random_calls_equal_the_per_sequence_oracle(seed):
    rng = random.Random(1000 + seed)
    problem = trial(rng, seed)
    assert problem is None, problem
