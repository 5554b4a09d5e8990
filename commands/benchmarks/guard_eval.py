"""The guard bench's runs (DESIGN.md §18.6): for every request (greedy, one at a time) the
full-cache teacher, H2O at the base ratio with the guard logging its risk, H2O at each fixed
budget and H2O under each of the guard's policies; what they measure (:class:`GuardReport`) and
its printout (:func:`format_report`)."""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

from .common import HeldSlots
from .guard_fit import (
    Outcome,
    _matched,
    _reprefill,
    _rescore,
    _scores,
    auroc,
    first_wrong,
    fit_threshold,
    fit_weights,
    matched_features,
    select_heads,
)

__all__ = [
    "KS",
    "BUDGETS",
    "POLICIES",
    "HEADS",
    "RequestRun",
    "run_request",
    "GuardReport",
    "evaluate",
    "format_report",
]

KS = (1, 4, 16)
BUDGETS = (0.05, 0.1, 0.2, 0.35, 0.5, 1.0)
#: the guard's policies the bench runs: (action, target keep ratio, rescue share[, threshold]), DESIGN.md
#: §18.2; a policy with its own threshold acts at it instead of the fitted (or given) one
POLICIES = (("raise", 0.35, 0.15), ("raise", 0.5, 0.0), ("refill", 1.0, 0.0))
#: the heads the fitted ``prefill`` signal reads (DESIGN.md §18.1)
HEADS = 5


@dataclass
class RequestRun:
    """One generation of one request: its tokens, answer, verdict, cost and the guard's log."""

    tokens: list[int]
    answer: str
    passed: bool | None
    seconds: float
    memory: float  # mean KV slots held over the decode steps, as a share of the full cache's
    risks: list[dict[str, Any]] = field(default_factory=list)
    events: list[dict[str, Any]] = field(default_factory=list)
    guard_seconds: float = 0.0
    #: the guard's lost share at the prefill per layer and KV set (:attr:`GuardState.prefill_heads`)
    heads: list[list[float]] = field(default_factory=list)
    #: the generation stopped at the request's new-token limit, not at an end-of-sequence token: a
    #: wrong verdict may be the limit's (an answer cut mid-number), not the cache's
    cut: bool = False


def run_request(model: Any, tokenizer: Any, task: Any, config: Any = None, guard: Any = None) -> RequestRun:
    """Generate ``task`` greedily: the full cache when ``config`` is None, else H2O under ``config``
    (with the guard of ``guard``, a :class:`~h2o_lens.guard.GuardConfig`, when given)."""
    import contextlib

    import torch

    from h2o_lens.guard import guarded
    from h2o_lens.runtime import h2o

    ids = tokenizer(task.chat_text(tokenizer), return_tensors="pt", add_special_tokens=False).input_ids
    prompt_len = ids.shape[1]
    pad = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else tokenizer.eos_token_id
    slots = HeldSlots()
    kw = dict(max_new_tokens=task.max_new_tokens, do_sample=False, pad_token_id=pad)
    with contextlib.ExitStack() as stack:
        g = stack.enter_context(guarded(guard)) if guard is not None else None
        if config is not None:
            stack.enter_context(h2o(model, config, listener=slots))
        if g is not None:
            kw["logits_processor"] = [g.cues(tokenizer, ids)]  # the prompt's cues count at the prefill
            if guard.action == "refill":
                kw["logits_processor"].append(g.refill(model))
        t0 = time.perf_counter()
        with torch.no_grad():
            out = model.generate(ids, **kw)
        seconds = time.perf_counter() - t0
    tokens = out[0, prompt_len:].tolist()
    answer = tokenizer.decode(tokens, skip_special_tokens=True)
    full = [prompt_len + i + 1 for i in range(len(slots.held))]
    memory = sum(slots.held) / sum(full) if config is not None and full else 1.0
    cut = len(tokens) >= task.max_new_tokens and not _ends(model, tokenizer, tokens)
    run = RequestRun(tokens, answer, task.check(answer) if task.checked else None, seconds, memory, cut=cut)
    if g is not None and g.last is not None:
        run.risks, run.events, run.guard_seconds = g.last.risk_rows(), g.last.event_rows(), g.last.seconds
        if g.last.prefill_heads is not None:
            run.heads = g.last.prefill_heads[0].tolist()
    return run


def _ends(model: Any, tokenizer: Any, tokens: list[int]) -> bool:
    """Whether ``tokens`` end with one of the model's end-of-sequence tokens."""
    eos = getattr(getattr(model, "generation_config", None), "eos_token_id", None)
    eos = set(eos if isinstance(eos, list | tuple) else [eos]) | {tokenizer.eos_token_id}
    return bool(tokens) and tokens[-1] in eos - {None}


def _outcome(task: Any, prompt_len: int, teacher: RequestRun, base: RequestRun) -> Outcome | None:
    """None when the teacher fails the checker (no budget can save the request)."""
    if teacher.passed is False:
        return None
    wrong = first_wrong(teacher.tokens, base.tokens)
    failed = (base.passed is False) if base.passed is not None else wrong is not None
    return Outcome(task.name, prompt_len, failed, wrong, base.risks, base.heads)


@dataclass
class GuardReport:
    """What :func:`evaluate` measured (the fields :func:`format_report` prints)."""

    ratio: float
    requests: int
    left_out: int
    threshold: float
    aurocs: dict[str, dict[int, float]]
    table: list[dict[str, Any]]
    recovered: list[dict[str, Any]]
    fit_requests: int = 0
    weights: tuple[float, ...] | None = None  # fitted on the fit seed (None: the defaults)
    bias: float | None = None
    early: dict[int, int] = field(default_factory=dict)  # failures scored at the prefill alone, per k
    matched: dict[str, dict[int, float]] = field(default_factory=dict)  # the same-horizon AUROC
    outcomes: list[Outcome] = field(default_factory=list)  # the report seed's requests (for --dump)
    fit_outcomes: list[Outcome] = field(default_factory=list)
    heads: tuple[tuple[int, int], ...] = ()  # the prefill signal's heads, chosen on the fit set
    saved: bool = False  # the weights, heads and threshold came from a saved fit (``--fit``)
    threshold_rule: str = "midpoint"  # where a fitted threshold sits (:func:`fit_threshold`)
    threshold_given: bool = False  # the threshold was given (``--threshold``), not fitted
    #: per policy row of :attr:`table` (fixed budgets and guard policies), each kept request's result:
    #: ``{"name", "passed", "memory", "seconds", "raised"}`` (for --dump: which requests a policy saved)
    per_request: dict[str, list[dict[str, Any]]] = field(default_factory=dict)


def _base_pass(model, tokenizer, tasks, ratio, guard_cfg, progress) -> tuple[list, list, list]:
    from h2o_lens.config import H2OConfig

    teachers, bases, outcomes = [], [], []
    for task in tasks:
        teacher = run_request(model, tokenizer, task)
        progress()
        base = run_request(model, tokenizer, task, H2OConfig(ratio=ratio), guard_cfg)
        progress()
        p = len(tokenizer(task.chat_text(tokenizer), add_special_tokens=False).input_ids)
        teachers.append(teacher)
        bases.append(base)
        outcomes.append(_outcome(task, p, teacher, base))
    return teachers, bases, outcomes


def evaluate(
    model: Any,
    tokenizer: Any,
    tasks: list[Any],
    fit_tasks: list[Any],
    *,
    ratio: float = 0.2,
    budgets: Sequence[float] = BUDGETS,
    policies: Sequence[tuple] = POLICIES,
    ks: Sequence[int] = KS,
    threshold: float | None = None,
    heads: int = HEADS,
    given: dict[str, Any] | None = None,
    threshold_rule: str = "midpoint",
    progress: Callable[[str], None] = lambda msg: None,
) -> GuardReport:
    """Run the bench's generations and measure (:mod:`commands.benchmarks.guard` says what);
    ``threshold`` given: the guard acts at it, and ``fit_tasks`` only count; ``heads`` the layers
    and KV sets the ``prefill`` signal reads, chosen on ``fit_tasks`` (0: all of them); ``given`` a
    fit made elsewhere (:func:`~.guard_fit.read_fit`: weights, bias, heads, threshold), used instead
    of fitting (``threshold`` still wins); ``threshold_rule`` where a fitted threshold sits
    (:func:`~.guard_fit.fit_threshold`)."""
    from h2o_lens.guard import SIGNALS

    given_threshold = threshold is not None
    fixed = [b for b in budgets if b < 1.0 and b != ratio]
    fitting = given is None and bool(fit_tasks)
    # the generations to run: the fit pass, the base pass, then per kept request the fixed budgets
    # (the base ratio and the full cache are the base pass's own) and the policies
    count = _Count(2 * len(fit_tasks) * fitting + len(tasks) * (2 + len(fixed) + len(policies)), progress)
    fit, fitted, chosen, threshold, logging = _fit_pass(
        model, tokenizer, fit_tasks, ratio, heads, given, threshold, threshold_rule, count.tick
    )
    weights, bias = fitted if fitted is not None else _default_weights()
    teachers, bases, outcomes = _base_pass(model, tokenizer, tasks, ratio, logging, count.tick)
    kept = [i for i, o in enumerate(outcomes) if o is not None]
    count.total = count.done + len(kept) * (len(fixed) + len(policies))  # the requests left out run no more
    outs = [outcomes[i] for i in kept]
    _reprefill(outs, chosen)
    _rescore(outs, weights, bias)
    labels = [o.failed for o in outs]
    names = ("risk", *(("fitted",) if fitted is not None else ()), *SIGNALS, *(("all heads",) if chosen else ()))
    runs = _Runs(model, tokenizer, tasks, teachers, bases, outcomes, kept, count.tick)
    runs.fixed_budgets(budgets, ratio)
    guard = dict(weights=tuple(weights), bias=bias, heads=chosen, signal_rows=logging.signal_rows)
    recovered = runs.guard_policies(policies, threshold, ratio, guard)
    if not any(r["policy"] == f"fixed {ratio:.0%}" for r in runs.table):
        runs.add(f"fixed {ratio:.0%}", {i: bases[i] for i in kept}, first=True)
    return GuardReport(
        ratio,
        len(kept),
        len(tasks) - len(kept),
        threshold,
        {name: {k: auroc(_scores(outs, k, name), labels) for k in ks} for name in names},
        runs.table,
        recovered,
        fit_requests=len(fit),
        threshold_rule=threshold_rule,
        threshold_given=given_threshold,
        weights=None if fitted is None else tuple(weights),
        bias=None if fitted is None else bias,
        early={k: sum(1 for o in outs if o.failed and o.wrong is not None and o.wrong < k) for k in ks},
        matched={name: {k: _matched(outs, k, name) for k in ks} for name in names},
        outcomes=outs,
        fit_outcomes=fit,
        heads=chosen,
        saved=given is not None,
        per_request={row["policy"]: runs.per_request[row["policy"]] for row in runs.table},
    )


class _Count:
    """The generations run so far of ``total``, reported through ``progress``."""

    def __init__(self, total: int, progress: Callable[[str], None]):
        self.done, self.total, self.progress = 0, total, progress

    def tick(self) -> None:
        self.done += 1
        self.progress(f"{self.done}/{self.total} generations")


def _default_weights() -> tuple[tuple[float, ...], float]:
    from h2o_lens.guard import DEFAULT_BIAS, DEFAULT_WEIGHTS

    return tuple(DEFAULT_WEIGHTS), DEFAULT_BIAS


def _fit_pass(model, tokenizer, fit_tasks, ratio, heads, given, threshold, threshold_rule, tick):
    """The guard's weights, heads and threshold: ``given`` (a saved fit), or fitted on ``fit_tasks``
    (their base pass: the heads, the weights, then the threshold unless ``threshold`` is given).
    Returns ``(fit outcomes, (weights, bias) or None, heads, threshold, logging GuardConfig)``."""
    from h2o_lens.guard import GuardConfig

    logging = GuardConfig()
    fit, fitted, chosen = [], None, ()
    if given is not None:
        fitted, chosen = (given["weights"], given["bias"]), tuple(given["heads"])
        threshold = given["threshold"] if threshold is None else threshold
        if given["signal_rows"] != logging.signal_rows:
            logging = GuardConfig(signal_rows=given["signal_rows"])
    elif fit_tasks:
        _, _, fit = _base_pass(model, tokenizer, fit_tasks, ratio, logging, tick)
        fit = [o for o in fit if o is not None]
        chosen = select_heads(fit, heads)
        _reprefill(fit, chosen)
        rows, labels, sample_weights = matched_features(fit, 4)  # each pair over the same horizon
        fitted = fit_weights(rows, labels, sample_weights=sample_weights)
    weights, bias = fitted if fitted is not None else _default_weights()
    if fit and threshold is None and given is None:
        _rescore(fit, weights, bias)
        threshold = fit_threshold(_scores(fit, 4, "fitted"), [o.failed for o in fit], threshold_rule)
    return fit, fitted, chosen, 1.0 if threshold is None else threshold, logging


class _Runs:
    """The base pass's runs of the kept requests, and the table rows of the budgets and policies run on them."""

    def __init__(self, model, tokenizer, tasks, teachers, bases, outcomes, kept, tick):
        self.model, self.tokenizer, self.tasks, self.tick = model, tokenizer, tasks, tick
        self.teachers, self.bases, self.outcomes, self.kept = teachers, bases, outcomes, kept
        self.table: list[dict[str, Any]] = []
        self.per_request: dict[str, list[dict[str, Any]]] = {}

    def verdict(self, run: RequestRun, i: int) -> bool:
        if run.passed is not None:
            return run.passed
        return first_wrong(self.teachers[i].tokens, run.tokens) is None

    def add(self, policy: str, runs: dict[int, RequestRun], first: bool = False) -> dict[str, Any]:
        """A table row of ``runs`` and each request's result in it."""
        row = _row(policy, runs, self.verdict)
        self.table.insert(0 if first else len(self.table), row)
        self.per_request[policy] = [
            {
                "name": self.outcomes[i].name,
                "passed": bool(self.verdict(r, i)),
                "memory": r.memory,
                "seconds": r.seconds,
                "raised": bool(r.events),
                "cut": r.cut,
            }
            for i, r in runs.items()
        ]
        return row

    def fixed_budgets(self, budgets: Sequence[float], ratio: float) -> None:
        from h2o_lens.config import H2OConfig

        for b in budgets:
            runs = {}
            for i in self.kept:
                if b >= 1.0:
                    runs[i] = self.teachers[i]  # the full cache: the teacher's own run
                elif b == ratio:
                    runs[i] = self.bases[i]
                else:
                    runs[i] = run_request(self.model, self.tokenizer, self.tasks[i], H2OConfig(ratio=b))
                    self.tick()
            self.add(f"fixed {b:.0%}", runs)

    def guard_policies(self, policies, threshold: float, ratio: float, guard: dict[str, Any]) -> list[dict[str, Any]]:
        """Run each guard policy on the kept requests; per policy how many base failures it recovered."""
        from h2o_lens.config import H2OConfig
        from h2o_lens.guard import GuardConfig

        recovered = []
        failures = [i for i in self.kept if self.outcomes[i].failed]
        from ..options import guard_target

        for action, target, rescue, *own in policies:
            level = own[0] if own else threshold
            cfg = GuardConfig(action=action, threshold=level, rescue=rescue, **guard_target(action, target), **guard)
            runs = {}
            for i in self.kept:
                runs[i] = run_request(self.model, self.tokenizer, self.tasks[i], H2OConfig(ratio=ratio), cfg)
                self.tick()
            row = self.add(f"guard {_arm(action, target, rescue)} @{level:.3f}", runs)
            row["raised"] = sum(1 for r in runs.values() if r.events)
            saved = [i for i in failures if self.verdict(runs[i], i)]
            recovered.append(
                {
                    "policy": row["policy"],
                    "failures": len(failures),
                    "recovered": len(saved),
                    "memory": row["memory"],
                    "seconds": row["seconds"],
                    "guard_share": sum(r.guard_seconds for r in runs.values())
                    / max(1e-9, sum(r.seconds for r in runs.values())),
                    "cut": sum(1 for i in failures if not self.verdict(runs[i], i) and runs[i].cut),
                }
            )
        return recovered


def _arm(action: str, target: float, rescue: float) -> str:
    """A guard policy's name in the tables: ``raise->35%+15% pinned``, ``recall+5%`` (a window of 5 %
    of the prompt) or ``recall+16`` (of 16 slots)."""
    if action == "recall":
        return f"recall+{target}" if isinstance(target, int) else f"recall+{target:.0%}"
    return f"{action}->{target:.0%}" + (f"+{rescue:.0%} pinned" if rescue else "")


def _row(policy: str, runs: dict[int, RequestRun], verdict: Callable[[RequestRun, int], bool]) -> dict[str, Any]:
    n = max(1, len(runs))
    right = {i: verdict(r, i) for i, r in runs.items()}
    return {
        "policy": policy,
        "accuracy": sum(right.values()) / n,
        "memory": sum(r.memory for r in runs.values()) / n,
        "seconds": sum(r.seconds for r in runs.values()) / n,
        "wrong": sum(1 for ok in right.values() if not ok),
        "cut": sum(1 for i, r in runs.items() if not right[i] and r.cut),  # of them, cut at the limit
    }


def format_report(report: GuardReport) -> str:
    """The bench's printout."""
    lines = [
        f"base budget {report.ratio:.0%}: {report.requests} request{'' if report.requests == 1 else 's'} "
        f"({report.left_out} left out: the full cache fails them); threshold {report.threshold:.3f} "
        + (
            "given; the weights "
            + (
                "of the saved fit"
                if report.saved
                else f"fitted on {report.fit_requests} other requests"
                if report.fit_requests
                else "by default"
            )
            if report.threshold_given
            else "from the saved fit"
            if report.saved
            else f"fitted on {report.fit_requests} other requests"
            + (
                _one_class(report.fit_outcomes, "the fit set", ": it never acts")
                or f" (the fit set; the {report.threshold_rule} of its gap)"
            )
            if report.fit_requests
            else "(not fitted)"
        ),
        "",
    ]
    undefined = _one_class(report.outcomes, "these requests", "")
    if undefined:
        # an AUROC ranks failing against passing requests: a table of nan would only hide why
        lines.append(f"AUROC: not defined{undefined}")
    else:
        lines += [
            "AUROC of the warning score (highest risk >= k steps before the first wrong token; the prefill's "
            "risk always counts) vs failure",
            "failures first wrong within k tokens (scored at the prefill alone): "
            + ", ".join(f"k={k}: {n}" for k, n in report.early.items()),
            f"{'signal':>10} " + " ".join(f"{'k=' + str(k):>7}" for k in next(iter(report.aurocs.values()))),
        ]
        for name, by_k in report.aurocs.items():
            lines.append(f"{name:>10} " + " ".join(f"{v:>7.3f}" for v in by_k.values()))
    if report.matched and not undefined:
        lines += [
            "",
            "AUROC over the same horizon (each failing/passing pair scored over the steps before the failure's "
            "first wrong token, k early)",
        ]
        for name, by_k in report.matched.items():
            lines.append(f"{name:>10} " + " ".join(f"{v:>7.3f}" for v in by_k.values()))
    if report.weights is not None:
        from h2o_lens.guard import SIGNALS

        fitted = ", ".join(f"{n} {w:+.2f}" for n, w in zip(SIGNALS, report.weights))
        where = "of the saved fit" if report.saved else "fitted on the fit set"
        lines += ["", f"weights {where}: bias {report.bias:+.2f}, {fitted}"]
    if report.heads:
        lines.append(
            f"prefill heads (layer.KV set) {'of the saved fit' if report.saved else 'chosen on the fit set'}: "
            + " ".join(f"{a}.{b}" for a, b in report.heads)
        )
    if report.weights is not None:
        cfg = (
            f"weights=({', '.join(f'{w:.3g}' for w in report.weights)},), bias={report.bias:.3g}, "
            f"heads={report.heads!r}, threshold={report.threshold:.3g}"
        )
        lines.append(f"to run the fitted guard: GuardConfig(action=..., raise_ratio=..., {cfg})")
    lines += [
        "",
        "wrong, cut: of the wrong answers, those that stopped at the new-token limit (not at an end token)",
        f"{'policy':>38} {'accuracy':>9} {'mean KV':>8} {'s/request':>10} {'wrong, cut':>11}",
    ]
    for row in report.table:
        wrong = f"{row.get('wrong', 0)}, {row.get('cut', 0)}"
        lines.append(
            f"{row['policy']:>38} {row['accuracy']:>9.1%} {row['memory']:>8.1%} {row['seconds']:>10.2f} {wrong:>11}"
            + (f"  {'opened' if ' recall+' in row['policy'] else 'raised'} {row['raised']}" if "raised" in row else "")
        )
    lines.append("")
    for r in report.recovered:
        cost = f"mean KV {r['memory']:.1%}, {r['seconds']:.2f} s/request (guard {r['guard_share']:.1%} of it)"
        if not r["failures"]:
            lines.append(f"{r['policy']}: no H2O failure to recover; {cost}")
            continue
        lines.append(
            f"{r['policy']}: recovered {r['recovered']} of {r['failures']} H2O failures "
            f"({r['recovered'] / r['failures']:.0%}) at {cost}"
            + (f"; {r['cut']} of the rest stopped at the new-token limit" if r.get("cut") else "")
        )
    return "\n".join(lines)


def _one_class(outcomes: list[Outcome], what: str, then: str) -> str:
    """``""`` when ``outcomes`` hold failing and passing requests; else why a ranking of failure
    against passing is not defined on them (``then``: what follows from that)."""
    failing = sum(1 for o in outcomes if o.failed)
    if outcomes and 0 < failing < len(outcomes):
        return ""
    n = len(outcomes)
    if not n:
        return f" ({what} keep no request: the full cache fails every one){then}"
    verb = ("fail" if failing else "pass") + ("s" if n == 1 else "")
    return f" ({what}: {n} {verb} at the base budget, none {'passes' if failing else 'fails'}){then}"
