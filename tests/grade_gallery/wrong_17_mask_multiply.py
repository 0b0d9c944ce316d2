# task: scaled_dot_product_attention
# expect: mask_fill_zero
# seen: georg-wolflein/good-features#1 ("the multiplication by it effectively sets the masked elements to
#       zero. However, softmax will still treat zeros as full-fledged elements")
import math

import torch


def scaled_dot_product_attention(q, k, v, mask=None):
    scores = q @ k.T / math.sqrt(k.shape[-1])
    if mask is not None:
        scores = scores * mask  # hidden keys get score 0, not -inf
    return torch.softmax(scores, dim=-1) @ v
