# task: scaled_dot_product_attention
# expect: none
# Style: torch's fused kernel (bool mask True = attend; torch returns zeros for a fully masked row).
import torch.nn.functional as F


def scaled_dot_product_attention(q, k, v, mask=None):
    return F.scaled_dot_product_attention(q, k, v, attn_mask=mask)
