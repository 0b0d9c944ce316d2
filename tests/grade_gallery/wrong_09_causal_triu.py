# task: causal_mask
# expect: mask_polarity, causal_top_left
# seen: karpathy/nanoGPT#170 ("you use tril(), shouldn't it be triu()?": the two conventions confused),
#       pytorch/tutorials#2250 (generate_square_subsequent_mask: an upper triangle of blocked positions),
#       TransformerLensOrg/TransformerLens#284 (triu(diagonal=1) read as the keys to keep)
import torch


def causal_mask(q_len, k_len):
    # True where the key is in the future: the blocked positions, not the visible ones; square-only
    return torch.triu(torch.ones(q_len, k_len, dtype=torch.bool), diagonal=1)
