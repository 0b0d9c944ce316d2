# task: scaled_dot_product_attention
# expect: mask_ignored
# seen: facebookresearch/fairseq#1682 ("BART attn_mask unused ... It's a bug"), facebookresearch/xformers#103
#       ("Causal mask is skipped if no att_mask is passed"), jingyaogong/minimind-v#76 ("没有设置attention mask")
import math

import torch


def scaled_dot_product_attention(q, k, v, mask=None):
    scores = q @ k.T / math.sqrt(k.shape[-1])  # the mask is accepted, never used
    return torch.softmax(scores, dim=-1) @ v
