"""The measured targets of DESIGN.md §20 on the default model, side by side in one run:
``python -m commands.eval_measure --out DIR [--docs 50] [--niah 6] [--length 2048]``.

1. A local lm-eval YAML task of ``--docs`` ``generate_until`` requests (short sums, written
   here): ``h2o-lens eval --policies full`` against ``lm_eval --model hf`` on the same model
   folder (the aggregates must be equal).
2. The same task under H2O at 20 %: a run, a replay and a verdict for every request.
3. What recording adds: the H2O 20 % generations with and without the recorder, alternated.
4. A RULER-format file of needle requests at ``--length`` tokens, imported, swept with
   ``h2o,tova`` (and ``kvpress:snapkv`` where kvpress imports) at 20 %, every failed request
   explained.
"""

from __future__ import annotations

import argparse
import json
import random
import time
from pathlib import Path
from typing import Any

__all__ = ["main"]

FILLER = (
    "The river runs past the old mill and under the stone bridge. Farmers bring their apples to the market "
    "on Saturdays. The library opens at nine and closes at six. Children play football in the park after "
    "school. A new bakery sells bread that is still warm in the morning. "
)


def _arith_task(folder: Path, docs: int) -> Path:
    rng = random.Random(0)
    rows = []
    for _ in range(docs):
        a, b = rng.randint(1, 9), rng.randint(1, 9)
        rows.append({"question": f"Question: What is {a} plus {b}?\nAnswer:", "answer": f" {a + b}"})
    folder.mkdir(parents=True, exist_ok=True)
    data = folder / "sums.jsonl"
    data.write_text("".join(json.dumps(r) + "\n" for r in rows))
    (folder / "lens_sums.yaml").write_text(
        f"task: lens_sums\ndataset_path: json\ndataset_kwargs:\n  data_files:\n    test: {data}\n"
        'test_split: test\noutput_type: generate_until\ndoc_to_text: "{{question}}"\n'
        'doc_to_target: "{{answer}}"\ntarget_delimiter: ""\n'
        'generation_kwargs:\n  until: ["\\n", "Question:"]\n  max_gen_toks: 8\n  do_sample: false\n'
        "metric_list:\n  - metric: exact_match\n    aggregation: mean\n    higher_is_better: true\n"
        "    ignore_case: true\n"
    )
    return folder


def _ruler_file(path: Path, count: int, chars: int) -> Path:
    """RULER's niah layout: ``index``, ``input``, ``outputs``, ``length``, ``answer_prefix``."""
    rng = random.Random(1)
    lines = []
    for i in range(count):
        key, value = f"{rng.choice(['amber', 'cobalt', 'violet', 'olive'])}-{i}", str(rng.randint(1000000, 9999999))
        hay = (FILLER * (chars // len(FILLER) + 1))[:chars]
        cut = hay.rfind(". ", 0, int(len(hay) * (0.1 + 0.8 * i / max(count - 1, 1)))) + 2
        text = (
            "Some special magic numbers are hidden within the following text. Make sure to memorize it.\n"
            + hay[:cut]
            + f"One of the special magic numbers for {key} is: {value}. "
            + hay[cut:]
            + f"\nWhat is the special magic number for {key} mentioned in the provided text?"
        )
        lines.append(
            {
                "index": i,
                "input": text,
                "outputs": [value],
                "length": 0,
                "answer_prefix": f" The special magic number for {key} mentioned in the provided text is",
            }  # fmt: skip
        )
    path.write_text("".join(json.dumps(r) + "\n" for r in lines))
    return path


def _lm_eval_part(out: Path, tasks: Path, docs: int, model: Any, tok: Any, folder: str) -> dict[str, Any]:
    from lm_eval import simple_evaluate

    from recorders.harness import task_manager

    from .eval import evaluate

    report: dict[str, Any] = {}
    t0 = time.perf_counter()
    full = evaluate(["lens_sums"], out=out / "eval", policies=[("full", "sum")], ratios=[1.0], model=model,
                    tokenizer=tok, include_path=str(tasks), replay=False)["full"]  # fmt: skip
    report["lens_full_seconds"] = time.perf_counter() - t0
    t0 = time.perf_counter()
    hf = simple_evaluate(model="hf", model_args=f"pretrained={folder},dtype=float32", tasks=["lens_sums"],
                         task_manager=task_manager(str(tasks)), batch_size=1, device="cpu")  # fmt: skip
    report["hf_seconds"] = time.perf_counter() - t0
    report["full"] = full["results"]["lens_sums"]
    report["hf"] = hf["results"]["lens_sums"]
    report["equal"] = report["full"] == report["hf"]
    h2o = evaluate(["lens_sums"], out=out / "eval", policies=[("h2o", "sum")], ratios=[0.2], model=model,
                   tokenizer=tok, include_path=str(tasks))["h2o-sum_r0.2"]  # fmt: skip
    report["h2o"] = h2o["results"]["lens_sums"]
    root = out / "eval" / "h2o-sum_r0.2"
    from analyses import connect

    con = connect(str(root))
    report["h2o_runs"] = len([p for p in root.iterdir() if p.is_dir()])
    report["h2o_verdicts"] = con.sql("SELECT count(correct) FROM requests").fetchall()[0][0]
    report["h2o_replays"] = con.sql("SELECT count(DISTINCT run_id) FROM replay").fetchall()[0][0]
    report["docs"] = docs
    return report


def _timing(out: Path, tasks: Path, model: Any, tok: Any, rounds: int = 2, limit: int | None = None) -> dict[str, Any]:
    """The lm-eval run at H2O 20 %, recorder off and on, alternated; each a fresh root."""
    from lm_eval import simple_evaluate

    from recorders.harness import LensLM, task_manager

    times: dict[bool, list[float]] = {False: [], True: []}
    for r in range(rounds):
        for rec in (False, True) if r % 2 == 0 else (True, False):
            lm = LensLM(model=model, tokenizer=tok, policy="h2o", ratio=0.2, out=str(out / f"timing_{r}_{rec}"),
                        record=rec, replay=False, include_path=str(tasks))  # fmt: skip
            t0 = time.perf_counter()
            simple_evaluate(
                model=lm, tasks=["lens_sums"], task_manager=task_manager(str(tasks)), log_samples=False, limit=limit
            )
            times[rec].append(time.perf_counter() - t0)
    off, on = min(times[False]), min(times[True])
    return {"plain_s": times[False], "recorded_s": times[True], "ratio": on / off}


def _niah_part(out: Path, count: int, length: int, model: Any, tok: Any) -> dict[str, Any]:
    from h2o_lens import presses
    from h2o_lens.tasks.importers import import_tasks
    from h2o_lens.tasks.taskfile import write_tasks

    from .explain import explain_run
    from .jobs import sweep

    chars = int(length * 4.2)  # about 4.2 characters a token for this text and tokenizer
    src = _ruler_file(out / "ruler_niah.jsonl", count, chars)
    # room for the answer prefix the model restates and the 7-digit number (RULER gives 128)
    tasks = import_tasks(src, "ruler", max_new_tokens=32)
    write_tasks(tasks, out / "niah_tasks.jsonl")
    lengths = [len(tok(t.chat_text(tok), add_special_tokens=False)["input_ids"]) for t in tasks]
    policies = [("h2o", "sum"), ("tova", "sum")]
    try:
        presses.import_kvpress()
        policies.append(("kvpress:snapkv", "sum"))
        kvpress = "swept"
    except Exception as exc:  # not installable beside this transformers release
        kvpress = f"not run: {exc}"
    root = out / "niah_sweep"
    sweep(root, tasks=tasks, tasks_spec=str(out / "niah_tasks.jsonl"), model=model, tokenizer=tok,
          ratios=[1.0, 0.2], policies=policies, batch_size=count, progress=False)  # fmt: skip
    from analyses import connect

    con = connect(str(root))
    failed = con.sql(
        "SELECT r.run_id, count(*) FROM requests q JOIN runs r USING (run_id) "
        "WHERE q.correct = false AND r.policy <> 'full' GROUP BY r.run_id"
    ).fetchall()
    explained, failures = 0, 0
    for run_id, n in failed:
        failures += n
        verdicts = explain_run(str(root / run_id), model=model, tokenizer=tok, bisect=False, progress=False)
        explained += sum(1 for v in verdicts if getattr(v, "verdict", None))
    accuracy = con.sql(
        "SELECT r.policy, avg(q.correct::INT), count(*) FROM requests q JOIN runs r USING (run_id) GROUP BY 1"
    ).fetchall()
    return {"prompt_tokens": [min(lengths), max(lengths)], "accuracy": accuracy, "failed": failures,
            "explained": explained, "kvpress": kvpress}  # fmt: skip


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__)
    p.add_argument("--out", required=True)
    p.add_argument("--docs", type=int, default=50)
    p.add_argument("--niah", type=int, default=6)
    p.add_argument("--length", type=int, default=2048)
    p.add_argument("--parts", default="lm_eval,timing,niah")
    p.add_argument("--timing-docs", type=int, default=None, help="documents of the timed runs (default: --docs)")
    p.add_argument(
        "--rounds", type=int, default=2, help="alternated rounds of the timed runs (the fastest of each kept)"
    )
    args = p.parse_args()
    from h2o_lens.models import load_model

    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    model, tok = load_model(None, progress=False)
    folder = str(model.config._name_or_path)
    tasks = _arith_task(out / "tasks", args.docs)
    report: dict[str, Any] = {"model": folder}
    parts = args.parts.split(",")
    if "lm_eval" in parts:
        report["lm_eval"] = _lm_eval_part(out, tasks, args.docs, model, tok, folder)
        print(json.dumps(report["lm_eval"], default=str), flush=True)
    if "timing" in parts:
        report["timing"] = _timing(out, tasks, model, tok, rounds=args.rounds, limit=args.timing_docs)
        print(json.dumps(report["timing"]), flush=True)
    if "niah" in parts:
        report["niah"] = _niah_part(out, args.niah, args.length, model, tok)
        print(json.dumps(report["niah"], default=str), flush=True)
    (out / f"report_{'_'.join(parts)}.json").write_text(json.dumps(report, indent=1, default=str))


if __name__ == "__main__":
    main()
