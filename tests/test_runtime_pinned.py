"""Pinned positions (DESIGN.md §2.11): never evicted, in slots taken out of the budget.

The config's split rule and errors; the shared rules of ``h2o_lens.eviction`` with pins; the
torch ops and the runtime against the FP64 references (h2o, heavy, tova, scissorhands) and
against a direct model of the unscored policies (local, sink); invariants for every evicting
policy; a recorded pinned run whose replay passes the implementation check.
"""

from __future__ import annotations

import json

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from runtime_utils import KeptRecorder, assert_same_sets, capture_qk, reference_sets, slot_kept_sets
from tiny import tiny_model

import h2o_lens
import recorders
from h2o_lens import H2OConfig, eviction, ops, policies
from h2o_lens.config import pin
from h2o_lens.errors import ConfigError
from recorders.replay import replay
from runlog import open_runs, read_manifest

VOCAB = 256
REFERENCED = ("h2o", "heavy", "tova", "scissorhands")  # policies with an FP64 reference
UNSCORED = ("local", "sink")  # position alone decides: modelled directly below


def _ids(n: int, seed: int = 0, batch: int = 1) -> torch.Tensor:
    return torch.randint(3, VOCAB, (batch, n), generator=torch.Generator().manual_seed(seed))


def _greedy(model, ids, new, **kw):
    with torch.no_grad():
        return model.generate(ids, max_new_tokens=new, do_sample=False, pad_token_id=0, **kw)


def _unscored_sets(prefill: int, n: int, recent: int, sink: int, pinned, budget: int) -> list[list[int]]:
    """Kept sets of ``local``/``sink`` with pins, written out: the prompt keeps its last ``recent``
    positions, the first ``sink`` and the pins; a step that overflows ``budget`` evicts the oldest
    position outside the window, the sink and the pins."""
    fixed = set(range(min(sink, prefill))) | set(pinned)
    kept = set(range(max(0, prefill - recent), prefill)) | fixed
    out = [sorted(kept)]
    for t in range(prefill, n):
        kept.add(t)
        if len(kept) > budget:
            kept.discard(min(p for p in kept if p <= t - recent and p not in fixed))
        out.append(sorted(kept))
    return out


# -- the config ------------------------------------------------------------------------


def test_pin_takes_slots_out_of_heavy_first_then_recent():
    base = H2OConfig(heavy=5, recent=4)
    assert pin(base, [3]).split == (4, 4, 0)
    assert pin(base, [9, 1, 3, 4, 5]).split == (0, 4, 0)  # heavy exhausted exactly
    assert pin(base, range(7)).split == (0, 2, 0)  # then out of recent
    cfg = pin(base, [9, 1, 3])
    assert cfg.pinned == (1, 3, 9) and (cfg.heavy, cfg.recent, cfg.capacity) == (5, 4, 9)
    assert cfg.policy == base.policy and cfg.gqa == base.gqa
    assert "pinned=[1, 3, 9]" in cfg.describe() and "heavy=2 recent=4" in cfg.describe()
    # a baseline splits the B - k other slots its own way
    expected = {"local": (0, 6, 0), "heavy": (6, 0, 0), "sink": (0, 4, 2), "random": (2, 4, 0), "tova": (2, 4, 0)}
    for name, split in expected.items():
        got = pin(H2OConfig(policy=name, heavy=5, recent=4, sink=2), [1, 3, 9])
        assert got.split == split, name
        assert sum(got.split) + len(got.pinned) == got.capacity == 9
    many = pin(base, range(8))
    assert "8 positions [0, 1, 2, …, 7]" in many.describe()


def test_pinned_survives_the_manifest_round_trip_and_ratio_resolution():
    cfg = pin(H2OConfig(policy="tova", heavy=6, recent=6, gqa="max"), [30, 2, 17])
    again = H2OConfig(**json.loads(json.dumps(cfg.to_dict())))  # JSON gives a list back
    assert again == cfg and again.pinned == (2, 17, 30)
    by_ratio = H2OConfig(ratio=0.5, pinned=[1, 2, 3])
    assert by_ratio.resolve(20).split == (2, 5, 0)  # B = 10: heavy 5 - 3, recent 5
    with pytest.raises(ConfigError, match="need 3 of the 2 slots"):
        by_ratio.resolve(4)


@pytest.mark.parametrize(
    "make, needle",
    [
        (lambda: pin(H2OConfig(heavy=2, recent=2), range(4)), r"need 4 of the 4 slots.*at least 5 slots"),
        (lambda: pin(H2OConfig(heavy=2, recent=2), range(6)), r"need 6 of the 4 slots.*at least 7 slots"),
        (lambda: pin(H2OConfig(policy="local", heavy=0, recent=3), [0, 5, 9]), "at least 4 slots"),
        (
            lambda: pin(H2OConfig(policy="sink", heavy=3, recent=3, sink=5), [10]),
            r"needs 1 of the 6 slots, leaving heavy=2, recent=3.*sink=5 leaves no recent slot",
        ),
        (lambda: H2OConfig(heavy=4, recent=4, pinned=[-1]), "whole numbers >= 0"),
        (lambda: H2OConfig(heavy=4, recent=4, pinned=[1.5]), "whole numbers >= 0"),
        (lambda: H2OConfig(heavy=4, recent=4, pinned=[True]), "whole numbers >= 0"),
        (lambda: H2OConfig(heavy=4, recent=4, pinned=[3, 1, 3]), r"distinct, got \[3\] more than once"),
        (lambda: H2OConfig(heavy=4, recent=4, pinned="12"), "sequence of prompt positions"),
        (lambda: H2OConfig(heavy=4, recent=4, pinned=12), "sequence of prompt positions"),
        (lambda: H2OConfig(policy="full", pinned=[1]), "evicts nothing"),
        (lambda: pin(H2OConfig(policy="full"), [1]), "evicts nothing"),
        (lambda: pin(H2OConfig(ratio=0.2), [1]), "resolve it first"),
        (lambda: pin({"heavy": 4, "recent": 4}, [1]), "needs an H2OConfig"),
    ],
)
def test_bad_pins_are_config_errors(make, needle):
    with pytest.raises(ConfigError, match=needle):
        make()


def test_a_pin_beyond_the_prompt_fails_at_prefill():
    model = tiny_model("llama")
    with pytest.raises(ConfigError, match=r"pinned position 20 is beyond the prompt of request 0 \(20 tokens"):
        with h2o_lens.h2o(model, pin(H2OConfig(heavy=4, recent=3), [2, 20])):
            _greedy(model, _ids(20), 2)
    # with left padding the positions are each request's own: the shorter one is too short
    ids, mask = _ids(20, batch=2), torch.ones(2, 20, dtype=torch.long)
    mask[1, :6] = 0
    with pytest.raises(ConfigError, match=r"position 15 is beyond the prompt of request 1 \(14 tokens"):
        with h2o_lens.h2o(model, pin(H2OConfig(heavy=4, recent=3), [15])):
            _greedy(model, ids, 2, attention_mask=mask)


# -- the shared rules ------------------------------------------------------------------


def test_rules_never_choose_a_pinned_position():
    pos = torch.arange(10)
    pins = torch.tensor([0, 8])
    scores = torch.tensor([0.0, 1, 2, 3, 4, 9, 5, 6, 7, 8])
    keep = eviction.prefill_keep(scores, pos, heavy=1, recent=2, pinned=pins)
    assert pos[keep].tolist() == [0, 5, 8, 9]  # pin 8 inside the window counts once
    elig = eviction.eligible_mask(pos, 9, 2, pinned=pins)
    assert pos[elig].tolist() == [1, 2, 3, 4, 5, 6, 7]
    victim, found = eviction.select_victim(scores, pos, eviction.eligible_mask(pos, 12, 0, pinned=pins))
    assert bool(found) and int(victim) == 1  # position 0 has the lowest score but is pinned


@settings(max_examples=60, deadline=None, derandomize=True)
@given(
    n=st.integers(4, 30),
    prefill=st.integers(2, 30),
    heavy=st.integers(0, 4),
    recent=st.integers(0, 4),
    group=st.sampled_from([1, 2]),
    gqa=st.sampled_from(["sum", "max"]),
    name=st.sampled_from(REFERENCED),
    pins=st.sets(st.integers(0, 29), max_size=4),
    seed=st.integers(0, 2**16),
)
@pytest.mark.slow
def test_torch_ops_equal_reference_with_pins(n, prefill, heavy, recent, group, gqa, name, pins, seed):
    """The torch prefill and decode step, in FP64 on raw q/k, keep what the FP64 reference keeps,
    and the pinned positions are in every kept set."""
    if heavy + recent == 0:
        recent = 1
    if name == "heavy":
        heavy, recent = heavy + recent, 0
    prefill = min(prefill, n)
    pinned = tuple(sorted(p for p in pins if p < prefill))
    spec = policies.get(name)
    d = 8
    g = torch.Generator().manual_seed(seed)
    q = torch.randn(1, group, n, d, generator=g, dtype=torch.float64) * 2
    k = torch.randn(1, 1, n, d, generator=g, dtype=torch.float64) * 2
    v = torch.randn(1, 1, n, d, generator=g, dtype=torch.float64)
    expected = spec.reference((q[0] @ k[0, 0].T).numpy(), prefill, heavy, recent, gqa, pinned=pinned)
    cap = heavy + recent + len(pinned)
    assert all(set(pinned) <= set(s) and len(s) <= cap for s in expected)
    args = ops.PolicyArgs(name, heavy, recent, 0, gqa, pinned=pinned)
    assert args.capacity == cap
    pos = torch.arange(prefill, dtype=torch.int32)[None, None]
    qp, kp, vp = q[:, :, :prefill], k[:, :, :prefill], v[:, :, :prefill]
    columns = ops.prefill_attention(qp, kp, vp, None, 1.0, gqa, chunk=5)[1] if spec.prefill == "columns" else None
    rows = ops.prefill_rows(qp, kp, None, 1.0, gqa, spec.prefill_rows) if spec.prefill == "rows" else None
    scores, hist = ops.prefill_scores(columns, rows, pos, args, dtype=torch.float64, group=group)
    keep = eviction.prefill_keep(scores, pos, heavy, recent, 0, torch.tensor(pinned, dtype=torch.int64))
    sets = slot_kept_sets(q, k, v, prefill, args, scores, keep, hist if spec.history else None)
    assert sets[0] == expected[0]
    for t in range(prefill, n):
        got = sets[t - prefill + 1]
        assert got == expected[t - prefill + 1], f"{name} pinned={pinned} step {t}"


# -- the runtime -----------------------------------------------------------------------

PINS = (1, 6, 20, 22)  # 20 and 22 fall inside the recent window of a 24-token prompt
PROMPT, NEW = 24, 16


def _run(model, cfg, ids, new=NEW, **kw):
    rec = KeptRecorder()
    with h2o_lens.h2o(model, cfg, listener=rec) as session, capture_qk() as qk:
        _greedy(model, ids, new, **kw)
    assert session.last_cache.args.capacity == cfg.capacity
    return rec, qk


def _check_invariants(sets, pinned, cap, where):
    for s, per_set in enumerate(sets):
        for kept in per_set:
            assert set(pinned) <= set(kept), f"{where} step {s}: pinned {pinned} not all in {kept}"
            assert len(kept) <= cap, f"{where} step {s}: {len(kept)} slots > {cap}"


@pytest.mark.parametrize(
    "name, gqa",
    [("h2o", "sum"), ("h2o", "max"), ("h2o", "none"), ("heavy", "sum"), ("tova", "none"), ("scissorhands", "max")],
)
def test_runtime_equals_reference_with_pins(name, gqa):
    model = tiny_model("llama", layers=2, q_heads=4, kv_heads=2)
    cfg = pin(H2OConfig(policy=name, heavy=5, recent=4, gqa=gqa), PINS)
    heavy, recent, _ = cfg.split
    rec, qk = _run(model, cfg, _ids(PROMPT))
    for layer in range(2):
        runtime = [step[0] for step in rec.kept[layer]]
        _check_invariants(runtime, PINS, 9, f"{name} layer {layer}")
        expected = reference_sets(qk[layer], 0, PROMPT, heavy, recent, gqa, policy=name, pinned=PINS)
        assert_same_sets(runtime, expected, f"{name} gqa={gqa} layer {layer}")


@pytest.mark.parametrize("name", UNSCORED)
def test_unscored_runtime_equals_the_written_out_rule(name):
    model = tiny_model("llama", layers=2, q_heads=4, kv_heads=2)
    cfg = pin(H2OConfig(policy=name, heavy=5, recent=4, sink=2), PINS)
    _, recent, sink = cfg.split
    rec, _ = _run(model, cfg, _ids(PROMPT))
    expected = _unscored_sets(PROMPT, PROMPT + NEW - 1, recent, sink, PINS, 9)
    for layer in range(2):
        runtime = [step[0] for step in rec.kept[layer]]
        assert_same_sets(runtime, [[e, e] for e in expected], f"{name} layer {layer}")


def test_random_never_evicts_a_pin_and_differs_from_unpinned():
    model = tiny_model("llama", layers=2, q_heads=4, kv_heads=2)
    rec, _ = _run(model, pin(H2OConfig(policy="random", heavy=5, recent=4, seed=3), PINS), _ids(PROMPT))
    free, _ = _run(model, H2OConfig(policy="random", heavy=5, recent=4, seed=3), _ids(PROMPT))
    for layer in range(2):
        _check_invariants([step[0] for step in rec.kept[layer]], PINS, 9, f"random layer {layer}")
    lost = {p for layer in free.kept.values() for step in layer for s in step[0] for p in PINS if p not in s}
    assert lost  # without pins the draw does evict some of them: the pins changed the run


@pytest.mark.parametrize("name", ["h2o", "local"])
def test_batch_with_padding_pins_each_request(name):
    """Two requests of different lengths, left-padded, with the same pins: each keeps what it
    keeps alone (the pins are positions of its own real tokens)."""
    model = tiny_model("llama")
    seqs = [_ids(26, seed=5)[0], _ids(19, seed=6)[0]]
    pins = (2, 9, 17)
    width = max(len(s) for s in seqs)
    ids = torch.zeros(2, width, dtype=torch.long)
    mask = torch.zeros(2, width, dtype=torch.long)
    for r, s in enumerate(seqs):
        ids[r, width - len(s) :] = s
        mask[r, width - len(s) :] = 1
    cfg = pin(H2OConfig(policy=name, heavy=4, recent=4), pins)
    heavy, recent, _ = cfg.split
    rec, qk = _run(model, cfg, ids, new=14, attention_mask=mask)
    for layer in range(2):
        for r, s in enumerate(seqs):
            runtime = [step[r] for step in rec.kept[layer]]
            _check_invariants(runtime, pins, 8, f"{name} layer {layer} request {r}")
            if name == "h2o":
                expected = reference_sets(qk[layer], r, len(s), heavy, recent, "sum", width - len(s), pinned=pins)
            else:
                sets = _unscored_sets(len(s), len(s) + 13, recent, 0, pins, 8)
                expected = [[e] * len(runtime[0]) for e in sets]
            assert_same_sets(runtime, expected, f"{name} layer {layer} request {r}")


def test_keep_ratio_budgets_per_request_with_pins():
    """A keep ratio resolves per request (two budgets in one batch, each stepping on its own
    slots); the pins come out of each request's own split and each request equals the reference."""
    model = tiny_model("llama")
    seqs = [_ids(30, seed=7)[0], _ids(20, seed=9)[0]]
    pins = (3, 11)
    width = 30
    ids = torch.zeros(2, width, dtype=torch.long)
    mask = torch.zeros(2, width, dtype=torch.long)
    for r, s in enumerate(seqs):
        ids[r, width - len(s) :] = s
        mask[r, width - len(s) :] = 1
    rec = KeptRecorder()
    with h2o_lens.h2o(model, H2OConfig(ratio=0.4, pinned=pins), listener=rec) as session, capture_qk() as qk:
        _greedy(model, ids, 12, attention_mask=mask)
    configs = session.last_cache.request_configs
    assert [c.capacity for c in configs] == [12, 8] and [c.split for c in configs] == [(4, 6, 0), (2, 4, 0)]
    for layer in range(2):
        for r, s in enumerate(seqs):
            heavy, recent, _ = configs[r].split
            runtime = [step[r] for step in rec.kept[layer]]
            _check_invariants(runtime, pins, configs[r].capacity, f"ratio layer {layer} request {r}")
            expected = reference_sets(qk[layer], r, len(s), heavy, recent, "sum", width - len(s), pinned=pins)
            assert_same_sets(runtime, expected, f"ratio layer {layer} request {r}")


def test_triton_backend_with_pins_runs_the_torch_step():
    """The fused Triton decode step has no pins: a pinned config takes the torch step, and keeps
    the same sets as backend='torch'."""
    pytest.importorskip("triton")
    from h2o_lens.kernels._checks import interpret_mode

    if not interpret_mode() and not torch.cuda.is_available():
        pytest.skip("needs CUDA or TRITON_INTERPRET=1")
    model = tiny_model("llama")
    out = {}
    for backend in ("torch", "triton"):
        cfg = pin(H2OConfig(heavy=4, recent=3, backend=backend), (1, 5))
        with h2o_lens.h2o(model, cfg) as session:
            out[backend] = _greedy(model, _ids(16, seed=3), 8)
            layer = session.last_cache.layers[1]
            assert {1, 5} <= set(layer.positions[0, 0].tolist())
    assert torch.equal(out["torch"], out["triton"])


# -- recorded and replayed -------------------------------------------------------------


def _evictions(root, run_id):
    return (
        open_runs(root)
        .execute("SELECT position, phase, margin FROM evictions WHERE run_id = ? ORDER BY ALL", [run_id])
        .df()
    )


@pytest.mark.slow
def test_recorded_pinned_run_never_logs_a_pin_and_replays_exactly(tmp_path):
    """Pin two positions the unpinned run evicts: the pinned run's log never evicts them, its
    margins stay >= 0 (pins are not eligible), its steps hold at most B slots, the manifest
    carries the pins, and the masked replay reproduces its logits (implementation check)."""
    model = tiny_model("llama", layers=2, q_heads=4, kv_heads=2)
    base = H2OConfig(heavy=4, recent=3, gqa="none")
    ids = _ids(20, seed=8, batch=2)
    with recorders.record(model, base, out=tmp_path, fsync=False) as free:
        _greedy(model, ids, 12)
    lost = _evictions(tmp_path, free.run_id)
    prefill_lost = sorted(set(lost[lost.phase == "prefill"].position))
    pins = (prefill_lost[0], prefill_lost[-1])
    cfg = pin(base, pins)
    with recorders.record(model, cfg, out=tmp_path, fsync=False) as run:
        _greedy(model, ids, 12)
    ev = _evictions(tmp_path, run.run_id)
    assert len(ev) and not set(ev.position) & set(pins)
    margins = ev.margin.dropna()
    assert (margins >= 0).all()
    con = open_runs(tmp_path)
    kept = con.execute("SELECT max(kept) FROM steps WHERE run_id = ?", [run.run_id]).fetchone()[0]
    assert kept <= 7
    manifest = read_manifest(tmp_path / run.run_id)
    assert manifest["config"]["pinned"] == list(pins)
    assert H2OConfig(**manifest["config"]) == cfg
    summary = replay(tmp_path / run.run_id, model=model, progress=False)
    assert summary.implementation_ok and summary.max_logit_diff < 1e-4


def test_pinned_policy_case_restores_the_delayed_reference(tmp_path):
    """The FP64 policy case of a delayed first reference: H2O evicts the evidence and answers
    wrong; pinned, the same policy at the same slot count keeps it and answers right. The cache
    equals the FP64 reference with the pin, and the written run passes its implementation check."""
    from h2o_lens.reference import trace
    from h2o_lens.tasks import policy_case
    from recorders.policy_cases import case_kept_sets, write_policy_case

    case = policy_case("delayed_reference")
    ev = case.marks["evidence"]
    cfg = pin(H2OConfig(heavy=case.heavy, recent=case.recent, backend="torch"), [ev])
    heavy, recent, _ = cfg.split
    expected = trace(case.logits[0, 0], case.prompt_len, heavy, recent, pinned=[ev]).kept
    cand = case_kept_sets(case, cfg)
    got = [sorted(set(np.flatnonzero(cand[t][0, 0]).tolist()) - {t}) for t in range(case.prompt_len, case.n)]
    assert got + [sorted(np.flatnonzero(cand[case.n][0, 0]).tolist())] == expected
    free = write_policy_case(tmp_path, case)
    pinned = write_policy_case(tmp_path, case, pinned=[ev])
    assert pinned.name.endswith("-pinned1") and pinned != free
    con = open_runs(tmp_path)
    evicted = {
        run: {p for (p,) in con.execute("SELECT position FROM evictions WHERE run_id = ?", [run]).fetchall()}
        for run in (free.name, pinned.name)
    }
    assert ev in evicted[free.name] and ev not in evicted[pinned.name]
    correct = dict(con.execute("SELECT run_id, correct FROM requests").fetchall())
    assert correct == {free.name: False, pinned.name: True}
    assert read_manifest(pinned)["replay"]["implementation_ok"]
    assert read_manifest(pinned)["config"]["pinned"] == [ev]


# -- the pins on the cache's extension point (DESIGN.md §1.1) ----------------------------------


def test_the_pins_are_kept_by_the_cache_extension_and_by_nothing_else():
    """A pinned config's cache holds a :class:`~h2o_lens.pins.Pins` extension, and it is what keeps
    the pins: with it dropped before the first decode step, ``local`` evicts pin 1 (the oldest
    position) at once, while with it the pins are in every kept set of every layer."""
    from h2o_lens.extension import CacheExtension, use_extensions
    from h2o_lens.pins import Pins

    class DropPins(CacheExtension):
        def __init__(self, cache):
            self.cache = cache

        def step_needs(self, layer):  # the before-step event comes before the step asks what is protected
            self.cache.extensions = tuple(e for e in self.cache.extensions if not isinstance(e, Pins))
            return super().step_needs(layer)

    model = tiny_model("llama", layers=2, q_heads=4, kv_heads=2)
    cfg = pin(H2OConfig(policy="local", heavy=5, recent=4), (1, 6))
    kept = {}
    for name, factories in (("with", ()), ("without", (DropPins,))):
        rec = KeptRecorder()
        with use_extensions(*factories), h2o_lens.h2o(model, cfg, listener=rec) as session:
            _greedy(model, _ids(PROMPT), 6)
        assert any(isinstance(e, Pins) for e in session.last_cache.extensions) == (name == "with")
        kept[name] = [[step[0] for step in rec.kept[layer]] for layer in range(2)]
    for layer in range(2):  # each step: the kept positions of each KV set
        assert all({1, 6} <= set(s) for step in kept["with"][layer] for s in step)
        assert all({1, 6} <= set(s) for s in kept["without"][layer][0])  # the prefill kept the pins
        assert all(1 not in s for s in kept["without"][layer][1])


def test_a_rows_own_pins_are_not_eligible_in_what_the_recorder_derives():
    """The decode event carries the positions the step protected (per row), and its facts use them:
    a protected slot with the lowest score is neither the victim nor the margin's next-lowest."""
    from h2o_lens.events import DecodeEvent

    scores = torch.tensor([[[0.1, 0.5, 0.3, 0.9, 2.0]], [[0.1, 0.5, 0.3, 0.9, 2.0]]])  # (2, 1, 5)
    positions = torch.tensor([[[0, 1, 2, 3, 10]], [[0, 1, 2, 3, 10]]], dtype=torch.int32)
    protected = torch.tensor([[[0, -2]], [[-2, -2]]])  # row 0 protects position 0, row 1 nothing
    slot = torch.tensor([[2], [0]])  # row 0 evicts its lowest eligible (0.3), row 1 position 0
    ev = DecodeEvent(
        step=torch.tensor([10, 10]),
        slot=slot,
        evicts=torch.ones(2, 1, dtype=torch.bool),
        cand_scores=scores,
        cand_positions=positions,
        kept=positions[..., :4],
        protected=protected,
    )
    st = ev.stats(recent=2)
    assert st.victim_position.tolist() == [[2], [0]]
    # row 0: the survivors are positions 1 and 3 (0 is protected): margin 0.5 - 0.3; row 1: 0.3 - 0.1
    assert st.margin[:, 0].tolist() == pytest.approx([0.2, 0.2])
    assert st.min_heavy_score[:, 0].tolist() == pytest.approx([0.5, 0.3])


# -- one set of pins per row (DESIGN.md §2.11) ------------------------------------------------------

ROW_PINS = [(), (3,), (3, 17), (1, 5, 9, 20), (30, 31)]


def _row_tokens_and_sets(model, cfg, ids, row_pins=None):
    """Each row's new tokens and, per layer, its final kept positions (sorted per KV set)."""
    with torch.no_grad(), h2o_lens.h2o(model, cfg) as session:
        cache = session.new_cache(row_pins=row_pins) if row_pins is not None else None
        out = model.generate(
            input_ids=ids,
            attention_mask=torch.ones_like(ids),
            max_new_tokens=10,
            min_new_tokens=10,
            do_sample=False,
            pad_token_id=0,
            **({"cache": cache} if cache is not None else {}),
        )
    kept = [layer.positions.sort(-1).values for layer in session.last_cache.layers]
    return [(out[r, ids.shape[1] :].tolist(), [k[r].tolist() for k in kept]) for r in range(ids.shape[0])]


@pytest.mark.parametrize("family", ["llama", "qwen2"])
def test_each_row_pins_its_own_set_and_equals_that_set_pinned_alone(family):
    """A batch of one prompt whose rows pin different sets (``new_cache(row_pins=)``): each row
    generates the tokens, and keeps the positions, of the same config pinned at its set, alone."""
    model = tiny_model(family, layers=2, q_heads=4, kv_heads=2)
    ids = _ids(40, seed=5)
    cfg = H2OConfig(heavy=8, recent=4)
    alone = [_row_tokens_and_sets(model, pin(cfg, p) if p else cfg, ids)[0] for p in ROW_PINS]
    assert len({tuple(t) for t, _ in alone}) > 2  # the pins change the answers
    got = _row_tokens_and_sets(model, cfg, ids.expand(len(ROW_PINS), -1), ROW_PINS)
    assert got == alone
    for (_, sets), p in zip(got, ROW_PINS):
        assert all(set(p) <= set(s) for layer in sets for s in layer)


def test_row_pins_that_do_not_fit_are_config_errors():
    model = tiny_model("llama")
    with h2o_lens.h2o(model, H2OConfig(heavy=4, recent=4)) as session:
        with pytest.raises(ConfigError, match="pinned positions need 8 of the 8 slots"):
            session.new_cache(row_pins=[(1,), tuple(range(8))])
        with pytest.raises(ConfigError, match="2 sets of positions for a batch of 3 rows"):
            _greedy(model, _ids(PROMPT, batch=3), 2, cache=session.new_cache(row_pins=[(1,), (2,)]))
        with pytest.raises(ConfigError, match="pinned position 30 is beyond the prompt of request 1"):
            _greedy(model, _ids(PROMPT, batch=2), 2, cache=session.new_cache(row_pins=[(1,), (30,)]))
