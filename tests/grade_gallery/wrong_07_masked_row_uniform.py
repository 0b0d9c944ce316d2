# task: scaled_dot_product_attention
# expect: masked_row_uniform
# seen: pytorch/pytorch#131060 (option 1 for fully masked rows: "uniformly attend to all values"), the
#       fill value -1e9 of course code such as harvardnlp/annotated-transformer (its issue #17 discusses
#       that very MultiHeadedAttention), RVC-Boss/GPT-SoVITS#965 (a mask question on the same pattern)
import math

import torch


def scaled_dot_product_attention(q, k, v, mask=None):
    scores = q @ k.T / math.sqrt(k.shape[-1])
    if mask is not None:
        scores = scores.masked_fill(mask == 0, -1e9)
    return torch.softmax(scores, dim=-1) @ v
