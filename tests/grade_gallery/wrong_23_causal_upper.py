# task: causal_mask
# expect: causal_future
# seen: karpathy/nanoGPT#170 ("you use tril(). Shouldn't it be triu()?": triu taken as the keys to keep
#       lets every query see the future), TransformerLensOrg/TransformerLens#284 (the same triangle question)
import torch


def causal_mask(q_len, k_len):
    return torch.ones(q_len, k_len, dtype=torch.bool).triu(k_len - q_len)  # the upper triangle kept
