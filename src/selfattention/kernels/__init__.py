"""The kernels layer: how a block of attention is computed, merged, differentiated and summarised.

* :mod:`.plan` — a :class:`~selfattention.visibility.Visibility` becomes a short list of kernel calls
  (blocks nobody can see are never computed);
* :mod:`.vendor` — torch's fused flash kernels (CPU; memory-efficient on CUDA), which return the
  log-sum-exp; :mod:`.exact` — plain torch ops, for what no fused kernel offers (NaN/inf semantics,
  dropout replay, float-mask gradients);
* :mod:`.scored` — flex_attention's score mods that are not a bias (softcap, learned tables): per query
  block, checkpointed, autograd to every captured tensor;
* :mod:`.merge` — the log-sum-exp merge of partial outputs (also used by ring attention);
* :mod:`.engine` — a plan executed by one kernel, forward and backward, with autograd;
* :mod:`.stats` — entropy, top-k keys and column sums from one sweep over the plan.

Sources: Dao 2023, "FlashAttention-2" (Algorithms 1 and 2); Milakov & Gimelshein 2018, "Online normalizer
calculation for softmax"; flex_attention's BlockMask (full vs partial blocks) for the idea of the plan.
"""
