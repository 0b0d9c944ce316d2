# task: scaled_dot_product_attention
# expect: mask_polarity
# seen: lucidrains/halonet-pytorch#4 ("the attention mask should be reversed": masked_fill_ filled the
#       valid positions), OpenNMT/OpenNMT-py#1479 (mask meaning documented the wrong way round)
import math

import torch


def scaled_dot_product_attention(q, k, v, mask=None):
    scores = q @ k.T / math.sqrt(q.size(-1))
    if mask is not None:
        scores = scores.masked_fill(mask, float("-inf"))  # hides where the mask says "attend"
    return torch.softmax(scores, dim=-1).nan_to_num(0.0) @ v
