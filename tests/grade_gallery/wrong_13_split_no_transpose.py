# task: heads
# expect: heads_split_order
# seen: reczoo/FuxiCTR#30 ("The code of splitting heads is buggy, without transpose the shape"),
#       hyunwoongko/transformer#15 (view(batch, heads, seq, d) instead of view + transpose(1, 2)),
#       harvardnlp/annotated-transformer#17 (the same question about the split)


def split_heads(x, num_heads):
    b, t, d_model = x.shape
    return x.view(b, num_heads, t, d_model // num_heads)  # no transpose: mixes tokens and features


def merge_heads(x):
    b, h, t, d = x.shape
    return x.transpose(1, 2).contiguous().view(b, t, h * d)
