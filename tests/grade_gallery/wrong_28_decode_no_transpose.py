# task: decode_step
# expect: missing_transpose
# seen: nsidn98/InforMARL#22, lsdefine/attention-is-all-you-need-keras#25 (query times key without the
#       transpose; here in a cached decode step, where it runs only when pos + 1 keys equal d_k)
import math

import torch


def decode_step(q, k, v, k_cache, v_cache, pos):
    k_cache[pos] = k[0]
    v_cache[pos] = v[0]
    keys, values = k_cache[: pos + 1], v_cache[: pos + 1]
    scores = q @ keys / math.sqrt(k.shape[-1])  # should be keys.T
    return torch.softmax(scores, dim=-1) @ values
