# task: heads
# expect: heads_merge_order
# seen: jsbaan/transformer-from-scratch#6 ("a missing permute before a reshape in multi-head attention"),
#       649453932/Chinese-Text-Classification-Pytorch#10 ("求出attention之后的view()似乎会让顺序错误"),
#       jadore801120/attention-is-all-you-need-pytorch#7 (outputs.view(mb_size, len_q, -1) after the heads)


def split_heads(x, num_heads):
    b, t, d_model = x.shape
    return x.view(b, t, num_heads, d_model // num_heads).transpose(1, 2)


def merge_heads(x):
    b, h, t, d = x.shape
    return x.reshape(b, t, h * d)  # no transpose back to (B, T, H, D)
