# task: scaled_dot_product_attention
# expect: scale_d_k
# seen: delzac/cntkx#10 (the scale applied without C.sqrt, i.e. by d_k), thegregyang/NTK4A#3 (1/d_head
#       instead of 1/sqrt(d_head), asked about in a course-style notebook)
import torch


def scaled_dot_product_attention(q, k, v, mask=None):
    d_k = q.shape[-1]
    scores = (q @ k.T) / d_k  # no square root
    if mask is not None:
        scores = scores.masked_fill(~mask, float("-inf"))
    weights = torch.softmax(scores, dim=-1)
    if mask is not None:
        weights = weights * mask.any(dim=-1, keepdim=True)
    return weights.nan_to_num(0.0) @ v
