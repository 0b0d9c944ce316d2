"""Plain mask functions (attention-gym's style) recognised as the ready mod they equal (mods/recognise.py):
planned like it, and still equal to the float64 oracle of the function itself (forward, lse, gradients);
functions that only look alike (one extra key, a gap, a head-dependent window) keep the block plan."""

from __future__ import annotations

import functools
import warnings

import numpy as np
import pytest
import torch

import selfattention as sa
from selfattention import flex, flex_masks, mods
from selfattention.mods.recognise import RowRuns, equivalent, reads
from tests.test_flex import check, inputs

warnings.filterwarnings("ignore", message=".*flex_attention called without torch.compile.*")

DOC = torch.tensor([0] * 50 + [1] * 77 + [2] * 73)
IDS = torch.stack([DOC, torch.tensor([0] * 120 + [1] * 80)])


def _causal(b, h, q, kv):
    return q >= kv


def _window(b, h, q, kv):  # attention-gym's sliding_window_causal with WINDOW = 16
    return (q >= kv) & (q - kv <= 16)


def _prefix(b, h, q, kv):  # attention-gym's prefix_lm_causal with PREFIX = 30
    return (kv < 30) | (q >= kv)


# name: (mask function, Tq, Tk, the strategy it must be planned with)
RECOGNISED = {
    "causal": (_causal, 200, 200, "causal"),
    "window": (_window, 200, 200, "window"),
    "two-sided window": (lambda b, h, q, kv: (q - kv).abs() <= 5, 200, 200, "window"),
    "prefix-LM": (_prefix, 200, 200, "prefix-LM"),
    "documents": (lambda b, h, q, kv: DOC[q] == DOC[kv], 200, 200, "documents"),
    "causal documents": (lambda b, h, q, kv: (DOC[q] == DOC[kv]) & (q >= kv), 200, 200, "documents"),
    "bottom-right causal": (lambda b, h, q, kv: q + 100 >= kv, 200, 300, "causal"),
    "bottom-right window": (lambda b, h, q, kv: (q + 100 >= kv) & (q + 100 - kv < 40), 200, 300, "window"),
    "top-left, Tq > Tk": (_causal, 300, 200, "causal"),
    "everything": (lambda b, h, q, kv: q >= 0, 200, 200, "single"),
    "torch's and_masks": (
        torch.nn.attention.flex_attention.and_masks(_causal, lambda b, h, q, kv: q - kv < 9),
        200,
        200,
        "window",
    ),
}
NOT_RECOGNISED = {
    "dilated": lambda b, h, q, kv: (q >= kv) & ((q - kv) % 2 == 0),
    "a window with one key more": lambda b, h, q, kv: _window(b, h, q, kv) | ((q == 77) & (kv == 3)),
    "sinks": lambda b, h, q, kv: (q >= kv) & ((q - kv < 8) | (kv < 2)),
    "per-head window": lambda b, h, q, kv: (q >= kv) & (q - kv <= 4 + h),
}


@pytest.mark.parametrize("name", sorted(RECOGNISED))
def test_a_function_equal_to_a_ready_mod_gets_its_plan_and_the_oracles_numbers(name):
    fn, tq, tk, strategy = RECOGNISED[name]
    q, k, v = inputs(2, 4, 2, tq, tk, 16, 8, seed=len(name))
    bm = check(q, k, v, fn, block=64, gqa=True)  # float64 oracle of the function: out, lse, gradients
    assert flex.describe(q, k, v, block_mask=bm, enable_gqa=True).strategy == strategy
    assert bm in flex_masks.STRUCTURE or bm in flex_masks.TWINS


@pytest.mark.parametrize("name", sorted(NOT_RECOGNISED))
def test_a_function_that_only_looks_like_one_keeps_the_block_plan(name):
    fn = NOT_RECOGNISED[name]
    q, k, v = inputs(1, 4, 4, 200, 200, 16, 8, seed=len(name))
    bm = check(q, k, v, fn, block=64)
    assert flex.describe(q, k, v, block_mask=bm).strategy == "blocks"
    assert bm not in flex_masks.STRUCTURE and bm not in flex_masks.TWINS


def test_per_batch_document_ids_are_recognised_with_b_given():
    """ids differ per batch entry: recognised as document_mask(ids (B, T)) when B is given; with B = None
    the function reads b, so the tables (batch 0's) and the function itself decide, as in torch."""

    def fn(b, h, q, kv):
        return (IDS[b, q] == IDS[b, kv]) & (q >= kv)

    q, k, v = inputs(2, 2, 2, 200, 200, 16, 8)
    bm = check(q, k, v, fn, block=64)
    assert bm in flex_masks.STRUCTURE
    assert reads(fn) == (True, False)
    none = sa.create_block_mask(fn, None, 2, 200, 200, device="cpu", BLOCK_SIZE=64)
    assert none not in flex_masks.STRUCTURE and none not in flex_masks.TWINS


def test_a_head_reading_function_made_for_fewer_heads_is_not_used_for_more():
    """Equal for heads 0 and 1 (made with H = 2), different for heads 2 and 3 of the call: those evaluate
    the function itself (the tables are read at h % 2, as torch's kernels read them)."""

    def fn(b, h, q, kv):
        return (q >= kv) | ((h < 2) & (kv < 40))

    bm = sa.create_block_mask(fn, 1, 2, 70, 70, device="cpu", BLOCK_SIZE=16)
    q, k, v = inputs(1, 2, 2, 70, 70, 8, 8)
    assert flex.describe(q, k, v, block_mask=bm).strategy == "prefix-LM"  # its own two heads: prefix-LM
    q4 = torch.randn(1, 4, 70, 8)
    assert flex.describe(q4, k, v, block_mask=bm, enable_gqa=True).strategy == "blocks"


@pytest.mark.parametrize("block", [7, 16, 64])
def test_row_runs_against_a_dense_count(block):
    """First key, last key and count of every row, accumulated over column tiles that do not divide Tk."""
    gen = torch.Generator().manual_seed(block)
    b, h, tq, tk = 2, 3, 37, 50
    dense = torch.rand(b, h, tq, tk, generator=gen) < 0.3
    dense[0, 0, 5] = False  # a row that sees nothing
    runs = RowRuns(b, h, tq, tk)
    for j0 in range(0, tk, 3 * block):
        m = dense[..., j0 : j0 + 3 * block]
        pad = -m.shape[-1] % block
        runs.add(torch.cat([m, m.new_zeros((*m.shape[:-1], pad))], -1), 0, j0, block)
    cols = torch.arange(tk)
    assert torch.equal(runs.count, dense.sum(-1))
    assert torch.equal(runs.first, torch.where(dense, cols, tk).amin(-1))
    assert torch.equal(runs.last, torch.where(dense, cols, -1).amax(-1))


def test_equivalent_needs_every_row_to_match():
    """A window whose last row sees one key fewer is not a window."""
    t = 20
    i = torch.arange(t)
    dense = (i[:, None] >= i[None, :]) & (i[:, None] - i[None, :] < 4)
    runs = RowRuns(1, 1, t, t)
    runs.add(dense[None, None], 0, 0, t)
    assert equivalent(runs, t, t) == mods.sliding_window(3)
    dense[-1, -4] = False
    runs = RowRuns(1, 1, t, t)
    runs.add(dense[None, None], 0, 0, t)
    assert equivalent(runs, t, t) is None


WINDOWS = torch.tensor([2, 4, 8, 16])


def _per_head_behind_isinstance(b, h, q, kv):
    """Reads h only when h is a tensor: torch.fx's proxies take the other branch (found by a breaker run)."""
    if not isinstance(h, torch.Tensor):
        return q >= kv
    return (q >= kv) & (q - kv < WINDOWS[h])


@pytest.mark.parametrize(
    "fn",
    [
        _per_head_behind_isinstance,
        lambda b, h, q, kv: (q >= kv) & (q - kv <= 3 * q.new_tensor(h)),  # h through new_tensor's value
    ],
)
def test_a_head_reading_function_with_h_none_is_not_recognised(fn):
    """H = None and a function that reads h anyway: the tables are head 0's and every head evaluates the
    function in partial blocks, as in torch — never one head's window for all."""
    warnings.filterwarnings("ignore", message=".*new_tensor.*")
    q, k, v = inputs(1, 4, 4, 64, 64, 8, 8)
    bm = sa.create_block_mask(fn, None, None, 64, 64, device="cpu", BLOCK_SIZE=16)
    assert flex.describe(q, k, v, block_mask=bm).strategy == "blocks"
    assert bm not in flex_masks.STRUCTURE and bm not in flex_masks.TWINS


@pytest.mark.parametrize("name", ["window", "prefix-LM", "causal documents", "bottom-right window"])
def test_torchs_own_block_mask_is_recognised_too(name):
    """A BlockMask from torch's create_block_mask (code that changed only the flex_attention import): the
    keys each row sees — full blocks, and the mod in partial ones — are read once, and the mask gets the
    ready mod's plan; the numbers are the function's (float64 oracle, with gradients)."""
    from torch.nn.attention.flex_attention import create_block_mask as torch_block_mask

    fn, tq, tk, strategy = RECOGNISED[name]
    q, k, v = inputs(2, 4, 2, tq, tk, 16, 8, seed=5)
    bm = torch_block_mask(fn, 2, 4, tq, tk, device="cpu", BLOCK_SIZE=64)
    assert flex.describe(q, k, v, block_mask=bm, enable_gqa=True).strategy == strategy
    out, lse = sa.flex_attention(q, k, v, block_mask=bm, enable_gqa=True, return_lse=True)
    mine = sa.create_block_mask(fn, 2, 4, tq, tk, device="cpu", BLOCK_SIZE=64)
    want, want_lse = sa.flex_attention(q, k, v, block_mask=mine, enable_gqa=True, return_lse=True)
    assert (out - want).abs().max() < 1e-6 and (lse - want_lse).abs().max() < 1e-6
    check(q, k, v, fn, block=64, gqa=True)


def test_torch_tables_that_hide_a_block_the_mod_shows_are_not_taken_for_the_mod():
    """A hand-built BlockMask whose tables leave out a block of a causal mod: the rows see what the kernels
    would (not causal), so it keeps the block plan and its numbers follow the tables."""
    from torch.nn.attention.flex_attention import BlockMask

    t, blk = 64, 16
    n = t // blk
    kv_num = torch.tensor([[[1, 2, 3, 3]]], dtype=torch.int32)  # row block 3 leaves out key block 0
    kv_idx = torch.tensor([[[[0, 0, 0, 0], [0, 1, 0, 0], [0, 1, 2, 0], [1, 2, 3, 0]]]], dtype=torch.int32)
    bm = BlockMask.from_kv_blocks(kv_num, kv_idx, BLOCK_SIZE=blk, mask_mod=_causal, seq_lengths=(t, t))
    q, k, v = inputs(1, 1, 1, t, t, 8, 8)
    assert flex.describe(q, k, v, block_mask=bm).strategy == "blocks"
    keep = bm.to_dense()[0, 0].bool().repeat_interleave(blk, 0).repeat_interleave(blk, 1)
    assert keep.shape == (n * blk, n * blk)
    from tests.test_flex import oracle

    ref, _ = oracle(*(x.detach().double() for x in (q, k, v)), lambda b, h, qi, kv: (qi >= kv) & keep[qi, kv])
    assert (sa.flex_attention(q, k, v, block_mask=bm).double() - ref).abs().max() < 1e-5


def test_tables_written_to_after_the_first_call_are_read_again():
    """A recognised BlockMask whose tables are then changed in place: the old recognition is not used (the
    tables' version counters changed); the call follows the new tables, as torch's kernels would."""
    t, blk = 64, 16
    q, k, v = inputs(1, 1, 1, t, t, 8, 8)
    for bm in (
        sa.create_block_mask(_causal, 1, 1, t, t, device="cpu", BLOCK_SIZE=blk),
        torch.nn.attention.flex_attention.create_block_mask(
            _causal, 1, 1, t, t, device="cpu", BLOCK_SIZE=blk
        ),
    ):
        assert flex.describe(q, k, v, block_mask=bm).strategy == "causal"
        bm.full_kv_num_blocks[..., 3] = 0  # row block 3 keeps only its diagonal block
        # rows 48–63 now see keys 48 … q: two causal documents, [0, 48) and [48, 64)
        assert flex.describe(q, k, v, block_mask=bm).strategy == "documents"
        keep = bm.to_dense()[0, 0].bool().repeat_interleave(blk, 0).repeat_interleave(blk, 1)
        from tests.test_flex import oracle

        ref, _ = oracle(
            *(x.detach().double() for x in (q, k, v)),
            lambda b, h, qi, kv, keep=keep: (qi >= kv) & keep[qi, kv],
        )
        assert (sa.flex_attention(q, k, v, block_mask=bm).double() - ref).abs().max() < 1e-5


@pytest.mark.parametrize("how", ["replaced", "through .data"])
def test_tables_replaced_or_written_without_a_version_bump_are_read_again(how):
    """(A second breaker run.) The copy of the tables, not their version counters, decides."""
    t, blk = 64, 16
    q, k, v = inputs(1, 1, 1, t, t, 8, 8)
    bm = torch.nn.attention.flex_attention.create_block_mask(
        _causal, 1, 1, t, t, device="cpu", BLOCK_SIZE=blk
    )
    assert flex.describe(q, k, v, block_mask=bm).strategy == "causal"
    if how == "replaced":
        bm.full_kv_num_blocks = torch.zeros_like(bm.full_kv_num_blocks)
    else:
        bm.full_kv_num_blocks.data.zero_()
    assert flex.describe(q, k, v, block_mask=bm).strategy != "causal"
    keep = bm.to_dense()[0, 0].bool().repeat_interleave(blk, 0).repeat_interleave(blk, 1)
    from tests.test_flex import oracle

    ref, _ = oracle(*(x.detach().double() for x in (q, k, v)), lambda b, h, qi, kv: (qi >= kv) & keep[qi, kv])
    assert (sa.flex_attention(q, k, v, block_mask=bm).double() - ref).abs().max() < 1e-5


def test_a_mod_of_the_keys_alone_from_torchs_tables_is_every_key():
    """torch's noop_mask, or a mod that ignores q_idx: every row counted (not only each block's first)."""
    from torch.nn.attention.flex_attention import create_block_mask as torch_block_mask
    from torch.nn.attention.flex_attention import noop_mask

    q = torch.randn(1, 2, 100, 8)
    for fn in (noop_mask, lambda b, h, qi, kv: kv >= 0):
        bm = torch_block_mask(fn, None, None, 100, 100, device="cpu", BLOCK_SIZE=32)
        assert flex.describe(q, q, q, block_mask=bm).strategy == "single"


def test_a_head_difference_from_head_2_on_behind_isinstance_is_seen():
    def sneaky(b, h, q, kv):
        if isinstance(h, torch.Tensor):
            return (q >= kv) | (h >= 2)
        return q >= kv

    q, k, v = inputs(1, 4, 4, 64, 64, 8, 8)
    bm = sa.create_block_mask(sneaky, None, None, 64, 64, device="cpu", BLOCK_SIZE=16)
    assert flex.describe(q, k, v, block_mask=bm).strategy == "blocks"


def _tables_with_mod_now(bm, mod, t, blk):
    """What torch's kernels compute from ``bm``: its tables (made with the old ids) and ``mod`` as it is."""
    from selfattention.visibility import FULL, PARTIAL

    kinds = flex_masks.block_kinds(bm)[0, 0].repeat_interleave(blk, 0).repeat_interleave(blk, 1)[:t, :t]
    qi, kv = torch.arange(t).view(-1, 1), torch.arange(t).view(1, -1)
    z = torch.zeros((), dtype=torch.long)
    return lambda b, h, q_, k_: ((kinds == FULL) | ((kinds == PARTIAL) & mod(z, z, qi, kv)))[q_, k_]


@pytest.mark.parametrize("kind", ["plain function", "ready mod", "torch's and_masks", "offset"])
def test_a_tensor_the_mod_reads_changed_in_place_is_seen(kind):
    """Document ids (or a causal offset) the mask function closes over, changed in place after a call:
    the recognised plan of the old ids is dropped and the call computes what torch's kernels compute from
    the same BlockMask — its tables, the function as it is now (found by a breaker run: 0.48 off).
    Oracle: float64 math on full | (partial & mod now)."""
    from torch.nn.attention.flex_attention import and_masks

    from tests.test_flex import oracle

    t, blk = 160, 32
    doc = torch.zeros(1, t, dtype=torch.long)
    doc[:, 70:] = 1
    offset = torch.tensor(0)
    mod = {
        "plain function": lambda b, h, q, kv: doc[0, q] == doc[0, kv],
        "ready mod": mods.document_mask(doc),
        "torch's and_masks": and_masks(lambda b, h, q, kv: doc[0, q] == doc[0, kv], _causal),
        "offset": lambda b, h, q, kv: q + offset >= kv,
    }[kind]
    bm = sa.create_block_mask(mod, None, None, t, t, device="cpu", BLOCK_SIZE=blk)
    q, k, v = inputs(1, 2, 2, t, t, 8, 8, seed=3)
    assert flex.describe(q, k, v, block_mask=bm).strategy in ("documents", "causal")
    sa.flex_attention(q, k, v, block_mask=bm)
    doc[:, 70:] = 0  # the boundary moves inside the same 32-block: the tables stay right for the new ids
    doc[:, 90:] = 1
    offset += 5  # a causal offset inside the same block as well
    out = sa.flex_attention(q, k, v, block_mask=bm)
    want, _ = oracle(*(x.detach().double() for x in (q, k, v)), _tables_with_mod_now(bm, mod, t, blk))
    assert (out.double() - want).abs().max() < 1e-5


REBOUND_DOC = torch.zeros(160, dtype=torch.long)


def test_a_global_the_mod_reads_rebound_to_another_tensor_is_seen():
    """``doc = new_ids`` at module level (not an in-place change): the snapshot holds the old tensor, the
    function reads the new one; the call must follow the function, as torch's kernels do."""
    from tests.test_flex import oracle

    global REBOUND_DOC
    REBOUND_DOC = torch.zeros(160, dtype=torch.long)
    REBOUND_DOC[70:] = 1

    def mod(b, h, q, kv):
        return REBOUND_DOC[q] == REBOUND_DOC[kv]

    bm = sa.create_block_mask(mod, None, None, 160, 160, device="cpu", BLOCK_SIZE=32)
    q, k, v = inputs(1, 2, 2, 160, 160, 8, 8, seed=4)
    sa.flex_attention(q, k, v, block_mask=bm)
    REBOUND_DOC = torch.zeros(160, dtype=torch.long)
    REBOUND_DOC[90:] = 1
    out = sa.flex_attention(q, k, v, block_mask=bm)
    want, _ = oracle(*(x.detach().double() for x in (q, k, v)), _tables_with_mod_now(bm, mod, 160, 32))
    assert (out.double() - want).abs().max() < 1e-5


def test_a_nonlocal_number_an_attribute_and_a_dict_entry_the_mod_reads_are_seen():
    """A causal offset changed with ``nonlocal``, a bound method whose object's ids change, a global dict's
    ids: each after create_block_mask, each followed as torch's kernels follow it (a breaker run: 1.4–3.0
    off before). Oracle: float64 math on full | (partial & mod now)."""
    from tests.test_flex import oracle

    t, blk = 256, 32
    q, k, v = inputs(1, 2, 2, t, t, 8, 8, seed=6)

    def make():
        off = 0

        def mod(b, h, qi, kv):
            return kv <= qi + off

        def set_off(x):
            nonlocal off
            off = x

        return mod, set_off

    class Doc:
        def __init__(self, ids):
            self.ids = ids

        def mod(self, b, h, qi, kv):
            return self.ids[qi] == self.ids[kv]

    cfg = {"doc": torch.arange(t) // 64}

    def by_dict(b, h, qi, kv):
        return cfg["doc"][qi] == cfg["doc"][kv]

    offset_mod, set_off = make()
    doc = Doc(torch.arange(t) // 64)
    cases = [
        (offset_mod, lambda: set_off(-70)),
        (doc.mod, lambda: doc.ids.copy_(torch.arange(t) // 40)),
        (doc.mod, lambda: setattr(doc, "ids", torch.arange(t) // 48)),
        (by_dict, lambda: cfg.__setitem__("doc", torch.arange(t) // 40)),
    ]
    for mod, change in cases:
        bm = sa.create_block_mask(mod, None, None, t, t, device="cpu", BLOCK_SIZE=blk)
        sa.flex_attention(q, k, v, block_mask=bm)
        change()
        out = sa.flex_attention(q, k, v, block_mask=bm)
        want, _ = oracle(*(x.detach().double() for x in (q, k, v)), _tables_with_mod_now(bm, mod, t, blk))
        assert (out.double() - want).abs().max() < 1e-5, mod


_HELPERS: dict = {}  # a global the mask function names, whose function is rebound


def _same_doc(model, qi, kv):
    return model.ids[qi] == model.ids[kv]


class _ClassDoc:
    doc = torch.arange(256) // 50  # a class attribute read as _ClassDoc.doc or through self.doc


class _SlotsRaising:
    """``__slots__`` and a dict-backed ``__getattr__`` that raises KeyError (a breaker case: crashed)."""

    __slots__ = ("doc",)

    def __init__(self, doc):
        self.doc = doc

    def __getattr__(self, name):
        return {}[name]


def _reach_cases(t: int):
    """(name, mask_mod, change) — document ids (or an offset) a mask function reaches through a container
    or an object, and a change after create_block_mask. The ids start as // 50 and become // 45: both
    move boundaries inside 32-blocks, so the tables' partial blocks consult the mod (ids aligned with the
    blocks would leave no partial block and the test could not fail)."""
    import collections
    from types import SimpleNamespace

    def ids(n):
        return torch.arange(t) // n

    ns = SimpleNamespace(doc=ids(50))
    lst = [ids(50)]
    cfg = {"inner": {"deeper": {"doc": ids(50)}}}
    deque = collections.deque([ids(50)])
    slotted = _SlotsRaising(ids(50))
    holder = {"docs": [ids(50)]}
    lengths = {"n": 50}
    offsets: dict = {}

    class Sub(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.register_buffer("doc", ids(50))

    class Model(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.sub = Sub()
            self.weight = torch.nn.Parameter(torch.randn(64, 64))  # not watched: a training step is no change

        def mask(self, b, h, qi, kv):
            return self.sub.doc[qi] == self.sub.doc[kv]

    class ByClass:
        def mask(self, b, h, qi, kv):
            return self.doc[qi] == self.doc[kv]

    ByClass.doc = ids(50)
    model, by_class = Model(), ByClass()
    np_offset = np.int64(0)

    def make_np_offset_mod():
        def mod(b, h, qi, kv):
            return kv <= qi + int(np_offset)

        def set_offset(x):
            nonlocal np_offset
            np_offset = np.int64(x)

        return mod, set_offset

    np_mod, set_np = make_np_offset_mod()
    numpy_ids = ids(50).numpy().copy()

    def numpy_mod(b, h, qi, kv):
        doc = torch.from_numpy(numpy_ids)
        return doc[qi] == doc[kv]

    def doc_mod(get):
        return lambda b, h, qi, kv: get()[qi] == get()[kv]

    class Private(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self._doc = ids(50)  # a plain (not registered) attribute with a leading underscore

        def mask(self, b, h, qi, kv):
            return self._doc[qi] == self._doc[kv]

    class Base:
        doc = ids(50)

        def mask(self, b, h, qi, kv):
            return self.doc[qi] == self.doc[kv]

    class Derived(Base):
        pass

    class Defaults(torch.nn.Module):
        doc = ids(50)  # a class-level default, set on the instance later

        def mask(self, b, h, qi, kv):
            return self.doc[qi] == self.doc[kv]

    class Helped(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.register_buffer("ids", ids(50))

        def current(self):
            return self.ids

        def mask(self, b, h, qi, kv):
            return self.current()[qi] == self.current()[kv]

        @property
        def doc_ids(self):
            return self.ids

        def by_property(self, b, h, qi, kv):
            return self.doc_ids[qi] == self.doc_ids[kv]

    class DerivedHelped(Helped):
        def current(self):
            return super().current()

    class Shared(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.low = 0
            self.register_buffer("doc", ids(50))

    class Layer(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.register_buffer("doc", ids(50))

    class Layered(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.layers = torch.nn.ModuleList([Layer(), Layer()])

        def mask(self, b, h, qi, kv):
            return self.layers[0].doc[qi] == self.layers[0].doc[kv]

    class Later(torch.nn.Module):
        def mask(self, b, h, qi, kv):
            pad = getattr(self, "pad", None)
            return (qi >= kv) if pad is None else pad[qi] == pad[kv]

    private, derived, defaults, helped = Private(), Derived(), Defaults(), Helped()
    derived_helped, shared, layered, later = DerivedHelped(), Shared(), Layered(), Later()
    maybe: dict = {"doc": None}

    def make_in_method(model):
        def mask(b, h, qi, kv):
            return _same_doc(model, qi, kv)

        return mask

    in_method = make_in_method(helped)
    _HELPERS["doc"] = lambda: ids(50)
    mod_list = [doc_mod(lambda: ids(50))]

    def by_attr(b, h, qi, kv):
        return by_attr.doc[qi] == by_attr.doc[kv]

    by_attr.doc = ids(50)

    def by_keyword(b, h, qi, kv, doc=None):
        return doc[qi] == doc[kv]

    by_partial = functools.partial(by_keyword, doc=ids(50))

    return [
        ("object attribute in place", doc_mod(lambda: ns.doc), lambda: ns.doc.copy_(ids(45))),
        ("object attribute rebound", doc_mod(lambda: ns.doc), lambda: setattr(ns, "doc", ids(45))),
        ("list element rebound", doc_mod(lambda: lst[0]), lambda: lst.__setitem__(0, ids(45))),
        ("deque element in place", doc_mod(lambda: deque[0]), lambda: deque[0].copy_(ids(45))),
        ("dict three levels down", doc_mod(lambda: cfg["inner"]["deeper"]["doc"]),
         lambda: cfg["inner"]["deeper"].__setitem__("doc", ids(45))),
        ("container rebound", doc_mod(lambda: holder["docs"][0]), lambda: holder.__setitem__("docs", [ids(45)])),
        ("a number in a dict", lambda b, h, qi, kv: qi // lengths["n"] == kv // lengths["n"],
         lambda: lengths.__setitem__("n", 45)),
        ("a dict key added later", lambda b, h, qi, kv: kv <= qi + offsets.get("off", 0),
         lambda: offsets.__setitem__("off", -40)),
        ("slots with a raising __getattr__", doc_mod(lambda: slotted.doc), lambda: slotted.doc.copy_(ids(45))),
        ("a submodule's buffer", model.mask, lambda: model.sub.doc.copy_(ids(45))),
        ("a submodule's buffer rebound", model.mask, lambda: setattr(model.sub, "doc", ids(45))),
        ("a class attribute through self", by_class.mask, lambda: setattr(ByClass, "doc", ids(45))),
        ("a global class's attribute", doc_mod(lambda: _ClassDoc.doc), lambda: _ClassDoc.doc.copy_(ids(45))),
        ("a numpy offset with nonlocal", np_mod, lambda: set_np(-40)),
        ("a numpy array in place", numpy_mod, lambda: numpy_ids.__setitem__(slice(None), ids(45).numpy())),
        ("a module's private attribute", private.mask, lambda: private._doc.copy_(ids(45))),
        ("a module's private attribute rebound", private.mask, lambda: setattr(private, "_doc", ids(45))),
        ("an instance attribute shadowing the class's", by_class.mask, lambda: setattr(by_class, "doc", ids(45))),
        ("a base class's attribute", derived.mask, lambda: setattr(Base, "doc", ids(45))),
        ("a module's class-level default set on it", defaults.mask, lambda: setattr(defaults, "doc", ids(45))),
        ("a global function rebound", lambda b, h, qi, kv: _HELPERS["doc"]()[qi] == _HELPERS["doc"]()[kv],
         lambda: _HELPERS.__setitem__("doc", lambda: ids(45))),
        ("an entry of a list of mods replaced", lambda b, h, qi, kv: mod_list[0](b, h, qi, kv),
         lambda: mod_list.__setitem__(0, doc_mod(lambda: ids(45)))),
        ("a function's own attribute", by_attr, lambda: setattr(by_attr, "doc", ids(45))),
        ("a partial's keyword changed", by_partial, lambda: by_partial.keywords.__setitem__("doc", ids(45))),
        ("a buffer read through self.helper()", helped.mask, lambda: helped.ids.copy_(ids(45))),
        ("two closures over one module, the second's attribute", torch.nn.attention.flex_attention.and_masks(lambda b, h, qi, kv: qi >= shared.low,
         lambda b, h, qi, kv: shared.doc[qi] == shared.doc[kv]), lambda: shared.doc.copy_(ids(45))),
        ("a closure cell passed to a global helper", in_method, lambda: helped.ids.copy_(ids(45))),
        ("a ModuleList's layer", layered.mask, lambda: layered.layers[0].doc.copy_(ids(45))),
        ("a property reading a buffer", helped.by_property, lambda: helped.ids.copy_(ids(45))),
        ("super().helper() reading a buffer", derived_helped.mask, lambda: derived_helped.ids.copy_(ids(45))),
        ("a buffer registered later", later.mask, lambda: later.register_buffer("pad", ids(45))),
        ("None, then ids", lambda b, h, qi, kv: (qi >= kv) if maybe["doc"] is None
         else maybe["doc"][qi] == maybe["doc"][kv], lambda: maybe.__setitem__("doc", ids(45))),
    ]  # fmt: skip


@pytest.mark.parametrize("case", range(32))
def test_what_a_mod_reaches_through_containers_and_objects_is_followed(case):
    """Each of :func:`_reach_cases` after create_block_mask: followed as torch's kernels follow it (a
    breaker run found each 1.2–2.4 off torch's compiled flex, silently). Oracle: float64 math on
    full | (partial & mod now)."""
    from tests.test_flex import oracle

    t, blk = 256, 32
    name, mod, change = _reach_cases(t)[case]
    q, k, v = inputs(1, 2, 2, t, t, 8, 8, seed=7)
    bm = sa.create_block_mask(mod, None, None, t, t, device="cpu", BLOCK_SIZE=blk)
    assert flex.describe(q, k, v, block_mask=bm).strategy in ("documents", "causal"), name
    sa.flex_attention(q, k, v, block_mask=bm)
    change()
    out = sa.flex_attention(q, k, v, block_mask=bm)
    want, _ = oracle(*(x.detach().double() for x in (q, k, v)), _tables_with_mod_now(bm, mod, t, blk))
    assert (out.double() - want).abs().max() < 1e-5, name


def test_walking_what_a_mod_reads_stops_at_modules_big_containers_and_its_budget():
    """captured() does not wander into modules, a container of thousands of entries or past its budget (a
    nested list of 200³ numbers: 16 s per create_block_mask and 3.7 s per call before), skips what cannot
    be looked at (a dead weak proxy), a cycle ends, and an nn.Module's parameters are not copied."""
    import weakref
    from types import SimpleNamespace

    from selfattention.flex_tables import WALK_BUDGET, WALK_ITEMS_MAX, Snapshot, captured

    x = torch.arange(64)
    ns = SimpleNamespace(x=x)
    ns.me = ns
    big = [torch.zeros(1) for _ in range(WALK_ITEMS_MAX + 1)]
    nested = [[[1] * 200 for _ in range(200)] for _ in range(200)]

    class Gone:
        pass

    dead = weakref.proxy(Gone())  # its referent is gone at once
    layer = torch.nn.Linear(8, 8)

    def mod(b, h, qi, kv):
        return (
            (ns.x[qi] >= 0)
            & (len(big) > 0)
            & (nested[0][0][0] == 1)
            & (dead is not None)
            & (layer is not None)
        )

    found = captured(mod)
    assert any(t is x for t in found)
    assert not any(t is big[0] for t in found)
    assert not any(t is layer.weight for t in found)
    bm = sa.create_block_mask(mod, None, None, 64, 64, device="cpu", BLOCK_SIZE=16)
    snap = Snapshot(bm)
    assert len(snap.bound) <= WALK_BUDGET + 64 and snap.match(bm)


def test_odd_state_neither_crashes_nor_makes_every_call_look_again():
    """State a mask function can reach that a snapshot cannot copy or compare — inference tensors, a dead
    weak proxy, sparse / meta buffers, an unchanged tensor holding NaN — and state it never reads that
    changes on every step — a BatchNorm submodule in training, a cache buffer written in place: calls
    equal the float64 oracle and the recognised plan is kept (a breaker run: crashes, or a look again on
    every call at 2.8× its time)."""
    import weakref

    from tests.test_flex import oracle

    t, blk = 256, 32
    q, k, v = inputs(1, 2, 2, t, t, 8, 8, seed=9)
    with torch.inference_mode():
        inference_ids = torch.arange(t) // 50

    class Owner:
        pass

    class Model(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.register_buffer("doc", torch.arange(t) // 50)
            self.register_buffer("nan_scale", torch.tensor([1.0, float("nan")]))
            self.register_buffer("sparse", torch.eye(3).to_sparse())
            self.register_buffer("meta", torch.empty(3, device="meta"))
            self.register_buffer("k_cache", torch.zeros(4, 8))
            self.bn = torch.nn.BatchNorm1d(8)
            owner = Owner()
            self.owner = weakref.proxy(owner)  # dead at once

        def mask(self, b, h, qi, kv):
            return (self.doc[qi] == self.doc[kv]) & (self.nan_scale[0] > 0)

        def forward(self, x):  # a training step: a counter, a cache buffer, BatchNorm's statistics
            self.calls = getattr(self, "calls", 0) + 1
            self.k_cache.add_(1.0)
            return self.bn(x)

    model = Model().train()
    cases = [
        ("inference tensors", lambda b, h, qi, kv: inference_ids[qi] == inference_ids[kv], lambda: None),
        ("a module with odd buffers, stepped", model.mask, lambda: model(torch.randn(5, 8))),
    ]
    for name, mod, step in cases:
        bm = sa.create_block_mask(mod, None, None, t, t, device="cpu", BLOCK_SIZE=blk)
        assert flex.describe(q, k, v, block_mask=bm).strategy == "documents", name
        want, _ = oracle(*(x.detach().double() for x in (q, k, v)), _tables_with_mod_now(bm, mod, t, blk))
        sa.flex_attention(q, k, v, block_mask=bm)
        looked = flex_masks.LOOKED[bm]
        for _ in range(2):
            step()
            out = sa.flex_attention(q, k, v, block_mask=bm)
            assert (out.double() - want).abs().max() < 1e-5, name
        assert flex_masks.LOOKED[bm] is looked, name  # not looked at again
