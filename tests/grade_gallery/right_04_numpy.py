# task: simple_attention
# expect: none
# Style: numpy, with the max subtracted before exp (returns an ndarray).
import numpy as np


def simple_attention(X):
    X = np.asarray(X, dtype=np.float64)
    omega = X @ X.T
    e = np.exp(omega - omega.max(axis=-1, keepdims=True))
    alpha = e / e.sum(axis=-1, keepdims=True)
    return alpha @ X
