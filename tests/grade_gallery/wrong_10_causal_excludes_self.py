# task: causal_mask
# expect: causal_diagonal
# seen: pbloem/former#10 (triu_indices with offset 0 masks the diagonal: a token cannot see itself),
#       RVC-Boss/GPT-SoVITS#965 ("这个 causal mask 就没有包含当前位置": the diagonal off by one)
import torch


def causal_mask(q_len, k_len):
    offset = k_len - q_len
    return torch.ones(q_len, k_len).tril(offset - 1).bool()  # diagonal - 1: not itself
