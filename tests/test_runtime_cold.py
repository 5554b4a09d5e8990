"""The cold tier (DESIGN.md §2.13): the runtime keeps, moves to the cold store and recalls exactly
what the FP64 reference does; a recalled K/V is the evicted one, bit for bit; a window that holds
every evicted entry gives the full cache's tokens."""

from __future__ import annotations

import contextlib
import gc
import os
import subprocess
import sys
import tempfile

import numpy as np
import pytest
import torch
from runtime_utils import capture_qk
from tiny import tiny_model

import h2o_lens
from h2o_lens import H2OConfig
from h2o_lens.cold import ColdExtension, cold_summary, select
from h2o_lens.cold_config import PAGE, ColdTier, parse_cold
from h2o_lens.cold_store import ColdStore
from h2o_lens.errors import ConfigError
from h2o_lens.extension import CacheExtension, use_extensions
from h2o_lens.reference_cold import choose, cold_trace


def _ids(n: int, seed: int = 0, batch: int = 1) -> torch.Tensor:
    return torch.randint(3, 250, (batch, n), generator=torch.Generator().manual_seed(seed))


def _generate(model, cfg, ids, new, *extra, qk=None):
    spy = capture_qk() if qk is not None else contextlib.nullcontext({})
    with use_extensions(*extra), h2o_lens.h2o(model, cfg) as session, spy as seen, torch.no_grad():
        out = model.generate(ids, max_new_tokens=new, do_sample=False, pad_token_id=0)
    if qk is not None:
        qk.update(seen)
    return out, getattr(session, "last_cache", None)


def _cold(cache) -> ColdExtension:
    return next(e for e in cache.extensions if isinstance(e, ColdExtension))


class Watch(CacheExtension):
    """Per layer and step: the policy's slots, the window and the victims; every K/V seen."""

    def __init__(self, cache):
        self.cache = cache
        self.kept, self.window, self.victims = {}, {}, {}
        self.seen = {}  # layer -> (key, value) of every position, (b, Hs, N, d)
        self.bad = []

    def prompt_chosen(self, layer, choice):
        self.seen[layer.layer_idx] = (choice.key.clone(), choice.value.clone())
        return False

    def on_prefill(self, layer, event):
        i = layer.layer_idx
        self.kept[i] = [_sets(torch.where(event.keep, event.positions, -1))]
        self.window[i], self.victims[i] = (
            [_sets(event.positions[..., :0])],
            [_sets(torch.where(~event.keep, event.positions, -1))],
        )

    def before_step(self, layer, query, key, value):
        k, v = self.seen[layer.layer_idx]
        self.seen[layer.layer_idx] = (torch.cat([k, key[:, :, None]], 2), torch.cat([v, value[:, :, None]], 2))

    def step_taken(self, layer, step):
        i = layer.layer_idx
        start = _cold(self.cache).layers[i].start
        self.kept[i].append(_sets(layer.positions[..., :start]))
        win = layer.positions[..., start:]
        self.window[i].append(_sets(win))
        res = step.result
        gone = torch.where(res.evicts[..., None], res.cand_positions.gather(-1, res.slot[..., None]), -1)
        self.victims[i].append(_sets(gone))
        k, v = self.seen[i]
        for b, h, j in (win >= 0).nonzero().tolist():  # the window's K/V are the evicted ones, bit for bit
            p = int(win[b, h, j])
            same = torch.equal(layer.keys[b, h, start + j], k[b, h, p])
            if not (same and torch.equal(layer.values[b, h, start + j], v[b, h, p])):
                self.bad.append((i, b, h, p))


def _sets(pos):
    return [[sorted(p for p in row.tolist() if p >= 0) for row in req] for req in pos]


def _reference(qk, layer, hs, prompt, cfg, gqa):
    q = torch.cat(qk[layer]["q"], 2)[0]  # (Hq, N, d)
    k = torch.cat(qk[layer]["k"], 2)[0]  # (Hs, N, d)
    group = q.shape[0] // hs
    heavy, recent, _ = cfg.split
    tier = cfg.cold
    return [
        cold_trace(
            q[g * group : (g + 1) * group].numpy(),
            k[g].numpy(),
            prompt,
            heavy,
            recent,
            tier.recall,
            "sum" if gqa == "none" else gqa,
            scaling=qk[layer]["scaling"] or q.shape[-1] ** -0.5,
            every=tier.every,
            select=tier.select,
            scan=tier.pages_scanned,
        )
        for g in range(hs)
    ]


@pytest.mark.parametrize("select", ["exact", "pages"])
@pytest.mark.parametrize("gqa", ["sum", "max"])
def test_kept_cold_and_recalled_sets_equal_the_reference(select, gqa):
    """Every layer and KV set, every step: the policy's slots, the window, the victims and the
    store's records (in write order, which the pages follow) are the FP64 reference's. The prompt
    evicts more than one page, so ``pages`` (one page read exactly) differs from ``exact``."""
    check_reference(select, gqa, "torch")


def check_reference(select: str, gqa: str, backend: str, new: int = 30) -> None:
    """A tiny model's generation with a cold tier on ``backend`` against the FP64 reference, every
    layer, KV set and step (the test above; tests/test_runtime_cold_cpu.py on ``cpp``)."""
    model = tiny_model("llama", layers=2, q_heads=4, kv_heads=2)
    prompt = 40
    cold = ColdTier(recall=4, select=select, scan=1, every=1)
    cfg = H2OConfig(heavy=10, recent=3, gqa=gqa, cold=cold, backend=backend)
    qk = {}
    _, cache = _generate(model, cfg, _ids(prompt), new, Watch, qk=qk)
    watch = next(e for e in cache.extensions if isinstance(e, Watch))
    ext = _cold(cache)
    for layer in range(2):
        ref = _reference(qk, layer, 2, prompt, cfg, gqa)
        steps = len(watch.kept[layer])
        for g in range(2):
            where = f"{select} gqa={gqa} {backend} layer {layer} set {g}"
            assert [s[0][g] for s in watch.kept[layer]] == ref[g].kept[:steps], where
            assert [s[0][g] for s in watch.window[layer]] == ref[g].window[:steps], where
            assert [s[0][g] for s in watch.victims[layer]] == ref[g].victims[:steps], where
            store = ext.layers[layer].store
            n = int(store.count[0, g])
            assert store.positions[0, g, :n].tolist() == ref[g].records[:n], where
            # the scores: a record carries what it had when evicted plus what the window gave it
            got = store.scores[0, g, :n].clone()
            st = ext.layers[layer]
            win = st.window[0, g]
            held = cache.layers[layer].scores[0, g, st.start : st.start + len(win)]
            got[win[win >= 0]] = held[win >= 0].to(got.dtype)
            assert np.allclose(got.numpy(), ref[g].record_scores[:n], rtol=1e-4, atol=1e-5), where
    assert watch.bad == []


def test_every_k_and_a_batch_equal_the_reference_per_request():
    """``every=3`` keeps the window for three steps; two requests of one batch each follow the
    reference of their own queries (a request's store and window are its own)."""
    model = tiny_model("llama", layers=1, q_heads=4, kv_heads=1)
    prompt, new = 36, 20
    cfg = H2OConfig(heavy=9, recent=3, cold=ColdTier(recall=5, every=3, select="pages", scan=1))
    ids = _ids(prompt, seed=3, batch=2)
    qk = {}
    _, cache = _generate(model, cfg, ids, new, Watch, qk=qk)
    watch = next(e for e in cache.extensions if isinstance(e, Watch))
    for r in range(2):
        one = {0: {name: [t[r : r + 1] for t in qk[0][name]] for name in ("q", "k")}}
        one[0]["scaling"] = qk[0]["scaling"]
        (ref,) = _reference(one, 0, 1, prompt, cfg, "sum")
        assert [s[r][0] for s in watch.window[0]] == ref.window[: len(watch.window[0])]
        assert [s[r][0] for s in watch.kept[0]] == ref.kept[: len(watch.kept[0])]
    assert watch.bad == []


def test_selection_ties_take_the_newer_position_and_the_later_page():
    """Equal keys give equal selection values: the newer position is recalled, as in the
    reference; with the page bound tied too, the later page is read."""
    d, recall = 4, 3
    key = torch.zeros(40, d, dtype=torch.float64)
    key[:, 0] = 1.0  # every key the same: every value ties
    positions = torch.arange(40)
    store = ColdStore("cpu", 1, 1, d, torch.float64, pin=False, directory=None, name="t")
    store.append(key[None, None], key[None, None], torch.zeros(1, 1, 40), positions[None, None])
    q = torch.ones(1, 1, 2, d, dtype=torch.float64)
    for how in ("exact", "pages"):
        got = select(store, q, "sum", recall, how, 1)
        picked = sorted(store.positions[0, 0, got[0, 0]].tolist())
        ref = choose(q[0, 0].numpy(), key.numpy(), positions.tolist(), recall, "sum", how, 1)
        assert picked == sorted(positions[ref].tolist())
        # exact: the three newest; pages: inside the last page read (positions 32..39)
        assert picked == [37, 38, 39]
    assert PAGE == 16


@pytest.mark.parametrize("store", ["cpu", "disk"])
def test_a_window_that_holds_every_evicted_entry_gives_the_full_cache_tokens(store, tmp_path):
    """The recall path, not a memory claim: with a window as large as everything evicted, each
    step attends to every position, so the tokens are the full cache's (plain H2O at the policy's
    slot count is not); every recalled K/V equals the evicted one, bit for bit."""
    model = tiny_model("llama", layers=2)
    ids = _ids(30, seed=1, batch=2)
    full, _ = _generate(model, H2OConfig(policy="full"), ids, 20)
    plain, _ = _generate(model, H2OConfig(heavy=4, recent=4), ids, 20)
    tier = ColdTier(store=store, recall=56, directory=str(tmp_path) if store == "disk" else None)
    cold, cache = _generate(model, H2OConfig(heavy=60, recent=4, cold=tier), ids, 20, Watch)
    assert torch.equal(cold, full) and not torch.equal(plain, full)
    watch = next(e for e in cache.extensions if isinstance(e, Watch))
    assert watch.bad == [] and any(w for s in watch.window[0][1:] for w in s[0])
    numbers = cold_summary(cache)
    assert numbers["evicted"] > 0 and numbers["recalled"] > 0 and numbers["read"] > 0
    assert numbers["written"] == numbers["evicted"] * 2 * 16 * 4  # K and V of d=16 in float32
    if store == "disk":
        assert list(tmp_path.glob("*.bin"))


@pytest.mark.parametrize("policy", ["scissorhands", "tova"])
def test_every_evicting_policy_with_a_window_of_everything_gives_the_full_cache_tokens(policy):
    """Other policies than h2o (scissorhands keeps a per-slot history, which a filled window slot
    restarts): the window that holds every evicted entry attends to every position, and every
    recalled K/V is the evicted one, bit for bit."""
    model = tiny_model("llama", layers=2)
    ids = _ids(30, seed=2, batch=2)
    full, _ = _generate(model, H2OConfig(policy="full"), ids, 12)
    tier = ColdTier(recall=56)
    cold, cache = _generate(model, H2OConfig(policy=policy, heavy=60, recent=4, cold=tier), ids, 12, Watch)
    watch = next(e for e in cache.extensions if isinstance(e, Watch))
    assert torch.equal(cold, full) and watch.bad == []
    assert cold_summary(cache)["recalled"] > 0
    if policy == "scissorhands":
        layer, st = cache.layers[0], _cold(cache).layers[0]
        fresh = st.log[-1][3]  # the slots the last refill filled: their history restarted at 0
        assert layer.history is not None and bool(fresh.any())
        assert bool((layer.history[..., st.start :][fresh] <= 1).all())


def test_a_small_window_changes_only_what_it_recalls():
    """A window of 3 slots inside B: the hot memory stays B, the policy keeps B - 3 slots."""
    model = tiny_model("llama", layers=1)
    cfg = H2OConfig(heavy=6, recent=4, cold=ColdTier(recall=3))
    _, cache = _generate(model, cfg, _ids(30), 8)
    layer = cache.layers[0]
    assert cfg.split == (3, 4, 0) and cfg.capacity == 10
    assert layer.keys.shape[2] == 10 and cache.budgets[0].capacity == 7


def test_the_cold_config_checks_and_round_trips():
    with pytest.raises(ConfigError, match="recall window need 10 of the 10 slots"):
        H2OConfig(heavy=6, recent=4, cold=ColdTier(recall=10))
    with pytest.raises(ConfigError, match="unknown cold store"):
        ColdTier(store="tape")
    with pytest.raises(ConfigError, match="evicts nothing"):
        H2OConfig(policy="full", cold=ColdTier())
    with pytest.raises(ConfigError, match="STORE:RECALL"):
        parse_cold("cpu")
    cfg = H2OConfig(heavy=6, recent=4, cold=parse_cold("disk:3:pages"))
    assert H2OConfig(**cfg.to_dict()) == cfg and "cold=disk:3:pages" in cfg.describe()
    assert "cold" not in H2OConfig(heavy=6, recent=4).to_dict()
    assert np.isclose(cfg.cold.pages_scanned, 1)
    assert ColdTier(recall=205, select="pages").pages_scanned == 13  # the window's worth of pages
    chosen = parse_cold("cpu:32:pages=5:2")
    assert (chosen.select, chosen.scan, chosen.every, chosen.pages_scanned) == ("pages", 5, 2, 5)
    assert parse_cold(chosen.describe().removeprefix("cold=").split()[0]).scan == 5
    for bad in ("cpu:32:exact=3", "cpu:32:pages=", "cpu:32:pages=x"):
        with pytest.raises(ConfigError, match="STORE:RECALL"):
            parse_cold(bad)
    assert parse_cold("cpu:8:pages:4") == ColdTier(store="cpu", recall=8, select="pages", every=4)
    for bad in ("cpu:8:pages:x", "cpu:8:pages:4:1", "cpu:8:pages:0"):
        with pytest.raises(ConfigError, match="STORE:RECALL|every"):
            parse_cold(bad)


def test_a_disk_store_never_opens_or_removes_a_file_it_did_not_make(tmp_path):
    """In a given directory the store writes only new files of its own: a user's file with the
    name it would take first is left as it was, through growth and close."""
    user = tmp_path / "s-1.bin"
    user.write_bytes(b"the user's bytes")
    store = ColdStore("disk", 1, 1, 4, torch.float32, pin=False, directory=tmp_path, name="s")
    key = torch.randn(1, 1, 40, 4)
    store.append(key, key.clone(), torch.rand(1, 1, 40), torch.arange(40)[None, None])  # grows twice
    assert store.file is not None and store.file != user
    store.close()
    assert user.read_bytes() == b"the user's bytes"
    assert sorted(p.name for p in tmp_path.iterdir()) == ["s-1.bin"]


def _temporary_store(tmp_path, monkeypatch) -> ColdStore:
    monkeypatch.setattr(tempfile, "tempdir", str(tmp_path))  # the store's own folder lands here
    store = ColdStore("disk", 1, 1, 4, torch.float32, pin=False, directory=None, name="s")
    key = torch.randn(1, 1, 40, 4)
    store.append(key, key.clone(), torch.rand(1, 1, 40), torch.arange(40)[None, None])
    assert store.file is not None and store.file.exists() and store.file.parent.parent == tmp_path
    return store


def test_a_disk_store_without_a_directory_removes_its_temporary_folder_on_close(tmp_path, monkeypatch):
    store = _temporary_store(tmp_path, monkeypatch)
    store.close()
    assert list(tmp_path.iterdir()) == []
    key = torch.randn(1, 1, 3, 4)  # a store used again after close makes a new folder, removed again
    store.append(key, key.clone(), torch.rand(1, 1, 3), torch.arange(3)[None, None])
    assert len(list(tmp_path.iterdir())) == 1
    store.close()
    assert list(tmp_path.iterdir()) == []


def test_a_disk_store_leaves_a_foreign_file_in_its_temporary_folder_and_the_folder(tmp_path, monkeypatch):
    """Only what the store wrote goes: a file someone put in its temporary folder stays, and so
    does the folder that holds it."""
    store = _temporary_store(tmp_path, monkeypatch)
    folder = store.file.parent
    (folder / "notes.txt").write_text("someone's")
    store.close()
    assert sorted(p.name for p in folder.iterdir()) == ["notes.txt"]
    assert (folder / "notes.txt").read_text() == "someone's"


def test_a_disk_store_dropped_unclosed_leaves_nothing_on_disk(tmp_path, monkeypatch):
    """A cache dropped without ``close`` (a generation that is simply let go) still removes its
    store's file and folder, when the store is collected."""
    store = _temporary_store(tmp_path, monkeypatch)
    del store
    gc.collect()
    assert list(tmp_path.iterdir()) == []


def test_disk_stores_left_open_are_removed_when_the_process_exits(tmp_path):
    """A process that generates with a disk cold tier and exits leaves no folder behind."""
    code = (
        "import torch\n"
        "from h2o_lens.cold_store import ColdStore\n"
        "keep = []\n"
        "for i in range(3):\n"
        "    s = ColdStore('disk', 1, 1, 4, torch.float32, pin=False, directory=None, name='s')\n"
        "    k = torch.randn(1, 1, 9, 4)\n"
        "    s.append(k, k.clone(), torch.rand(1, 1, 9), torch.arange(9)[None, None])\n"
        "    keep.append(s)\n"
        "import os; print(len(os.listdir(os.environ['TMPDIR'])))\n"
    )
    env = {**os.environ, "TMPDIR": str(tmp_path)}
    done = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr
    assert done.stdout.strip() == "3"  # three folders while it ran
    assert list(tmp_path.iterdir()) == []


def test_a_disk_store_whose_directory_is_a_users_file_fails_and_leaves_the_file(tmp_path):
    """A directory that is a user's file: the store's error names it, and the file stays as it was
    (the failure path removes only a file the store itself created)."""
    user = tmp_path / "notes.txt"
    user.write_bytes(b"the user's bytes")
    store = ColdStore("disk", 1, 1, 4, torch.float32, pin=False, directory=user, name="s")
    key = torch.randn(1, 1, 8, 4)
    with pytest.raises(OSError, match="cold tier"):
        store.append(key, key.clone(), torch.rand(1, 1, 8), torch.arange(8)[None, None])
    assert user.read_bytes() == b"the user's bytes"


def test_a_cold_tier_starts_from_a_reused_prompt_forward_bit_for_bit():
    """The prompt forward does not depend on the cold tier (it keeps what the keep rule drops):
    under ``reuse_prompts`` a cold-tier generation starts from a plain H2O one's prompt forward
    (DESIGN.md §12.5), with the tokens and the store of its own prefill."""
    from h2o_lens.prompt_reuse import reuse_prompts

    model = tiny_model("llama", layers=2)
    ids = _ids(30, seed=2)
    cfg = H2OConfig(heavy=6, recent=4, cold=ColdTier(recall=3))
    alone, cache = _generate(model, cfg, ids, 10)
    with reuse_prompts(model) as shared:
        _generate(model, H2OConfig(heavy=6, recent=4), ids, 10)
        reused, cache2 = _generate(model, cfg, ids, 10)
    assert shared.hits == 1 and cache2.prompt_reused
    assert torch.equal(alone, reused) and cold_summary(cache) == cold_summary(cache2)


def test_a_refill_keeps_an_occupant_in_its_slot_and_fills_the_freed_slots_by_position():
    """Records 3 and 5 hold slots 0 and 1, slot 2 is empty; the selection is 5, 7 and 2: record 5
    stays in slot 1, and the new ones take slots 0 and 2 in ascending position order (record 7 at
    position 10 before record 2 at position 40); a second row with nothing selected empties."""
    from h2o_lens.cold import next_window

    positions = np.array([[0, 1, 40, 30, 4, 50, 6, 10], [0, 1, 2, 3, 4, 5, 6, 7]])
    scores = np.arange(16, dtype=np.float32).reshape(2, 8) / 10
    old = np.array([[3, 5, -1], [1, 2, -1]])
    best = np.array([[5, 7, 2], [-1, -1, -1]])
    new, filled, score, position = next_window(old, best, positions, scores)
    assert new.tolist() == [[7, 5, 2], [-1, -1, -1]]
    assert filled.tolist() == [[True, False, True], [False, False, False]]
    assert position.tolist() == [[10, 50, 40], [-1, -1, -1]]
    assert np.allclose(score, [[0.7, 0.5, 0.2], [0, 0, 0]])


def test_the_torch_swap_of_a_full_window_equals_next_window():
    """The refill's torch path for a full window and a full choice (:func:`h2o_lens.cold._swap`)
    gives the slots, the filled mask and the record-to-slot map of :func:`next_window`, over
    random windows of several rows with a random share of occupants staying."""
    from h2o_lens.cold import _Layer, _slots, _swap, next_window

    gen = torch.Generator().manual_seed(3)
    for rows, r, n in ((1, 5, 40), (6, 17, 90), (24, 64, 300)):
        positions = torch.stack([torch.randperm(5 * n, generator=gen)[:n] for _ in range(rows)])
        scores = torch.rand(rows, n, generator=gen)
        old = torch.stack([torch.randperm(n, generator=gen)[:r] for _ in range(rows)])
        best = torch.stack([torch.randperm(n, generator=gen)[:r] for _ in range(rows)])
        keep = torch.rand(rows, r, generator=gen) < 0.6  # some of the old occupants chosen again
        best = torch.stack([_merge(o[k], b, r) for o, k, b in zip(old, keep, best)])
        st = _Layer(window=old.view(rows, 1, r))
        new, filled = _swap(st, best, positions)
        want = next_window(old.numpy(), best.numpy(), positions.numpy(), scores.numpy())
        assert new.tolist() == want[0].tolist() and filled.tolist() == want[1].tolist()
        assert bool(filled.any()) and not bool(filled.all())
        st.window = new.view(rows, 1, r)
        rebuilt = _slots(_Layer(window=st.window), n)
        assert torch.equal(st.slot_of, rebuilt)  # the map kept in step equals one built afresh


def _merge(kept: torch.Tensor, other: torch.Tensor, r: int) -> torch.Tensor:
    """``kept`` then the first of ``other`` not in it, ``r`` distinct records in all, shuffled."""
    rest = [int(x) for x in other if int(x) not in set(kept.tolist())]
    out = torch.tensor(kept.tolist() + rest[: r - kept.numel()])
    return out[torch.randperm(r, generator=torch.Generator().manual_seed(r))]


def test_the_reference_reads_the_tiers_default_page_count():
    """With no ``scan``, the FP64 reference reads the pages :class:`ColdTier` reads by default (the
    window's worth, ⌈r/16⌉), and that count decides what the window holds."""
    rng = np.random.default_rng(3)
    q, k = rng.standard_normal((2, 200, 8)), rng.standard_normal((200, 8))
    differs = False
    for recall in (4, 20, 36):
        scan = ColdTier(recall=recall, select="pages").pages_scanned
        assert scan == -(-recall // PAGE)
        default = cold_trace(q, k, 150, 40, 10, recall, select="pages")
        assert default == cold_trace(q, k, 150, 40, 10, recall, select="pages", scan=scan), recall
        differs |= default != cold_trace(q, k, 150, 40, 10, recall, select="pages", scan=scan + 1)
    assert differs  # the count is one the trace depends on
