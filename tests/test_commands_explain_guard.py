"""``explain`` judges only runs it can judge, and finishes what a killed explain left (DESIGN.md §6.10).

A parent that is failed, interrupted or not replayed is refused in one line (``--force`` explains
it anyway); a counterfactual whose replay a killed ``explain`` never finished is replayed when the
next ``explain`` reuses it, so its KL is never shown blank. A tiny random llama in a folder.
"""

from __future__ import annotations

import importlib

import pytest
import torch
from tiny import save_tiny

import recorders
from analyses import connect
from commands.cli import main
from h2o_lens import H2OConfig
from h2o_lens.models import load_model
from recorders.counterfactual import explain_request
from recorders.replay import replay
from runlog.manifest import read_manifest, write_manifest

PROMPT = "Notes: the lab code is 4419. The cable goes to port 7. Lunch is at noon. What is the code?"


class _Killed(BaseException):
    """The process ends here (as under SIGKILL)."""


@pytest.fixture(scope="module")
def model(tmp_path_factory):
    return load_model(save_tiny(tmp_path_factory.mktemp("model") / "m"), progress=False)


def _parent(model, root, *, replayed: bool = True):
    model, tok = model
    enc = tok([PROMPT], return_tensors="pt", return_token_type_ids=False)
    with (
        torch.no_grad(),
        recorders.record(
            model, H2OConfig(heavy=3, recent=3), out=root, tokenizer=tok, evidence={"code": "4419"}, fsync=False
        ) as rec,
    ):
        model.generate(**enc, max_new_tokens=6, do_sample=False, pad_token_id=0)
    if replayed:
        replay(rec.run_dir, model=model, progress=False)
    return rec.run_dir


def _failed(run_dir):
    manifest = read_manifest(run_dir)
    manifest.update(status="failed", error="CUDA out of memory", error_type="RuntimeError")
    write_manifest(run_dir, manifest)


def _interrupted(run_dir):
    manifest = read_manifest(run_dir)
    manifest["status"] = "running"
    manifest["writer"] = dict(manifest["writer"], pid=2**22 + 1, start_ticks=1)  # no process has it
    write_manifest(run_dir, manifest)


@pytest.mark.parametrize(
    "case, said",
    [
        (_failed, "is failed (CUDA out of memory)"),
        (_interrupted, "is interrupted"),
        (None, "has no complete replay"),
    ],
    ids=["failed", "interrupted", "not-replayed"],
)
def test_explain_refuses_a_parent_it_cannot_judge_unless_forced(model, tmp_path, capsys, case, said):
    run_dir = _parent(model, tmp_path, replayed=case is not None)
    if case is not None:
        case(run_dir)
    capsys.readouterr()
    assert main(["explain", str(run_dir), "--cached"]) == 2
    err = capsys.readouterr().err
    (line,) = [x for x in err.splitlines() if x.strip()]
    assert line.startswith("h2o-lens: error: run ") and said in line and "--force" in line, err
    assert main(["explain", str(run_dir), "--cached", "--force"]) == 0


def test_a_counterfactual_left_unreplayed_by_a_killed_explain_is_replayed_when_reused(model, tmp_path, monkeypatch):
    run_dir = _parent(model, tmp_path)
    module = importlib.import_module("recorders.replay")
    real = module.replay

    def killed(*args, **kwargs):
        raise _Killed()

    monkeypatch.setattr(module, "replay", killed)  # the first re-run's replay: the pinned one
    with pytest.raises(_Killed):
        explain_request(model[0], model[1], run_dir, 0, bisect=False)
    monkeypatch.setattr(module, "replay", real)
    sql = "SELECT kind, kl_mean, correct FROM counterfactuals WHERE kind = 'pinned'"
    (kind, kl, _) = connect(tmp_path).execute(sql).fetchone()
    assert kl is None  # the state a killed explain leaves: recorded, never replayed
    ex = explain_request(model[0], model[1], run_dir, 0, bisect=False)
    assert ex.outcomes["pinned"].ran and ex.outcomes["oracle"].ran
    rows = dict(
        (k, (kl, passed))
        for k, kl, passed in connect(tmp_path).execute("SELECT kind, kl_mean, correct FROM counterfactuals").fetchall()
    )
    assert rows["pinned"][0] is not None and rows["oracle"][0] is not None  # no KL shown as "-"
    assert read_manifest(tmp_path / ex.outcomes["pinned"].run_id)["counterfactual"].get("answer") is not None


def test_a_guarded_run_is_refused_unless_forced_and_then_explained_at_its_first_slot_count(model, tmp_path, capsys):
    """A run recorded under the guard (here one that raised the request's slot count): explain's
    re-runs have no guard, so it refuses in one line; forced, it explains unguarded H2O at the
    config's slot count, not the raised one the request row holds."""
    from h2o_lens.guard import guarded
    from h2o_lens.guard_config import GuardConfig

    m, tok = model
    enc = tok([PROMPT], return_tensors="pt", return_token_type_ids=False)
    guard = GuardConfig(action="raise", threshold=0.0, raise_slots=12)  # every row raised at once
    with (
        torch.no_grad(),
        guarded(guard),
        recorders.record(
            m, H2OConfig(heavy=3, recent=3), out=tmp_path, tokenizer=tok, evidence={"code": "4419"}, fsync=False
        ) as rec,
    ):
        m.generate(**enc, max_new_tokens=6, do_sample=False, pad_token_id=0)
    replay(rec.run_dir, model=m, progress=False)
    assert read_manifest(rec.run_dir)["guard"]["action"] == "raise"
    (heavy,) = connect(tmp_path).execute("SELECT heavy FROM requests").fetchone()
    assert heavy > 3  # the row holds the raised count
    capsys.readouterr()
    assert main(["explain", str(rec.run_dir), "--cached", "--no-bisect"]) == 2
    (line,) = [x for x in capsys.readouterr().err.splitlines() if x.strip()]
    assert "recorded under the guard (action raise)" in line and "--force" in line, line
    assert main(["explain", "--all", "--root", str(tmp_path), "--no-bisect"]) == 0
    assert "skipped: it was recorded under the guard" in capsys.readouterr().err
    assert main(["explain", str(rec.run_dir), "--no-bisect", "--force"]) == 0
    slots = (
        connect(tmp_path)
        .execute("SELECT counterfactual_slots FROM runs WHERE counterfactual_kind = 'pinned'")
        .fetchall()
    )
    assert slots == [(6,)]  # heavy 3 + recent 3, as the run started
