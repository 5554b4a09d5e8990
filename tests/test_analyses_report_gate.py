"""The report's gate fails closed: a run that is not ``complete``, was never replayed or lacks the
data a check needs fails that check, with the reason, and ``report --gate`` exits 1 in every format
(DESIGN.md §6.10)."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest

from commands.cli import main
from runlog import write_synthetic_run
from runlog.manifest import read_manifest, write_manifest

SAMPLES = Path(__file__).resolve().parents[1] / "sample_runs"
GOOD = "delayed-recall-0-full-100"  # complete, replayed, integrity ok: passes every check that has data
#: the lifecycle check has not run on the samples; switched off, the good sample passes
NO_LIFECYCLE = {"gate_max_lifecycle_errors": None}
FORMATS = ("html", "md", "json")


@pytest.fixture
def root(tmp_path):
    root = tmp_path / "runs"
    root.mkdir()
    shutil.copytree(SAMPLES / GOOD, root / GOOD)
    (tmp_path / "th.json").write_text(json.dumps(NO_LIFECYCLE))
    return root


def _gate(root: Path, run: str, fmt: str, capsys, thresholds: Path | None = None) -> tuple[int, str, str]:
    args = ["report", run, "--root", str(root), "--format", fmt, "--gate"]
    if thresholds is not None:
        args += ["--thresholds", str(thresholds)]
    rc = main(args)
    out = capsys.readouterr()
    return rc, out.out, out.err


def _shown_verdict(fmt: str, text: str) -> str:
    if fmt == "json":
        return json.loads(text)["verdict"]["status"]
    if fmt == "md":
        return "fail" if "**Verdict: FAIL**" in text else "pass" if "**Verdict: PASS**" in text else "?"
    return "fail" if 'id="gate-verdict">Verdict: FAIL' in text else "pass" if "Verdict: PASS" in text else "?"


def _set_status(run_dir: Path, status: str) -> None:
    manifest = read_manifest(run_dir)
    manifest["status"] = status
    manifest["error"] = "killed mid-record" if status == "interrupted" else "RuntimeError: out of memory"
    write_manifest(run_dir, manifest)


@pytest.mark.parametrize("fmt", FORMATS)
def test_a_good_run_passes_the_gate_in_every_format(root, fmt, capsys):
    rc, out, err = _gate(root, GOOD, fmt, capsys, root.parent / "th.json")
    assert (rc, _shown_verdict(fmt, out)) == (0, "pass") and "gate: pass" in err


@pytest.mark.parametrize("fmt", FORMATS)
@pytest.mark.parametrize("status", ["failed", "interrupted"])
def test_a_run_that_did_not_complete_fails_the_gate(root, fmt, status, capsys):
    _set_status(root / GOOD, status)
    rc, out, err = _gate(root, GOOD, fmt, capsys, root.parent / "th.json")
    assert (rc, _shown_verdict(fmt, out)) == (1, "fail")
    assert f"run_complete: fail: the run is {status}, not complete" in err


@pytest.mark.parametrize("fmt", FORMATS)
def test_a_run_never_replayed_fails_the_gate_with_the_reason(tmp_path, fmt, capsys):
    root = tmp_path / "runs"
    write_synthetic_run(root, "bare", steps=16, prompt_len=32, tables=["tokens", "evictions", "steps"], fsync=False)
    rc, out, err = _gate(root, "bare", fmt, capsys)
    assert (rc, _shown_verdict(fmt, out)) == (1, "fail")
    assert "replayed: fail: the run has no replay steps" in err
    assert "kl_mean: no data: no replay steps: the run was not replayed" in err
    assert "no replay steps" in out  # the reason is in the report itself, not only on stderr


def test_no_data_fails_a_check_that_is_on_and_off_switches_it_off(root, capsys):
    from analyses.report import report_data

    data = report_data(root, GOOD)
    check = {c["name"]: c for c in data["verdict"]["checks"]}["lifecycle_errors"]
    assert (check["status"], check["pass"]) == ("no data", False) and "h2o-lens check" in check["reason"]
    assert data["verdict"]["failed"] == ["lifecycle_errors"]
    check = {c["name"]: c for c in report_data(root, GOOD, thresholds=NO_LIFECYCLE)["verdict"]["checks"]}
    assert (check["lifecycle_errors"]["status"], check["lifecycle_errors"]["pass"]) == ("off", None)
