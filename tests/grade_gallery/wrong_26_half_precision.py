# task: scaled_dot_product_attention
# expect: low_precision
# seen: Dao-AILab/flash-attention#37 (an fp16 result checked against float32 with atol=1e-3: "fp16 simply
#       doesn't have that much precision"), Dao-AILab/flash-attention#385 (naive attention in fp16 vs fp32)
import math

import torch


def scaled_dot_product_attention(q, k, v, mask=None):
    q, k, v = q.half(), k.half(), v.half()  # "faster": every product and the softmax's input in float16
    scores = q @ k.T / math.sqrt(q.shape[-1])
    if mask is not None:
        scores = scores.masked_fill(~mask, float("-inf"))
    weights = torch.softmax(scores.float(), dim=-1).nan_to_num(0.0).half()
    return (weights @ v).float()
