"""The oracle at any budget from one teacher pass (DESIGN.md §2.12), on tiny models.

The recorded oracle run is a normal run: it replays with the implementation check passing,
its evictions are the schedule of the teacher table and the FP64 reference on the teacher's
own queries and keys; :meth:`OracleTeacher.check` (no run written) gives the recorded run's
top-1; the teacher's full-cache forward runs once however many budgets are tried. The
oracle's own answer (:meth:`OracleTeacher.generate`) follows the teacher until its top-1
departs, then re-plans or ranks as H2O does; the runtime, generating freely under the table
the answer ranked by, writes the same tokens and evicts what that table's schedule says.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch
from tiny import tiny_model

import recorders
import runlog
from h2o_lens import H2OConfig
from h2o_lens.hindsight import schedule, teacher_scores
from h2o_lens.hooks import attention_implementation
from h2o_lens.policies import oracle
from recorders.oracle_runs import OracleTeacher
from recorders.replay import replay
from runlog import load_run, read_manifest
from runlog.eviction_steps import evict_steps

PROMPT, NEW = 24, 12


def _full_run(model, root, seed=0):
    ids = torch.randint(3, 256, (1, PROMPT), generator=torch.Generator().manual_seed(seed))
    with recorders.record(model, H2OConfig(policy="full"), out=root, fsync=False) as run, torch.no_grad():
        model.generate(input_ids=ids, max_new_tokens=NEW, do_sample=False, pad_token_id=0)
    return root / run.run_id


@pytest.fixture(scope="module")
def setup(tmp_path_factory):
    root = tmp_path_factory.mktemp("oracle")
    model = tiny_model("llama", layers=2, q_heads=4, kv_heads=2)
    return model, root, _full_run(model, root)


def _leave_steps(run_dir, layers, sets, n, gqa_none):
    ev = load_run(run_dir, tables=("evictions",))["evictions"]
    cols = ("layer", "kv_head", "position", "step") + (("q_head",) if gqa_none else ())
    return evict_steps({c: np.asarray(ev[c].to_pylist(), dtype=np.int64) for c in cols}, layers, sets, n, gqa_none)


def _teacher_qk(model, ids):
    """Post-RoPE queries and keys of a plain full-attention forward, per layer (FP64)."""
    seen = {}

    def spy(module, query, key, value, attention_mask, scaling=None, **kw):
        seen[module.layer_idx] = (query[0].double(), key[0].double(), scaling)
        out = torch.nn.functional.scaled_dot_product_attention(
            query, key, value, is_causal=True, scale=scaling, enable_gqa=query.shape[1] != key.shape[1]
        )
        return out.transpose(1, 2), None

    with attention_implementation(model, "oracle_test_spy", spy, lambda *a, **k: None), torch.no_grad():
        model(input_ids=ids)
    return seen


@pytest.mark.slow
@pytest.mark.parametrize("gqa", ["sum", "max", "none"])
def test_recorded_oracle_equals_the_schedule_and_the_reference(tmp_path, gqa):
    """FP64 model: the runtime's evictions = the table's schedule = the FP64 reference on the
    teacher's own queries and keys, in every layer and KV set."""
    model = tiny_model("llama", layers=2, q_heads=4, kv_heads=2).double()
    full = _full_run(model, tmp_path, seed=1)
    teacher = OracleTeacher(model, full, gqa=gqa)
    p, n = teacher.prompt_len, teacher.positions
    assert (p, n) == (PROMPT, PROMPT + NEW - 1)
    slots = 9
    rec = teacher.record(slots, out=tmp_path, fsync=False)
    sets = 4 if gqa == "none" else 2
    got = _leave_steps(rec.run_dir, 2, sets, n, gqa == "none")
    np.testing.assert_array_equal(got, torch.stack(schedule(teacher.table, slots)).numpy())
    ids = torch.as_tensor(np.concatenate([teacher.prompt, teacher.answer])[:n])[None]
    for layer, (q, k, scaling) in _teacher_qk(model, ids).items():
        for s in range(sets):
            heads = [s] if gqa == "none" else [2 * s, 2 * s + 1]
            kv = s // 2 if gqa == "none" else s
            logits = (q[heads] @ k[kv].T * scaling).numpy()  # (G, N, N)
            kept = oracle.simulate(logits, p, slots, 0, "sum" if gqa == "none" else gqa)
            runtime = [[i for i in range(t + 1) if got[layer, s, i] > t] for t in range(p - 1, n)]
            assert runtime == kept, (gqa, layer, s)
    assert (got < n).any()  # something was evicted


def test_oracle_run_is_a_normal_replayable_run(setup, tmp_path):
    model, _, full = setup
    teacher = OracleTeacher(model, full)
    rec = teacher.record(
        6,
        out=tmp_path,
        fsync=False,
        name="oracle at 6",
        info={"parent_run": "x"},
        annotate=lambda request, answer: {"correct": request == 0},
    )
    manifest = read_manifest(rec.run_dir)
    assert manifest["policy"] == "oracle" and manifest["heavy"] == 6 and manifest["recent"] == 0
    assert manifest["source_run"] == full.name and manifest["teacher_forced"] is True
    assert manifest["oracle"] == {"request": 0, "slots": 6} and manifest["parent_run"] == "x"
    summary = replay(rec.run_dir, model=model, progress=False)
    assert summary.implementation_ok, summary
    assert load_run(rec.run_dir, tables=("requests",))["requests"].to_pydict()["correct"] == [True]
    tokens = load_run(rec.run_dir, tables=("tokens",))["tokens"].to_pydict()
    assert tokens["token_id"] == np.concatenate([teacher.prompt, teacher.answer]).tolist()


@pytest.mark.slow
def test_check_agrees_with_the_recorded_run(setup, tmp_path):
    """check() (one masked forward, no run) gives the recorded run's top-1 and logits."""
    model, _, full = setup
    teacher = OracleTeacher(model, full)
    assert teacher.teacher.passed  # the full cache reproduces its own greedy answer
    outcomes = set()
    for slots in (1, 3, 6, 12, 40):
        check = teacher.check(slots)
        rec = teacher.record(slots, out=tmp_path, fsync=False)
        lg = load_run(rec.run_dir, tables=("run_logits",))["run_logits"].to_pydict()
        np.testing.assert_array_equal(np.asarray(lg["step"]), check.steps)
        np.testing.assert_array_equal(np.asarray(lg["top1_id"]), check.top1)
        mine = check.logits.gather(-1, torch.as_tensor(check.answer)[:, None])[:, 0].numpy()
        np.testing.assert_allclose(mine, np.asarray(lg["token_logit"]), atol=2e-3)
        ran = bool((np.asarray(lg["top1_id"]) == np.asarray(lg["token_id"])).all())
        assert check.passed == ran
        wrong = np.flatnonzero(~check.agree)
        assert check.first_wrong == (int(check.steps[wrong[0]]) if len(wrong) else None)
        outcomes.add(check.passed)
        if slots >= teacher.positions:  # B >= N keeps everything
            assert load_run(rec.run_dir, tables=("evictions",))["evictions"].num_rows == 0 and check.passed
    assert outcomes == {True, False}  # the budgets tried both pass and fail


def test_the_teacher_forward_runs_once_for_several_budgets(setup):
    model, _, full = setup
    lengths = []
    hook = model.register_forward_pre_hook(
        lambda module, args, kwargs: lengths.append(kwargs["input_ids"].shape[1]), with_kwargs=True
    )
    try:
        teacher = OracleTeacher(model, full)
        table = teacher.table
        assert lengths == [PROMPT, NEW - 1] and teacher.forwards == 2  # the teacher: prompt, then its rows
        for slots in (2, 4, 8, 16, 5, 3, 7, 6):  # a bisection's worth of budgets
            teacher.check(slots)
    finally:
        hook.remove()
    assert lengths == [PROMPT] + [NEW - 1] * 9  # the prompt was forwarded once; one forward per budget
    assert teacher.table is table and teacher.forwards == 10
    assert teacher.check(4) is teacher.check(4) and teacher.forwards == 10  # asked again: from memory


def test_bad_input_is_refused(setup):
    model, _, full = setup
    with pytest.raises(runlog.RecorderError, match="no request 3 in the run's tokens; it has \\[0\\]"):
        OracleTeacher(model, full, request=3)
    with pytest.raises(runlog.RecorderError, match="unknown gqa 'mean'"):
        OracleTeacher(model, full, gqa="mean")
    with pytest.raises(runlog.RecorderError, match="unknown departure rule 'stop'; expected one of replan, h2o"):
        OracleTeacher(model, full, departure="stop")
    teacher = OracleTeacher(model, full)
    for bad in (0, 2.5, True):
        with pytest.raises(runlog.RecorderError, match="slots must be a whole number >= 1"):
            teacher.check(bad)


def test_one_generated_token_has_no_decode_step(tmp_path):
    model = tiny_model("llama")
    ids = torch.randint(3, 256, (1, 10), generator=torch.Generator().manual_seed(4))
    with recorders.record(model, H2OConfig(policy="full"), out=tmp_path, fsync=False) as run, torch.no_grad():
        model.generate(input_ids=ids, max_new_tokens=1, do_sample=False, pad_token_id=0)
    teacher = OracleTeacher(model, tmp_path / run.run_id)
    assert teacher.positions == teacher.prompt_len == 10
    assert teacher.check(3).passed and teacher.teacher.passed  # the prefill's last row sees the whole prompt
    assert teacher.generate(3).tokens.tolist() == teacher.answer.tolist()
    rec = teacher.record(3, out=tmp_path, fsync=False)
    assert rec.status == "complete"


# ----------------------------------------------------------------------------- its own answer


def _free_generation(model, teacher, got, gqa, root):
    """The runtime's oracle generating freely (not fed any token) under the table the answer ranked by."""
    ids = torch.as_tensor(teacher.prompt)[None]
    config = H2OConfig(policy="oracle", heavy=got.slots, recent=0, gqa=gqa)
    with teacher_scores(got.table), recorders.record(model, config, out=root, fsync=False) as rec, torch.no_grad():
        out = model.generate(input_ids=ids, max_new_tokens=len(got.tokens), do_sample=False, pad_token_id=0)
    return out[0, ids.shape[1] :].tolist(), rec.run_dir


@pytest.mark.slow
@pytest.mark.parametrize("departure", ["replan", "h2o"])
@pytest.mark.parametrize("gqa", ["sum", "none"])
def test_own_answer_is_what_the_runtime_generates_under_its_table(tmp_path, departure, gqa):
    """FP64: past every departure (re-planned, or ranked as H2O does), the runtime's free
    generation under the answer's table writes the answer's tokens, and evicts at each step
    what the table's schedule says; the recorded answer run is that generation."""
    model = tiny_model("llama", layers=2, q_heads=4, kv_heads=2).double()
    full = _full_run(model, tmp_path, seed=0)
    teacher = OracleTeacher(model, full, gqa=gqa, departure=departure, max_new_tokens=NEW)
    kinds = set()
    for slots in (2, 6, 9, 14, 40):
        got = teacher.generate(slots)
        assert teacher.generate(slots) is got  # asked again: from memory
        check = teacher.check(slots)
        assert (got.agree, got.steps) == (int(check.agree.sum()), NEW)
        tokens, run_dir = _free_generation(model, teacher, got, gqa, tmp_path)
        assert tokens == got.tokens.tolist(), (departure, gqa, slots)
        n = teacher.prompt_len + len(got.tokens) - 1
        sets = 4 if gqa == "none" else 2
        np.testing.assert_array_equal(
            _leave_steps(run_dir, 2, sets, n, gqa == "none"), torch.stack(schedule(got.table, slots)).numpy()
        )
        first = check.first_wrong
        if first is None:  # it never departs: its answer is the teacher's
            assert got.follows_teacher and got.tokens.tolist() == teacher.answer.tolist()
            kinds.add("teacher")
            continue
        k = first - (teacher.prompt_len - 1)
        assert got.departures[0] == first and got.tokens[:k].tolist() == teacher.answer[:k].tolist()
        assert got.tokens[k] == check.top1[k] != teacher.answer[k]  # its own token at the departure
        if departure == "h2o":
            assert got.replans == 0 and got.switched == first + 1 and len(got.departures) == 1
        kinds.add("replanned" if got.replans else "h2o")
        rec = teacher.record(slots, answer=got, out=tmp_path, fsync=False)
        recorded = load_run(rec.run_dir, tables=("tokens",))["tokens"].to_pydict()
        assert recorded["token_id"][teacher.prompt_len :] == got.tokens.tolist()
        oracle = read_manifest(rec.run_dir)["oracle"]
        assert oracle["answer"] == "own" and oracle["teacher_agreement"] == [got.agree, got.steps]
        assert "teacher_forced" not in read_manifest(rec.run_dir)
    assert kinds >= {"teacher", "replanned" if departure == "replan" else "h2o"}


def test_replanning_stops_at_its_allowance_and_ranks_as_h2o(setup):
    """Without re-planning tokens left, a departure stops the hindsight: the answer is the H2O rule's."""
    model, _, full = setup
    h2o = OracleTeacher(model, full, departure="h2o")
    none_left = OracleTeacher(model, full, departure="replan", replan_tokens=0)
    replan = OracleTeacher(model, full, departure="replan")
    departed = [s for s in (1, 2, 3, 4, 6) if not h2o.check(s).passed]
    assert departed
    for s in departed:
        assert none_left.generate(s).tokens.tolist() == h2o.generate(s).tokens.tolist()
        assert none_left.generate(s).switched == h2o.generate(s).switched is not None
        assert replan.generate(s).replans >= 1 and replan.forwards > h2o.forwards - 1


def test_a_prompt_pass_spares_the_teacher_its_prompt_forward(setup, tmp_path):
    """The teacher starts from a recording's prompt pass of the same prompt: no prompt forward,
    the same choices and answers."""
    model, _, full = setup
    plain = OracleTeacher(model, full)
    ids = torch.as_tensor(plain.prompt)[None]
    with (
        recorders.record(model, H2OConfig(heavy=3, recent=3), out=tmp_path, fsync=False, keep_prompt_pass=True) as rec,
        torch.no_grad(),
    ):
        model.generate(input_ids=ids, max_new_tokens=2, do_sample=False, pad_token_id=0)
    lengths = []
    hook = model.register_forward_pre_hook(
        lambda module, args, kwargs: lengths.append(kwargs["input_ids"].shape[1]), with_kwargs=True
    )
    try:
        shared = OracleTeacher(model, full, prompt_pass=rec.prompt_passes[0])
    finally:
        hook.remove()
    assert lengths == [NEW - 1] and shared.forwards == 1  # the teacher's rows only
    for a, b in zip(plain.table.remaining, shared.table.remaining):
        torch.testing.assert_close(a, b, atol=1e-5, rtol=1e-4)
    for s in (2, 5, 9):
        assert shared.generate(s).tokens.tolist() == plain.generate(s).tokens.tolist()
