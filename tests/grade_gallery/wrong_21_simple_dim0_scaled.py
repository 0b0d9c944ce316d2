# task: simple_attention
# expect: softmax_axis, extra_scale
# seen: jadore801120/attention-is-all-you-need-pytorch#52 (softmax over dim 0); the second mistake, the
#       1/sqrt(d) of lecture 003 carried into lecture 000's parameter-free form, has no public report we
#       could cite: it is here to show two mistakes named at once


def simple_attention(X):
    omega = X @ X.T / X.shape[1] ** 0.5
    alpha = omega.softmax(dim=0)
    return alpha @ X
