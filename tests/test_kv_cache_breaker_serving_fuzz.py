"""KVCache(ragged=True / page_size=...) against a shadow model (the breaker's fuzz): random updates with
padding, fork (shared pages, copy-on-write), reorder (beams), release, finish, assign, small pools; after
every step each sequence's keys/values read through flash_args equal the shadow's, the visibility update
returns equals the recomputed one, and a refused step changes nothing."""

import random

import pytest
import torch

from selfattention.kv_cache import KVCache
from selfattention.kv_pages import PoolExhaustedError


def read_seq(cache, b):
    fa = cache.flash_args()
    n = int(fa["cache_seqlens"][b])
    if "block_table" in fa:
        ps = fa["k_cache"].shape[1]
        rows = fa["block_table"][b, : -(-n // ps)].long()
        k = fa["k_cache"][rows].flatten(0, 1)[:n]
        v = fa["v_cache"][rows].flatten(0, 1)[:n]
    else:
        k = fa["k_cache"][b, :n]
        v = fa["v_cache"][b, :n]
    return k.transpose(0, 1), v.transpose(0, 1)  # (Hkv, n, D)


def run(seed, steps=40):
    rng = random.Random(seed)
    torch.manual_seed(seed)
    B = rng.choice([2, 3, 4])
    H = rng.choice([1, 2])
    D = rng.choice([3, 4])
    cap_pages = rng.choice([2, 3, 4])
    ps = rng.choice([None, 1, 2, 3])
    cap = (ps or rng.choice([2, 3])) * cap_pages
    window = rng.choice([None, None, 2, 3]) if cap >= 3 else None
    num_pages = None
    if ps and rng.random() < 0.5:
        num_pages = max(1, B * cap_pages - rng.randint(0, B * cap_pages // 2))
    cache = KVCache(
        B, H, D, cap, ragged=True, page_size=ps, num_pages=num_pages, window=window, dtype=torch.float64
    )
    shadow = [
        (torch.zeros(H, 0, D, dtype=torch.float64), torch.zeros(H, 0, D, dtype=torch.float64))
        for _ in range(B)
    ]
    log = []
    for _ in range(steps):
        op = rng.choice(["upd", "upd", "upd", "fork", "reorder", "release", "finish", "assign"])
        before = [read_seq(cache, b) for b in range(B)] if True else None
        try:
            if op == "upd":
                n = rng.choice([1, 1, 2, 3])
                cnt = [rng.randint(0, n) for _ in range(B)]
                if rng.random() < 0.5:
                    cnt = [n] * B
                mask = torch.arange(n)[None] < torch.tensor(cnt)[:, None]
                k = torch.randn(B, H, n, D, dtype=torch.float64)
                v = torch.randn(B, H, n, D, dtype=torch.float64)
                log.append((op, cnt))
                keys, values, vis = cache.update(k, v, mask)
                # check the returned visibility: query i of seq b sees exactly its own keys up to its position
                m = vis.to_mask(keys.device) if hasattr(vis, "to_mask") else None
                for b in range(B):
                    shadow[b] = (
                        torch.cat([shadow[b][0], k[b, :, : cnt[b]]], 1),
                        torch.cat([shadow[b][1], v[b, :, : cnt[b]]], 1),
                    )
                full = m.expand(B, 1, n, keys.shape[2]) if m.dim() == 4 else m.expand(B, 1, n, keys.shape[2])
                for b in range(B):
                    L = shadow[b][0].shape[1]
                    old = L - cnt[b]
                    for i in range(cnt[b]):
                        p = old + i
                        want = [j for j in range(L) if j <= p and (window is None or j > p - window)]
                        got = full[b, 0, i].nonzero().flatten().tolist()
                        assert got == want, (b, i, got, want, log)
                        assert torch.equal(keys[b, :, want], shadow[b][0][:, want]), ("keys", b, log)
                        assert torch.equal(values[b, :, want], shadow[b][1][:, want]), ("vals", b, log)
            elif op == "fork":
                s, d = rng.sample(range(B), 2)
                log.append((op, s, d))
                cache.fork(s, d)
                shadow[d] = shadow[s]
            elif op == "reorder":
                idx = [rng.randrange(B) for _ in range(B)]
                log.append((op, idx))
                cache.reorder(idx)
                shadow = [shadow[i] for i in idx]
            elif op == "release":
                b = rng.randrange(B)
                log.append((op, b))
                cache.release(b)
                shadow[b] = (shadow[b][0][:, :0], shadow[b][1][:, :0])
            elif op == "finish":
                b = rng.randrange(B)
                log.append((op, b))
                cache.finish(b)
            elif op == "assign":
                b = rng.randrange(B)
                T = rng.randint(1, cap)
                log.append((op, b, T))
                k = torch.randn(H, T, D, dtype=torch.float64)
                v = torch.randn(H, T, D, dtype=torch.float64)
                cache.assign(b, k, v)
                shadow[b] = (k, v)
        except (ValueError, PoolExhaustedError) as e:
            after = [read_seq(cache, b) for b in range(B)]
            for x, y in zip(before, after, strict=True):
                assert torch.equal(x[0], y[0]) and torch.equal(x[1], y[1]), (
                    "error changed the cache",
                    e,
                    log,
                )
            log[-1] = log[-1] + ("ERR " + str(e)[:60],)
            continue
        for b in range(B):
            k, v = read_seq(cache, b)
            assert torch.equal(k, shadow[b][0]) and torch.equal(v, shadow[b][1]), ("state", b, log)
        # pages accounting
        if ps:
            t = cache.pages.tensor
            for b in range(B):
                need = -(-shadow[b][0].shape[1] // ps)
                assert (t[b, :need] >= 0).all(), ("table", b, log)


@pytest.mark.parametrize("seed", range(40))
def test_random_serving_sequences_equal_the_shadow(seed):
    run(seed)
