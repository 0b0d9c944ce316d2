"""The report's other views of a run: words instead of tokens, and rollout, flow and ‖α f(x)‖ beside the
raw weights (:mod:`selfattention.words`, :mod:`selfattention.attribution`).

Each view is one more set of 8-bit matrices in the payload, under ``payload["views"]["<unit>:<measure>"]``
(``unit`` ``tokens`` or ``words``, ``measure`` one of :data:`~selfattention.attribution.MEASURES`); the
page's raw token weights are ``tokens:raw`` itself. A view holds::

    {"unit", "measure", "labels": [W labels], "special": [W flags], "dims": [Lv, Hv],
     "weights_u8": (Lv, Hv, W, W) 8-bit, "note": "what the view shows"}

``dims`` is (L, H) for per-head views (raw, norm), (L, 1) for rollout (one matrix per layer, shown for
every head of it) and (1, 1) for flow (one matrix, to the last layer). Values are row-normalised (rows sum
to 1) before the 8-bit encoding, so the page's colour scales apply unchanged.
"""

from __future__ import annotations

from typing import Any

import torch

from ..attribution import FLOW_MAX_TOKENS, MEASURES, measure
from ..i18n import N_, _
from ..words import WordGroups, aggregate
from .payload import encode_array, quantise_weights

__all__ = ["MEASURE_NOTES", "WORDS_NOTE", "add_views", "views_payload"]

MEASURE_NOTES = {
    "raw": N_("Raw attention weights: softmax(Q Kᵀ·scale) of one head; rows sum to 1."),
    "norm": N_(
        "‖α f(x)‖ (Kobayashi et al. 2020): each weight times the norm of what its key adds (the key's value "
        "through the head's slice of the output projection); rows rescaled to sum to 1."
    ),
    "rollout": N_(
        "Attention rollout (Abnar & Zuidema 2020) after the selected layer: heads averaged, the residual "
        "added (0.5·A + 0.5·I), multiplied through the layers up to it; every head of a layer shows the same "
        "matrix; rows sum to 1."
    ),
    "flow": N_(
        "Attention flow (Abnar & Zuidema 2020) from the input tokens to the last layer: the max-flow through "
        "every layer's 0.5·A + 0.5·I; one matrix, shown for every head; rows rescaled to sum to 1."
    ),
}
WORDS_NOTE = N_(
    "Words ({segmenter}): weights summed over a word's keys, averaged over its queries (Clark et al. 2019)."
)


def views_payload(
    run: Any,
    groups: WordGroups | None = None,
    net: Any = None,
    measures: tuple[str, ...] = MEASURES,
) -> tuple[dict[str, Any], list[str]]:
    """The extra views of a run with its weights kept, and notes on the views left out.

    Args:
        run: a ``ModelRun`` whose ``attentions`` is a tensor (else no view is made).
        groups: the run's words (:func:`selfattention.words.word_groups`); None: no word views.
        net: the loaded model, for the output projection in ``norm`` (None: ‖v‖).
        measures: which measures to include (``raw`` is always there for tokens).

    Returns:
        (views, notes): ``views`` maps ``"unit:measure"`` to a view dict (``tokens:raw`` is not repeated:
        it is the page's main data); ``notes`` says what was left out and why.
    """
    notes: list[str] = []
    if run.attentions is None:
        return {}, [_("Rollout, flow, ‖α f(x)‖ and words need every weight matrix: this input is too long.")]
    tokens = list(run.tokens)
    special = list(getattr(run, "special", None) or [False] * len(tokens))
    views: dict[str, Any] = {}
    for name in measures:
        if name not in MEASURES:
            raise ValueError(f"measures must be among {MEASURES}, got {name!r}")
        if name == "flow" and len(tokens) > FLOW_MAX_TOKENS:
            notes.append(
                _(
                    "Attention flow is left out: it is computed for at most {n} tokens (this text has {t})."
                ).format(n=FLOW_MAX_TOKENS, t=len(tokens))
            )
            continue
        m = measure(run, name, net)  # (L, H, T, T), (L, T, T) or (T, T)
        m = m.reshape(*([1] * (4 - m.dim())), *m.shape) if name == "flow" else m
        m = m[:, None] if name == "rollout" else m  # (Lv, Hv, T, T)
        if name != "raw":
            views[f"tokens:{name}"] = _view("tokens", name, tokens, special, m, _(MEASURE_NOTES[name]))
        if groups is not None:
            words_special = [all(special[t] for t in g) for g in groups.groups]
            note = _("{measure} {words}").format(
                measure=_(MEASURE_NOTES[name]), words=_(WORDS_NOTE).format(segmenter=groups.segmenter)
            )
            views[f"words:{name}"] = _view(
                "words", name, groups.words, words_special, aggregate(m, groups.groups), note, groups.groups
            )
    return views, notes


def _view(
    unit: str,
    name: str,
    labels: list[str],
    special: list[bool],
    m: torch.Tensor,
    note: str,
    groups: list[list[int]] | None = None,
) -> dict[str, Any]:
    m = m.double()
    s = m.sum(-1, keepdim=True)
    m = torch.where(s > 0, m / torch.where(s > 0, s, 1.0), 0.0)  # rows sum to 1 for the colour scales
    view = {
        "unit": unit,
        "measure": name,
        "labels": [str(x) for x in labels],
        "special": [bool(x) for x in special],
        "dims": [int(m.shape[0]), int(m.shape[1])],
        "weights_u8": encode_array(quantise_weights(m), "u8"),
        "note": note,
    }
    if groups is not None:
        view["groups"] = [list(g) for g in groups]
    return view


def add_views(
    payload: dict[str, Any],
    run: Any,
    groups: WordGroups | None = None,
    net: Any = None,
    initial: str = "tokens:raw",
) -> dict[str, Any]:
    """Put the views of :func:`views_payload` into a model report's ``payload`` (in place; returned),
    with the page opening on view ``initial`` (``"tokens:raw"``, ``"words:rollout"``, …).

    Raises:
        ValueError: ``initial`` is not ``tokens:raw`` and not among the views made (e.g. words without
            ``groups``, flow for a long text).
    """
    views, notes = views_payload(run, groups, net)
    if initial != "tokens:raw" and initial not in views:
        raise ValueError(f"the view {initial!r} is not available for this run (views: {sorted(views)})")
    payload["views"] = views
    payload["initial"]["view"] = initial
    if initial.startswith("words:") and groups is not None:
        payload["initial"]["token"] = groups.word_of(payload["initial"]["token"])
    payload["notes"] = [*payload["notes"], *notes]
    payload["raw_note"] = _(MEASURE_NOTES["raw"])
    return payload
