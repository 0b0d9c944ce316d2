# task: scaled_dot_product_attention
# expect: transposed_scores
# seen: karpathy/llm.c#531 (K^T @ Q instead of Q @ K^T suspected in the attention; there column-major
#       cuBLAS made it right, in row-major PyTorch it is the transposed score table),
#       datawhalechina/learn-nlp-with-transformers#40 (the attention formula written with the wrong factors)
import math

import torch


def scaled_dot_product_attention(q, k, v, mask=None):
    scores = k @ q.T / math.sqrt(q.shape[-1])  # (Tk, Tq): key i against query j
    if mask is not None:
        scores = scores.masked_fill(~mask, float("-inf"))
    return torch.softmax(scores, dim=-1).nan_to_num(0.0) @ v
