# task: SelfAttention
# expect: scale_inverted
# seen: esceptico/perceiver-io#9 ("self.scale should be multiplied instead of the divide, since it's
#       defined as self.scale = self.qk_head_dim ** -0.5")
from torch import nn


class SelfAttention(nn.Module):
    def __init__(self, d_in, d_out):
        super().__init__()
        self.scale = d_out**-0.5
        self.to_q = nn.Linear(d_in, d_out, bias=False)
        self.to_k = nn.Linear(d_in, d_out, bias=False)
        self.to_v = nn.Linear(d_in, d_out, bias=False)

    def forward(self, x):
        q, k, v = self.to_q(x), self.to_k(x), self.to_v(x)
        attention = q @ k.transpose(-2, -1) / self.scale  # divides by d**-0.5: multiplies by sqrt(d)
        return attention.softmax(dim=-1) @ v
