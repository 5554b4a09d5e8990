"""``backend="cpp"`` on tiny models: the fused CPU step runs where it may (it gives a recorder its
candidate sets too), keeps what the FP64 reference keeps, and generates, records and plans what the
torch backend does; where an extension reads the step's weights, the torch step runs instead."""

from __future__ import annotations

import contextlib
import dataclasses
import os

import numpy as np
import pytest
import torch
from runtime_utils import KeptRecorder, assert_same_sets, capture_qk, left_pad, reference_sets
from test_commands_sweep_grid import tiny_dir  # noqa: F401  (a module fixture)
from tiny import local_attention, tiny_model

import h2o_lens
import recorders
from h2o_lens import H2OConfig, ops
from h2o_lens.kernels import cpu
from h2o_lens.plan import BudgetPlan
from runlog import load_run

if cpu.cpu_step_problem() is not None:  # CI installs a compiler and ninja (.ci/run): there it must build
    if os.environ.get("CI"):
        pytest.fail(f"the fused CPU step does not build in CI: {cpu.cpu_step_problem()}", pytrace=False)
    pytest.skip(f"the fused CPU step does not build here: {cpu.cpu_step_problem()}", allow_module_level=True)


def _ids(n: int, seed: int) -> torch.Tensor:
    return torch.randint(3, 250, (1, n), generator=torch.Generator().manual_seed(seed))


@pytest.fixture
def counted(monkeypatch):
    """Counts the fused CPU step's and the torch step's calls."""
    calls = {"cpp": 0, "torch": 0}
    built, torch_step = cpu._module(), ops.decode_step
    fused = built.decode_step

    class Module:
        cold_refill, cold_append = built.cold_refill, built.cold_append  # the cold tier's calls, uncounted

        @staticmethod
        def decode_step(*a):
            calls["cpp"] += 1
            return fused(*a)

    def counted_torch(*a, **k):
        calls["torch"] += 1
        return torch_step(*a, **k)

    monkeypatch.setattr(cpu, "_module", lambda: Module)
    monkeypatch.setattr(ops, "decode_step", counted_torch)
    return calls


def _generate(model, cfg, ids, mask, new, listener=None):
    with h2o_lens.h2o(model, cfg, listener=listener), capture_qk() as qk, torch.no_grad():
        out = model.generate(
            ids, attention_mask=mask, max_new_tokens=new, do_sample=False, pad_token_id=0, return_dict_in_generate=True
        )
    cache = out.past_key_values
    final = [[[sorted(p for p in r.tolist() if p >= 0) for r in req] for req in lay.positions] for lay in cache.layers]
    return out.sequences, final, cache.backend, qk


@pytest.mark.parametrize("gqa", ["sum", "max"])
def test_kept_sets_equal_the_fp64_reference_step_by_step(counted, gqa):
    """A left-padded batch of two prompts, heads biased to nearby positions so the heavy set keeps
    changing: every layer, request and KV set keeps what the FP64 reference keeps, at every step,
    and every decode step ran the fused CPU step (a listener's candidate sets included)."""
    model = local_attention(tiny_model("llama", layers=2, q_heads=4, kv_heads=2))
    lens = (14, 9)
    ids, mask = left_pad([_ids(n, seed=n)[0] for n in lens])
    rec = KeptRecorder()
    _, _, backend, qk = _generate(model, H2OConfig(heavy=4, recent=3, gqa=gqa, backend="cpp"), ids, mask, 12, rec)
    assert backend == "cpp"
    assert counted["cpp"] == 2 * 11 and counted["torch"] == 0  # two layers, eleven decode steps
    for layer in range(2):
        for r, n in enumerate(lens):
            expected = reference_sets(qk[layer], r, n, 4, 3, gqa, offset=max(lens) - n)
            assert_same_sets([step[r] for step in rec.kept[layer]], expected, f"layer {layer}, request {r}")


@pytest.mark.parametrize(
    "cfg",
    [
        H2OConfig(heavy=5, recent=4),
        H2OConfig(policy="local", heavy=0, recent=6, sink=2),
        H2OConfig(plan=BudgetPlan(slots=[(3, 11), 6])),  # a ragged layer: capacities per KV set
    ],
    ids=["h2o", "local", "plan"],
)
def test_generates_and_keeps_what_the_torch_backend_does(cfg):
    model = local_attention(tiny_model("llama", layers=2, q_heads=4, kv_heads=2, seed=3))
    ids, mask = left_pad([_ids(17, seed=1)[0], _ids(11, seed=2)[0]])
    seq_t, sets_t, back_t, _ = _generate(model, dataclasses.replace(cfg, backend="torch"), ids, mask, 14)
    seq_c, sets_c, back_c, _ = _generate(model, dataclasses.replace(cfg, backend="cpp"), ids, mask, 14)
    assert (back_t, back_c) == ("torch", "cpp")
    assert torch.equal(seq_t, seq_c) and sets_t == sets_c


def test_a_recorded_run_on_the_cpp_backend_logs_what_the_torch_backend_logs(tmp_path, counted):
    """The recorder's candidate sets come from the fused CPU step: the same tokens and the same
    evictions (step, layer, KV set, position) as a run recorded on the torch backend."""
    model = local_attention(tiny_model("llama", layers=2, q_heads=4, kv_heads=2, seed=5))
    ids, mask = left_pad([_ids(15, seed=3)[0], _ids(10, seed=4)[0]])
    logs = {}
    for backend in ("torch", "cpp"):
        before = dict(counted)
        with recorders.record(model, H2OConfig(heavy=4, recent=3, backend=backend), out=tmp_path, fsync=False) as run:
            with torch.no_grad():
                seq = model.generate(ids, attention_mask=mask, max_new_tokens=10, do_sample=False, pad_token_id=0)
        ev = load_run(run.run_dir, tables=("evictions",))["evictions"].to_pandas()
        cols = ["request", "step", "layer", "kv_head", "position"]
        logs[backend] = (seq, ev.sort_values(cols)[cols].values, {k: counted[k] - before[k] for k in counted})
    (seq_t, ev_t, calls_t), (seq_c, ev_c, calls_c) = logs["torch"], logs["cpp"]
    assert torch.equal(seq_t, seq_c) and len(ev_c) > 0 and np.array_equal(ev_t, ev_c)
    assert calls_c["cpp"] > 0 and calls_c["torch"] == 0 and calls_t["cpp"] == 0


def test_the_guard_pins_and_the_cold_tier_run_on_the_fused_step(counted):
    """What the extensions ask of a step (the guard's softmax weights and overwritten keys, the
    pins' protection, the cold tier's candidates and overwritten K/V) the fused step gives: every
    decode step is a fused call, and each run generates and keeps what it does on the torch backend
    (DESIGN.md §2.8)."""
    from h2o_lens.cold_config import ColdTier
    from h2o_lens.guard import GuardConfig, guarded

    model = local_attention(tiny_model("llama", layers=2, q_heads=4, kv_heads=2, seed=7))
    ids = _ids(16, seed=6)
    runs = {
        "guard": (H2OConfig(heavy=4, recent=3), GuardConfig(stride=1, reservoir=0.5)),
        "pins": (H2OConfig(heavy=4, recent=3, pinned=(1, 5)), None),
        "cold": (H2OConfig(heavy=5, recent=4, cold=ColdTier(store="cpu", recall=2)), None),
    }
    for name, (cfg, guard) in runs.items():
        got = {}
        for backend in ("torch", "cpp"):
            before = dict(counted)
            with h2o_lens.h2o(model, dataclasses.replace(cfg, backend=backend)) as session, torch.no_grad():
                with guarded(guard) if guard is not None else contextlib.nullcontext():
                    out = model.generate(ids, max_new_tokens=8, min_new_tokens=8, do_sample=False, pad_token_id=0)
                cache = session.last_cache
            sets = [sorted(p for p in layer.positions[0].flatten().tolist() if p >= 0) for layer in cache.layers]
            got[backend] = (out, sets, {k: counted[k] - before[k] for k in counted})
        (out_t, sets_t, calls_t), (out_c, sets_c, calls_c) = got["torch"], got["cpp"]
        assert torch.equal(out_t, out_c) and sets_t == sets_c, name
        assert calls_c == {"cpp": 2 * 7, "torch": 0} and calls_t["cpp"] == 0, (name, calls_c)


def test_graphs_run_the_cpp_backend_eagerly_and_say_why():
    """The CPU's traced graphs record torch operators: a cache on the cpp backend runs eagerly, with
    the reason kept, and generates what it generates without graphs."""
    model = tiny_model("llama", layers=2, q_heads=4, kv_heads=2)
    ids = _ids(14, seed=7)
    cfg = H2OConfig(heavy=4, recent=4, backend="cpp")
    out = {}
    for graphs in (False, True):
        with h2o_lens.h2o(model, cfg, graphs=graphs) as session, torch.no_grad():
            out[graphs] = model.generate(ids, max_new_tokens=8, min_new_tokens=8, do_sample=False, pad_token_id=0)
            replayed = session.graphs.replayed if graphs else 0
            reasons = dict(session.graphs.fallbacks) if graphs else {}
    assert torch.equal(out[False], out[True]) and replayed == 0
    assert any("cpp" not in r and "compiled call" in r for r in reasons), reasons


def test_record_takes_backend_cpp_and_the_manifest_names_it(tmp_path, tiny_dir, capsys):  # noqa: F811
    """``h2o-lens record --backend cpp`` on a tiny model folder: the run is recorded on the fused
    CPU step and its manifest says so; an unknown backend is refused by the parser; ``generate
    --backend cpp`` says which step decoded."""
    from commands.cli import main
    from runlog import open_runs, read_manifest

    runs = tmp_path / "runs"
    argv = ["record", "--model", str(tiny_dir), "--prompt", "one two three four " * 6, "--raw"]
    budget = ["--heavy", "4", "--recent", "4", "--max-new-tokens", "6"]
    assert main([*argv, *budget, "--backend", "cpp", "--out", str(runs)]) == 0
    (run_id,) = open_runs(runs).execute("SELECT run_id FROM runs").fetchall()[0]
    manifest = read_manifest(runs / run_id)
    assert manifest["backend"] == "cpp" and manifest["config"]["backend"] == "cpp"
    assert len(load_run(runs / run_id, tables=("evictions",))["evictions"]) > 0
    assert main([*argv, "--backend", "metal", "--out", str(runs)]) == 2
    gen = ["generate", "--model", str(tiny_dir), "--prompt", "one two three four " * 6, "--raw", *budget]
    capsys.readouterr()
    assert main([*gen, "--backend", "cpp"]) == 0
    assert "decode step: cpp" in capsys.readouterr().err


@pytest.mark.parametrize("mode", ["rollback", "defer"])
def test_speculative_decoding_on_the_fused_step_equals_plain_decoding(counted, mode):
    """Prompt lookup on a repeating prompt under ``backend="cpp"``: its segments run the fused step
    step by step (a rollback restores what the step returned it overwrote), so the tokens and slots
    equal plain greedy decoding's on the same backend, and the scores up to FP32 rounding (the
    segment's queries come from a forward of several tokens, whose projections round differently in
    FP32, on the torch backend too; DESIGN.md §14)."""
    model = tiny_model("llama", layers=2, q_heads=4, kv_heads=2, seed=2)
    ids = torch.cat([_ids(6, seed=8)] * 4, 1)
    cfg = H2OConfig(heavy=6, recent=6, backend="cpp")
    state = {}
    for name, extra in (("plain", {}), ("speculative", {"prompt_lookup_num_tokens": 4})):
        options = {"speculative": mode} if extra else {}
        with h2o_lens.h2o(model, cfg, **options) as session, torch.no_grad():
            out = model.generate(ids, max_new_tokens=16, do_sample=False, pad_token_id=0, **extra)
            state[name] = (out, [(la.positions.clone(), la.scores.clone()) for la in session.last_cache.layers])
    (plain, layers_p), (spec, layers_s) = state["plain"], state["speculative"]
    assert torch.equal(plain, spec)
    for (pos_p, sc_p), (pos_s, sc_s) in zip(layers_p, layers_s):
        assert torch.equal(pos_p, pos_s)
        torch.testing.assert_close(sc_p, sc_s, rtol=1e-5, atol=1e-6)
    assert counted["torch"] == 0 and counted["cpp"] > 2 * 16


def test_an_fp64_model_takes_the_torch_step_on_the_cpp_backend(counted):
    """The fused step computes in FP32: an FP64 cache on ``backend="cpp"`` takes the torch step
    (FP64 throughout) and generates what the torch backend does."""
    model = tiny_model("llama", layers=2, q_heads=4, kv_heads=2).double()
    ids = _ids(12, seed=9)
    outs = []
    for backend in ("torch", "cpp"):
        with h2o_lens.h2o(model, H2OConfig(heavy=4, recent=3, backend=backend)), torch.no_grad():
            outs.append(model.generate(ids, max_new_tokens=6, do_sample=False, pad_token_id=0))
    assert torch.equal(outs[0], outs[1]) and counted["cpp"] == 0 and counted["torch"] == 2 * 5 * 2
