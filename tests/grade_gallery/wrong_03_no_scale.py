# task: scaled_dot_product_attention
# expect: missing_scale
# seen: ethen8181/machine-learning#13 ("it does not implement the scale of the multiplication of Query and
#       Key"), huggingface/blog#2893 (the KV-cache post's attention code lacked 1/sqrt(d_k)),
#       delzac/cntkx#10 (ScaledDotProductAttention without the square root)
import torch


def scaled_dot_product_attention(q, k, v, mask=None):
    scores = q @ k.transpose(-2, -1)
    if mask is not None:
        scores = scores.masked_fill(mask.logical_not(), float("-inf"))
    weights = torch.softmax(scores, dim=-1)
    weights = torch.where(torch.isnan(weights), torch.zeros_like(weights), weights)
    return weights @ v
