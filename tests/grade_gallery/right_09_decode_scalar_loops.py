# task: decode_step
# expect: none
# A loop over tensor entries: the scores, weights and output are 0-d tensors, returned as a plain list.
import math

import torch


def decode_step(q, k, v, k_cache, v_cache, pos):
    k_cache[pos] = k[0]
    v_cache[pos] = v[0]
    d_k = q.shape[1]
    scores = [sum(q[0][j] * k_cache[t][j] for j in range(d_k)) / math.sqrt(d_k) for t in range(pos + 1)]
    top = max(scores)
    e = [torch.exp(s - top) for s in scores]
    total = sum(e)
    return [sum(e[t] / total * v_cache[t][j] for t in range(pos + 1)) for j in range(v.shape[1])]
