"""The fused CPU decode step (``backend="cpp"``, h2o_lens/kernels/cpu.py) against the torch step,
the FP64 torch step and the FP64 reference: the same victims, slots, kept sets and candidate
sets; outputs and scores within twice the torch step's own error (the Triton kernel's rule,
tests/test_runtime_kernels.py); a request in a batch equal to itself alone, bit for bit."""

from __future__ import annotations

import os

import pytest
import torch

from h2o_lens import ops
from h2o_lens.errors import ConfigError
from h2o_lens.kernels import KernelInputError, resolve_backend
from h2o_lens.kernels.cpu import cpu_step_problem, decode_step_cpu
from h2o_lens.reference import simulate

if cpu_step_problem() is not None:  # CI installs a compiler and ninja (.ci/run): there it must build
    if os.environ.get("CI"):
        pytest.fail(f"the fused CPU step does not build in CI: {cpu_step_problem()}", pytrace=False)
    pytest.skip(f"the fused CPU step does not build here: {cpu_step_problem()}", allow_module_level=True)

CASES = {
    # name: (args, prompt lengths, steps, Hq, Hs, d); B = 11 with a row 4 slots short of full
    "h2o-sum-G3-fills": (ops.PolicyArgs("h2o", 6, 5, 0, "sum"), (15, 7), 6, 6, 2, 64),
    "h2o-none-G1": (ops.PolicyArgs("h2o", 3, 2, 0, "none"), (9,), 6, 2, 2, 16),
    "h2o-max-G8": (ops.PolicyArgs("h2o", 4, 3, 0, "max"), (12,), 6, 8, 1, 16),
    "h2o-sum-d24-B37": (ops.PolicyArgs("h2o", 20, 17, 0, "sum"), (45,), 4, 8, 2, 24),
    "heavy-recent0": (ops.PolicyArgs("heavy", 7, 0, 0, "sum"), (10, 8), 6, 4, 2, 16),
    "local": (ops.PolicyArgs("local", 0, 6, 0, "sum"), (9, 4), 5, 2, 1, 16),
    "sink": (ops.PolicyArgs("sink", 0, 4, 2, "sum"), (10,), 5, 2, 1, 16),
}


def _within(name, got, same, ref):
    """``|got - ref| <= 2 |same - ref| + 4 ulps``: ``same`` the torch step in got's dtype, ``ref`` FP64."""
    ref = ref.double()
    err = (got.double() - ref).abs().max().item()
    base = (same.double() - ref).abs().max().item()
    floor = 4 * torch.finfo(got.dtype).eps * max(1.0, ref.abs().max().item())
    assert err <= 2 * base + floor, f"{name}: CPU step error {err:.3g} > 2 x torch error {base:.3g} + {floor:.2g}"


def _streams(lens, steps, hq, hs, d, seed):
    """Token streams whose keys drift with position (recency bias), so heavy slots change hands."""
    g = torch.Generator().manual_seed(seed)
    b, n = len(lens), max(lens) + steps
    u = torch.full((d,), d**-0.5)
    ramp = torch.arange(n)[:, None] / n
    q = torch.randn(b, hq, n, d, generator=g) * 1.5 + 4.0 * u
    k = torch.randn(b, hs, n, d, generator=g) * 1.5 + 4.0 * ramp * u
    return q, k, torch.randn(b, hs, n, d, generator=g)


def _prefilled(q, k, v, lens, args, scaling):
    """Left-padded prompts through the torch prefill, laid into slots as the cache does."""
    b, _, _, d = q.shape
    hs, p, cap = k.shape[1], max(lens), args.capacity
    lens_t = torch.tensor(lens)
    valid = torch.arange(p)[None] >= (p - lens_t)[:, None]
    idx = (torch.arange(p)[None] - (p - lens_t)[:, None]).clamp(min=0)

    def pad(x):
        return x.gather(2, idx[:, None, :, None].expand(b, x.shape[1], p, d)) * valid[:, None, :, None]

    _, scores = ops.prefill_attention(pad(q), pad(k), pad(v), valid, scaling, args.gqa)
    positions = (valid.cumsum(-1) - 1).to(torch.int32).masked_fill(~valid, -1)[:, None, :].expand(b, hs, p)
    keep = ops.prefill_select(scores, positions, args)
    order = torch.where(keep, positions, torch.iinfo(torch.int32).max).argsort(-1)[..., :cap]
    kept = torch.where(keep.gather(-1, order), positions.gather(-1, order), -1)
    n = order.shape[-1]
    state = dict(
        keys=torch.zeros(b, hs, cap, d),
        values=torch.zeros(b, hs, cap, d),
        scores=torch.zeros(b, hs, cap),
        positions=torch.full((b, hs, cap), -1, dtype=torch.int32),
    )
    gidx = order[..., None].expand(b, hs, n, d)
    state["keys"][:, :, :n] = pad(k).gather(2, gidx)
    state["values"][:, :, :n] = pad(v).gather(2, gidx)
    state["scores"][:, :, :n] = torch.where(kept >= 0, scores.gather(-1, order), 0.0).float()
    state["positions"][:, :, :n] = kept
    fill = lens_t.clamp(max=cap)
    return state, (None if bool((fill >= cap).all()) else fill)


def _kept(positions):
    return [[sorted(p for p in row.tolist() if p >= 0) for row in req] for req in positions]


def _clone(state, dtype=None):
    return {n: (x.to(dtype) if dtype is not None and x.is_floating_point() else x).clone() for n, x in state.items()}


@pytest.mark.parametrize("name", list(CASES))
def test_steps_match_the_torch_step_and_the_fp64_reference(name):
    args, lens, steps, hq, hs, d = CASES[name]
    cap, scaling = args.capacity, d**-0.5
    q, k, v = _streams(lens, steps, hq, hs, d, seed=len(name))
    state, fill = _prefilled(q, k, v, lens, args, scaling)
    history = [_kept(state["positions"])]
    rows = torch.arange(len(lens))
    for i in range(steps):
        t = torch.tensor(lens) + i
        new = dict(query=q[rows, :, t], key=k[rows, :, t], value=v[rows, :, t])
        step = t.to(torch.int32)
        same, ref = _clone(state), _clone(state, torch.float64)
        common = dict(step=step, fill=fill, scaling=scaling, args=args, want_candidates=True, journal=True)
        r_same = ops.decode_step(**new, **same, **common)
        r_ref = ops.decode_step(**{n: x.double() for n, x in new.items()}, **ref, **common)
        r_c = decode_step_cpu(**new, **state, **common, weights=True)
        _within(f"step {i} weights", r_c.weights, r_same.weights, r_ref.weights)
        kept = r_c.slot < args.capacity  # where a slot was written: what it held before
        assert torch.equal(r_c.old_key[kept], r_same.old_key[kept])
        assert torch.equal(r_c.old_value[kept], r_same.old_value[kept])
        for other in (r_same, r_ref):
            assert torch.equal(r_c.slot, other.slot), f"step {i}: slots {r_c.slot.tolist()} vs {other.slot.tolist()}"
            assert torch.equal(r_c.evicts, other.evicts), f"step {i}: evicts differ"
        assert torch.equal(r_c.cand_positions, r_same.cand_positions.to(r_c.cand_positions.dtype))
        _within(f"step {i} candidate scores", r_c.cand_scores, r_same.cand_scores, r_ref.cand_scores)
        for other in (same, ref):
            assert torch.equal(state["positions"], other["positions"]), f"step {i}: positions differ"
        assert torch.equal(state["keys"], same["keys"]) and torch.equal(state["values"], same["values"])
        _within(f"step {i} out", r_c.out, r_same.out, r_ref.out)
        _within(f"step {i} scores", state["scores"], same["scores"], ref["scores"])
        history.append(_kept(state["positions"]))
        if fill is not None:
            fill = (fill + 1).clamp(max=cap)
            fill = None if bool((fill >= cap).all()) else fill
    if args.policy == "sink":  # the invariant: the sinks and the recent window
        for r, p in enumerate(lens):
            seen = p + steps
            assert history[-1][r][0] == sorted(set(range(args.sink)) | set(range(seen - args.recent, seen)))
        return
    group = hq // hs
    for r, p in enumerate(lens):
        for h in range(hs):
            n = p + steps
            logits = (q[r, h * group : (h + 1) * group, :n].double() @ k[r, h, :n].double().T * scaling).numpy()
            expected = simulate(logits, p, args.heavy, args.recent, "sum" if args.gqa == "none" else args.gqa)
            assert [history[s][r][h] for s in range(steps + 1)] == expected, f"request {r}, KV set {h}"


def _random_state(b, hs, cap, d, seed, dtype=torch.float32):
    g = torch.Generator().manual_seed(seed)
    return dict(
        keys=torch.randn(b, hs, cap, d, generator=g).to(dtype),
        values=torch.randn(b, hs, cap, d, generator=g).to(dtype),
        scores=torch.rand(b, hs, cap, generator=g) * 40,
        positions=torch.stack([torch.randperm(4 * cap, generator=g)[:cap] for _ in range(b * hs)])
        .view(b, hs, cap)
        .to(torch.int32),
    )


def _new(b, hq, hs, d, seed, dtype=torch.float32):
    g = torch.Generator().manual_seed(seed)
    return {n: torch.randn(b, h, d, generator=g).to(dtype) for n, h in (("query", hq), ("key", hs), ("value", hs))}


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_half_precision(dtype):
    b, hq, hs, cap, d = 1, 4, 2, 150, 64
    args = ops.PolicyArgs("h2o", 100, 50, 0, "sum")
    state = _random_state(b, hs, cap, d, 7, dtype)
    for i in range(2):
        new = _new(b, hq, hs, d, 10 + i, dtype)
        step = torch.tensor([4 * cap + i])
        same, ref = _clone(state), _clone(state, torch.float64)
        r_same = ops.decode_step(**new, **same, step=step, fill=None, scaling=d**-0.5, args=args)
        r_ref = ops.decode_step(
            **{n: x.double() for n, x in new.items()}, **ref, step=step, fill=None, scaling=d**-0.5, args=args
        )
        r_c = decode_step_cpu(**new, **state, step=step, fill=None, scaling=d**-0.5, args=args)
        assert r_c.out.dtype == dtype
        _within("out", r_c.out, r_same.out, r_ref.out)
        _within("scores", state["scores"], same["scores"], ref["scores"])
        assert torch.equal(r_c.slot, r_ref.slot) and torch.equal(state["positions"], ref["positions"])


def test_a_request_in_a_batch_equals_itself_alone_bit_for_bit():
    """Three requests with their own capacity, window and sink in storage wider than each, one of
    them still filling: every result of each row equals that row stepped alone on its own slots."""
    hq, hs, cap, d = 6, 2, 40, 32
    state = _random_state(3, hs, cap, d, 3)
    caps, recents, sinks = [40, 25, 33], [10, 0, 5], [0, 2, 1]
    for r, c in enumerate(caps):
        state["positions"][r, :, c:] = -1
    state["positions"][2, :, 30:] = -1  # row 2 holds 30 of its 33 slots
    fill = torch.tensor([40, 25, 30])
    table = {n: torch.tensor(x).view(3, 1, 1) for n, x in (("capacity", caps), ("recent", recents), ("sink", sinks))}
    rows = ops.RowBudgets(**table, self_victim=True)
    new = _new(3, hq, hs, d, 4)
    step = torch.tensor([200, 170, 190])
    args = ops.PolicyArgs("h2o", 20, 20, 0, "sum")
    batch = _clone(state)
    r_b = decode_step_cpu(**new, **batch, step=step, fill=fill, scaling=0.2, args=args, rows=rows, want_candidates=True)
    for r in range(3):
        c = caps[r]
        alone = {n: x[r : r + 1, :, :c].clone() for n, x in state.items()}
        a = ops.PolicyArgs("h2o", c - recents[r] - sinks[r], recents[r], sinks[r], "sum")
        f = None if fill[r] >= c else fill[r : r + 1]
        r_a = decode_step_cpu(
            **{n: x[r : r + 1] for n, x in new.items()},
            **alone,
            step=step[r : r + 1],
            fill=f,
            scaling=0.2,
            args=a,
            want_candidates=True,
        )
        assert torch.equal(r_b.out[r], r_a.out[0]), f"row {r}: outputs differ"
        slot_b = r_b.slot[r]
        assert torch.equal(torch.where(slot_b == cap, c, slot_b), r_a.slot[0]), f"row {r}: slots differ"
        assert torch.equal(r_b.evicts[r], r_a.evicts[0])
        for n in alone:
            assert torch.equal(batch[n][r, :, :c], alone[n][0]), f"row {r}: {n} differ"
        assert torch.equal(r_b.cand_scores[r, :, :c], r_a.cand_scores[0, :, :c])


@pytest.mark.parametrize("recent", [3, 0])
def test_slots_past_the_capacity_are_attended_and_never_chosen(recent):
    """An extension's slots (a recall window) past each row's capacity: they hold positions, the
    step attends to them and never evicts from or writes into them, as the torch step does."""
    b, hq, hs, cap, d, c = 2, 4, 2, 24, 16, 18
    state = _random_state(b, hs, cap, d, 9)
    state["scores"][:, :, c:] = -5.0  # the lowest scores of all: never chosen all the same
    rows = ops.RowBudgets(
        torch.full((b, 1, 1), c), torch.full((b, 1, 1), recent), torch.zeros(b, 1, 1, dtype=torch.int64), recent == 0
    )
    args = ops.PolicyArgs("h2o", c - recent, recent, 0, "sum")
    for i in range(3):
        new = _new(b, hq, hs, d, 20 + i)
        step = torch.tensor([100 + i, 100 + i])
        same, ref = _clone(state), _clone(state, torch.float64)
        common = dict(step=step, fill=None, scaling=0.25, args=args, rows=rows)
        r_same = ops.decode_step(**new, **same, **common)
        r_ref = ops.decode_step(**{n: x.double() for n, x in new.items()}, **ref, **common)
        r_c = decode_step_cpu(**new, **state, **common)
        assert torch.equal(r_c.slot, r_same.slot) and torch.equal(r_c.evicts, r_same.evicts)
        assert bool((r_c.slot < c).all() | (r_c.slot == cap).all())
        assert torch.equal(state["positions"], same["positions"])
        _within(f"step {i} out", r_c.out, r_same.out, r_ref.out)
        _within(f"step {i} scores", state["scores"], same["scores"], ref["scores"])


def test_reads_block_storage_in_place():
    """Keys and values as the torch backend allocates them (rows padded to whole blocks): the same
    results as from contiguous copies, and the slots written in place."""
    b, hq, hs, cap, d = 2, 6, 3, 180, 64
    state = _random_state(b, hs, cap, d, 5)
    blocked = _clone(state)
    for name in ("keys", "values"):
        view = ops.block_storage(state[name], b, hs, cap, d)
        view.copy_(state[name])
        blocked[name] = view
    assert blocked["keys"].stride(1) != cap * d  # the padded layout
    new = _new(b, hq, hs, d, 6)
    args = ops.PolicyArgs("h2o", 90, 90, 0, "sum")
    common = dict(step=torch.tensor([720, 720]), fill=None, scaling=0.125, args=args)
    r_plain = decode_step_cpu(**new, **state, **common)
    r_block = decode_step_cpu(**new, **blocked, **common)
    assert torch.equal(r_plain.out, r_block.out) and torch.equal(r_plain.slot, r_block.slot)
    for n in state:
        assert torch.equal(state[n], blocked[n])


@pytest.mark.parametrize("per_row", [False, True])
def test_pinned_positions_are_never_chosen(per_row):
    """Pins (DESIGN.md §2.11), for every row or per row padded with -2: never eligible, as in the
    torch step, whose victims they would otherwise be (the lowest scores)."""
    b, hq, hs, cap, d = 2, 4, 2, 30, 16
    state = _random_state(b, hs, cap, d, 11)
    low = state["positions"][:, :, :3]  # give three positions of every row the lowest scores
    state["scores"][:, :, :3] = -1.0
    pins = low[0, 0].to(torch.int64)
    if per_row:
        pins = torch.stack([low[r, 0].to(torch.int64) for r in range(b)])[:, None, :]
        pins = torch.cat([pins, torch.full((b, 1, 2), -2)], -1)  # the padding no slot holds
    args = ops.PolicyArgs("h2o", 20, 10, 0, "sum")
    for i in range(3):
        new = _new(b, hq, hs, d, 30 + i)
        common = dict(step=torch.tensor([200 + i] * b), fill=None, scaling=0.25, args=args, protected=pins)
        same = _clone(state)
        r_same = ops.decode_step(**new, **same, **common)
        r_c = decode_step_cpu(**new, **state, **common)
        assert torch.equal(r_c.slot, r_same.slot) and torch.equal(state["positions"], same["positions"])
    for r in range(b if per_row else 1):  # the pinned positions of KV set 0 are all still held there
        assert set(low[r, 0].tolist()) <= set(state["positions"][r, 0].tolist())


def test_ties_evict_the_older_position_then_the_lower_slot():
    """Zero queries give every candidate the same weight: tied scores stay bitwise equal, and the
    tied heavy slots leave oldest first, as the torch step and the reference rule say."""
    positions, scores = [5, 30, 2, 29, 0, 31, 3], [-1.0, 0.5, -1.0, 0.5, -1.0, 0.5, -1.0]
    g = torch.Generator().manual_seed(1)
    state = dict(
        keys=torch.randn(1, 1, 7, 16, generator=g),
        values=torch.randn(1, 1, 7, 16, generator=g),
        scores=torch.tensor(scores).view(1, 1, 7),
        positions=torch.tensor(positions, dtype=torch.int32).view(1, 1, 7),
    )
    args = ops.PolicyArgs("h2o", 4, 3, 0, "sum")
    victims = []
    for i in range(5):
        new = dict(query=torch.zeros(1, 2, 16), key=torch.randn(1, 1, 16, generator=g), value=torch.randn(1, 1, 16))
        twin = _clone(state)
        before = state["positions"].clone()
        step = torch.tensor([32 + i])
        r_t = ops.decode_step(**new, **twin, step=step, fill=None, scaling=1.0, args=args)
        r_c = decode_step_cpu(**new, **state, step=step, fill=None, scaling=1.0, args=args)
        assert torch.equal(r_c.slot, r_t.slot) and torch.equal(state["positions"], twin["positions"])
        victims.append(before[0, 0, r_c.slot.item()].item())
    assert victims == [0, 2, 3, 5, 33]


@pytest.mark.parametrize(
    "change, needle",
    [
        (lambda s: s.update(scores=s["scores"].double()), "scores has dtype float64"),
        (lambda s: s.update(values=s["values"][:, :, :5]), "values has shape"),
        (lambda s: s.update(query=s["query"][:, :3]), "query has shape"),
        (lambda s: s.update(values=s["values"].transpose(2, 3).contiguous().transpose(2, 3)), "contiguous last axis"),
    ],
)
def test_rejects_bad_inputs_in_one_line(change, needle):
    s = {**_random_state(1, 2, 10, 16, 1), **_new(1, 4, 2, 16, 2)}
    change(s)
    with pytest.raises(KernelInputError, match=needle):
        args = ops.PolicyArgs("h2o", 5, 5, 0, "sum")
        decode_step_cpu(**s, step=torch.tensor([40]), fill=None, scaling=0.25, args=args)


def test_backend_cpp_resolves_on_cpu_and_says_why_not_elsewhere(monkeypatch):
    assert resolve_backend("cpp", "cpu") == "cpp"
    with pytest.raises(ConfigError, match="fused CPU step"):
        resolve_backend("cpp", "meta")
    from h2o_lens.kernels import cpu

    monkeypatch.setattr(cpu, "cpu_step_problem", lambda: "no C++ compiler (c++ or $CXX) on the PATH")
    with pytest.raises(ConfigError, match="no C.. compiler.*backend='torch'"):
        resolve_backend("cpp", "cpu")


def test_a_build_killed_half_way_does_not_block_the_next_load(tmp_path):
    """torch leaves its lock file behind when a build is killed; a later process would wait on it
    for ever. Under the step's own lock (released when its holder dies) the stale file is removed."""
    import subprocess
    import sys

    from h2o_lens.kernels import cpu

    cpu._module()
    build = next(p for p in cpu._build_root().glob("h2o_lens_decode_cpu_*") if p.is_dir() and any(p.glob("*.so")))
    (build / "lock").touch()  # what a killed build leaves
    code = "from h2o_lens.kernels.cpu import cpu_step_problem; print(cpu_step_problem())"
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert done.stdout.strip() == "None", done.stderr[-2000:]


def test_a_full_disk_is_said_in_one_line(monkeypatch):
    """A build that fails for want of room says so (the assembler's own output does not)."""
    import collections
    import shutil

    from h2o_lens.kernels import cpu

    def fail():
        raise RuntimeError("Error building extension 'x': [1/2] c++ -c main.cpp\nas: BFD assertion fail")

    usage = collections.namedtuple("usage", "total used free")
    monkeypatch.setattr(cpu, "_module", fail)
    monkeypatch.setattr(shutil, "disk_usage", lambda _: usage(2**20, 2**20, 0))
    cpu.cpu_step_problem.cache_clear()
    try:
        problem = cpu.cpu_step_problem()
    finally:
        cpu.cpu_step_problem.cache_clear()
    assert "0.0 MiB free in" in problem and "\n" not in problem


def test_the_build_touches_only_its_own_folder_in_a_users_extensions_dir(tmp_path, monkeypatch):
    """``TORCH_EXTENSIONS_DIR`` may be a folder of the user's: the build writes only its own lock
    file and its own named folder there, and the stale lock it clears is the one inside that folder;
    a ``lock`` of the user's (at the top, or in another folder) and every other file stay."""
    from torch.utils import cpp_extension

    from h2o_lens.kernels import cpu

    root = tmp_path / "exts"
    (root / "other").mkdir(parents=True)
    foreign = {root / "lock": "mine", root / "notes.txt": "keep", root / "other" / "lock": "theirs"}
    for path, text in foreign.items():
        path.write_text(text)
    monkeypatch.setenv("TORCH_EXTENSIONS_DIR", str(root))
    seen = {}

    def fake_load_inline(name, build_directory, **kwargs):  # the compile itself is tested elsewhere
        seen["name"], seen["dir"] = name, build_directory
        return object()

    monkeypatch.setattr(cpp_extension, "load_inline", fake_load_inline)
    stale = None
    for _ in range(2):  # the second time, a killed build's lock is inside the step's folder
        cpu._module.__wrapped__()
        build = root / seen["name"]
        assert seen["dir"] == str(build) and build.is_dir()
        if stale is not None:
            assert not stale.exists()
        stale = build / "lock"
        stale.touch()
    assert {p: p.read_text() for p in foreign} == foreign
    made = {p.relative_to(root).as_posix() for p in root.rglob("*")} - {"lock", "notes.txt", "other", "other/lock"}
    assert made == {seen["name"], f"{seen['name']}.lock", f"{seen['name']}/lock"}
