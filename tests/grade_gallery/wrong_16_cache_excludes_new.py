# task: decode_step
# expect: cache_off_by_one
# seen: microsoft/onnxruntime-genai#2354 (a past length vs. position off by one in a decoder's KV cache);
#       pytorch/pytorch#103082 (a single decode query that does not see the keys it should)
import math

import torch


def decode_step(q, k, v, k_cache, v_cache, pos):
    k_cache[pos] = k[0]
    v_cache[pos] = v[0]
    keys, values = k_cache[:pos], v_cache[:pos]  # the past only: the new token does not see itself
    weights = torch.softmax(q @ keys.T / math.sqrt(k.shape[-1]), dim=-1)
    return weights @ values
