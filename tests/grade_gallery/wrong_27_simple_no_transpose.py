# task: simple_attention
# expect: missing_transpose
# seen: spro/practical-pytorch#135 (a dot-product attention score of two (1, 256) vectors that would not
#       multiply: the fix was hidden.mm(energy.transpose(0, 1)))
import torch


def simple_attention(X):
    return torch.softmax(X @ X, dim=-1) @ X  # X·X: (T, d) @ (T, d) runs only when T == d
