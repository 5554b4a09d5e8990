"""The outputs stay the same when code moves: a demo root, a sweep root and the command line.

A tiny random llama (float64, so that the numbers do not depend on summation order) runs the
demo (every policy, the replays, the counterfactual re-runs of its failures, the reports) and a
sweep (three policies, three keep ratios, batches of two) over two requests. Every file of both
roots and what they print is reduced to a digest by :func:`outputs_digest.root_digest` (a hash,
and the sums of its decimal numbers, compared within a tolerance), which
normalises only what differs between two identical runs (time stamps, random run ids and
segment suffixes, durations, the temporary folder). The command line's parsers are compared
option by option (names, defaults, choices, help). All of it must equal the hashes stored in
tests/golden/outputs.json; ``H2O_LENS_WRITE_GOLDEN=1`` writes the file from this code.
"""

from __future__ import annotations

import argparse
import json
import os
from pathlib import Path

import pytest
import torch

from tests.outputs_digest import root_digest, same_digest
from tests.tiny import save_tiny

pytestmark = pytest.mark.golden
GOLDEN = Path(__file__).resolve().parent / "golden" / "outputs.json"
WRITE = os.environ.get("H2O_LENS_WRITE_GOLDEN") == "1"

REQUESTS = [
    {
        "name": "code",
        "kind": "recall",
        "prompt": "Notes: the lab code is 4419. The cable goes to port 7. Lunch is at noon. What is the code?",
        "answer": "4419",
        "evidence": {"code": "code is 4419"},
        "max_new_tokens": 6,
    },
    {
        "name": "pair",
        "prompt": "Oslo is cold, Lima is warm, Cairo is hot. Name the cold and the warm city.",
        "answer": {"all": ["Oslo", "Lima"]},
        "evidence": {"cold": "Oslo is cold"},
        "max_new_tokens": 4,
    },
]


@pytest.fixture(scope="module")
def outputs(tmp_path_factory) -> dict[str, dict[str, str]]:
    """The digests of a demo root and a sweep root made on a tiny model in a fresh folder."""
    import contextlib
    import io

    from commands.jobs import demo, sweep
    from h2o_lens.models import load_model
    from h2o_lens.tasks.builtins import resolve_tasks

    base = tmp_path_factory.mktemp("outputs")
    here = Path.cwd()
    os.chdir(base)  # the model is named by a relative path, as the sweep's cell keys hash its name
    try:
        save_tiny(Path("model"))
        (base / "tasks.jsonl").write_text("".join(json.dumps(r) + "\n" for r in REQUESTS), encoding="utf-8")
        model, tok = load_model("model", dtype=torch.float64, progress=False)
        tasks = resolve_tasks(str(base / "tasks.jsonl"))
        printed = {}
        with contextlib.redirect_stdout(io.StringIO()) as out:
            demo(base / "demo", tasks=tasks, model=model, tokenizer=tok, progress=False)
        printed["demo"] = out.getvalue()
        with contextlib.redirect_stdout(io.StringIO()) as out:
            sweep(
                base / "sweep",
                tasks=tasks,
                model=model,
                tokenizer=tok,
                ratios=(1.0, 0.5, 0.25),
                policies=(("h2o", "sum"), ("h2o", "none"), ("local", "sum")),
                batch_size=2,
                progress=False,
            )
        printed["sweep"] = out.getvalue()
    finally:
        os.chdir(here)
    return {name: root_digest(base / name, stdout=printed[name], base=base) for name in ("demo", "sweep")}


def _parsers(parser: argparse.ArgumentParser, prog: str = "h2o-lens") -> dict[str, list]:
    """Every (sub)parser's description and options: flags, destination, default, choices, help."""
    out = {prog: [parser.description, parser.epilog]}
    for action in parser._actions:
        if isinstance(action, argparse._SubParsersAction):
            helps = {a.dest: a.help for a in action._choices_actions}
            for name, sub in action.choices.items():
                out[prog].append(["subcommand", name, helps.get(name)])
                out.update(_parsers(sub, f"{prog} {name}"))
            continue
        out[prog].append(
            [
                action.option_strings,
                action.dest,
                repr(action.default),
                sorted(map(str, action.choices)) if action.choices is not None else None,
                action.help,
                str(action.metavar),
                str(action.nargs),
                action.required,
                getattr(action.type, "__name__", None),
                type(action).__name__,
            ]
        )
    return out


def _cli() -> dict[str, str]:
    import hashlib

    from commands.cli import build_parser

    return {
        prog: hashlib.sha256(json.dumps(spec, sort_keys=True).encode()).hexdigest()[:16]
        for prog, spec in _parsers(build_parser()).items()
    }


def _same(want, got) -> bool:
    """A file's digests agree (:func:`same_digest`), or a parser's hashes are equal."""
    if isinstance(want, dict) and isinstance(got, dict):
        return same_digest(want, got)
    return want == got


def _compare(name: str, got: dict) -> None:
    golden = json.loads(GOLDEN.read_text(encoding="utf-8")) if GOLDEN.exists() else {}
    if WRITE:
        golden[name] = got
        GOLDEN.write_text(json.dumps(golden, indent=0, sort_keys=True) + "\n", encoding="utf-8")
    want = golden[name]
    changed = sorted(k for k in set(want) | set(got) if not _same(want.get(k), got.get(k)))
    assert not changed, f"{name}: {len(changed)} outputs differ from {GOLDEN.name}, e.g. {changed[:8]}"


@pytest.mark.slow
def test_the_demo_root_and_what_it_prints_are_unchanged(outputs):
    assert len(outputs["demo"]) > 100 and "demo_summary.json" in outputs["demo"]
    _compare("demo", outputs["demo"])


@pytest.mark.slow
def test_the_sweep_root_and_what_it_prints_are_unchanged(outputs):
    assert len(outputs["sweep"]) > 100 and "sweep.html" in outputs["sweep"]
    _compare("sweep", outputs["sweep"])


def test_the_command_line_options_and_their_help_are_unchanged():
    got = _cli()
    assert "h2o-lens sweep" in got and "h2o-lens bench" in got
    _compare("cli", got)
