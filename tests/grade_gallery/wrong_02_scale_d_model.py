# task: SelfAttention
# expect: scale_d_model
# seen: jadore801120/attention-is-all-you-need-pytorch#42 and #49 (temperature np.power(d_model, 0.5)),
#       brightmart/bert_language_understanding#9 (1/sqrt(d_model) instead of 1/sqrt(d_model/h)),
#       omihub777/ViT-CIFAR#11 (sqrt of the total feature size instead of the per-head size)
import math

import torch
from torch import nn


class SelfAttention(nn.Module):
    def __init__(self, d_in, d_out):
        super().__init__()
        self.d_model = d_in
        self.W_query = nn.Linear(d_in, d_out, bias=False)
        self.W_key = nn.Linear(d_in, d_out, bias=False)
        self.W_value = nn.Linear(d_in, d_out, bias=False)

    def forward(self, x):
        q, k, v = self.W_query(x), self.W_key(x), self.W_value(x)
        scores = q @ k.T / math.sqrt(self.d_model)  # the embedding size, not the key size
        return torch.softmax(scores, dim=-1) @ v
