# task: scaled_dot_product_attention
# expect: missing_transpose, masked_row_nan
# seen: nsidn98/InforMARL#22 (a learner asking why the query-key product is taken without a transpose),
#       lsdefine/attention-is-all-you-need-keras#25 (is batch_dot(Q, K) the same as Q·Kᵀ?)
import math

import torch


def scaled_dot_product_attention(q, k, v, mask=None):
    scores = q @ k / math.sqrt(q.shape[-1])  # Q·K: runs only when Tk == d_k
    if mask is not None:
        scores = scores.masked_fill(~mask, float("-inf"))
    return torch.softmax(scores, dim=-1) @ v
