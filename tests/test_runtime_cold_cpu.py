"""The cold tier's refill and append as compiled calls (``cold_cpu.cpp``), taken by a cache on the
fused CPU step (``backend="cpp"``, DESIGN.md §2.13): each layer's refill equals the torch refill
and the FP64 reference (the selection, with ties; the window's swap; the slots written; the store's
scores; the bytes counted), and whole generations equal their torch-backend counterparts."""

from __future__ import annotations

import dataclasses
import os

import numpy as np
import pytest
import torch
from test_runtime_cold import Watch, _generate, _ids, check_reference
from tiny import tiny_model

import h2o_lens
from h2o_lens import H2OConfig
from h2o_lens.cold import cold_extension, cold_summary, next_window, select
from h2o_lens.cold_config import ColdTier
from h2o_lens.cold_store import ColdStore
from h2o_lens.kernels import cpu
from h2o_lens.reference_cold import choose

if cpu.cpu_step_problem() is not None:  # CI installs a compiler and ninja (.ci/run): there it must build
    if os.environ.get("CI"):
        pytest.fail(f"the fused CPU step does not build in CI: {cpu.cpu_step_problem()}", pytrace=False)
    pytest.skip(f"the fused CPU step does not build here: {cpu.cpu_step_problem()}", allow_module_level=True)


@pytest.fixture
def fused(monkeypatch):
    """Counts the compiled refills and appends."""
    calls = {"refill": 0, "append": 0}
    refill, append = cpu.cold_refill_cpu, cpu.cold_append_cpu

    def counted_refill(*a, **k):
        calls["refill"] += 1
        return refill(*a, **k)

    def counted_append(*a, **k):
        calls["append"] += 1
        return append(*a, **k)

    monkeypatch.setattr(cpu, "cold_refill_cpu", counted_refill)
    monkeypatch.setattr(cpu, "cold_append_cpu", counted_append)
    return calls


class _Slots:
    """A layer's slots as the refill sees them: ``W`` slots, the window the last ``r``."""

    def __init__(self, b, hs, width, d, dtype, wide=True, scaling=0.25):
        self.keys = torch.zeros(b, hs, width, d, dtype=dtype)
        self.values = torch.zeros(b, hs, width, d, dtype=dtype)
        self.scores = torch.zeros(b, hs, width)
        self.positions = torch.full((b, hs, width), -1, dtype=torch.int64 if wide else torch.int32)
        self.scaling = scaling


def _store(b, hs, d, dtype, counts, gen, summaries, ties=False):
    """A store whose rows hold ``counts`` records (positions a shuffle, so record order is not
    position order); ``ties``: the keys of a row repeat four values, so selections tie."""
    st = ColdStore("cpu", b, hs, d, dtype, pin=False, directory=None, name="t", summaries=summaries)
    n = max(counts)
    key = torch.randn(b, hs, n, d, generator=gen)
    if ties:
        key = key[:, :, torch.arange(n) % 4]
    value = torch.randn(b, hs, n, d, generator=gen)
    pos = torch.stack([torch.randperm(4 * n, generator=gen)[:n] for _ in range(b * hs)]).view(b, hs, n)
    ok = torch.arange(n) < torch.tensor(counts).view(b, hs, 1)
    st.append(key.to(dtype), value.to(dtype), torch.rand(b, hs, n, generator=gen), torch.where(ok, pos, -1))
    return st


def _torch_refill(st, window, slots, start, query, gqa, how, scan):
    """The torch refill of :class:`~h2o_lens.cold.ColdExtension` on copies: the store's scores
    after the write-back, the keys' bytes the selection read, the new window, filled, score and
    position per slot."""
    b, hs, r = window.shape
    scores = st.scores.clone()
    held = slots.scores[:, :, start : start + r]
    ok = window >= 0
    bi, hi, wi = ok.nonzero(as_tuple=True)
    scores[bi, hi, window[bi, hi, wi]] = held[bi, hi, wi]
    saved, st.scores, before = st.scores, scores, st.read_bytes
    try:
        qg = query.unflatten(1, (hs, query.shape[1] // hs)) * slots.scaling
        best = select(st, qg, gqa, r, how, scan)
    finally:
        st.scores, scored, st.read_bytes = saved, st.read_bytes - before, before
    new, filled, score, position = next_window(
        window.reshape(b * hs, r).numpy(),
        best.reshape(b * hs, r).numpy(),
        st.positions.reshape(b * hs, -1).numpy(),
        scores.reshape(b * hs, -1).numpy(),
    )
    shape = (b, hs, r)
    return scores, scored, *(torch.from_numpy(a).view(shape) for a in (new, filled, score, position))


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
@pytest.mark.parametrize("how", ["exact", "pages"])
@pytest.mark.parametrize("gqa", ["sum", "max"])
def test_one_refill_equals_the_torch_refill_and_the_reference(dtype, how, gqa):
    """Rows of 0, 3, fewer than a window, a few pages and many pages of records, a window partly
    filled from a refill before: the selection, the swap (an occupant chosen again keeps its slot;
    the incoming fill the freed slots by position), the slots' K/V, scores and positions, the
    store's scores and the bytes counted are the torch refill's; the records chosen are the FP64
    reference's."""
    gen = torch.Generator().manual_seed(11)
    b, hs, d, group, r, width, scan = 3, 2, 16, 3, 6, 20, 2
    counts = [0, 3, 5, 40, 70, 137]
    st = _store(b, hs, d, dtype, counts, gen, summaries=how == "pages")
    slots = _Slots(b, hs, width, d, dtype, wide=dtype != torch.float16)
    start = width - r
    window = torch.full((b, hs, r), -1, dtype=torch.int64)
    for step in range(3):
        query = torch.randn(b, hs * group, d, generator=gen).to(dtype)
        slots.scores[:, :, start:] = torch.rand(b, hs, r, generator=gen) * (window >= 0)
        pages = scan if how == "pages" else None
        want_scores, scored, *want = _torch_refill(st, window, slots, start, query, gqa, how, pages)
        read_before = st.read_bytes
        got = cpu.cold_refill_cpu(query, st, window, slots, start, gqa == "max", pages)
        new, filled, score, held, keys_read, entries = got
        where = f"{dtype} {how} {gqa} step {step}"
        assert torch.equal(new, want[0]) and torch.equal(filled, want[1]), where
        assert torch.equal(score, want[2].to(score.dtype)) and torch.equal(held, want[3]), where
        assert torch.equal(st.scores, want_scores), where
        assert entries == int(filled.sum())
        assert keys_read * d * st.itemsize == scored > 0, where
        assert st.read_bytes == read_before  # the wrapper counts nothing; the extension does
        assert torch.equal(slots.positions[:, :, start:].to(torch.int64), held), where
        assert torch.equal(slots.scores[:, :, start:], score), where
        for row, j in filled.view(b * hs, r).nonzero().tolist():
            bi, hi, rec = row // hs, row % hs, int(new.view(b * hs, r)[row, j])
            assert torch.equal(slots.keys[bi, hi, start + j], st.kv[0, bi, hi, rec]), where
            assert torch.equal(slots.values[bi, hi, start + j], st.kv[1, bi, hi, rec]), where
        for row in range(b * hs):  # the FP64 reference's choice, as a set of records
            bi, hi = row // hs, row % hs
            n = counts[row]
            q = (query[bi, hi * group : (hi + 1) * group].float() * slots.scaling).to(dtype).double().numpy()
            ref = _reference_choice(q, st, bi, hi, n, r, gqa, how, scan)
            chosen = sorted(x for x in new[bi, hi].tolist() if x >= 0)
            assert chosen == sorted(ref), (where, row)
        window = new


def _reference_choice(q, st, bi, hi, n, r, gqa, how, scan):
    """The records :func:`h2o_lens.reference_cold.choose` brings in for row ``(bi, hi)`` of
    ``st``: its keys laid out by position, the records in store order (ties go by position)."""
    positions = st.positions[bi, hi, :n].tolist()
    keys = np.zeros((max(positions, default=0) + 1, st.d))
    keys[positions] = st.kv[0, bi, hi, :n].double().numpy()
    return choose(q, keys, positions, r, gqa, how, scan)


@pytest.mark.parametrize("how", ["exact", "pages"])
def test_ties_take_the_newer_position_and_the_later_page(how):
    """Keys that repeat four values: whole groups of records tie, across the window's edge; the
    compiled selection takes the newer positions (and, tied page bounds, the later pages), as the
    torch selection and the reference do."""
    gen = torch.Generator().manual_seed(5)
    b, hs, d, r, scan = 1, 3, 8, 7, 2
    counts = [40, 65, 96]
    st = _store(b, hs, d, torch.float32, counts, gen, summaries=how == "pages", ties=True)
    slots = _Slots(b, hs, 12, d, torch.float32)
    window = torch.full((b, hs, r), -1, dtype=torch.int64)
    query = torch.randn(b, hs * 2, d, generator=gen)
    want = _torch_refill(st, window, slots, 12 - r, query, "sum", how, scan if how == "pages" else None)
    new, *_ = cpu.cold_refill_cpu(query, st, window, slots, 12 - r, False, scan if how == "pages" else None)
    assert torch.equal(new, want[2])
    for h, n in enumerate(counts):
        q = (query[0, 2 * h : 2 * h + 2] * slots.scaling).double().numpy()
        ref = _reference_choice(q, st, 0, h, n, r, "sum", how, scan)
        assert sorted(new[0, h].tolist()) == sorted(ref)


@pytest.mark.parametrize("select_", ["exact", "pages"])
@pytest.mark.parametrize("gqa", ["sum", "max"])
def test_kept_cold_and_recalled_sets_equal_the_reference_on_the_compiled_calls(select_, gqa, fused):
    """The FP64 reference check of the torch refill (tests/test_runtime_cold.py), on
    ``backend="cpp"``: every layer, KV set and step, the slots, window, victims and records."""
    check_reference(select_, gqa, "cpp", new=30)
    assert fused["refill"] == fused["append"] == 2 * 29


@pytest.mark.parametrize("store", ["cpu", "disk"])
def test_a_window_of_everything_gives_the_full_cache_tokens_on_the_compiled_calls(store, tmp_path, fused):
    """Both stores: a window as large as everything evicted attends to every position, so the
    tokens are the full cache's; every recalled K/V is the evicted one, bit for bit."""
    model = tiny_model("llama", layers=2)
    ids = _ids(30, seed=1, batch=2)
    full, _ = _generate(model, H2OConfig(policy="full"), ids, 20)
    tier = ColdTier(store=store, recall=56, directory=str(tmp_path) if store == "disk" else None)
    cold, cache = _generate(model, H2OConfig(heavy=60, recent=4, cold=tier, backend="cpp"), ids, 20, Watch)
    assert torch.equal(cold, full) and fused["refill"] > 0 and fused["append"] > 0
    watch = next(e for e in cache.extensions if isinstance(e, Watch))
    assert watch.bad == [] and any(w for s in watch.window[0][1:] for w in s[0])
    numbers = cold_summary(cache)
    assert numbers["written"] == numbers["evicted"] * 2 * 16 * 4 and numbers["recalled"] > 0


def _run(model, cfg, ids, mask=None, new=24):
    kwargs = {} if mask is None else {"attention_mask": mask}
    with h2o_lens.h2o(model, cfg) as session, torch.no_grad():
        out = model.generate(ids, max_new_tokens=new, do_sample=False, pad_token_id=0, **kwargs)
    ext = cold_extension(session.last_cache)
    logs = [[(h.tolist(), s.tolist(), f.tolist()) for _, h, s, f in st.log] for st in ext.layers.values()]
    stores = [(st.store.positions.tolist(), st.store.count.tolist()) for st in ext.layers.values()]
    return out, logs, stores, cold_summary(session.last_cache)


def _padded_batch():
    ids = _ids(48, seed=8, batch=2)
    mask = torch.ones_like(ids)
    mask[1, :19] = 0
    return ids.masked_fill(mask == 0, 0), mask


def test_a_left_padded_batch_decodes_as_on_the_torch_backend(fused):
    """Two prompts of 48 and 29 tokens, left-padded (the short one's rows evict nothing at first,
    so an append writes some rows and not others), pages and every=2: tokens, each refill's window
    (positions and filled slots; scores to the last bits the two decode steps sum differently), the
    stores' records and the bytes are the torch backend's."""
    model = tiny_model("llama", layers=2, q_heads=4, kv_heads=2, seed=3)
    ids, mask = _padded_batch()
    tier = ColdTier(recall=5, select="pages", scan=1, every=2)
    cfg = H2OConfig(heavy=14, recent=5, cold=tier)
    torch_run = _run(model, cfg, ids, mask)
    calls = dict(fused)
    cpp_run = _run(model, dataclasses.replace(cfg, backend="cpp"), ids, mask)
    assert calls == {"refill": 0, "append": 0} and fused["refill"] > 0
    assert torch.equal(torch_run[0], cpp_run[0]) and torch_run[2:] == cpp_run[2:]
    for a, b in zip(torch_run[1], cpp_run[1]):  # per layer and refill
        for (held_a, score_a, filled_a), (held_b, score_b, filled_b) in zip(a, b, strict=True):
            assert held_a == held_b and filled_a == filled_b
            assert np.allclose(score_a, score_b, rtol=1e-5, atol=1e-6)


def test_a_bfloat16_batch_recalls_the_evicted_bits(fused):
    """In bfloat16 the two decode steps' last bits differ, and a layer's queries with them, so
    the windows may differ from the torch backend's; what holds is the recall path: every
    recalled key and value is the evicted one, bit for bit, in every layer, row and step."""
    model = tiny_model("llama", layers=2, q_heads=4, kv_heads=2, seed=3).to(torch.bfloat16)
    cfg = H2OConfig(heavy=14, recent=5, cold=ColdTier(recall=5, select="pages", scan=1), backend="cpp")
    _, cache = _generate(model, cfg, _ids(48, seed=8, batch=2), 20, Watch)  # (Watch reads unpadded rows)
    watch = next(e for e in cache.extensions if isinstance(e, Watch))
    assert fused["refill"] == fused["append"] == 2 * 19
    assert watch.bad == [] and cold_summary(cache)["recalled"] > 0


def test_bench_cold_takes_backend_cpp(capsys, tmp_path, fused):
    """``h2o-lens bench cold --backend cpp``: plain H2O and every cold configuration decode on the
    fused step with the compiled refill, and each row's accuracy and bytes read are the torch
    backend's (the same tasks, the same answers)."""
    from tiny import save_tiny

    from commands.cli import main

    folder = save_tiny(tmp_path / "m")
    argv = ["bench", "cold", "--model", str(folder), "--tasks", "builtin:delayed_reference", "--count", "2"]
    argv += ["--stores", "cpu", "--new-tokens", "6", "--rounds", "0"]
    tables = {}
    for backend in ("torch", "cpp"):
        before = dict(fused)
        assert main([*argv, "--backend", backend]) == 0
        out = capsys.readouterr().out
        assert f"backend {backend}" in out
        tables[backend] = [line for line in out.splitlines() if line.startswith(("full", "h2o", "cold"))]
        ran = fused["refill"] - before["refill"]
        assert (ran > 0) if backend == "cpp" else ran == 0, backend
    assert len(tables["cpp"]) == 4 and tables["cpp"] == tables["torch"]


@pytest.mark.parametrize("newest_last", [True, False])
def test_keys_scored_in_blocks_and_in_the_tail_tie_exactly(newest_last):
    """37 copies of one key: the first 32 are scored eight at a time (the vector path where the
    build has one), the last 5 one at a time; every value ties, so the window takes the 8 newest
    positions, whichever end of the records they lie at (a tail scored a bit higher or lower
    would take some of its own instead)."""
    gen = torch.Generator().manual_seed(2)
    n, r, d = 37, 8, 64
    key = torch.randn(1, d, generator=gen).expand(n, d)
    positions = torch.arange(n) if newest_last else torch.arange(n).flip(0)
    st = ColdStore("cpu", 1, 1, d, torch.float32, pin=False, directory=None, name="t", summaries=False)
    st.append(key[None, None], key[None, None], torch.zeros(1, 1, n), positions[None, None])
    slots = _Slots(1, 1, 12, d, torch.float32)
    window = torch.full((1, 1, r), -1, dtype=torch.int64)
    new, *_ = cpu.cold_refill_cpu(torch.randn(1, 3, d, generator=gen), st, window, slots, 12 - r, False, None)
    assert sorted(positions[new[0, 0]].tolist()) == list(range(n - r, n))


@pytest.mark.parametrize("seed", [0, 1])
def test_a_crowd_of_near_values_at_the_windows_edge_is_ranked_exactly(seed):
    """3,000 records: 20 far above, 280 far below and 2,700 crowded into 6 % of one value (60
    logits 1e-3 apart, 45 copies each), so the ranking's first histogram leaves thousands in the
    bucket of the window's edge and narrows them again. The window takes the 20, the 3 best
    crowded values whole and the 17 newest copies of the 4th, as ranking by logit and then by
    position says, and as the torch refill takes."""
    gen = torch.Generator().manual_seed(seed)
    d, r = 8, 20 + 3 * 45 + 17
    logits = torch.cat(
        [
            5 + torch.arange(20.0),
            (torch.arange(60.0) * 1e-3).repeat_interleave(45),
            -10 - 50 * torch.rand(280, generator=gen),
        ]
    )
    order = torch.randperm(len(logits), generator=gen)  # record order is neither rank nor position order
    logits = logits[order]
    n = len(logits)
    key = torch.zeros(1, 1, n, d)
    key[0, 0, :, 0] = logits
    positions = torch.randperm(4 * n, generator=gen)[:n]
    st = ColdStore("cpu", 1, 1, d, torch.float32, pin=False, directory=None, name="t", summaries=False)
    st.append(key, torch.randn(1, 1, n, d, generator=gen), torch.zeros(1, 1, n), positions[None, None])
    slots = _Slots(1, 1, r + 4, d, torch.float32, scaling=1.0)
    window = torch.full((1, 1, r), -1, dtype=torch.int64)
    query = torch.zeros(1, 1, d)
    query[0, 0, 0] = 1.0
    want = _torch_refill(st, window, slots, 4, query, "sum", "exact", None)
    new, *_ = cpu.cold_refill_cpu(query, st, window, slots, 4, False, None)
    ranked = sorted(range(n), key=lambda c: (float(logits[c]), int(positions[c])), reverse=True)
    assert sorted(new[0, 0].tolist()) == sorted(ranked[:r])
    assert torch.equal(new, want[2])


def test_beam_search_moves_the_stores_rows_as_on_the_torch_backend(fused):
    """Three beams over two prompts: the beams' reorders move every store's rows (the compiled
    calls read them flat); the sequences and the bytes are the torch backend's."""
    model = tiny_model("llama", layers=2, q_heads=4, kv_heads=2)
    ids = _ids(40, seed=4, batch=2)
    got = {}
    for backend in ("torch", "cpp"):
        cfg = H2OConfig(heavy=10, recent=4, backend=backend, cold=ColdTier(recall=4, select="pages", scan=1))
        with h2o_lens.h2o(model, cfg) as session, torch.no_grad():
            out = model.generate(ids, max_new_tokens=12, num_beams=3, do_sample=False, pad_token_id=0)
        got[backend] = (out, cold_summary(session.last_cache))
    assert fused["refill"] > 0 and torch.equal(got["torch"][0], got["cpp"][0])
    assert got["torch"][1] == got["cpp"][1] and got["cpp"][1]["recalled"] > 0
