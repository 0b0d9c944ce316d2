# task: scaled_dot_product_attention
# expect: missing_scale, masked_row_nan
# seen: huggingface/blog#2893 (the KV-cache post's attention without 1/sqrt(d_k)) with the -inf fill of
#       tracel-ai/burn#4694 / pytorch/pytorch#41508 (NaN on fully masked rows): two mistakes at once
import torch


def scaled_dot_product_attention(q, k, v, mask=None):
    scores = torch.matmul(q, k.transpose(0, 1))
    if mask is not None:
        scores[~mask] = float("-inf")
    return torch.matmul(torch.softmax(scores, dim=1), v)
