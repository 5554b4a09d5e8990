"""Counterfactual re-runs and their verdicts (DESIGN.md §6.10).

* bisection: the smallest passing budget on a monotone toy test, and a non-monotone test
  stated as such instead of a wrong number;
* synthetic policy cases whose cause is known by construction get the designed verdict from
  their counterfactuals, written as linked runs on the FP64 path (the case's own logits are
  the teacher; the model-free analogue of re-running a model);
* on a tiny model: a counterfactual that crashes leaves the parent run untouched, and the
  verdict names the variant that could not run.
"""

from __future__ import annotations

import hashlib
import shutil

import pytest
import torch
from starvation import budget_starvation
from tiny import tiny_model

import recorders
import runlog
from analyses import budget_distribution, causal_verdicts, connect, counterfactual_runs
from h2o_lens import H2OConfig
from h2o_lens.tasks import policy_case
from recorders.counterfactual import bisect_budget, explain_request, split_slots
from recorders.counterfactual_cases import explain_case

# ----------------------------------------------------------------------------- bisection


def test_bisection_finds_the_smallest_passing_budget_on_a_monotone_test():
    calls = []

    def passes(s):
        calls.append(s)
        return s >= 37

    got = bisect_budget(passes, 1, 100)
    assert got.min_slots == 37 and got.monotone and got.violations == ()
    assert len(calls) == len(set(calls)) <= 12  # each count at most once, about log2(100) + checks
    assert got.probes[36] is False and got.probes[37] is True  # the neighbour is tested
    # known results are not re-tested; lo itself may be the answer
    assert bisect_budget(lambda s: s >= 10, 10, 50, known={10: True}).min_slots == 10
    assert bisect_budget(lambda s: False, 1, 20).min_slots is None  # nothing passes


def test_bisection_with_a_resolution_stops_within_it():
    got = bisect_budget(lambda s: s >= 37, 1, 200, resolution=8, checks=0)
    assert 37 <= got.min_slots <= 37 + 7 and got.monotone
    assert len(got.probes) < len(bisect_budget(lambda s: s >= 37, 1, 200, checks=0).probes)


def test_bisection_states_a_non_monotone_pass_test_instead_of_a_number():
    # passes in [20, 30) and from 60 on: the search alone would answer 60
    test = lambda s: 20 <= s < 30 or s >= 60  # noqa: E731
    blind = bisect_budget(test, 1, 100, checks=0)
    assert blind.min_slots == 60  # what an unchecked bisection would report
    got = bisect_budget(test, 1, 100)
    assert got.min_slots is None and not got.monotone
    passing, failing = got.violations[0]
    assert test(passing) and not test(failing) and passing < failing
    assert got.smallest_pass is not None and test(got.smallest_pass)
    assert got.to_dict()["monotone"] is False


def test_a_non_monotone_search_at_explains_resolution_is_told_by_the_counts_it_tried():
    """restated_fact_0 at 8k (P = 8,190, the run at 1,638 slots, explain's 5 % resolution): 2,451
    slots passed, 3,270 failed, 3,884 passed. The search's probes say so in words."""
    from analyses.causal import describe_search

    test = lambda s: 2400 <= s < 3000 or s >= 3800  # noqa: E731
    got = bisect_budget(test, 1638, 8222, known={1638: False, 8222: True}, checks=1, resolution=410)
    assert not got.monotone and got.min_slots is None
    tried = got.to_dict()["probes"]
    assert [p for _, p in tried] == [test(s) for s, _ in tried]
    text = describe_search(tried)
    assert text.startswith("not monotone in the budget: the search tried (slots) 1638 fail, 2461 pass, 3284 fail")
    stable = min(s for s, _ in tried if all(p for t, p in tried if t >= s))
    assert text.endswith(f"every count tried from {stable} slots on passes") and 3800 <= stable < 3800 + 410


def test_split_slots_keeps_the_heavy_recent_ratio():
    assert split_slots(19, 19, 50) == (25, 25)
    assert split_slots(10, 30, 20) == (5, 15)
    assert split_slots(0, 8, 5) == (0, 5) and split_slots(8, 0, 5) == (5, 0)


# ----------------------------------------------------------------------------- policy cases


@pytest.fixture(scope="module")
def cases_root(tmp_path_factory):
    root = tmp_path_factory.mktemp("cases")
    made = {}
    for case in (*(policy_case(n) for n in ("delayed_reference", "hotspot_switch", "uniform")), budget_starvation()):
        made[case.name] = explain_case(root, case)
    return root, made


def _verdict(root, ex):
    (v,) = causal_verdicts(connect(root), ex.parent_run)
    return v


@pytest.mark.slow
def test_delayed_reference_is_scoring_and_pinning_brings_the_answer_back(cases_root):
    root, made = cases_root
    v = _verdict(root, made["delayed_reference"])
    assert (v.verdict, v.sub_label) == ("scoring", "delayed_reference")
    assert v.passes["full"] and v.passes["pinned"] and v.passes["oracle"]
    assert v.min_slots["oracle"] <= v.slots < v.min_slots["policy"]
    assert set(v.decided_by) >= {v.runs["full"], v.runs["pinned"]}


@pytest.mark.slow
def test_hotspot_switch_is_scoring_with_stale_heavy_hitters(cases_root):
    root, made = cases_root
    v = _verdict(root, made["hotspot_switch"])
    assert (v.verdict, v.sub_label) == ("scoring", "stale_heavy")
    # the new hotspot is a generated position, so no pin can hold it: the oracle decides
    assert v.passes["pinned"] is False and v.passes["oracle"] is True
    assert v.runs["oracle"] in v.decided_by


def test_uniform_attention_is_scoring_and_the_estimate_no_longer_says_budget(cases_root):
    root, made = cases_root
    v = _verdict(root, made["uniform"])
    assert v.verdict == "scoring" and v.sub_label == "stale_heavy"  # age bias: old positions hold the slots
    # the old threshold rules said budget (evidence evicted, high dropped mass); the evicted evidence
    # fits the heavy slots and the teacher departs, which is what the estimate's scoring asks
    assert v.estimate == "scoring" and v.agrees is True


def test_budget_starvation_is_budget_and_the_pins_could_not_run(cases_root):
    root, made = cases_root
    v = _verdict(root, made["budget_starvation"])
    assert v.verdict == "budget"
    assert v.passes["full"] and v.passes["oracle"] is False
    assert "pinned" in v.could_not_run and "pinned" not in v.passes
    assert v.slots < v.min_slots["oracle"] <= v.min_slots["policy"]
    status = {r["variant"]: r["status"] for r in v.table}
    assert status["pinned"] == "failed" and "40 of the 8 slots" in v.could_not_run["pinned"]


def test_counterfactuals_view_links_every_rerun_to_its_parent(cases_root):
    root, made = cases_root
    ex = made["delayed_reference"]
    rows = counterfactual_runs(connect(root), ex.parent_run).df()
    assert set(rows["kind"]) == {"full", "pinned", "oracle", "policy_budget", "oracle_budget"}
    assert (rows["parent_run"] == ex.parent_run).all() and (rows["request"] == 0).all()
    assert rows.set_index("kind").loc["pinned", "slots"] == ex.slots
    con = connect(root)
    kinds = con.execute(
        "SELECT counterfactual_kind FROM runs WHERE parent_run = ? ORDER BY 1", [ex.parent_run]
    ).fetchall()
    assert len(kinds) == 5
    assert (
        con.execute("SELECT count(*) FROM runs WHERE run_id = ? AND parent_run IS NULL", [ex.parent_run]).fetchall()[0][
            0
        ]
        == 1
    )


# ----------------------------------------------------------------------------- tiny model


class CharTokenizer:
    """One letter per token id: enough text for answers and evidence spans."""

    pad_token_id = 0

    def decode(self, ids, skip_special_tokens=False):
        return "".join(chr(65 + int(i) % 26) for i in ids)


def _tree_digest(path):
    h = hashlib.sha256()
    for f in sorted(p for p in path.rglob("*") if p.is_file()):
        h.update(f.name.encode())
        h.update(f.read_bytes())
    return h.hexdigest()


@pytest.mark.slow
def test_a_crashing_counterfactual_leaves_the_parent_untouched_and_is_named(tmp_path, monkeypatch):
    model = tiny_model("llama", layers=2, q_heads=4, kv_heads=2)
    tok = CharTokenizer()
    ids = torch.randint(3, 256, (1, 24), generator=torch.Generator().manual_seed(1))
    text = tok.decode(ids[0].tolist())
    with (
        recorders.record(
            model, H2OConfig(heavy=2, recent=2), out=tmp_path, tokenizer=tok, evidence={"fact": text[3:6]}, fsync=False
        ) as run,
        torch.no_grad(),
    ):
        model.generate(input_ids=ids, max_new_tokens=8, do_sample=False, pad_token_id=0)
    parent = tmp_path / run.run_id
    before = _tree_digest(parent)

    from recorders.oracle_runs import OracleTeacher

    def boom(self, *args, **kwargs):
        raise RuntimeError("the oracle blew up")

    monkeypatch.setattr(OracleTeacher, "record", boom)
    monkeypatch.setattr(OracleTeacher, "generate", boom)
    ex = explain_request(model, tok, parent, 0, replay=False, resolution=0)
    assert _tree_digest(parent) == before  # the parent is only read
    assert ex.outcomes["full"].ran and ex.outcomes["pinned"].ran
    assert not ex.outcomes["oracle"].ran and "the oracle blew up" in ex.outcomes["oracle"].error
    assert not ex.outcomes["oracle_budget"].ran
    assert ex.outcomes["policy_budget"].ran  # the other variants still run
    # one folder per variant that ran or crashed; the bisection's other probes are removed
    folders = sorted(d.name for d in tmp_path.iterdir() if d.is_dir())
    assert folders == sorted([run.run_id, *(o.run_id for k, o in ex.outcomes.items() if k != "oracle_budget")])
    assert ex.outcomes["policy_budget"].bisection.probes  # they were run
    # recorded re-runs carry their budget as a share of the prompt: the policy's curve reaches 1
    dist = budget_distribution(connect(tmp_path))
    assert dist[dist["curve"] == "h2o"]["share"].max() == 1.0
    (v,) = causal_verdicts(connect(tmp_path), run.run_id)
    assert "oracle" in v.could_not_run and "the oracle blew up" in v.could_not_run["oracle"]
    assert "oracle" not in v.passes
    status = {r["variant"]: r["status"] for r in v.table}
    assert status["oracle"] == "failed"
    # decided from what ran, or undecided naming the variant that could not run
    assert v.verdict in ("scoring", "not_the_cache", "undecided")
    if v.verdict == "undecided":
        assert "oracle" in v.reason


def _tiny_runs(root, max_new=8, full=True):
    """A named tiny model, a full-cache run of a prompt (``full``) and an H2O parent run of it."""
    model = tiny_model("llama", layers=2, q_heads=4, kv_heads=2)
    model.config._name_or_path = "tiny/llama-explain"  # a name: a full run of it can be found again
    tok = CharTokenizer()
    ids = torch.randint(3, 256, (1, 24), generator=torch.Generator().manual_seed(1))
    text = tok.decode(ids[0].tolist())
    info = {"decoding": {"do_sample": False, "max_new_tokens": max_new}}
    source = None
    if full:
        with recorders.record(model, H2OConfig(policy="full"), out=root, tokenizer=tok, info=info, fsync=False) as f:
            with torch.no_grad():
                model.generate(input_ids=ids, max_new_tokens=max_new, do_sample=False, pad_token_id=0)
        source = root / f.run_id
    config = H2OConfig(heavy=2, recent=2)
    ev = {"fact": text[3:6]}
    with recorders.record(model, config, out=root, tokenizer=tok, evidence=ev, info=info, fsync=False) as run:
        with torch.no_grad():
            model.generate(input_ids=ids, max_new_tokens=max_new, do_sample=False, pad_token_id=0)
    return model, tok, source, root / run.run_id


@pytest.mark.slow  # more than a few seconds on an idle 2-core machine (docs/TESTING.md)
def test_explain_copies_the_roots_full_run_and_forwards_the_prompt_once(tmp_path):
    model, tok, source, parent = _tiny_runs(tmp_path)
    widths = []  # positions of each forward the decoder really ran (a reused prompt forward runs none)
    hook = model.model.register_forward_pre_hook(
        lambda module, args, kwargs: widths.append(kwargs["input_ids"].shape[1]), with_kwargs=True
    )
    try:
        ex = explain_request(model, tok, parent, 0, resolution=0)
    finally:
        hook.remove()
    full = ex.outcomes["full"]
    assert ex.full_copied_from == source.name and full.ran
    copied = runlog.load_run(tmp_path / full.run_id, tables=("tokens", "requests"))
    original = runlog.load_run(source, tables=("tokens", "requests"))
    assert copied.manifest["copied_from"] == {"run": source.name, "request": 0}
    assert copied["tokens"]["token_id"].to_pylist() == original["tokens"]["token_id"].to_pylist()
    assert full.answer == original["requests"]["answer"][0].as_py()
    # one prompt forward for every variant: pinned, the policy's probes, the oracle's teacher and
    # run, and the replays all start from it
    assert widths.count(24) == 1, widths
    generates = 1 + len(ex.outcomes["policy_budget"].bisection.probes) - 2  # pinned, the probes run
    assert ex.prompts_reused >= generates
    assert all(o.ran for o in ex.outcomes.values())
    # the same counterfactuals as with the full cache generated again and nothing shared
    again = tmp_path / "again"
    ex2 = explain_request(model, tok, parent, 0, resolution=0, out=again, reuse_full=False)
    assert ex2.full_copied_from is None
    for kind, o in ex.outcomes.items():
        o2 = ex2.outcomes[kind]
        got, want = (o.passed, o.answer, o.slots, o.teacher_agreement), (o2.passed, o2.answer, o2.slots)
        assert got == (*want, o2.teacher_agreement), kind


def test_a_full_run_with_other_decoding_is_not_copied(tmp_path):
    from runlog.manifest import write_manifest

    model, tok, source, parent = _tiny_runs(tmp_path)
    manifest = runlog.read_manifest(source)
    manifest["decoding"]["max_new_tokens"] = 9
    write_manifest(source, manifest)
    ex = explain_request(model, tok, parent, 0, bisect=False, replay=False)
    assert ex.full_copied_from is None and ex.outcomes["full"].ran


def test_an_oracle_judged_teacher_forced_is_not_judged_and_is_recorded_again(tmp_path):
    """An earlier version's oracle run (teacher-forced, passed only when every token was its
    top-1) shows the teacher's text: it is never marked wrong, is named as not judged, and
    explaining again records the oracle's own answer."""
    from commands.explain import format_verdicts
    from recorders.counterfactual import _link, load_parent
    from recorders.oracle_runs import OracleTeacher

    model, tok, _, parent_dir = _tiny_runs(tmp_path, full=False)
    ex = explain_request(model, tok, parent_dir, 0, bisect=False, replay=False)
    parent = load_parent(parent_dir, 0)
    oracle = ex.outcomes["oracle"]
    teacher = OracleTeacher(model, tmp_path / ex.outcomes["full"].run_id)
    slots = next(s for s in (1, 2, 3, oracle.slots) if not teacher.check(s).passed)
    shutil.rmtree(tmp_path / oracle.run_id)
    link = _link(parent, "oracle", slots)
    teacher.record(slots, out=tmp_path, tokenizer=tok, run_id=oracle.run_id, info=link, fsync=False)
    (v,) = causal_verdicts(connect(tmp_path), ex.parent_run)
    row = next(r for r in v.table if r["variant"] == "oracle")
    assert row["answer"] == ex.outcomes["full"].answer and row["right"] is None and row["status"] == "not_judged"
    assert "oracle" not in v.passes and "earlier version" in v.could_not_run["oracle"]
    shown = format_verdicts([v])
    line = next(x for x in shown.splitlines() if x.strip().startswith("oracle "))
    assert "NO" not in line.split() and "not judged: oracle" in shown
    again = explain_request(model, tok, parent_dir, 0, bisect=False, replay=False)
    manifest = runlog.read_manifest(tmp_path / again.outcomes["oracle"].run_id)
    assert manifest["oracle"]["answer"] == "own" and not manifest.get("teacher_forced")
    (v,) = causal_verdicts(connect(tmp_path), ex.parent_run)
    assert "oracle" in v.passes and not v.could_not_run
