# task: scaled_dot_product_attention
# expect: softmax_axis
# seen: jadore801120/attention-is-all-you-need-pytorch#52 (softmax over dim 0 in the attention),
#       PetrochukM/PyTorch-NLP#2 (nn.Softmax(dim=0): "the weights ... always 1"),
#       nerdai/llms-from-scratch-rs#30 ("softmax on wrong dim for attn weights", a from-scratch course port)
import math

import torch


def scaled_dot_product_attention(q, k, v, mask=None):
    scores = q @ k.T / math.sqrt(k.shape[-1])
    if mask is not None:
        scores = scores.masked_fill(~mask, float("-inf"))
    weights = torch.softmax(scores, dim=0).nan_to_num(0.0)  # dim=0: over the queries
    return weights @ v
