"""`h2o-lens eval` (DESIGN.md §20.1): lm-eval tasks under a policy, every generated request a run.

A local lm-eval YAML task on a tiny random model saved to a folder: under the full cache the
aggregate equals what lm-eval's own HF model gives on the same folder and task; under H2O every
request has a run, a replay and lm-eval's metric as its verdict; bad options stop in one line.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest

pytest.importorskip("lm_eval")

import torch  # noqa: E402
from tiny import save_tiny  # noqa: E402

from commands.cli import main  # noqa: E402

DOCS = 56  # >= 50 generate_until requests
NEW = 5


def _yaml(folder: Path, name: str, docs: Path, extra: str = "") -> None:
    (folder / f"{name}.yaml").write_text(
        f"task: {name}\n"
        "dataset_path: json\n"
        f"dataset_kwargs:\n  data_files:\n    test: {docs}\n"
        "test_split: test\n"
        "output_type: generate_until\n"
        'doc_to_text: "{{question}} ->"\n'
        'doc_to_target: "{{answer}}"\n'
        f'generation_kwargs:\n  until: ["\\n", "."]\n  max_gen_toks: {NEW}\n  do_sample: false\n'
        "metric_list:\n  - metric: exact_match\n    aggregation: mean\n    higher_is_better: true\n" + extra
    )


@pytest.fixture(scope="module")
def local_task(tmp_path_factory):
    """A tiny model folder and a task whose even documents expect the model's own greedy answer
    (so exact match is 0.5, not a trivial 0), computed with plain transformers."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    root = tmp_path_factory.mktemp("lm_eval")
    folder = save_tiny(root / "model")
    model, tok = AutoModelForCausalLM.from_pretrained(folder).eval(), AutoTokenizer.from_pretrained(folder)
    rows = []
    for i in range(DOCS):
        question = f"Say {chr(97 + i % 26) * 2} number {i}"
        ids = torch.tensor([tok.encode(question + " ->", add_special_tokens=False)])
        with torch.no_grad():
            out = model.generate(ids, max_new_tokens=NEW, do_sample=False, pad_token_id=0)
        text = tok.decode(out[0, ids.shape[1] :], skip_special_tokens=True).split("\n")[0].split(".")[0]
        rows.append({"question": question, "answer": text if i % 2 == 0 else "never this"})
    tasks = root / "tasks"
    tasks.mkdir()
    docs = tasks / "docs.jsonl"
    docs.write_text("".join(json.dumps(r) + "\n" for r in rows))
    _yaml(tasks, "lens_gen", docs)
    return folder, tasks


def _eval(capsys, *argv: str) -> tuple[int, str, str]:
    code = main(["eval", *argv])
    out, err = capsys.readouterr()
    return code, out, err


@pytest.mark.slow
def test_full_cache_aggregate_equals_lm_eval_hf_model(local_task, tmp_path, capsys):
    from lm_eval import simple_evaluate
    from lm_eval.tasks import TaskManager

    folder, tasks = local_task
    out = tmp_path / "runs"
    code, text, _ = _eval(
        capsys, "--tasks", "lens_gen", "--include-path", str(tasks), "--policies", "full",
        "--model", str(folder), "--out", str(out), "--no-replay",
    )  # fmt: skip
    assert code == 0
    ours = json.loads((out / "eval_full.json").read_text())
    theirs = simple_evaluate(
        model="hf",
        model_args=f"pretrained={folder},dtype=float32",
        tasks=["lens_gen"],
        task_manager=TaskManager(include_path=str(tasks)),
        batch_size=1,
        device="cpu",
        log_samples=True,
    )
    assert ours["results"]["lens_gen"]["exact_match,none"] == theirs["results"]["lens_gen"]["exact_match,none"] == 0.5
    assert ours["results"]["lens_gen"] == theirs["results"]["lens_gen"]
    table = text.splitlines()
    assert table[0].split() == ["policy", "ratio", "task", "filter", "metric", "value", "stderr"]
    assert table[1].split()[:6] == ["full", "1", "lens_gen", "none", "exact_match", "0.5000"]
    # every request: one run, lm-eval's per-request metric as its verdict
    per_doc = {s["doc_id"]: s["exact_match"] for s in theirs["samples"]["lens_gen"]}
    rows = ours["requests"]
    assert len(rows) == DOCS and {r["doc_id"] for r in rows} == set(per_doc)
    for r in rows:
        assert r["value"] == per_doc[r["doc_id"]] and r["correct"] == bool(per_doc[r["doc_id"]])
        manifest = json.loads((out / "full" / r["run_id"] / "manifest.json").read_text())
        assert manifest["status"] == "complete" and manifest["lm_eval"]["value"] == r["value"]


@pytest.mark.slow
def test_h2o_every_request_has_run_replay_verdict_and_resumes(local_task, tmp_path, capsys):
    from analyses import connect

    folder, tasks = local_task
    out = tmp_path / "runs"
    argv = ["--tasks", "lens_gen", "--include-path", str(tasks), "--policies", "h2o", "--ratios", "0.2"]
    argv += ["--model", str(folder), "--out", str(out), "--limit", "6"]
    code, first, _ = _eval(capsys, *argv)
    assert code == 0
    runs = sorted(p.name for p in (out / "h2o-sum_r0.2").iterdir())
    assert len(runs) == 6
    con = connect(str(out / "h2o-sum_r0.2"))
    got = con.sql("SELECT count(*), count(correct) FROM requests").fetchall()[0]
    assert got == (6, 6)
    assert con.sql("SELECT count(DISTINCT run_id) FROM replay").fetchall()[0][0] == 6
    # run again: the cell is done, nothing is recorded again, the same table is printed
    stamps = {r: (out / "h2o-sum_r0.2" / r / "manifest.json").stat().st_mtime_ns for r in runs}
    code, second, _ = _eval(capsys, *argv)
    assert (code, second) == (0, first)
    assert stamps == {r: (out / "h2o-sum_r0.2" / r / "manifest.json").stat().st_mtime_ns for r in runs}
    # a cell cut short: its complete runs are reused, the missing one recorded
    (out / "eval_h2o-sum_r0.2.json").unlink()
    import shutil

    shutil.rmtree(out / "h2o-sum_r0.2" / runs[0])
    code, third, _ = _eval(capsys, *argv)
    assert (code, third) == (0, first)
    saved = json.loads((out / "eval_h2o-sum_r0.2.json").read_text())
    assert sorted(r["reused"] for r in saved["requests"]) == [False] + [True] * 5


@pytest.mark.slow  # more than a few seconds on an idle 2-core machine (docs/TESTING.md)
def test_loglikelihood_tasks_are_named_as_not_showing_eviction(local_task, tmp_path, capsys):
    folder, tasks = local_task
    docs = tmp_path / "mc.jsonl"
    rows = [{"q": f"pick {i}", "choices": ["a", "b"], "gold": i % 2} for i in range(4)]
    docs.write_text("".join(json.dumps(r) + "\n" for r in rows))
    (tmp_path / "lens_mc.yaml").write_text(
        "task: lens_mc\ndataset_path: json\n"
        f"dataset_kwargs:\n  data_files:\n    test: {docs}\n"
        "test_split: test\noutput_type: multiple_choice\n"
        'doc_to_text: "{{q}}:"\ndoc_to_choice: "{{choices}}"\ndoc_to_target: "{{gold}}"\n'
        "metric_list:\n  - metric: acc\n"
    )
    code, out, err = _eval(
        capsys, "--tasks", "lens_mc", "--include-path", str(tmp_path), "--policies", "h2o", "--ratios", "0.2",
        "--model", str(folder), "--out", str(tmp_path / "runs"),
    )  # fmt: skip
    assert code == 0
    assert "no eviction effect possible in lens_mc" in err
    assert out.splitlines()[1].split()[:5] == ["h2o-sum", "0.2", "lens_mc", "none", "acc"]
    assert "0 recorded requests" in out


@pytest.mark.slow  # more than a few seconds on an idle 2-core machine (docs/TESTING.md)
@pytest.mark.parametrize(
    "argv, needle",
    [
        (["--tasks", "no_such_task_xyz"], "no_such_task_xyz: not an lm-eval task"),
        (["--tasks", "lens_gen", "--ratios", "0"], "--ratios: '0' is out of range; give keep ratios in (0, 1]"),
        (["--tasks", "lens_gen", "--policies", "nope"], "nope"),
        (["--tasks", "lens_gen", "--limit", "0"], "--limit must be at least 1"),
        (["--tasks", "lens_gen", "--include-path", "/no/such/folder"], "is not a folder of lm-eval YAML tasks"),
    ],
)
def test_bad_options_stop_in_one_line_before_the_model_loads(local_task, capsys, argv, needle):
    _, tasks = local_task
    if "--include-path" not in argv:
        argv = [*argv, "--include-path", str(tasks)]
    code, out, err = _eval(capsys, *argv, "--model", "/no/model/here")
    assert code == 2 and out == ""
    assert err.startswith("h2o-lens: error: ") and needle in err and len(err.strip().splitlines()) == 1
