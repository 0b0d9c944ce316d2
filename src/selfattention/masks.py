"""Boolean attention masks: ``True`` = this query may attend to this key.

Every mask here is a ``torch.bool`` tensor whose last two dims are (Tq, Tk). Masks are combined with
:func:`combine` (logical AND: a key is visible only if every mask allows it) and turned into an
additive float mask (0 / -inf) only at the last step, with :func:`to_additive`.

Causal masks are aligned **bottom-right**: query ``i`` sits at key position ``Tk - Tq + i``. With
Tq == Tk this is the usual lower triangle; with Tq = 2, Tk = 4 (two new tokens after two cached ones)::

    causal_mask(2, 4)        keys →  0 1 2 3
                            query 0  1 1 1 0      (position 2)
                            query 1  1 1 1 1      (position 3)

``torch.nn.functional.scaled_dot_product_attention(is_causal=True)`` aligns top-left instead (query i
sees keys 0..i), which is wrong for a query chunk that follows cached keys.

Mask polarity differs between libraries: ``torch.nn.MultiheadAttention`` uses True = *blocked*; convert
with :func:`from_torch_mha`.
"""

from __future__ import annotations

import torch

from ._validation import check_positive_int
from .visibility import Visibility, same_document

__all__ = [
    "causal_mask",
    "sliding_window_mask",
    "padding_mask",
    "document_mask",
    "combine",
    "to_additive",
    "from_torch_mha",
    "draw",
]


def _check_len(name: str, n: object) -> int:
    if isinstance(n, bool) or not isinstance(n, int):
        raise TypeError(f"{name} must be an int, got {type(n).__name__}")
    if n < 0:
        raise ValueError(f"{name} must be >= 0, got {n}")
    return n


def causal_mask(
    q_len: int, k_len: int | None = None, *, device: torch.device | str | None = None
) -> torch.Tensor:
    """Bottom-right aligned causal mask, shape (Tq, Tk), bool, True = attend.

    Query ``i`` (at position ``Tk - Tq + i``) may attend to keys ``0 .. Tk - Tq + i``. When Tq > Tk the
    first ``Tq - Tk`` queries see no key at all (their rows are all False; attention returns zeros there).

    >>> causal_mask(3).int()
    tensor([[1, 0, 0],
            [1, 1, 0],
            [1, 1, 1]], dtype=torch.int32)
    >>> causal_mask(2, 4).int()
    tensor([[1, 1, 1, 0],
            [1, 1, 1, 1]], dtype=torch.int32)

    Raises ``TypeError``/``ValueError`` for non-int or negative lengths. Source: the decoder mask of
    Vaswani et al. 2017 §3.2.3, aligned as for a KV cache.
    """
    q_len = _check_len("q_len", q_len)
    k_len = q_len if k_len is None else _check_len("k_len", k_len)
    return Visibility(q_len, k_len, is_causal=True).structure(device)


def sliding_window_mask(
    q_len: int, k_len: int | None = None, window: int = 1, *, device: torch.device | str | None = None
) -> torch.Tensor:
    """Causal sliding window, shape (Tq, Tk), bool: the query at position p sees keys p-W+1 .. p.

    Bottom-right aligned like :func:`causal_mask`; ``window >= Tk`` equals the causal mask.

    >>> sliding_window_mask(4, window=2).int()
    tensor([[1, 0, 0, 0],
            [1, 1, 0, 0],
            [0, 1, 1, 0],
            [0, 0, 1, 1]], dtype=torch.int32)

    Raises ``ValueError`` if ``window <= 0``. Source: Longformer (Beltagy et al. 2020), Mistral 7B.
    """
    q_len = _check_len("q_len", q_len)
    k_len = q_len if k_len is None else _check_len("k_len", k_len)
    window = check_positive_int("window", window)
    return Visibility(q_len, k_len, window=window).structure(device)


def padding_mask(lengths: torch.Tensor | list[int], max_len: int | None = None) -> torch.Tensor:
    """Key-padding mask for a batch of sequences of different lengths, shape (B, 1, 1, T), bool.

    Sequence ``b`` has its first ``lengths[b]`` keys real (True) and the rest padding (False). The shape
    broadcasts against scores of shape (B, H, Tq, Tk).

    >>> padding_mask([3, 1]).int().squeeze(1).squeeze(1)
    tensor([[1, 1, 1],
            [1, 0, 0]], dtype=torch.int32)

    Raises ``ValueError`` for negative lengths or lengths above ``max_len``.
    """
    try:
        lengths = torch.as_tensor(lengths)
    except (RuntimeError, TypeError, ValueError):
        raise TypeError(f"lengths must be a 1-D sequence of ints, got {type(lengths).__name__}") from None
    if lengths.dim() != 1 or lengths.is_floating_point() or lengths.dtype == torch.bool:
        raise ValueError(
            f"lengths must be a 1-D integer sequence, got {lengths.dtype} of shape {tuple(lengths.shape)}"
        )
    if lengths.numel() and int(lengths.min()) < 0:
        raise ValueError(f"lengths must be >= 0, got {lengths.tolist()}")
    longest = int(lengths.max()) if lengths.numel() else 0
    max_len = longest if max_len is None else _check_len("max_len", max_len)
    if longest > max_len:
        raise ValueError(f"a length ({longest}) exceeds max_len ({max_len})")
    keep = torch.arange(max_len, device=lengths.device)[None, :] < lengths[:, None]  # (B, T)
    return keep[:, None, None, :]  # (B, 1, 1, T)


def document_mask(q_doc_ids: torch.Tensor, k_doc_ids: torch.Tensor | None = None) -> torch.Tensor:
    """Block-diagonal mask for packed documents: a query sees only keys of the same document.

    ``q_doc_ids`` (..., Tq) and ``k_doc_ids`` (..., Tk) are integer document ids; result (..., Tq, Tk).
    Combine with :func:`causal_mask` for packed causal training.

    >>> document_mask(torch.tensor([0, 0, 1])).int()
    tensor([[1, 1, 0],
            [1, 1, 0],
            [0, 0, 1]], dtype=torch.int32)
    """
    k_doc_ids = q_doc_ids if k_doc_ids is None else k_doc_ids
    for name, ids in (("q_doc_ids", q_doc_ids), ("k_doc_ids", k_doc_ids)):
        if not isinstance(ids, torch.Tensor) or ids.is_floating_point() or ids.dim() < 1:
            raise ValueError(f"{name} must be an integer tensor of shape (..., T)")
    return same_document(q_doc_ids, k_doc_ids)


def combine(*masks: torch.Tensor | None) -> torch.Tensor | None:
    """Logical AND of bool masks (None entries are skipped): a key is visible only if all allow it.

    >>> combine(causal_mask(3), torch.tensor([True, False, True])).int()
    tensor([[1, 0, 0],
            [1, 0, 0],
            [1, 0, 1]], dtype=torch.int32)
    """
    out: torch.Tensor | None = None
    for m in masks:
        if m is None:
            continue
        if m.dtype != torch.bool:
            raise TypeError(f"combine() takes bool masks (True = attend), got {m.dtype}")
        out = m if out is None else out & m
    return out


def to_additive(mask: torch.Tensor, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """Bool keep-mask → additive float mask: True → 0.0, False → -inf.

    >>> to_additive(torch.tensor([True, False]))
    tensor([0., -inf])
    """
    if mask.dtype != torch.bool:
        raise TypeError(f"to_additive() takes a bool mask, got {mask.dtype}")
    zero = torch.zeros((), dtype=dtype, device=mask.device)
    return torch.where(mask, zero, torch.full((), float("-inf"), dtype=dtype, device=mask.device))


def from_torch_mha(mask: torch.Tensor) -> torch.Tensor:
    """Convert a ``torch.nn.MultiheadAttention``-style mask to this library's convention.

    torch MHA's bool ``attn_mask`` / ``key_padding_mask`` use True = **blocked**; ours use True = attend,
    so a bool mask is inverted. A float mask is additive in both and returned unchanged.

    >>> from_torch_mha(torch.tensor([[False, True]]))
    tensor([[ True, False]])
    """
    if not isinstance(mask, torch.Tensor):
        raise TypeError(f"mask must be a torch.Tensor, got {type(mask).__name__}")
    if mask.dtype == torch.bool:
        return ~mask
    if mask.is_floating_point():
        return mask
    raise TypeError(f"mask must be bool or floating, got {mask.dtype}")


def draw(mask: torch.Tensor | Visibility) -> str:
    """Render a 2-D mask (or a :class:`~selfattention.visibility.Visibility`) as rows of 1 (attend) and
    0 (hidden), for docs and error messages; leading dims are indexed at 0.

    >>> print(draw(causal_mask(2, 3)))
    1 1 0
    1 1 1
    """
    m = mask.to_mask() if isinstance(mask, Visibility) else mask
    if m.is_floating_point():
        m = m != float("-inf")
    while m.dim() > 2:
        m = m[0]
    if m.dim() == 1:
        m = m[None, :]
    return "\n".join(" ".join("1" if bool(v) else "0" for v in row) for row in m.tolist())
