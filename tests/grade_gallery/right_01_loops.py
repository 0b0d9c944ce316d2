# task: scaled_dot_product_attention
# expect: none
# Style: plain Python loops over queries and keys, the lecture's three steps one number at a time.
import math

import torch


def scaled_dot_product_attention(q, k, v, mask=None):
    tq, d_k = q.shape
    tk, d_v = v.shape
    out = torch.zeros(tq, d_v, dtype=q.dtype)
    for i in range(tq):
        scores = []
        for j in range(tk):
            if mask is None or bool(mask[i, j]):
                scores.append((j, float(q[i] @ k[j]) / math.sqrt(d_k)))
        if not scores:
            continue  # a query that sees no key: zero vector
        top = max(s for _, s in scores)
        exps = [(j, math.exp(s - top)) for j, s in scores]
        total = sum(e for _, e in exps)
        for j, e in exps:
            out[i] += (e / total) * v[j]
    return out
