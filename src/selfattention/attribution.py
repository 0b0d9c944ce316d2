"""Beyond raw weights: attention rollout, attention flow and the value-norm weighting ‖α f(x)‖.

A raw attention weight α_ij says how much of token j's value one head mixes into position i in one
layer. Three published readings go further; all take a run's (L, H, T, T) weights:

* **Rollout** (Abnar & Zuidema 2020, "Quantifying Attention Flow in Transformers", ACL 2020): average the
  heads of each layer, add the residual connection as an identity and re-normalise the rows,
  Â_l = rownorm(0.5·mean_h A_l + 0.5·I), then multiply through the layers:
  R_0 = Â_0, R_l = Â_l · R_{l−1}. Row i of R_l: how much each *input* token reaches position i after
  layer l. Every row sums to 1.
* **Flow** (same paper): the layers as a graph — a node per (layer boundary, token), an edge from
  node (l+1, i) down to (l, j) of capacity Â_l[i, j] — and the flow of input token j to position i
  after the last layer is the maximum flow from node (L, i) to node (0, j) (networkx). Each value is at
  most 1; rows do not sum to 1.
* **Norm** (Kobayashi et al. 2020, "Attention is Not Only a Weight: Analyzing Transformers with Vector
  Norms", EMNLP 2020): what key j adds to output i of head h is the vector α_ij f(x_j), with
  f(x_j) = (x_j W_V + b_V) W_O^h the value passed through the head's slice of the output projection, so
  its size is α_ij ‖f(x_j)‖. Without W_O (a model whose output projection we cannot find) ‖v_j‖ is used.

For pictures and comparisons, :func:`row_normalise` rescales each row to sum to 1 (flow and norm rows
do not on their own).

>>> import torch
>>> A = torch.tensor([[[[1.0, 0.0], [1.0, 0.0]]]])   # (L=1, H=1, T=2, T=2): both tokens read token 0
>>> attention_rollout(A)[0].tolist()                 # 0.5·A + 0.5·I, rows already sum to 1
[[1.0, 0.0], [0.5, 0.5]]
"""

from __future__ import annotations

import math
from typing import Any

import torch

__all__ = [
    "FLOW_MAX_TOKENS",
    "MEASURES",
    "attention_flow",
    "attention_rollout",
    "measure",
    "output_projections",
    "residual_attention",
    "row_normalise",
    "spearman",
    "value_norm_weights",
]

MEASURES = ("raw", "norm", "rollout", "flow")
"""The four readings `explain` and the report offer: raw weights, ‖α f(x)‖, rollout, flow."""

FLOW_MAX_TOKENS = 20
"""Attention flow solves T² max-flow problems on a graph of (L+1)·T nodes and L·T² edges; above this many
tokens it is refused (32 tokens took 53 s on a shared 2-core machine)."""


def _check_weights(attentions: Any) -> torch.Tensor:
    a = torch.as_tensor(attentions)
    if a.dim() != 4 or a.shape[-1] != a.shape[-2] or a.shape[-1] == 0:
        raise ValueError(f"attentions must be (L, H, T, T) with T >= 1, got shape {tuple(a.shape)}")
    if not a.dtype.is_floating_point:
        raise TypeError(f"attentions must be a floating-point tensor, got {a.dtype}")
    if not bool(torch.isfinite(a).all()):
        raise ValueError("attentions hold NaN or inf")
    return a.detach().to("cpu", torch.float64)


def residual_attention(attentions: torch.Tensor, residual: float = 0.5) -> torch.Tensor:
    """Â_l = rownorm((1 − residual)·mean_h A_l + residual·I): (L, H, T, T) → (L, T, T) float64.

    ``residual`` = 0.5 is Abnar & Zuidema's choice (the residual connection weighs as much as attention).

    Raises:
        ValueError: not (L, H, T, T), NaN/inf, or ``residual`` not in [0, 1].
    """
    if not 0.0 <= residual <= 1.0:
        raise ValueError(f"residual must be in [0, 1], got {residual}")
    a = _check_weights(attentions).mean(1)  # (L, T, T): heads averaged
    eye = torch.eye(a.shape[-1], dtype=torch.float64)
    aug = (1.0 - residual) * a + residual * eye
    return row_normalise(aug)


def attention_rollout(attentions: torch.Tensor, residual: float = 0.5) -> torch.Tensor:
    """Attention rollout after every layer: (L, H, T, T) → (L, T, T) float64, R_l = Â_l · R_{l−1}.

    ``R[l, i, j]``: the share of input token j in position i after layer l (0-based). Rows sum to 1.

    Raises:
        ValueError: see :func:`residual_attention`.
    """
    aug = residual_attention(attentions, residual)
    out = torch.empty_like(aug)
    acc = aug[0]
    out[0] = acc
    for layer in range(1, aug.shape[0]):
        acc = aug[layer] @ acc  # (T, T): this layer's mixing applied to what the layers below mixed
        out[layer] = acc
    return out


def attention_flow(
    attentions: torch.Tensor, residual: float = 0.5, *, max_tokens: int = FLOW_MAX_TOKENS
) -> torch.Tensor:
    """Attention flow from the input tokens to every position after the last layer: (T, T) float64.

    ``F[i, j]`` = the maximum flow from node (L, i) to node (0, j) in the graph whose edges go from
    (l+1, i) to (l, j) with capacity Â_l[i, j] (:func:`residual_attention`). Solved with networkx's
    shortest augmenting path, T² times: 2.4–3.7 s for T = 16 and L = 6 on a shared 2-core machine, 53 s for
    T = 32 (it grows about as T⁴), hence :data:`FLOW_MAX_TOKENS`.

    Raises:
        ValueError: see :func:`residual_attention`; more than ``max_tokens`` tokens.
        ImportError: networkx is not installed.
    """
    aug = residual_attention(attentions, residual)
    n_layers, t, _ = aug.shape
    if t > max_tokens:
        raise ValueError(
            f"attention flow is limited to {max_tokens} tokens (T² max-flow problems), got {t}: "
            "use rollout for longer inputs"
        )
    import networkx as nx
    from networkx.algorithms.flow import build_residual_network, shortest_augmenting_path

    graph = nx.DiGraph()
    graph.add_nodes_from((layer, i) for layer in range(n_layers + 1) for i in range(t))
    caps = aug.tolist()
    for layer in range(n_layers):
        for i in range(t):
            for j in range(t):
                if caps[layer][i][j] > 0.0:
                    graph.add_edge((layer + 1, i), (layer, j), capacity=caps[layer][i][j])
    residual_net = build_residual_network(graph, "capacity")  # built once, reset by each solve
    flow = torch.zeros(t, t, dtype=torch.float64)
    for i in range(t):
        for j in range(t):
            solved = shortest_augmenting_path(graph, (n_layers, i), (0, j), residual=residual_net)
            flow[i, j] = solved.graph["flow_value"]
    return flow


def row_normalise(m: torch.Tensor) -> torch.Tensor:
    """Each row divided by its sum (a row of zeros stays zeros). Float64.

    >>> row_normalise(torch.tensor([[1.0, 3.0], [0.0, 0.0]])).tolist()
    [[0.25, 0.75], [0.0, 0.0]]
    """
    m = torch.as_tensor(m).detach().to("cpu", torch.float64)
    s = m.sum(-1, keepdim=True)
    return torch.where(s > 0, m / torch.where(s > 0, s, 1.0), 0.0)


def output_projections(net: Any, n_heads: int) -> list[torch.Tensor] | None:
    """Per layer, the output projection W_O split per head, (H, D, d_model) float64 — for BERT-style
    encoders (``encoder.layer[l].attention.output.dense``, MiniLM, m3e-small) and GPT-2-style decoders
    (``h[l].attn.c_proj``); None for other architectures (then :func:`value_norm_weights` uses ‖v‖)."""
    layers = getattr(getattr(net, "encoder", None), "layer", None)
    mats = []
    if layers is not None:
        for layer in layers:
            dense = getattr(getattr(getattr(layer, "attention", None), "output", None), "dense", None)
            if dense is None:
                return None
            mats.append(dense.weight.detach().double().T)  # (H·D, d_model): out = ctx @ W.T + b
    elif getattr(net, "h", None) is not None:
        for block in net.h:
            proj = getattr(getattr(block, "attn", None), "c_proj", None)
            if proj is None:
                return None
            mats.append(proj.weight.detach().double())  # Conv1D: (H·D, d_model)
    else:
        return None
    out = []
    for w in mats:
        if w.shape[0] % n_heads:
            return None
        out.append(w.reshape(n_heads, w.shape[0] // n_heads, w.shape[1]))  # (H, D, d_model)
    return out


def value_norm_weights(
    attentions: torch.Tensor, values: torch.Tensor, out_proj: list[torch.Tensor] | None = None
) -> torch.Tensor:
    """Kobayashi et al.'s ‖α_ij f(x_j)‖ = α_ij ‖f(x_j)‖ per head: (L, H, T, T) float64, not normalised.

    Args:
        attentions: (L, H, T, T) weights.
        values: (L, H, T, D) the per-head values v_j = x_j W_V + b_V (``run.values``).
        out_proj: per layer (H, D, d_model), :func:`output_projections`; then f(x_j) = v_j W_O^h.
            None: f(x_j) = v_j.

    Raises:
        ValueError: shapes disagree.
    """
    a = _check_weights(attentions)
    v = torch.as_tensor(values).detach().to("cpu", torch.float64)
    n_layers, n_heads, t, _ = a.shape
    if v.dim() != 4 or tuple(v.shape[:3]) != (n_layers, n_heads, t):
        raise ValueError(
            f"values must be (L, H, T, D) = ({n_layers}, {n_heads}, {t}, D), got {tuple(v.shape)}"
        )
    if out_proj is None:
        norms = v.norm(dim=-1)  # (L, H, T)
    else:
        if len(out_proj) != n_layers:
            raise ValueError(f"out_proj must hold {n_layers} layers, got {len(out_proj)}")
        norms = torch.stack(
            [
                torch.einsum("htd,hde->hte", v[la], out_proj[la].double()).norm(dim=-1)
                for la in range(n_layers)
            ]
        )  # (L, H, T): ‖v_j W_O^h‖
    return a * norms[:, :, None, :]


def measure(run: Any, name: str, net: Any = None) -> torch.Tensor:
    """One reading of a run's attention, row-normalised: (L, H, T, T) float64 for ``raw`` and ``norm``,
    (L, T, T) for ``rollout`` (after each layer), (T, T) for ``flow`` (after the last layer).

    Args:
        run: a :class:`selfattention.pretrained.ModelRun` with its weights kept (``run.attentions``).
        name: one of :data:`MEASURES`.
        net: the loaded model, for W_O in ``norm`` (:func:`output_projections`); None: ‖v‖.

    Raises:
        ValueError: unknown ``name``; a run without its weight matrices; flow above
            :data:`FLOW_MAX_TOKENS` tokens.
    """
    if name not in MEASURES:
        raise ValueError(f"measure must be one of {MEASURES}, got {name!r}")
    if run.attentions is None:
        raise ValueError("the run kept no weight matrices (the input is too long): no rollout, flow or norm")
    att = run.attentions
    if name == "raw":
        return torch.as_tensor(att).double()
    if name == "rollout":
        return attention_rollout(att)
    if name == "flow":
        return row_normalise(attention_flow(att))
    proj = output_projections(net, run.n_heads) if net is not None else None
    return row_normalise(value_norm_weights(att, run.values, proj))


def spearman(x: torch.Tensor, y: torch.Tensor) -> float:
    """Spearman's rank correlation (average ranks for ties); NaN when either side is constant."""

    def ranks(v: torch.Tensor) -> torch.Tensor:
        v = v.double()
        order = torch.argsort(v, stable=True)
        r = torch.empty_like(v)
        r[order] = torch.arange(len(v), dtype=torch.float64)
        for value in torch.unique(v):  # ties share their mean rank
            tie = v == value
            r[tie] = r[tie].mean()
        return r

    rx, ry = ranks(x), ranks(y)
    rx, ry = rx - rx.mean(), ry - ry.mean()
    den = math.sqrt(float((rx * rx).sum()) * float((ry * ry).sum()))
    return float((rx * ry).sum()) / den if den > 0 else math.nan
