# task: heads
# expect: none
# Style: unflatten / flatten with explicit permutes.


def split_heads(x, num_heads):
    return x.unflatten(-1, (num_heads, -1)).permute(0, 2, 1, 3)


def merge_heads(x):
    return x.permute(0, 2, 1, 3).flatten(-2)
