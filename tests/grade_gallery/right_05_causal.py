# task: causal_mask
# expect: none
# Style: position arithmetic: query i sits at key position k_len - q_len + i.
import torch


def causal_mask(q_len, k_len):
    query_pos = torch.arange(q_len).unsqueeze(1) + (k_len - q_len)
    key_pos = torch.arange(k_len).unsqueeze(0)
    return key_pos <= query_pos
