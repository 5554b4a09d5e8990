"""What the toolkit may remove or replace (DESIGN.md §5.1): run folders it can prove it wrote,
never a ``.git``, a source folder or a foreign file, whatever the options."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from runlog import RunWriter
from runlog.ownership import (
    OutputFolderError,
    check_output_file,
    check_output_root,
    is_run_folder,
    remove_run,
    replace_runs,
)


def project(path: Path) -> Path:
    """A user's project folder: a ``.git``, a source folder and a file of theirs."""
    (path / ".git" / "objects").mkdir(parents=True)
    (path / ".git" / "HEAD").write_text("ref: refs/heads/main\n")
    (path / "src").mkdir()
    (path / "src" / "main.py").write_text("print('mine')\n")
    (path / "notes.txt").write_text("mine\n")
    return path


def tree(path: Path) -> dict[str, bytes | None]:
    """Every entry under ``path`` with its bytes (None for a folder)."""
    return {str(p.relative_to(path)): None if p.is_dir() else p.read_bytes() for p in sorted(path.rglob("*"))}


def run(root: Path, run_id: str) -> Path:
    writer = RunWriter(root, run_id, fsync=False, name=run_id)
    writer.start()
    writer.close("complete")
    return root / run_id


def test_a_run_folder_is_one_whose_manifest_names_it(tmp_path):
    assert is_run_folder(run(tmp_path, "a-run"))
    other = tmp_path / "copied"
    other.mkdir()
    (other / "manifest.json").write_text(json.dumps({"run_id": "a-run"}))  # names another folder
    assert not is_run_folder(other)
    assert not is_run_folder(project(tmp_path / "p") / "src")
    assert not is_run_folder(tmp_path / "p" / ".git")
    (tmp_path / "a-run" / ".git").mkdir()  # a run folder someone made a repository
    assert not is_run_folder(tmp_path / "a-run")


def test_replacing_the_runs_of_a_folder_removes_only_its_runs(tmp_path):
    root = project(tmp_path)
    run(root, "old-run")
    (root / "data").mkdir()
    (root / "data" / "table.parquet").write_bytes(b"PAR1 not a run")
    (root / "left-by-a-kill").mkdir()  # a writer killed before its manifest: nothing in it
    before = tree(root)
    assert replace_runs(root) == ["left-by-a-kill", "old-run"]
    after = tree(root)
    assert after == {k: v for k, v in before.items() if not k.startswith(("old-run", "left-by-a-kill"))}


def test_removing_a_run_refuses_anything_else_and_leaves_it(tmp_path):
    root = project(tmp_path)
    before = tree(root)
    for name in (".git", "src", "notes.txt"):
        with pytest.raises(OutputFolderError, match="not a run folder h2o-lens wrote"):
            remove_run(root / name)
    assert tree(root) == before
    remove_run(run(root, "mine"))
    remove_run(root / "never-there")
    assert not (root / "mine").exists() and tree(root) == before


def test_an_output_root_holding_foreign_entries_is_refused_unless_forced(tmp_path):
    root = project(tmp_path / "p")
    run(root, "a-run")
    with pytest.raises(OutputFolderError) as got:
        check_output_root(root)
    text = str(got.value)
    assert "\n" not in text and "3 entries h2o-lens did not write (.git, notes.txt, src)" in text and "--force" in text
    check_output_root(root, force=True)  # written beside them, never removed
    check_output_root(tmp_path / "new")  # missing: fine
    (tmp_path / "empty").mkdir()
    check_output_root(tmp_path / "empty")
    runs = tmp_path / "runs"
    run(runs, "r1")
    (runs / "sweep.csv").write_text("x")
    check_output_root(runs, names=("sweep.csv",))  # runs and what the command writes beside them
    with pytest.raises(OutputFolderError, match="version-control"):
        check_output_root(root / ".git" / "runs", force=True)


def test_a_file_is_replaced_only_when_the_toolkit_wrote_it_or_forced(tmp_path):
    mine = tmp_path / "notes.md"
    mine.write_text("# my notes\n")
    with pytest.raises(OutputFolderError, match="not a file h2o-lens wrote"):
        check_output_file(mine, markers=(b"H2O Lens report",))
    check_output_file(mine, markers=(b"H2O Lens report",), force=True)
    report = tmp_path / "r.md"
    report.write_text("# H2O Lens report: x\n")
    check_output_file(report, markers=(b"H2O Lens report",))
    check_output_file(tmp_path / "new.md", markers=(b"H2O Lens report",))
    with pytest.raises(OutputFolderError, match="version-control"):
        check_output_file(tmp_path / ".git" / "r.md", markers=(), force=True)
    with pytest.raises(OutputFolderError, match="is a folder"):
        check_output_file(tmp_path, markers=(), force=True)


def test_a_folder_a_writer_was_killed_in_before_its_manifest_is_the_toolkits(tmp_path):
    """A run folder killed between its creation and its manifest holds at most the manifest's
    temporary file, named as ``write_manifest`` names it: a resumed sweep writes beside it and
    replaces it, and it is removed as a run is; a folder holding anything else is not."""
    root = tmp_path / "grid"
    cell = root / "cell-0123"
    cell.mkdir(parents=True)
    (cell / "manifest.json.4242.a1b2c3.tmp").write_bytes(b'{"run_id": "cell-0')  # cut mid-write
    check_output_root(root)  # not foreign
    (root / "cell-empty").mkdir()
    check_output_root(root)
    remove_run(cell)
    assert not cell.exists()
    other = root / "cell-other"
    other.mkdir()
    (other / "notes.txt").write_text("mine")
    with pytest.raises(OutputFolderError, match="cell-other"):
        check_output_root(root)
    with pytest.raises(OutputFolderError):
        remove_run(other)
    assert (other / "notes.txt").read_text() == "mine"
