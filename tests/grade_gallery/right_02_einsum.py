# task: SelfAttention
# expect: none
# Style: einsum with (d_in, d_out) parameter matrices, as in Raschka's SelfAttention_v1.
import torch
from torch import nn


class SelfAttention(nn.Module):
    def __init__(self, d_in, d_out):
        super().__init__()
        self.W_query = nn.Parameter(torch.randn(d_in, d_out))
        self.W_key = nn.Parameter(torch.randn(d_in, d_out))
        self.W_value = nn.Parameter(torch.randn(d_in, d_out))

    def forward(self, x):
        q = torch.einsum("ti,io->to", x, self.W_query)
        k = torch.einsum("ti,io->to", x, self.W_key)
        v = torch.einsum("ti,io->to", x, self.W_value)
        scores = torch.einsum("id,jd->ij", q, k) / k.shape[-1] ** 0.5
        return torch.einsum("ij,jd->id", scores.softmax(dim=-1), v)
