"""A small GPT-like causal decoder built on :class:`~selfattention.mha.MultiHeadAttention`, trained in
about a minute on CPU on text every Python install ships, and generating with or without the KV cache.

Architecture (pre-LayerNorm, as GPT-2; Radford et al. 2019)::

    ids (B, T) ─► token embedding + learned position embedding ─► x (B, T, d_model)
    N × [ x = x + MHA(LN(x), causal)      x = x + MLP(LN(x)),  MLP = Linear(d, 4d) · GELU · Linear(4d, d) ]
    LN ─► Linear(d_model, vocab) ─► logits (B, T, vocab)

The tokenizer is character-level (:class:`CharTokenizer`); the training text is the documentation prose
CPython ships in :mod:`pydoc_data.topics` (no download). Training is seeded and deterministic for a
given machine and thread count.

Generation is greedy: with the cache, the prompt is prefilled once and each new token costs one
single-token step; without, the whole sequence is recomputed for every token. Both give the same tokens
(the tests check it). Checkpoints are a ``.safetensors`` file with a ``.json`` config next to it.
"""

from __future__ import annotations

import json
import math
import time
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path

import torch
from torch import nn

from . import masks
from ._validation import check_positive_int
from .kv_cache import KVCache
from .mha import MultiHeadAttention

__all__ = [
    "CharTokenizer",
    "DecoderConfig",
    "Decoder",
    "generate",
    "training_text",
    "train",
    "save_checkpoint",
    "load_checkpoint",
    "default_checkpoint",
    "train_default",
    "CheckpointError",
]

FORMAT = "selfattention-decoder/1"


class CheckpointError(ValueError):
    """A checkpoint that does not fit its config or the model (missing keys, wrong shapes, bad JSON)."""


# --------------------------------------------------------------------------------------------- tokenizer
class CharTokenizer:
    """One token per character of a fixed alphabet.

    >>> tok = CharTokenizer("abc ")
    >>> tok.encode("cab a")
    [3, 1, 2, 0, 1]
    >>> tok.decode([3, 1, 2])
    'cab'

    ``encode`` raises ``ValueError`` naming characters outside the alphabet.
    """

    def __init__(self, chars: str) -> None:
        if len(set(chars)) != len(chars):
            raise ValueError("the alphabet must not repeat characters")
        self.chars = "".join(sorted(chars))
        self._index = {c: i for i, c in enumerate(self.chars)}

    @classmethod
    def from_text(cls, text: str) -> CharTokenizer:
        return cls("".join(sorted(set(text))))

    @property
    def vocab_size(self) -> int:
        return len(self.chars)

    def encode(self, text: str) -> list[int]:
        unknown = sorted({c for c in text if c not in self._index})
        if unknown:
            raise ValueError(
                f"text contains characters the model's alphabet does not have: {''.join(unknown)!r} "
                f"(the alphabet has {self.vocab_size} characters, those of the training text)"
            )
        return [self._index[c] for c in text]

    def decode(self, ids: Sequence[int]) -> str:
        return "".join(self.chars[int(i)] for i in ids)


# ----------------------------------------------------------------------------------------------- model
@dataclass
class DecoderConfig:
    """Sizes of a :class:`Decoder`. ``context`` = number of learned positions (longest sequence);
    ``window`` = optional sliding attention window; ``backend`` = attention path (see backends)."""

    vocab_size: int
    context: int = 256
    d_model: int = 128
    num_heads: int = 4
    num_kv_heads: int | None = None
    num_layers: int = 4
    mlp_ratio: int = 4
    window: int | None = None
    backend: str | None = "torch"

    def __post_init__(self) -> None:
        for name in ("vocab_size", "context", "d_model", "num_heads", "num_layers", "mlp_ratio"):
            check_positive_int(name, getattr(self, name))
        if self.window is not None:
            check_positive_int("window", self.window)


class Block(nn.Module):
    """Pre-LN transformer block: x + MHA(LN(x)), then x + MLP(LN(x))."""

    def __init__(self, cfg: DecoderConfig) -> None:
        super().__init__()
        self.ln1 = nn.LayerNorm(cfg.d_model)
        self.attn = MultiHeadAttention(
            cfg.d_model, cfg.num_heads, num_kv_heads=cfg.num_kv_heads, backend=cfg.backend
        )
        self.ln2 = nn.LayerNorm(cfg.d_model)
        self.mlp = nn.Sequential(
            nn.Linear(cfg.d_model, cfg.mlp_ratio * cfg.d_model),
            nn.GELU(),
            nn.Linear(cfg.mlp_ratio * cfg.d_model, cfg.d_model),
        )

    def forward(
        self,
        x: torch.Tensor,
        attn_mask: torch.Tensor | None,
        is_causal: bool,
        key_padding_mask: torch.Tensor | None,
        kv_cache: KVCache | None,
    ) -> torch.Tensor:
        a, _ = self.attn(
            self.ln1(x),
            attn_mask=attn_mask,
            is_causal=is_causal,
            key_padding_mask=key_padding_mask,
            kv_cache=kv_cache,
        )
        x = x + a
        return x + self.mlp(self.ln2(x))


class Decoder(nn.Module):
    """A GPT-like causal language model on :class:`MultiHeadAttention` (see the module docstring).

    forward(ids, caches=None, key_padding_mask=None) → logits:

    * ``ids``: int64 (B, T) token ids.
    * ``caches``: None (the whole sequence, causal) or one :class:`KVCache` per layer from
      :meth:`new_caches`; the ids are then the next T tokens, at positions ``caches[0].offset …``.
    * ``key_padding_mask``: bool (B, T), True = real token (right padding without a cache).
    * Returns float logits (B, T, vocab_size).

    Raises ``ValueError`` when positions would exceed ``config.context`` or ids are out of range.

    >>> _ = torch.manual_seed(0)
    >>> model = Decoder(DecoderConfig(vocab_size=10, context=16, d_model=8, num_heads=2, num_layers=1))
    >>> model(torch.tensor([[1, 2, 3]])).shape
    torch.Size([1, 3, 10])
    """

    def __init__(self, config: DecoderConfig) -> None:
        super().__init__()
        self.config = config
        self.tok_emb = nn.Embedding(config.vocab_size, config.d_model)
        self.pos_emb = nn.Embedding(config.context, config.d_model)
        self.blocks = nn.ModuleList(Block(config) for _ in range(config.num_layers))
        self.ln_f = nn.LayerNorm(config.d_model)
        self.head = nn.Linear(config.d_model, config.vocab_size, bias=False)
        self.apply(self._init)

    @staticmethod
    def _init(m: nn.Module) -> None:
        if isinstance(m, nn.Linear | nn.Embedding):
            nn.init.normal_(m.weight, std=0.02)
        if isinstance(m, nn.Linear) and m.bias is not None:
            nn.init.zeros_(m.bias)

    def new_caches(self, batch_size: int, capacity: int | None = None) -> list[KVCache]:
        """One :class:`KVCache` per layer (capacity defaults to ``config.context``; the config's window)."""
        cfg = self.config
        capacity = cfg.context if capacity is None else capacity
        if cfg.window is not None:
            capacity = max(capacity if capacity is not None else 0, cfg.window)
        return [b.attn.new_cache(batch_size, capacity, window=cfg.window) for b in self.blocks]

    def forward(
        self,
        ids: torch.Tensor,
        caches: Sequence[KVCache] | None = None,
        key_padding_mask: torch.Tensor | None = None,
    ) -> torch.Tensor:
        if not isinstance(ids, torch.Tensor) or ids.dim() != 2 or ids.dtype not in (torch.int64, torch.int32):
            raise ValueError(f"ids must be an int64 tensor of shape (B, T), got {getattr(ids, 'shape', ids)}")
        B, T = ids.shape
        cfg = self.config
        if T and (int(ids.min()) < 0 or int(ids.max()) >= cfg.vocab_size):
            raise ValueError(
                f"token ids must be in [0, {cfg.vocab_size}), got min {int(ids.min())}, max {int(ids.max())}"
            )
        if caches is not None and len(caches) != len(self.blocks):
            raise ValueError(f"need one KVCache per layer ({len(self.blocks)}), got {len(caches)}")
        offset = 0 if caches is None else caches[0].offset
        if offset + T > cfg.context:
            raise ValueError(
                f"positions {offset}..{offset + T - 1} exceed the model's context of {cfg.context} positions"
            )
        pos = torch.arange(offset, offset + T, device=ids.device)
        x = self.tok_emb(ids) + self.pos_emb(pos)  # (B, T, d_model)
        attn_mask, is_causal = None, True
        if caches is None and cfg.window is not None:
            attn_mask, is_causal = masks.sliding_window_mask(T, T, cfg.window, device=ids.device), False
        for i, block in enumerate(self.blocks):
            x = block(x, attn_mask, is_causal, key_padding_mask, None if caches is None else caches[i])
        return self.head(self.ln_f(x))  # (B, T, vocab)


@torch.inference_mode()
def generate(
    model: Decoder,
    prompt: torch.Tensor | Sequence[int],
    max_new_tokens: int,
    *,
    use_cache: bool = True,
    on_token: Callable[[int], None] | None = None,
) -> torch.Tensor:
    """Greedy decoding: append the arg-max token ``max_new_tokens`` times.

    Args:
        model: a :class:`Decoder` (put in eval mode here).
        prompt: int ids, (T,) or (B, T) with T ≥ 1.
        max_new_tokens: how many tokens to generate; prompt + new must fit ``config.context``.
        use_cache: prefill a :class:`KVCache` per layer and decode one token per step (O(T) per step);
            False recomputes the whole sequence each step (O(T²) per step). Same tokens either way.
        on_token: called with each new token id of batch row 0 (for streaming output).

    Returns:
        The new ids, int64 (B, max_new_tokens) (or (max_new_tokens,) for a 1-D prompt).

    Raises ``ValueError`` if the prompt is empty or prompt + new tokens exceed the context.
    """
    model.eval()
    ids = torch.as_tensor(prompt, dtype=torch.int64)
    squeeze = ids.dim() == 1
    if squeeze:
        ids = ids[None]
    if ids.dim() != 2 or ids.shape[1] == 0:
        raise ValueError(
            f"prompt must be a non-empty (T,) or (B, T) sequence of ids, got shape {tuple(ids.shape)}"
        )
    n = max_new_tokens
    if isinstance(n, bool) or not isinstance(n, int) or n < 0:
        raise ValueError(f"max_new_tokens must be an int >= 0, got {n!r}")
    ctx = model.config.context
    if ids.shape[1] + n > ctx:
        raise ValueError(
            f"prompt ({ids.shape[1]} tokens) + {n} new tokens = {ids.shape[1] + n} exceed the model's context "
            f"of {ctx} positions"
        )
    ids = ids.to(model.head.weight.device)
    out = torch.empty(ids.shape[0], n, dtype=torch.int64, device=ids.device)
    if use_cache:
        caches = model.new_caches(ids.shape[0], ids.shape[1] + n)
        logits = model(ids, caches)[:, -1]  # prefill: (B, vocab) at the last prompt position
    seq = ids
    for i in range(n):
        if not use_cache:
            logits = model(seq)[:, -1]  # recompute everything
        nxt = logits.argmax(-1)  # (B,)
        out[:, i] = nxt
        if on_token is not None:
            on_token(int(nxt[0]))
        if i + 1 < n:
            if use_cache:
                logits = model(nxt[:, None], caches)[:, -1]
            else:
                seq = torch.cat([seq, nxt[:, None]], dim=1)
    return out[0] if squeeze else out


# -------------------------------------------------------------------------------------------- training
def training_text() -> str:
    """The prose of CPython's ``pydoc_data.topics`` (help() topics), joined in sorted-key order.

    Present in every CPython install; ~0.45 M characters of English with code samples.
    """
    from pydoc_data.topics import topics

    return "\n\n".join(topics[k].strip() for k in sorted(topics))


@dataclass
class TrainResult:
    steps: int
    seconds: float
    train_loss: float
    val_loss: float
    losses: list[float] = field(default_factory=list)


def _batches(
    data: torch.Tensor, batch: int, seq: int, gen: torch.Generator
) -> tuple[torch.Tensor, torch.Tensor]:
    starts = torch.randint(0, data.numel() - seq - 1, (batch,), generator=gen)
    idx = starts[:, None] + torch.arange(seq + 1)  # (B, seq + 1)
    chunk = data[idx]
    return chunk[:, :-1], chunk[:, 1:]


def train(
    model: Decoder,
    data: torch.Tensor,
    *,
    steps: int = 600,
    batch_size: int = 16,
    seq_len: int | None = None,
    lr: float = 3e-3,
    seed: int = 0,
    max_seconds: float | None = None,
    progress: Callable[[int, float], None] | None = None,
) -> TrainResult:
    """Next-token training with AdamW, linear warm-up and cosine decay; deterministic given ``seed``.

    ``data`` is a 1-D int64 tensor of token ids; the last 5 % is held out for ``val_loss``.
    ``max_seconds`` stops early (a safety cap for slow machines: the result then depends on speed;
    ``TrainResult.steps`` says how many ran). ``progress(step, loss)`` is called after every step.
    """
    steps = check_positive_int("steps", steps)
    seq_len = model.config.context if seq_len is None else seq_len
    split = int(data.numel() * 0.95)
    train_ids, val_ids = data[:split], data[split:]
    gen = torch.Generator().manual_seed(seed)
    torch.manual_seed(seed)
    opt = torch.optim.AdamW(model.parameters(), lr=lr, betas=(0.9, 0.95), weight_decay=0.01)
    warm = max(1, steps // 20)

    def lr_at(s: int) -> float:
        if s < warm:
            return lr * (s + 1) / warm
        return lr * (0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * (s - warm) / max(1, steps - warm))))

    model.train()
    losses: list[float] = []
    t0 = time.perf_counter()
    for s in range(steps):
        for g in opt.param_groups:
            g["lr"] = lr_at(s)
        x, y = _batches(train_ids, batch_size, seq_len, gen)
        logits = model(x)
        loss = nn.functional.cross_entropy(logits.reshape(-1, logits.shape[-1]), y.reshape(-1))
        opt.zero_grad(set_to_none=True)
        loss.backward()
        nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        losses.append(loss.item())
        if progress is not None:
            progress(s + 1, losses[-1])
        if max_seconds is not None and time.perf_counter() - t0 > max_seconds:
            break
    seconds = time.perf_counter() - t0
    model.eval()
    with torch.no_grad():
        vgen = torch.Generator().manual_seed(seed + 1)
        vx, vy = _batches(val_ids, 32, seq_len, vgen)
        vlogits = model(vx)
        val = nn.functional.cross_entropy(vlogits.reshape(-1, vlogits.shape[-1]), vy.reshape(-1)).item()
    tail = losses[-max(1, steps // 20) :]
    return TrainResult(len(losses), seconds, sum(tail) / len(tail), val, losses)


# The model `selfattention generate` trains when no checkpoint exists: ~0.6 M parameters, ~1 minute on
# 2 CPU cores (capped at TRAIN_MAX_SECONDS).
DEFAULT_SIZES = {"context": 256, "d_model": 128, "num_heads": 4, "num_layers": 3}
TRAIN_STEPS = 400
TRAIN_BATCH = 8
TRAIN_MAX_SECONDS = 110.0


def train_default(
    path: str | Path,
    *,
    steps: int = TRAIN_STEPS,
    max_seconds: float | None = TRAIN_MAX_SECONDS,
    seed: int = 0,
    progress: Callable[[int, float], None] | None = None,
) -> tuple[Decoder, CharTokenizer, dict]:
    """Train the default character-level model on :func:`training_text` and save it to ``path``.

    Returns ``(model, tokenizer, info)``; ``info`` (steps, seconds, losses, text source) is also stored
    in the checkpoint's JSON.
    """
    text = training_text()
    tokenizer = CharTokenizer.from_text(text)
    data = torch.tensor(tokenizer.encode(text), dtype=torch.int64)
    torch.manual_seed(seed)
    model = Decoder(DecoderConfig(vocab_size=tokenizer.vocab_size, **DEFAULT_SIZES))
    result = train(
        model,
        data,
        steps=steps,
        batch_size=TRAIN_BATCH,
        seed=seed,
        max_seconds=max_seconds,
        progress=progress,
    )
    info = {
        "text": "pydoc_data.topics (CPython documentation prose)",
        "characters": len(text),
        "steps": result.steps,
        "steps_planned": steps,
        "batch_size": TRAIN_BATCH,
        "seconds": round(result.seconds, 1),
        "train_loss": round(result.train_loss, 4),
        "val_loss": round(result.val_loss, 4),
        "seed": seed,
        "torch": torch.__version__,
    }
    save_checkpoint(model, tokenizer, path, info)
    return model, tokenizer, info


# ------------------------------------------------------------------------------------------ checkpoints
def default_checkpoint() -> Path:
    """``$XDG_CACHE_HOME/selfattention/decoder.safetensors`` (``~/.cache/...`` by default)."""
    import os

    base = os.environ.get("XDG_CACHE_HOME") or str(Path.home() / ".cache")
    return Path(base) / "selfattention" / "decoder.safetensors"


def _config_path(path: Path) -> Path:
    return path.with_suffix(".json")


def save_checkpoint(
    model: Decoder, tokenizer: CharTokenizer, path: str | Path, info: dict | None = None
) -> tuple[Path, Path]:
    """Write the weights to ``path`` (safetensors) and config + alphabet + ``info`` to ``path.json``.

    Returns the two paths. Creates the parent directory.
    """
    from safetensors.torch import save_file

    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    tensors = {k: v.detach().contiguous().cpu() for k, v in model.state_dict().items()}
    save_file(tensors, str(path), metadata={"format": FORMAT})
    meta = {"format": FORMAT, "config": asdict(model.config), "alphabet": tokenizer.chars, "info": info or {}}
    cfg_path = _config_path(path)
    cfg_path.write_text(json.dumps(meta, indent=2, ensure_ascii=False) + "\n", encoding="utf-8")
    return path, cfg_path


def check_state_dict(model: nn.Module, tensors: dict[str, torch.Tensor], source: str = "checkpoint") -> None:
    """Raise :class:`CheckpointError` naming every missing/unexpected tensor and every shape mismatch."""
    expected = model.state_dict()
    problems = []
    for name, t in expected.items():
        if name not in tensors:
            problems.append(f"missing tensor {name!r} (the model expects shape {tuple(t.shape)})")
        elif tuple(tensors[name].shape) != tuple(t.shape):
            problems.append(
                f"tensor {name!r} has shape {tuple(tensors[name].shape)}, the model expects {tuple(t.shape)}"
            )
    for name in tensors:
        if name not in expected:
            problems.append(f"unexpected tensor {name!r} of shape {tuple(tensors[name].shape)}")
    if problems:
        more = f" (and {len(problems) - 5} more)" if len(problems) > 5 else ""
        raise CheckpointError(f"{source} does not fit the model: " + "; ".join(problems[:5]) + more)


def load_checkpoint(path: str | Path) -> tuple[Decoder, CharTokenizer, dict]:
    """Load a checkpoint written by :func:`save_checkpoint`: ``(model in eval mode, tokenizer, info)``.

    Raises:
        FileNotFoundError: the ``.safetensors`` or its ``.json`` is missing.
        CheckpointError: bad JSON/config, or tensors missing, unexpected or of the wrong shape (each
            named with both shapes).
    """
    from safetensors.torch import load_file

    path = Path(path)
    cfg_path = _config_path(path)
    for p in (path, cfg_path):
        if not p.is_file():
            raise FileNotFoundError(f"checkpoint file not found: {p}")
    try:
        meta = json.loads(cfg_path.read_text(encoding="utf-8"))
        if meta.get("format") != FORMAT:
            raise CheckpointError(f"{cfg_path}: format {meta.get('format')!r}, expected {FORMAT!r}")
        config = DecoderConfig(**meta["config"])
        tokenizer = CharTokenizer(meta["alphabet"])
    except (json.JSONDecodeError, KeyError, TypeError) as e:
        raise CheckpointError(f"{cfg_path} is not a valid decoder config: {e}") from None
    if tokenizer.vocab_size != config.vocab_size:
        raise CheckpointError(
            f"{cfg_path}: alphabet has {tokenizer.vocab_size} characters but vocab_size is {config.vocab_size}"
        )
    model = Decoder(config)
    try:
        tensors = load_file(str(path))
    except Exception as e:  # safetensors raises its own error types for corrupt files
        raise CheckpointError(f"{path} is not a readable safetensors file: {e}") from None
    check_state_dict(model, tensors, source=str(path))
    model.load_state_dict(tensors, strict=True)
    return model.eval(), tokenizer, meta.get("info", {})
