# task: SelfAttention
# expect: value_not_projected
# seen: hmdolatabadi/denoising_diffusion#1 ("`value` not used in self attention"),
#       tensorflow/tensorflow#34696 (the value embeddings computed from the wrong input in an example)
import torch
from torch import nn


class SelfAttention(nn.Module):
    def __init__(self, d_in, d_out):
        super().__init__()
        self.W_query = nn.Parameter(torch.rand(d_in, d_out))
        self.W_key = nn.Parameter(torch.rand(d_in, d_out))
        self.W_value = nn.Parameter(torch.rand(d_in, d_out))

    def forward(self, x):
        queries = x @ self.W_query
        keys = x @ self.W_key
        weights = torch.softmax(queries @ keys.T / keys.shape[-1] ** 0.5, dim=-1)
        return weights @ x  # W_value is never used
