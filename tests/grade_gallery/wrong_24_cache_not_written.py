# task: decode_step
# expect: cache_not_written
# seen: alex-hh/profam#168 ("past_key_values was incorrectly being set to None": the cache never carried
#       the new keys), lucidrains/audiolm-pytorch#265 (an attention output lost when the KV cache was added)
import math

import torch


def decode_step(q, k, v, k_cache, v_cache, pos):
    keys = torch.cat([k_cache[:pos], k])  # right for this step, but the cache is never written
    values = torch.cat([v_cache[:pos], v])
    return torch.softmax(q @ keys.T / math.sqrt(k.shape[-1]), dim=-1) @ values
