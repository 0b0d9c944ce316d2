"""The words of the HTML report's page (report.html, report.js), marked for translation.

The page is static and written in English; :func:`labels` gives it, in the payload, every one of these
texts in the interface language (``--lang``), and report.js shows them through ``tx()``. The list must
hold exactly the texts of ``tx("...")`` calls, ``METRIC_NOTE`` and ``data-t``/``data-t-title`` elements:
tests/test_i18n.py checks it against the two files.
"""

from __future__ import annotations

from ..i18n import N_, _

__all__ = ["LABELS", "labels"]

LABELS: tuple[str, ...] = (
    N_("The report could not be drawn: {error}"),
    N_("{title} · attention report"),
    N_("#{j} · weight from “{token}”: {weight}"),
    N_("#{j} · weight to “{token}”: {weight}"),
    N_("no matrix stored for layer {layer} · head {head} (long input): nothing to shade"),
    N_("shade: how much “{token}” (#{s}) attends to each token (√, relative to its largest weight)"),
    N_("; its {k} heaviest keys only"),
    N_("shade: how much each token attends to “{token}” (#{s}) (√, relative to the largest)"),
    N_("layer {layer} · head {head}"),
    N_("entropy {entropy} bits · self {self} · first {first} · last {last}"),
    N_("exact values stored"),
    N_("no matrix stored (long input): statistics and heaviest keys only"),
    N_("Thumbnails show the largest weight in each block of {n}×{n} cells."),
    N_(
        "The input is long: only {n} heads have a matrix; the grey ones have statistics and each query's heaviest keys."
    ),
    N_(
        "Exact values and traces stored for {n} of {total} heads (underlined in blue: {heads}); the others show 8-bit values."
    ),
    N_("Exact values stored for every head."),
    N_("key →"),
    N_("No matrix is stored for layer {layer} · head {head}: the input is long."),
    N_("Pick a head with a coloured thumbnail, or: selfattention report … --head {layer}.{head}"),
    N_("query"),
    N_("key"),
    N_("weight"),
    N_("(8-bit; exact not stored)"),
    N_("score {score} · scaled {scaled}"),
    N_("each row's largest weight"),
    N_("Layer {layer} · head {head}"),
    N_("Attention weights"),
    N_("entropy"),
    N_("{bits} bits"),
    N_("of at most {bits} (uniform)"),
    N_("on self"),
    N_("on first “{token}”"),
    N_("on last “{token}”"),
    N_("Shown in %."),
    N_("layer {layer} · head {head} · query “{token}” (#{s})"),
    N_("The trace of layer {layer} · head {head} is not stored in this file; exact values are kept for"),
    N_("Select one of those heads, or make a report for this head:"),
    N_("Heaviest keys of query “{token}” (#{s}) in this head (from the tiled statistics):"),
    N_(
        "scores = Q Kᵀ   →   scaled = scores × {scale}   →   weights = softmax over each row   →   context = weights · V"
    ),
    N_("Q (query)"),
    N_("K (key)"),
    N_("V (value)"),
    N_("1 · scores Q Kᵀ"),
    N_("2 · scaled × {scale}"),
    N_("3 · weights softmax"),
    N_("4 · context weights · V"),
    N_("Row {s} of the trace: query “{token}” against every key."),
    N_("order by position"),
    N_("order by weight"),
    N_("show {n} keys"),
    N_("show all {n} keys"),
    N_("score qᵢ·kⱼ"),
    N_("scaled ×{scale}"),
    N_("Σ weights over all {n} keys = {sum}"),
    N_("showing {shown} of {n} keys"),
    N_("Context vector z{s} = Σⱼ weightⱼ · vⱼ  ({n} numbers)"),
    N_(
        "Made by selfattention (python -m selfattention report). {T} tokens, {L} × {H} heads; decoded in {decode} ms, drawn in {draw} ms. No network: everything is in this file."
    ),
    N_(
        "Mean over query rows of −Σ w log₂ w, in bits. Low: each token looks at a few tokens; log₂ T: uniform."
    ),
    N_("Mean over query rows of the weight a token gives itself (the diagonal)."),
    N_(
        "Mean over query rows of the weight on the first token. Heads that park most weight here (often [CLS]) act as a no-op."
    ),
    N_("Mean over query rows of the weight on the last token ([SEP] for the model), another common ‘sink’."),
    N_("attention report"),
    N_("Read with care."),
    N_("Tokens"),
    N_("what it attends to"),
    N_("what attends to it"),
    N_("click a token (or use ← →)"),
    N_("Layers × heads"),
    N_("click a head"),
    N_("Per-head statistics"),
    N_("on first token"),
    N_("on last token"),
    N_("Head"),
    N_("√ weight"),
    N_("row max"),
    N_(
        "Rows: queries (attending). Columns: keys (attended to). Each row sums to 1. Hover a cell for its exact weight; click it to select its query token."
    ),
    N_("Trace"),
    N_("colour ∝ √weight: small weights stay visible"),
    N_("colour ∝ weight"),
    N_("each row scaled to its own largest weight"),
    # the views: words instead of tokens; rollout, flow, ‖α f(x)‖ (selfattention.report.views)
    N_("raw"),
    N_("rollout"),
    N_("flow"),
    N_("by token"),
    N_("by word"),
    N_(
        "The trace is that of the raw weights over tokens: choose “raw” and “by token” above the heatmap to see it."
    ),
)


def labels() -> dict[str, str]:
    """Each page text that the interface language translates: English text → translation."""
    return {text: _(text) for text in LABELS if _(text) != text}
