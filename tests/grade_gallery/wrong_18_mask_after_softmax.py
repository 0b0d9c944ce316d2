# task: scaled_dot_product_attention
# expect: rows_not_normalized
# seen: lucidrains/memory-compressed-attention#2 ("The order of masking and softmax operation": masking
#       after the softmax), stevezheng23/reading_comprehension_tf#69 (masking added to attention layers)
import math

import torch


def scaled_dot_product_attention(q, k, v, mask=None):
    weights = torch.softmax(q @ k.T / math.sqrt(k.shape[-1]), dim=-1)
    if mask is not None:
        weights = weights * mask  # zeroed after the softmax: the rows no longer sum to 1
    return weights @ v
