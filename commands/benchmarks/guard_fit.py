"""The guard bench's fitting: AUROCs of warning scores, the logistic weights, the threshold, the
prefill heads, and the fit file that carries them to ``record --guard-fit`` (DESIGN.md §18.6),
checked on reading against the model it will guard."""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

__all__ = [
    "auroc",
    "first_wrong",
    "warning_score",
    "matched_auroc",
    "fit_weights",
    "THRESHOLD_RULES",
    "fit_threshold",
    "Outcome",
    "matched_features",
    "select_heads",
    "FIT_FIELDS",
    "write_fit",
    "read_fit",
    "check_fit",
    "check_heads",
    "model_key",
    "write_outcomes",
]


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
    import torch

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
class Outcome:
    """A request's fate at the base budget: its failure label, first wrong token and risks."""

    name: str
    prompt_len: int
    failed: bool
    wrong: int | None
    risks: list[dict[str, Any]]
    heads: list[list[float]] = field(default_factory=list)  # the lost share per layer and KV set


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
    import torch

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
    import torch

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


def write_fit(path: str, report: Any, about: dict[str, Any]) -> None:
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


def read_fit(
    path: str, where: str = "--guard-fit", *, model: Any = ..., allow_other_model: bool = False
) -> dict[str, Any]:
    """A fit file of :func:`write_fit` as ``GuardConfig`` keyword arguments; a missing, malformed,
    incomplete or impossible file (weights or bias not finite, a threshold outside [0, 1], heads that
    are not pairs of whole numbers >= 0, the same head twice) is refused in one sentence
    (:class:`~h2o_lens.errors.ConfigError`). ``model`` given (a name or path as ``--model`` takes
    it, None for the default): the fit must have been made for that model unless
    ``allow_other_model``, and its heads must lie inside it (:func:`check_fit`)."""
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
    fit = _fit_values(data, f"{where} {path!r}")
    if model is not ...:
        check_fit(fit, data.get("model"), model, f"{where} {path!r}", allow_other_model)
    return fit


def _whole(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def _fit_values(data: dict[str, Any], where: str) -> dict[str, Any]:
    """The ``GuardConfig`` arguments of a fit file's ``data``, each checked (``where`` opens the error)."""
    from h2o_lens.errors import ConfigError

    try:
        weights = tuple(float(w) for w in data["weights"])
        bias, threshold = float(data["bias"]), float(data["threshold"])
        heads = [tuple(h) for h in data["heads"]]
        if isinstance(data["weights"], str | dict) or any(len(h) != 2 for h in heads):
            raise TypeError
    except (TypeError, ValueError):
        raise ConfigError(f"{where}: malformed values in the fit file; write it with bench guard --save-fit") from None
    if not all(math.isfinite(v) for v in (*weights, bias)):
        raise ConfigError(f"{where}: the weights and bias must be finite numbers, got {list(weights)} and {bias}")
    if not 0.0 <= threshold <= 1.0:
        raise ConfigError(f"{where}: the threshold is a risk in [0, 1], got {data['threshold']!r}")
    bad = [list(h) for h in heads if not all(_whole(v) and v >= 0 for v in h)]
    if bad:
        raise ConfigError(
            f"{where}: heads are [layer, KV set] pairs of whole numbers >= 0, got {bad[0]!r}; write the file "
            "with bench guard --save-fit"
        )
    if len(set(heads)) != len(heads):
        raise ConfigError(f"{where}: a head is listed twice in {[list(h) for h in heads]!r}")
    rows = data["signal_rows"]
    if not _whole(rows) or rows < 1:
        raise ConfigError(f"{where}: signal_rows is a whole number >= 1, got {rows!r}")
    return {"weights": weights, "bias": bias, "heads": tuple(heads), "threshold": threshold, "signal_rows": rows}


def model_key(name: Any) -> str:
    """What names one model whatever the spelling: the default model's name for None and its
    aliases, a folder's real path, else the name itself (a Hugging Face id)."""
    import os

    from h2o_lens.models import DEFAULT_MODEL

    if name is None or str(name).lower() in ("default", DEFAULT_MODEL.lower()):
        return DEFAULT_MODEL
    path = os.path.expanduser(str(name))
    return os.path.realpath(path) if os.path.isdir(path) else str(name)


def check_fit(fit: dict[str, Any], made_for: Any, model: Any, where: str, allow_other_model: bool = False) -> None:
    """Refuse (one sentence) a fit made for another model than ``model`` unless ``allow_other_model``,
    and heads outside ``model`` (read from its config, no weights; unchecked when the config cannot
    be read before the model loads: the guard checks its heads then)."""
    from h2o_lens.errors import ConfigError

    from .common import model_config

    if not allow_other_model and (made_for is None or model_key(made_for) != model_key(model)):
        made = "names no model" if made_for is None else f"was made for {made_for!r}"
        raise ConfigError(
            f"{where}: the fit {made}, not for the model in use ({model_key(model)!r}); its weights, heads and "
            "threshold fit that model's signals; fit again on this one, or give --allow-other-model"
        )
    config = model_config(model)
    if config is not None:
        sets = getattr(config, "num_key_value_heads", None) or config.num_attention_heads
        check_heads(fit["heads"], config.num_hidden_layers, sets, where)


def check_heads(heads: Sequence[Sequence[int]], layers: int, sets: int, where: str) -> None:
    """Refuse heads outside a model of ``layers`` layers and ``sets`` KV sets, or more of them than it has."""
    from h2o_lens.errors import ConfigError

    if len(heads) > layers * sets:
        raise ConfigError(
            f"{where}: {len(heads):,} heads, more than this model's {layers} layers x {sets} KV sets = {layers * sets}"
        )
    outside = [list(h) for h in heads if h[0] >= layers or h[1] >= sets]
    if outside:
        raise ConfigError(
            f"{where}: head {outside[0]!r} is outside this model's {layers} layers and {sets} KV sets; "
            "the fit was made for another model"
        )


def write_outcomes(path: str, report: Any) -> None:
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
