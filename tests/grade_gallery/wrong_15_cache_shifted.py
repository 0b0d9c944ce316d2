# task: decode_step
# expect: cache_off_by_one
# seen: microsoft/onnxruntime-genai#2354 ("the first decode step should write at L, but wrote at L+1 ...
#       Position L was never written even though kv_len covered it on every decode step")
import math

import torch


def decode_step(q, k, v, k_cache, v_cache, pos):
    length = pos + 1  # the length so far, used as the write index too
    k_cache[length] = k[0]
    v_cache[length] = v[0]
    keys, values = k_cache[: length + 1], v_cache[: length + 1]
    weights = torch.softmax(q @ keys.T / math.sqrt(k.shape[-1]), dim=-1)
    return weights @ values
