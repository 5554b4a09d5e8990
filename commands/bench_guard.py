"""``h2o-lens bench guard``: does the guard's risk see failures coming, and does a raise save them (DESIGN.md §18.6).

For every request of ``--tasks`` (greedy, one request at a time): the full-cache teacher, H2O at
``--ratio`` with the guard logging its risk, H2O at each fixed budget, and H2O under each of the
guard's policies (:data:`POLICIES`, ``--guard-policies``). A request fails when its checker says
so (the teacher's first divergence where it has no checker); a request whose teacher fails its
checker is left out, as no budget can save it. It prints:

- the AUROC of the risk taken ``k`` steps before the first wrong token (k = 1, 4, 16) against
  failure, for the default weights, the fitted ones and each signal alone (:func:`warning_score`;
  the prefill's risk always counts);
- accuracy against mean KV slots (a share of the full cache's) for the fixed budgets and the
  guard's policies, on the same requests;
- how many of H2O's failures at ``--ratio`` each guard policy recovered, at what mean memory and
  time per request.

The heads the ``prefill`` signal reads (the ``--heads`` layers and KV sets whose lost share at the
prefill best ranks the failures, :func:`select_heads`), the weights (an L2-regularised logistic
regression of failure on each signal's warning score at k = 4, :func:`fit_weights`) and the
threshold (the best TPR − FPR of the fitted risk's warning score at k = 4; 1.0, never act, when
none beats chance) are fitted on the requests of ``--seed + 1``, and the guard runs with them on
those of ``--seed`` (DESIGN.md §18.6).
"""

from __future__ import annotations

import dataclasses
import functools
import math
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch

__all__ = [
    "KS",
    "BUDGETS",
    "auroc",
    "first_wrong",
    "warning_score",
    "matched_auroc",
    "fit_threshold",
    "THRESHOLD_RULES",
    "select_heads",
    "RequestRun",
    "run_request",
    "evaluate",
    "format_report",
    "bench_guard",
    "write_fit",
    "read_fit",
]

KS = (1, 4, 16)
BUDGETS = (0.05, 0.1, 0.2, 0.35, 0.5, 1.0)
#: the guard's policies the bench runs: (action, target keep ratio, rescue share[, threshold]), DESIGN.md
#: §18.2; a policy with its own threshold acts at it instead of the fitted (or given) one
POLICIES = (("raise", 0.35, 0.15), ("raise", 0.5, 0.0), ("refill", 1.0, 0.0))
#: the heads the fitted ``prefill`` signal reads (DESIGN.md §18.1)
HEADS = 5


def auroc(scores: Sequence[float], labels: Sequence[bool]) -> float:
    """The area under the ROC curve of ``scores`` for the positive ``labels`` (a tie counts a half);
    NaN when one class is empty."""
    pos = [s for s, y in zip(scores, labels) if y]
    neg = [s for s, y in zip(scores, labels) if not y]
    if not pos or not neg:
        return float("nan")
    wins = sum((p > n) + 0.5 * (p == n) for p in pos for n in neg)
    return wins / (len(pos) * len(neg))


def first_wrong(teacher: Sequence[int], run: Sequence[int]) -> int | None:
    """Index of the first generated token where ``run`` leaves ``teacher`` (a sequence that ends
    first diverges where it ends); None when they agree."""
    for i, (a, b) in enumerate(zip(teacher, run)):
        if a != b:
            return i
    return None if len(teacher) == len(run) else min(len(teacher), len(run))


def warning_score(risks: Sequence[tuple[int, float]], prompt_len: int, wrong: int | None, k: int) -> float:
    """The highest risk a guard had seen at least ``k`` steps before the first wrong token.

    ``risks`` are ``(step, risk)`` of the scored steps, the prefill's at ``P − 1``; the step at
    position ``s`` gives the token of index ``s − P + 1``, so generated token ``j`` follows the
    risks of the steps ``s ≤ P + j − 1``; ``k`` steps before it, those ``s ≤ P + j − 1 − k``.
    The prefill's risk always counts: it comes before anything of the prompt is evicted, the
    earliest point a guard can act, and a first wrong token within ``k`` of the prompt (token 0
    never is: it reads the whole prompt) has nothing earlier. A request without a wrong token
    takes its highest risk over the whole generation: a guard that fires on it at any step is a
    false alarm. 0 when no step qualifies.
    """
    last = math.inf if wrong is None else max(prompt_len - 1, prompt_len + wrong - 1 - k)
    seen = [r for s, r in risks if s <= last]
    return max(seen) if seen else 0.0


def matched_auroc(
    risks: Sequence[Sequence[tuple[int, float]]],
    prompt_lens: Sequence[int],
    wrongs: Sequence[int | None],
    labels: Sequence[bool],
    k: int,
) -> float:
    """The AUROC with both classes scored over the same horizon: each (failing, passing) pair
    compares the failure's :func:`warning_score` with the passing request's over the steps before
    the failure's own first wrong token (``k`` early), so a signal that grows with the length of
    the generation earns nothing from a passing request's longer window (a tie counts a half);
    NaN when one class is empty. A failure without a wrong token compares whole generations."""
    fails = [i for i, y in enumerate(labels) if y]
    passes = [i for i, y in enumerate(labels) if not y]
    if not fails or not passes:
        return float("nan")
    wins = 0.0
    for f in fails:
        sf = warning_score(risks[f], prompt_lens[f], wrongs[f], k)
        for p in passes:
            sp = warning_score(risks[p], prompt_lens[p], wrongs[f], k)
            wins += (sf > sp) + 0.5 * (sf == sp)
    return wins / (len(fails) * len(passes))


def fit_weights(
    features: Sequence[Sequence[float]],
    labels: Sequence[bool],
    l2: float = 0.05,
    sample_weights: Sequence[float] | None = None,
):
    """``(weights, bias)`` of an L2-regularised logistic regression of ``labels`` on ``features``
    (per request, each signal's warning score), each row counted ``sample_weights`` times (once
    without); None when one class is empty. The guard's risk with these weights is the same
    logistic per step (DESIGN.md §18.3)."""
    pos = sum(labels)
    if not pos or pos == len(labels):
        return None
    raw = torch.tensor(features, dtype=torch.float64)
    y = torch.tensor([float(v) for v in labels], dtype=torch.float64)
    sw = torch.ones(len(labels), dtype=torch.float64) if sample_weights is None else torch.tensor(sample_weights)
    sw = sw.to(torch.float64) / sw.sum() * len(labels)
    # standardised features: the penalty weighs every signal alike, whatever its range (the prefill
    # signal moves by hundredths); the weights are mapped back to the raw signals below
    mean = (raw * sw[:, None]).sum(0) / sw.sum()
    std = ((((raw - mean) ** 2) * sw[:, None]).sum(0) / sw.sum()).sqrt()
    std = torch.where(std > 1e-12, std, torch.ones_like(std))
    x = (raw - mean) / std
    w = torch.zeros(x.shape[1], dtype=torch.float64, requires_grad=True)
    b = torch.zeros((), dtype=torch.float64, requires_grad=True)
    opt = torch.optim.LBFGS([w, b], max_iter=200, line_search_fn="strong_wolfe")

    def loss():
        opt.zero_grad()
        z = x @ w + b
        value = torch.nn.functional.binary_cross_entropy_with_logits(z, y, weight=sw) + l2 * (w * w).sum()
        value.backward()
        return value

    with torch.enable_grad():
        opt.step(loss)
    scaled = w.detach() / std
    return tuple(float(v) for v in scaled), float(b.detach() - (scaled * mean).sum())


#: where the fitted threshold sits in the fit set's gap (DESIGN.md §18.6): ``midpoint``, halfway
#: between the lowest score the best TPR − FPR flags and the highest one below it; ``lowest``, at
#: the lowest flagged score (the rule of DESIGN.md §18.3's figures marked so)
THRESHOLD_RULES = ("midpoint", "lowest")


def fit_threshold(scores: Sequence[float], labels: Sequence[bool], rule: str = "midpoint") -> float:
    """The threshold with the best TPR − FPR over ``scores`` (the lowest of equals), placed by
    ``rule`` (:data:`THRESHOLD_RULES`): at the midpoint of the gap below that score, or at the score
    itself. Both flag the same fit requests; the midpoint leaves a margin on either side for
    requests the fit has not seen. 1.0 (never act) when one class is empty or no threshold does
    better than chance (TPR − FPR <= 0)."""
    if rule not in THRESHOLD_RULES:
        raise ValueError(f"threshold rule {rule!r}: expected one of {', '.join(THRESHOLD_RULES)}")
    pos = sum(labels)
    neg = len(labels) - pos
    if not pos or not neg:
        return 1.0
    best, best_t = -math.inf, 1.0
    for t in sorted(set(scores)):
        tpr = sum(1 for s, y in zip(scores, labels) if y and s >= t) / pos
        fpr = sum(1 for s, y in zip(scores, labels) if not y and s >= t) / neg
        if tpr - fpr > best:
            best, best_t = tpr - fpr, t
    if best <= 0:
        return 1.0
    below = [s for s in scores if s < best_t]
    return (max(below) + best_t) / 2 if rule == "midpoint" and below else best_t


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


class _Slots:
    """A cache listener that counts the slots layer 0's first KV set holds after each decode step."""

    def __init__(self):
        self.held: list[int] = []

    def on_prefill(self, layer: int, ev: Any) -> None:
        pass

    def on_decode(self, layer: int, ev: Any) -> None:
        if layer == 0:
            self.held.append(int((ev.kept[0, 0] >= 0).sum()))


def run_request(model: Any, tokenizer: Any, task: Any, config: Any = None, guard: Any = None) -> RequestRun:
    """Generate ``task`` greedily: the full cache when ``config`` is None, else H2O under ``config``
    (with the guard of ``guard``, a :class:`~h2o_lens.guard.GuardConfig`, when given)."""
    import contextlib

    from h2o_lens.guard import guarded
    from h2o_lens.runtime import h2o

    ids = tokenizer(task.chat_text(tokenizer), return_tensors="pt", add_special_tokens=False).input_ids
    prompt_len = ids.shape[1]
    pad = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else tokenizer.eos_token_id
    slots = _Slots()
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


@dataclass
class Outcome:
    """A request's fate at the base budget: its failure label, first wrong token and risks."""

    name: str
    prompt_len: int
    failed: bool
    wrong: int | None
    risks: list[dict[str, Any]]
    heads: list[list[float]] = field(default_factory=list)  # the lost share per layer and KV set


def _outcome(task: Any, prompt_len: int, teacher: RequestRun, base: RequestRun) -> Outcome | None:
    """None when the teacher fails the checker (no budget can save the request)."""
    if teacher.passed is False:
        return None
    wrong = first_wrong(teacher.tokens, base.tokens)
    failed = (base.passed is False) if base.passed is not None else wrong is not None
    return Outcome(task.name, prompt_len, failed, wrong, base.risks, base.heads)


def _score(o: Outcome, k: int, key: str = "risk") -> float:
    return warning_score([(r["step"], r[key]) for r in o.risks], o.prompt_len, o.wrong if o.failed else None, k)


def _scores(outcomes: list[Outcome], k: int, key: str = "risk") -> list[float]:
    return [_score(o, k, key) for o in outcomes]


def _matched(outcomes: list[Outcome], k: int, key: str = "risk") -> float:
    return matched_auroc(
        [[(r["step"], r[key]) for r in o.risks] for o in outcomes],
        [o.prompt_len for o in outcomes],
        [o.wrong for o in outcomes],
        [o.failed for o in outcomes],
        k,
    )


def matched_features(outcomes: list[Outcome], k: int = 4) -> tuple[list[list[float]], list[bool], list[float]]:
    """The fit's rows over the same horizon (DESIGN.md §18.6): a failing request's warning score
    of each signal before its own first wrong token (``k`` early), and a passing request's over
    the same steps once per failure onset, each such row weighted ``1 / failures`` (a passing
    request counts once in all). ``(features, labels, sample weights)``."""
    from h2o_lens.guard import SIGNALS

    onsets = [o.wrong for o in outcomes if o.failed]
    rows, labels, weights = [], [], []
    for o in outcomes:
        for j in [o.wrong] if o.failed else onsets:
            rows.append(
                [warning_score([(r["step"], r[name]) for r in o.risks], o.prompt_len, j, k) for name in SIGNALS]
            )
            labels.append(o.failed)
            weights.append(1.0 if o.failed else 1.0 / len(onsets))
    return rows, labels, weights


def select_heads(outcomes: list[Outcome], count: int) -> tuple[tuple[int, int], ...]:
    """The ``count`` ``(layer, KV set)`` pairs whose lost share at the prefill ranks ``outcomes``'
    failures best, in that order: the highest AUROC, and among equals (a few requests give many)
    the larger gap between the failing and passing means over their pooled standard deviation,
    then the lower index. The heads that read back, for the fitted ``prefill`` signal (DESIGN.md
    §18.1); () when ``count`` is 0, the outcomes carry no shares or one class is empty."""
    have = [o for o in outcomes if o.heads]
    labels = [o.failed for o in have]
    if count <= 0 or not have or all(labels) or not any(labels):
        return ()
    n_sets = len(have[0].heads[0])
    x = torch.tensor([[v for layer in o.heads for v in layer] for o in have], dtype=torch.float64)
    y = torch.tensor(labels)
    gap = x[y].mean(0) - x[~y].mean(0)
    spread = ((x[y].var(0, correction=0) + x[~y].var(0, correction=0)) / 2).sqrt().clamp_min(1e-12)
    effect = (gap / spread).tolist()
    areas = [auroc(x[:, j].tolist(), labels) for j in range(x.shape[1])]
    ranked = sorted(range(x.shape[1]), key=lambda j: (-areas[j], -effect[j], j))
    return tuple((j // n_sets, j % n_sets) for j in ranked[:count])


def _reprefill(outcomes: list[Outcome], heads: tuple[tuple[int, int], ...]) -> None:
    """Give every logged step the ``prefill`` signal over ``heads`` (what a guard with those heads
    logs), keeping the all-heads value as ``all heads``."""
    from h2o_lens.guard import head_signal

    for o in outcomes:
        if not o.heads:
            continue
        value = float(head_signal(torch.tensor([o.heads]), heads)[0])
        for r in o.risks:
            r.setdefault("all heads", r["prefill"])
            r["prefill"] = value


def _rescore(outcomes: list[Outcome], weights: Sequence[float], bias: float) -> None:
    """Add ``fitted``, the risk with ``weights`` and ``bias``, to every logged step."""
    from h2o_lens.guard import SIGNALS

    for o in outcomes:
        for r in o.risks:
            z = bias + sum(w * r[name] for w, name in zip(weights, SIGNALS))
            r["fitted"] = 1.0 / (1.0 + math.exp(-max(-500.0, min(500.0, z))))


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
    """Run the bench's generations and measure (the module docstring says what); ``threshold``
    given: the guard acts at it, and ``fit_tasks`` only count; ``heads`` the layers and KV sets
    the ``prefill`` signal reads, chosen on ``fit_tasks`` (0: all of them); ``given`` a fit made
    elsewhere (:func:`read_fit`: weights, bias, heads, threshold), used instead of fitting
    (``threshold`` still wins); ``threshold_rule`` where a fitted threshold sits
    (:func:`fit_threshold`)."""
    from h2o_lens.config import H2OConfig
    from h2o_lens.guard import DEFAULT_BIAS, DEFAULT_WEIGHTS, SIGNALS, GuardConfig

    logging = GuardConfig()
    fixed = [b for b in budgets if b < 1.0 and b != ratio]
    fitting = given is None and bool(fit_tasks)
    # the generations to run: the fit pass, the base pass, then per kept request the fixed budgets
    # (the base ratio and the full cache are the base pass's own) and the policies
    done, total = [0], [2 * len(fit_tasks) * fitting + len(tasks) * (2 + len(fixed) + len(policies))]

    def tick():
        done[0] += 1
        progress(f"{done[0]}/{total[0]} generations")

    fit, fitted, chosen = [], None, ()
    given_threshold = threshold is not None
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
        rows, labels, weights = matched_features(fit, 4)  # each pair over the same horizon
        fitted = fit_weights(rows, labels, sample_weights=weights)
    weights, bias = fitted if fitted is not None else (DEFAULT_WEIGHTS, DEFAULT_BIAS)
    if fit and threshold is None and given is None:
        _rescore(fit, weights, bias)
        threshold = fit_threshold(_scores(fit, 4, "fitted"), [o.failed for o in fit], threshold_rule)
    threshold = 1.0 if threshold is None else threshold
    teachers, bases, outcomes = _base_pass(model, tokenizer, tasks, ratio, logging, tick)
    kept = [i for i, o in enumerate(outcomes) if o is not None]
    total[0] = done[0] + len(kept) * (len(fixed) + len(policies))  # the requests left out run no more
    outs = [outcomes[i] for i in kept]
    _reprefill(outs, chosen)
    _rescore(outs, weights, bias)
    labels = [o.failed for o in outs]
    names = ("risk", *(("fitted",) if fitted is not None else ()), *SIGNALS, *(("all heads",) if chosen else ()))
    aurocs = {name: {k: auroc(_scores(outs, k, name), labels) for k in ks} for name in names}
    matched = {name: {k: _matched(outs, k, name) for k in ks} for name in names}
    early = {k: sum(1 for o in outs if o.failed and o.wrong is not None and o.wrong < k) for k in ks}

    def verdict(run: RequestRun, i: int) -> bool:
        if run.passed is not None:
            return run.passed
        return first_wrong(teachers[i].tokens, run.tokens) is None

    table = []
    per_request: dict[str, list[dict[str, Any]]] = {}

    def results(policy: str, runs: dict[int, RequestRun]) -> None:
        per_request[policy] = [
            {
                "name": outcomes[i].name,
                "passed": bool(verdict(r, i)),
                "memory": r.memory,
                "seconds": r.seconds,
                "raised": bool(r.events),
                "cut": r.cut,
            }
            for i, r in runs.items()
        ]

    for b in budgets:
        runs = {}
        for i in kept:
            if b >= 1.0:
                runs[i] = teachers[i]  # the full cache: the teacher's own run
            elif b == ratio:
                runs[i] = bases[i]
            else:
                runs[i] = run_request(model, tokenizer, tasks[i], H2OConfig(ratio=b))
                tick()
        table.append(_row(f"fixed {b:.0%}", runs, verdict))
        results(table[-1]["policy"], runs)
    recovered = []
    failures = [i for i, o in zip(kept, outs) if o.failed]
    for action, target, rescue, *own in policies:
        level = own[0] if own else threshold
        cfg = GuardConfig(
            action=action,
            threshold=level,
            raise_ratio=target,
            rescue=rescue,
            weights=tuple(weights),
            bias=bias,
            heads=chosen,
            signal_rows=logging.signal_rows,
        )
        runs = {}
        for i in kept:
            runs[i] = run_request(model, tokenizer, tasks[i], H2OConfig(ratio=ratio), cfg)
            tick()
        pinned = f"+{rescue:.0%} pinned" if rescue else ""
        row = _row(f"guard {action}->{target:.0%}{pinned} @{level:.3f}", runs, verdict)
        row["raised"] = sum(1 for r in runs.values() if r.events)
        table.append(row)
        results(row["policy"], runs)
        saved = [i for i in failures if verdict(runs[i], i)]
        recovered.append(
            {
                "policy": row["policy"],
                "failures": len(failures),
                "recovered": len(saved),
                "memory": row["memory"],
                "seconds": row["seconds"],
                "guard_share": sum(r.guard_seconds for r in runs.values())
                / max(1e-9, sum(r.seconds for r in runs.values())),
                "cut": sum(1 for i in failures if not verdict(runs[i], i) and runs[i].cut),
            }
        )
    base_row = next((r for r in table if r["policy"] == f"fixed {ratio:.0%}"), None)
    if base_row is None:
        table.insert(0, _row(f"fixed {ratio:.0%}", {i: bases[i] for i in kept}, verdict))
        results(table[0]["policy"], {i: bases[i] for i in kept})
    return GuardReport(
        ratio,
        len(kept),
        len(tasks) - len(kept),
        threshold,
        aurocs,
        table,
        recovered,
        fit_requests=len(fit),
        threshold_rule=threshold_rule,
        threshold_given=given_threshold,
        weights=None if fitted is None else tuple(weights),
        bias=None if fitted is None else bias,
        early=early,
        matched=matched,
        outcomes=outs,
        fit_outcomes=fit,
        heads=chosen,
        saved=given is not None,
        per_request={row["policy"]: per_request[row["policy"]] for row in table},
    )


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
            + (f"  raised {row['raised']}" if "raised" in row else "")
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


def bench_guard(
    model_name: str | None = None,
    tasks: str = "builtin:small",
    ratio: float = 0.2,
    count: int | None = None,
    length: int | None = None,
    seed: int = 0,
    fit_seed: int | None = 1,
    policies: Sequence[tuple] = POLICIES,
    budgets: Sequence[float] = BUDGETS,
    threshold: float | None = None,
    dump: str | None = None,
    fit_tasks: str | None = None,
    heads: int = HEADS,
    save_fit: str | None = None,
    fit_file: str | None = None,
    new_tokens: int | None = None,
    threshold_rule: str | None = None,
) -> int:
    """The CLI's ``bench guard``: load the model, resolve the tasks (``seed`` and ``fit_seed``),
    evaluate and print; ``fit_tasks`` the requests the weights and threshold are fitted on
    (default: ``tasks`` at ``fit_seed`` when they are built-in; a task file has no seeds, so give
    another file of one's own traffic); ``heads`` the layers and KV sets the fitted ``prefill`` signal
    reads (0: all); ``save_fit`` a JSON file that gets the fitted guard (:func:`write_fit`; 1 is
    returned when nothing could be fitted); ``fit_file`` a fit saved so (by a run on other requests)
    to measure here instead of fitting; ``new_tokens`` each request's new-token limit instead of its
    task's (on both seeds); ``threshold_rule`` where the fitted threshold sits (:func:`fit_threshold`,
    default ``midpoint``); ``dump`` a JSON file that gets each request's outcome and per-step
    signals (both seeds), for analyses of its own. Returns 0."""
    import sys

    from h2o_lens.errors import ConfigError
    from h2o_lens.models import load_model
    from h2o_lens.tasks.builtins import resolve_tasks

    if not 0.0 < ratio < 1.0:
        raise ConfigError(f"bench guard --ratio {ratio}: expected a keep ratio between 0 and 1, such as 0.2")
    if threshold is not None and not 0.0 <= threshold <= 1.0:
        raise ConfigError(f"bench guard --threshold {threshold}: expected a risk between 0 and 1, such as 0.5")
    if heads < 0:
        raise ConfigError(f"bench guard --heads {heads}: expected how many heads to choose (0: all of them), e.g. 5")
    if new_tokens is not None and new_tokens < 1:
        raise ConfigError(f"bench guard --new-tokens {new_tokens}: expected at least 1 new token, such as 32")
    if threshold_rule is not None and (threshold is not None or fit_file is not None):
        given_by = "--threshold" if threshold is not None else "--fit"
        raise ConfigError(f"bench guard --threshold-rule places a fitted threshold; with {given_by} none is fitted")
    if threshold_rule is not None and threshold_rule not in THRESHOLD_RULES:
        raise ConfigError(
            f"bench guard --threshold-rule {threshold_rule}: expected one of {', '.join(THRESHOLD_RULES)}"
        )
    bad = [b for b in budgets if not 0.0 < b <= 1.0]
    if bad:
        raise ConfigError(f"bench guard --fixed {bad[0]}: expected keep ratios in (0, 1], such as 0.2 0.35 1.0")
    import os

    for option, path in (("--dump", dump), ("--save-fit", save_fit)):
        if path is not None and (not os.path.isdir(os.path.dirname(os.path.abspath(path))) or os.path.isdir(path)):
            raise ConfigError(
                f"bench guard {option} {path!r}: give a file path in an existing folder (checked before the runs)"
            )
    if save_fit is not None and threshold is not None:
        raise ConfigError("bench guard --save-fit saves what is fitted; with --threshold nothing is, leave one out")
    given = None
    if fit_file is not None:
        if save_fit is not None or fit_tasks is not None:
            raise ConfigError("bench guard --fit FILE measures a saved fit; leave out --save-fit and --fit-tasks")
        given = read_fit(fit_file, "bench guard --fit")
    model, tokenizer = load_model(model_name, progress=False)
    if given is not None and given["heads"]:
        from h2o_lens.guard import head_signal

        cfg = model.config.get_text_config() if hasattr(model.config, "get_text_config") else model.config
        sets = getattr(cfg, "num_key_value_heads", None) or cfg.num_attention_heads
        head_signal(torch.zeros(1, cfg.num_hidden_layers, sets), given["heads"])  # heads of another model: refused

    def resolve(spec: str, s: int) -> list[Any]:
        if not spec.startswith("builtin:"):
            got = resolve_tasks(spec, seed=s, length=length, count=count, tokenizer=tokenizer)
        else:
            names = spec.removeprefix("builtin:").split(",")  # builtin:needle,delayed_reference: both families
            got = [
                t
                for n in names
                for t in resolve_tasks(f"builtin:{n}", seed=s, length=length, count=count, tokenizer=tokenizer)
            ]
        return got if new_tokens is None else [dataclasses.replace(t, max_new_tokens=new_tokens) for t in got]

    run = resolve(tasks, seed)
    if given is not None:
        fit = []
    elif fit_tasks is not None:
        fit = resolve(fit_tasks, fit_seed if fit_seed is not None else seed + 1)
    else:
        fit = resolve(tasks, fit_seed) if fit_seed is not None and tasks.startswith("builtin:") else []
    if not fit and threshold is None and given is None:
        print(
            "bench guard: nothing to fit on (a task file has no seeds): the default weights and no action; "
            "give --fit-tasks FILE (other requests of the same traffic) or --threshold",
            file=sys.stderr,
        )

    def progress(msg: str) -> None:
        print(f"\r{msg}", end="", file=sys.stderr, flush=True)

    fitted = (
        f"the fit of {fit_file}"
        if given is not None
        else f"threshold {threshold} given"
        if threshold is not None
        else f"fit on {fit_tasks}"
        if fit_tasks is not None
        else f"fit seed {fit_seed}"
    )
    print(f"bench guard: {tasks} (seed {seed}, {fitted}), {len(run)} requests, ratio {ratio}", flush=True)
    report = evaluate(
        model,
        tokenizer,
        run,
        fit,
        ratio=ratio,
        budgets=budgets,
        policies=policies,
        threshold=threshold,
        heads=heads,
        given=given,
        threshold_rule=threshold_rule or "midpoint",
        progress=progress,
    )
    print(file=sys.stderr)
    print(format_report(report), flush=True)
    if dump:
        write_outcomes(dump, report)
        print(f"outcomes of {len(report.outcomes)} + {len(report.fit_outcomes)} requests written to {dump}")
    if save_fit:
        if report.weights is None:
            print(
                f"bench guard: nothing fitted (the fit set needs failing and passing requests); {save_fit} not written",
                file=sys.stderr,
            )
            return 1
        from h2o_lens.models import DEFAULT_MODEL

        about = {
            "model": model_name or DEFAULT_MODEL,
            "fit_tasks": fit_tasks or tasks,
            "fit_seed": fit_seed,
            "length": length,
            "count": count,
            "ratio": ratio,
            "new_tokens": new_tokens,
            "threshold_rule": report.threshold_rule,
        }
        write_fit(save_fit, report, about)
        print(f"the fitted guard written to {save_fit} (h2o-lens record --guard ... --guard-fit {save_fit})")
    return 0


def _write_json(path: str, data: Any, indent: int | None = None) -> None:
    """``data`` as JSON at ``path``, written whole to a temporary file first and renamed into place,
    so an interrupted or failed write (a full disk) leaves no half file behind."""
    import json
    import os

    tmp = f"{path}.tmp"
    try:
        with open(tmp, "w", encoding="utf-8") as f:
            json.dump(data, f, indent=indent)
        os.replace(tmp, path)
    except BaseException:
        if os.path.exists(tmp):
            os.remove(tmp)
        raise


#: the GuardConfig fields a fit file carries (:func:`write_fit`)
FIT_FIELDS = ("weights", "bias", "heads", "threshold", "signal_rows")


def write_fit(path: str, report: GuardReport, about: dict[str, Any]) -> None:
    """The fitted guard as JSON, for ``h2o-lens record --guard-fit``: the weights, bias, heads,
    threshold and the rows the ``prefill`` signal read, with ``about`` (the model, tasks, seed,
    ratio); written whole to a temporary file first. Needs fitted weights."""

    from h2o_lens.guard import GuardConfig

    fit = {
        "weights": list(report.weights),
        "bias": report.bias,
        "heads": [list(h) for h in report.heads],
        "threshold": report.threshold,
        "signal_rows": GuardConfig().signal_rows,
        **about,
    }
    _write_json(path, fit, indent=1)


def read_fit(path: str, where: str = "--guard-fit") -> dict[str, Any]:
    """A fit file of :func:`write_fit` as ``GuardConfig`` keyword arguments; a missing, malformed
    or incomplete file is refused in one sentence (:class:`~h2o_lens.errors.ConfigError`)."""
    import json

    from h2o_lens.errors import ConfigError

    try:
        with open(path, encoding="utf-8") as f:
            data = json.load(f)
    except FileNotFoundError:
        raise ConfigError(f"{where} {path!r}: no such file; write one with h2o-lens bench guard --save-fit") from None
    except (OSError, ValueError) as e:
        raise ConfigError(f"{where} {path!r}: not a readable JSON fit file ({e})") from None
    missing = [k for k in FIT_FIELDS if not isinstance(data, dict) or k not in data]
    if missing:
        raise ConfigError(
            f"{where} {path!r}: the fit file lacks {', '.join(missing)}; write it with bench guard --save-fit"
        )
    try:
        return {
            "weights": tuple(float(w) for w in data["weights"]),
            "bias": float(data["bias"]),
            "heads": tuple((int(a), int(b)) for a, b in data["heads"]),
            "threshold": float(data["threshold"]),
            "signal_rows": int(data["signal_rows"]),
        }
    except (TypeError, ValueError):
        raise ConfigError(
            f"{where} {path!r}: malformed values in the fit file; write it with bench guard --save-fit"
        ) from None


def write_outcomes(path: str, report: GuardReport) -> None:
    """The report's requests as JSON: ``{"report": [...], "fit": [...], "policies": {...}}``, each
    request's name, prompt length, failure, first wrong token and per-step signals and risk, and per
    policy of the table each request's verdict, mean KV share, seconds and whether the guard acted;
    written whole to a temporary file first, so an interrupted write leaves no half file."""
    import dataclasses

    data = {
        "ratio": report.ratio,
        "report": [dataclasses.asdict(o) for o in report.outcomes],
        "fit": [dataclasses.asdict(o) for o in report.fit_outcomes],
        "policies": report.per_request,
    }
    _write_json(path, data)


def bench_decode_guard(
    model_name: str | None = None,
    contexts: Sequence[int] = (4096,),
    batches: Sequence[int] = (1, 8),
    keep: float = 0.2,
    steps: int = 8,
    rounds: int = 3,
    model: Any = None,
    strides: Sequence[int] = (1, 8),
) -> int:
    """``bench decode --guard``: ms per decode step of H2O with the guard's signals ÷ without, per
    context and batch size, measured in alternating rounds on the same prefilled state (the guarded
    cache is a restored copy of the plain one, DESIGN.md §15.2); ``guard own`` is the share of
    the guarded step spent in the guard's own code, ``same tokens`` whether both caches decoded
    the same tokens; one row per guard ``stride`` (signals from every ``stride``-th layer). Returns 0."""
    import statistics

    from h2o_lens.config import H2OConfig
    from h2o_lens.guard import GuardConfig, guarded
    from h2o_lens.models import load_model
    from h2o_lens.runtime import h2o
    from h2o_lens.timing import Decoder, median_time

    if model is None:
        model, _ = load_model(model_name, progress=False)
    vocab = model.config.get_text_config(decoder=True).vocab_size
    gen = torch.Generator().manual_seed(0)
    cfg = H2OConfig(ratio=keep)
    print(
        f"guard overhead: H2O at {keep:.0%}, {steps} steps x {rounds} rounds alternating plain / guarded, "
        f"medians; torch {torch.__version__}, {torch.get_num_threads()} threads",
        flush=True,
    )
    print(
        f"{'context':>8} {'batch':>6} {'stride':>6} {'h2o ms/step':>12} {'guard ms/step':>14} {'ratio':>7} "
        f"{'guard own':>10} {'same tokens':>12}"
    )
    for n, b in [(n, b) for n in contexts for b in batches]:
        ctx = torch.randint(0, vocab, (b, n), generator=gen)
        with h2o(model, cfg) as session:
            plain = Decoder(model, session.new_cache(), ctx, last_logits_only=True)
            header, tensors = plain.cache.export_state()
            start = plain.token.clone()
            plain.run(2)  # warm-up
            for stride in strides:
                with guarded(GuardConfig(stride=stride)):
                    cache = session.new_cache()
                cache.import_state(header, {k: v.clone() for k, v in tensors.items()})
                guard = Decoder.__new__(Decoder)
                guard.model, guard.cache, guard.token = model, cache, start.clone()
                guard.run(2)  # warm-up; the guard's first step sizes its reservoir
                same = torch.equal(guard.token, _replay(model, header, tensors, start, 2, session))
                t_plain, t_guard = [], []
                before = cache.guard.seconds
                for _ in range(rounds):
                    t_plain.append(median_time(functools.partial(plain.run, steps), 1) / steps)
                    t_guard.append(median_time(functools.partial(guard.run, steps), 1) / steps)
                own = (cache.guard.seconds - before) / (rounds * steps)
                tp, tg = statistics.median(t_plain), statistics.median(t_guard)
                print(
                    f"{n:>8} {b:>6} {stride:>6} {tp * 1e3:>12.2f} {tg * 1e3:>14.2f} {tg / tp:>7.3f} "
                    f"{own / tg:>10.1%} {'yes' if same else 'NO':>12}",
                    flush=True,
                )
    return 0


def _replay(model: Any, header: dict, tensors: dict, token: torch.Tensor, steps: int, session: Any) -> torch.Tensor:
    """The token after ``steps`` plain decode steps from a restored copy of a saved state."""
    from h2o_lens.timing import Decoder

    cache = session.new_cache()
    cache.import_state(header, {k: v.clone() for k, v in tensors.items()})
    dec = Decoder.__new__(Decoder)
    dec.model, dec.cache, dec.token = model, cache, token.clone()
    dec.run(steps)
    return dec.token
