# task: scaled_dot_product_attention
# expect: masked_row_nan
# seen: pytorch/pytorch#41508 and #103749 (NaN for fully masked rows, collected in pytorch/pytorch#131060),
#       tracel-ai/burn#4694 ("attention_fallback produces NaN for fully-masked rows"),
#       pbloem/former#10 (a row of -inf "gives a complete row of NaNs" in a tutorial's mask)
import math

import torch


def scaled_dot_product_attention(q, k, v, mask=None):
    scores = q @ k.T / math.sqrt(k.shape[-1])
    if mask is not None:
        scores = scores.masked_fill(mask == 0, float("-inf"))
    return torch.softmax(scores, dim=-1) @ v
