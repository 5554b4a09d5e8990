"""``h2o-lens bench explain``: explaining one failed request (every counterfactual, both bisections,
the replays) ÷ one generation of the same request, on this machine (DESIGN.md §6.10)."""

from __future__ import annotations

import argparse
import statistics
import time

from h2o_lens.errors import ConfigError, H2OLensError

from ..options import at_least, keep_share
from .common import check_ints, check_keep, generation_seconds, model_config

__all__ = ["add_arguments", "run", "bench_explain", "clear_reruns"]

NAME = "explain"
HELP = "explaining one failed request / one generation of it (DESIGN.md §6.10)"


def add_arguments(b: argparse.ArgumentParser) -> None:
    b.add_argument("--model", default=None, help="HF id or local path (default: the packaged SmolLM2-135M-Instruct)")
    b.add_argument(
        "--tasks",
        default=None,
        metavar="builtin:NAME",
        help="the request (default delayed_recall_1); with --length a long-context family (default each "
        "family the full cache solves)",
    )
    b.add_argument("--keep", type=keep_share, default=0.2, help="the parent's keep ratio, in (0, 1)")
    b.add_argument(
        "--length",
        type=at_least(1),
        default=None,
        help="prompt tokens of a long-context built-in family (capped at the model's window less the new tokens)",
    )
    b.add_argument("--rounds", type=at_least(1), default=3, help="rounds alternating generation and explanation")


def run(args: argparse.Namespace) -> int:
    return bench_explain(
        model_name=args.model,
        task=None if args.tasks in (None, "builtin:full") else args.tasks.removeprefix("builtin:"),
        keep=args.keep,
        length=args.length,
        rounds=args.rounds,
    )


def clear_reruns(root: str, run_id: str) -> list[str]:
    """Remove the re-runs a previous round wrote under ``root`` for the parent ``run_id``
    (``RUN_ID-r0-*``), each through :func:`runlog.ownership.remove_run`: a folder of that name
    that is not a run h2o-lens wrote is refused in one line and left as it is."""
    from pathlib import Path

    from runlog.ownership import remove_run

    gone = []
    for done in sorted(Path(root).glob(f"{run_id}-r0-*")):
        remove_run(done)
        gone.append(done.name)
    return gone


def _past_window(length: int, window: int | None) -> None:
    """A ConfigError when ``length`` prompt tokens pass the model's ``window``."""
    if window is not None and length > window:
        raise ConfigError(
            f"bench explain: --length {length} is past the model's window of {window:,} positions "
            f"(config.max_position_embeddings); expected at most {window} (the prompt is capped at the "
            f"window less the request's new tokens)"
        )


def _prompt_tokens(tok, task) -> int:
    """``task``'s prompt tokens as a run counts them (its chat text, no special tokens added)."""
    return len(tok(task.chat_text(tok), add_special_tokens=False)["input_ids"])


def _long_requests(model, tok, family: str, length: int, count: int = 3):
    """``count`` requests of the long-context ``family`` at ``length`` prompt tokens, the length
    capped so that each prompt and its new tokens fit the model's window (DESIGN.md §6.10).
    Returns the requests and the prompt length asked of the family (``length`` unless capped);
    a ConfigError naming the option when ``length`` is past the window or the cap leaves too little."""
    from h2o_lens.models import context_window
    from h2o_lens.tasks.longctx import LONG_FAMILIES

    window = context_window(model)
    _past_window(length, window)
    want, margin = length, 1
    for _ in range(10):  # a fit lands within half a filler sentence of the length asked, above or below
        try:
            reqs = LONG_FAMILIES[family](length=want, count=count, tokenizer=tok)
        except ValueError as exc:
            capped = f" (capped at {want} to fit the window of {window:,} positions)" if want != length else ""
            raise ConfigError(f"bench explain: --length {length}{capped}: {exc}") from None
        over = 0 if window is None else max(_prompt_tokens(tok, r) + r.max_new_tokens for r in reqs) - window
        if over <= 0:
            return reqs, want
        want, margin = want - over - margin, 2 * margin
    raise ConfigError(
        f"bench explain: cannot fit {family} requests of about {length} prompt tokens in {window:,} positions"
    )


def _explain_candidates(model, tok, task: str | None, length: int | None):
    """The requests the bench tries, in order, and a line per family whose length was capped:
    the built-in ``task`` (default ``delayed_recall_1``) without ``length``; with it, the
    requests of the long family ``task``, or of every family the full cache solves (needle
    first) when ``task`` is None, at ``length`` prompt tokens capped to the model's window less
    each request's new tokens."""
    from h2o_lens.models import context_window
    from h2o_lens.tasks import get_task
    from h2o_lens.tasks.longctx import FULL_CACHE_SOLVES, LONG_FAMILIES

    if length is None:
        return [get_task(task or "delayed_recall_1")], {}
    if task is not None and task not in LONG_FAMILIES:
        raise ConfigError(
            f"bench explain: --length takes a long-context family (--tasks builtin:NAME), got {task!r}; "
            f"expected one of {', '.join(LONG_FAMILIES)}"
        )
    families = [task] if task is not None else [f for f in LONG_FAMILIES if FULL_CACHE_SOLVES[f]]
    candidates, capped = [], {}
    for family in families:
        reqs, want = _long_requests(model, tok, family, length)
        candidates += reqs
        if want != length:
            capped[family] = (
                f"{family}: --length {length} capped at {want} prompt tokens (the window of "
                f"{context_window(model):,} positions less {reqs[0].max_new_tokens} new tokens)"
            )
    return candidates, capped


def _explain_request_task(model, tok, candidates, keep: float, root: str, what: str):
    """The first of ``candidates`` that the full cache answers right and H2O at ``keep`` wrong,
    with its runs under ``root``: the full-cache run (what a sweep's full cell would hold) and
    the parent under H2O. Returns the parent's TaskRun and the task, or None and a line saying
    why there is none (no H2O run is made for a request the full cache gets wrong)."""
    from h2o_lens.config import H2OConfig

    from ..jobs import run_task

    answered = 0
    for chosen in candidates:
        print(f"trying {chosen.name} ({what})", flush=True)
        full = run_task(model, tok, chosen, H2OConfig(policy="full"), root, replay=False, name=f"{chosen.name} full")
        if not full.correct:
            continue
        answered += 1
        parent = run_task(model, tok, chosen, H2OConfig(ratio=keep), root, ratio=keep, replay=True)
        if not parent.correct:
            return parent, chosen
    if not answered:
        return None, (
            f"bench explain: the full cache answers none of the {len(candidates)} requests tried ({what}), "
            "so no failure of H2O can be explained there on this model; try a shorter --length"
        )
    return None, (
        f"bench explain: no request of {what} fails at keep {keep:.0%} while the full cache answers it right "
        f"({answered} of {len(candidates)} answered by the full cache)"
    )


def bench_explain(
    model_name: str | None = None,
    task: str | None = None,
    keep: float = 0.2,
    resolution: float = 0.05,
    out: str | None = None,
    length: int | None = None,
    rounds: int = 2,
) -> int:
    """Explaining one failed request (every counterfactual, both bisections, the replays) ÷ one
    generation of the same request, on this machine (DESIGN.md §6.10).

    The request is the built-in ``task`` (default ``delayed_recall_1``), or with ``length`` the
    first request that H2O at ``keep`` fails and the full cache answers, of the long-context
    family ``task`` (default: each family the full cache solves in turn, ``needle`` first) at
    that many prompt tokens, capped at the model's window less the request's new tokens (the
    header says so; past the window is an error). Its root holds the full-cache run of the
    request, as a sweep's would, which the explanation copies. The two sides alternate on the
    same process: a plain (unrecorded) generation under the parent's config, an explanation from
    scratch (its counterfactual folders removed first), ``rounds`` times, then a last
    generation; the ratio is of the medians, printed with each round and the load average seen
    at the start and the end (a shared machine moves both sides). Returns 0; when no request
    fails, or the full cache answers none, an :class:`~h2o_lens.errors.H2OLensError` says so in
    one line (the command exits 2).
    """
    import os
    import tempfile

    import torch

    from h2o_lens.models import load_model
    from recorders.counterfactual import explain_request, load_parent

    rounds = check_ints("explain", "rounds", rounds, 1)[0]
    check_keep("explain", keep)
    if length is not None:  # before the model loads: the family, the length and the model's window
        check_ints("explain", "length", length, 1)
        from h2o_lens.tasks.longctx import LONG_FAMILIES

        if task is not None and task not in LONG_FAMILIES:
            _explain_candidates(None, None, task, length)
        config = model_config(model_name)
        _past_window(length, getattr(config, "max_position_embeddings", None))
    model, tok = load_model(model_name)
    candidates, capped = _explain_candidates(model, tok, task, length)
    for line in capped.values():
        print(line, flush=True)
    what = f"{task or 'the long families'} at {length} tokens" if length else candidates[0].name
    root = out or tempfile.mkdtemp(prefix="h2o-lens-bench-explain-")
    load = [os.getloadavg()[0]]
    parent, chosen = _explain_request_task(model, tok, candidates, keep, root, what)
    if parent is None:
        raise H2OLensError(chosen)
    req = load_parent(parent.run_dir, 0)

    def generate() -> float:
        return generation_seconds(model, tok, req)

    def explain():
        clear_reruns(root, req.run_id)
        return explain_request(model, tok, parent.run_dir, 0, resolution=resolution)

    print(
        f"model {type(model).__name__}, {torch.get_num_threads()} threads; {chosen.name}, keep {keep:.0%} "
        f"({req.slots} slots of a {req.prompt_len}-token prompt, {req.max_new_tokens} new tokens)"
        + "".join(f"; {line}" for f, line in capped.items() if f == getattr(chosen, "meta", {}).get("family")),
        flush=True,
    )
    gen, spent, last = [generate()], [], None
    for i in range(rounds):
        t0 = time.perf_counter()
        last = explain()
        spent.append(time.perf_counter() - t0)
        gen.append(generate())
        print(f"  round {i + 1}: generation {gen[i]:.2f} s, explain {spent[i]:.1f} s, generation {gen[i + 1]:.2f} s")
    load.append(os.getloadavg()[0])
    _print_explain(gen, spent, load, last, root)
    return 0


def _print_explain(gen: list[float], spent: list[float], load: list[float], last, root: str) -> None:
    """The medians of the generations and the explanations, their ratio and what the last explanation did."""
    g, e = statistics.median(gen), statistics.median(spent)
    ran = {k: o.slots for k, o in last.outcomes.items() if o.ran}
    print(f"load average {load[0]:.1f} at the start, {load[1]:.1f} at the end")
    print(f"{'generation s':>13} {'explain s':>10} {'ratio':>7} {'probes':>7} {'oracle forwards':>16} {'reused':>7}")
    print(
        f"{g:>13.2f} {e:>10.1f} {e / g:>6.1f}x {len(last.probe_seconds):>7} "
        f"{last.oracle_forwards if last.oracle_forwards is not None else '-':>16} {last.prompts_reused:>7}"
    )
    print(
        f"full cache: {'copied from ' + last.full_copied_from if last.full_copied_from else 'generated'}; "
        f"re-runs recorded: {ran}; runs under {root}"
    )
