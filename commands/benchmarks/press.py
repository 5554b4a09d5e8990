"""``h2o-lens bench press``: what recording a kvpress press costs, and how presses agree with H2O.

Speed (the default): for each press and prompt length, the same ``generate`` under
``with press(model):`` alone and under ``recorders.record(model, press, ...)``, rounds
alternating in ABBA order, the fastest rounds compared (target: recorded ÷ alone ≤ 1.10, DESIGN.md §17).

``--agreement``: the kept-set agreement of ``ObservedAttentionPress`` and ``TOVAPress`` with this
toolkit's ``h2o`` and ``tova`` prefill, as printed in DESIGN.md §17.2, with the presses that undo
each difference (:func:`reason_presses`).
"""

from __future__ import annotations

import argparse
import statistics
import tempfile
import time
from pathlib import Path
from typing import Any

from ..options import at_least, press_items

__all__ = [
    "add_arguments",
    "run",
    "bench_press",
    "bench_press_agreement",
    "reason_presses",
    "kept_sets",
    "record_each",
    "toolkit_sets",
]

NAME = "press"
HELP = "what recording a kvpress press costs; --agreement: how presses agree with H2O (DESIGN.md §17)"


def add_arguments(b: argparse.ArgumentParser) -> None:
    b.add_argument("--model", default=None, help="HF id or local path (default: the packaged SmolLM2-135M-Instruct)")
    b.add_argument("--contexts", type=at_least(2), nargs="+", default=None, help="prompt lengths (default 2048 4096)")
    b.add_argument("--rounds", type=at_least(1), default=3, help="rounds in ABBA order")
    b.add_argument("--new-tokens", type=at_least(1), default=None, help="new tokens of each prompt (default 16)")
    b.add_argument(
        "--policies",
        action="extend",
        nargs="+",
        default=None,
        metavar="kvpress:NAME",
        help="the presses timed (default snapkv, streaming_llm, tova, observed_attention, knorm); "
        "kvpress:dms(threshold=T) keeps what its scorer puts above T, not the keep ratio",
    )
    b.add_argument(
        "--agreement",
        action="store_true",
        help="kept-set agreement of ObservedAttention and TOVA presses with h2o and tova (DESIGN.md §17.2)",
    )


def run(args: argparse.Namespace) -> int:
    if args.agreement:
        return bench_press_agreement(model_name=args.model)
    from h2o_lens import presses

    timed = tuple(_timed_policy(presses, p) for p in press_items(args.policies)) or None
    return bench_press(
        model_name=args.model,
        contexts=tuple(args.contexts or (2048, 4096)),
        rounds=args.rounds,
        new_tokens=args.new_tokens or 16,
        **({"timed": timed} if timed else {}),
    )


def _timed_policy(presses: Any, text: str) -> tuple[str, dict[str, Any]]:
    """A ``--policies`` item as (class, arguments): a press a compression ratio builds, as a sweep
    parses it, or one a threshold builds (DMSPress, :func:`h2o_lens.presses.threshold_spec`)."""
    cls, args = presses.parse_sweep_policy(text, sweep=False)
    if cls in THRESHOLD:
        presses.threshold_spec(cls, args)  # refused now, before the model loads
        return cls, args
    return presses.parse_sweep_policy(text)


#: presses a threshold builds, not a compression ratio
THRESHOLD = frozenset({"DMSPress"})

#: the presses timed by default: their short names (h2o_lens.presses) and constructor arguments
#: the press of the field and the registry policy it is measured against (DESIGN.md §17.2)
_COMPARED = {"ObservedAttentionPress": "h2o", "TOVAPress": "tova"}

TIMED = (
    ("SnapKVPress", {}),
    ("StreamingLLMPress", {}),
    ("TOVAPress", {}),
    ("ObservedAttentionPress", {}),
    ("KnormPress", {}),
)


def reason_presses(kv: Any) -> dict[str, type]:
    """Subclasses of kvpress presses with one difference from the toolkit undone (DESIGN.md §17.2):

    - ``summed_observed``: ObservedAttentionPress summing the attention a key received over the rows
      instead of averaging it (H2O's prefill score);
    - ``group_tova``: TOVAPress averaging the last row per KV head's query group, not over all heads;
    - ``group_tova_self``: the same, with the last position ranked by its own weight like any other.
    """
    import dataclasses

    import torch

    @dataclasses.dataclass
    class SummedObserved(kv.ObservedAttentionPress):
        def score(self, module, hidden_states, keys, values, attentions, kwargs):
            rows = torch.arange(keys.shape[2], 0, -1).to(attentions)  # rows at or below each key
            return super().score(module, hidden_states, keys, values, attentions, kwargs) * rows

    @dataclasses.dataclass
    class GroupTOVA(kv.TOVAPress):
        def score(self, module, hidden_states, keys, values, attentions, kwargs):
            b, hkv, n, _ = keys.shape
            scores = attentions[..., -1, :-1].reshape(b, hkv, -1, n - 1).mean(2)
            return torch.nn.functional.pad(scores, (0, 1), value=scores.max().item() + 1)

    @dataclasses.dataclass
    class GroupTOVASelf(kv.TOVAPress):
        def score(self, module, hidden_states, keys, values, attentions, kwargs):
            b, hkv, n, _ = keys.shape
            return attentions[..., -1, :].reshape(b, hkv, -1, n).mean(2)

    return {"summed_observed": SummedObserved, "group_tova": GroupTOVA, "group_tova_self": GroupTOVASelf}


def kept_sets(run_dir: str | Path, lengths: list[int]) -> dict[tuple[int, int, int], set[int]]:
    """``(request, layer, KV head) -> kept prompt positions`` of a run of one prompt per request."""
    from runlog import load_run

    ev = load_run(run_dir)["evictions"].to_pandas()
    return {
        (int(r), int(layer), int(h)): set(range(lengths[int(r)])) - set(group.position.tolist())
        for (r, layer, h), group in ev.groupby(["request", "layer", "kv_head"])
    }


def record_each(model: Any, policy: Any, prompts: list[Any], out: Path) -> str:
    """One recorded run of ``policy`` (an H2OConfig or a press): each prompt alone, its prefill and one token."""
    import torch

    from recorders import record

    with record(model, policy, out=str(out), fsync=False) as rec, torch.no_grad():
        for ids in prompts:
            model.generate(input_ids=ids, max_new_tokens=1, do_sample=False, pad_token_id=0)
    return rec.run_dir


def toolkit_sets(model, policy: str, prompts, lengths, kept, out, *, recent0: bool):
    """The toolkit's kept sets at the press's count ``kept[i]``: all by score (``recent0``) or the
    policy's heavy/recent halves."""
    from h2o_lens.config import H2OConfig

    sets = {}
    for i, ids in enumerate(prompts):
        heavy, recent = (kept[i], 0) if recent0 else (kept[i] // 2, kept[i] - kept[i] // 2)
        run = record_each(model, H2OConfig(policy=policy, heavy=heavy, recent=recent, gqa="sum"), [ids], out)
        sets.update({(i, layer, h): s for (_, layer, h), s in kept_sets(run, [lengths[i]]).items()})
    return sets


def _agree(a: dict, b: dict) -> tuple[float, float]:
    """(share of kept positions both keep, share of sets equal)."""
    both = sum(len(a[k] & b[k]) for k in a)
    return both / max(1, sum(len(s) for s in a.values())), sum(a[k] == b[k] for k in a) / max(1, len(a))


def bench_press_agreement(model_name: str | None = None, ratios: tuple[float, ...] = (0.5, 0.8), tasks: int = 4) -> int:
    """Print the table of DESIGN.md §17.2 (the first prompt of ``tasks`` task kinds)."""
    from h2o_lens.models import load_model
    from h2o_lens.presses import import_kvpress
    from h2o_lens.tasks.real import KINDS, get_task

    kv = import_kvpress()
    reasons = reason_presses(kv)
    model, tok = load_model(model_name, progress=False)
    model.set_attn_implementation("eager")  # the presses read the weights the eager attention returns
    prompts = [tok(get_task(f"{k}_0").chat_text(tok), return_tensors="pt")["input_ids"] for k in KINDS[:tasks]]
    lengths = [int(p.shape[1]) for p in prompts]
    with tempfile.TemporaryDirectory(prefix="h2o-lens-bench-press-") as tmp:
        out = Path(tmp)
        print(f"{type(model).__name__}: {len(prompts)} prompts of {lengths} tokens; kept positions shared per set")
        for c in ratios:
            kept = [int(n * (1 - c)) for n in lengths]
            ref = {
                (p, r0): toolkit_sets(model, p, prompts, lengths, kept, out, recent0=r0)
                for p in _COMPARED.values()
                for r0 in (True, False)
            }
            rows = [
                ("ObservedAttentionPress", kv.ObservedAttentionPress(c), _COMPARED["ObservedAttentionPress"]),
                ("  summed over rows", reasons["summed_observed"](c), _COMPARED["ObservedAttentionPress"]),
                ("TOVAPress", kv.TOVAPress(c), _COMPARED["TOVAPress"]),
                ("  mean per KV group", reasons["group_tova"](c), _COMPARED["TOVAPress"]),
                ("  per group, last ranked by its weight", reasons["group_tova_self"](c), _COMPARED["TOVAPress"]),
            ]
            for name, press, policy in rows:
                sets = kept_sets(record_each(model, press, prompts, out), lengths)
                (a0, e0), (a1, e1) = _agree(sets, ref[policy, True]), _agree(sets, ref[policy, False])
                print(
                    f"c={c} {name:40s} vs {policy} recent=0: {a0:7.2%} ({e0:6.1%} of sets equal)"
                    f"   vs {policy} split: {a1:7.2%} ({e1:6.1%})"
                )
        return 0


def bench_press(
    model_name: str | None = None,
    contexts: tuple[int, ...] = (2048, 4096),
    keep: float = 0.5,
    new_tokens: int = 16,
    rounds: int = 3,
    model: Any = None,
    timed: tuple[tuple[str, dict[str, Any]], ...] = TIMED,
) -> int:
    """Recorded ÷ alone per press and prompt length, side by side in one process (``timed``: the
    presses, as class names and arguments; a press of :data:`THRESHOLD` keeps what its threshold
    says, not ``keep``)."""
    import torch

    from h2o_lens.models import load_model
    from h2o_lens.presses import import_kvpress, policy_text, sweep_policy, sweep_spec, threshold_spec
    from recorders import record
    from recorders.press import build_press

    import_kvpress()
    if model is None:
        model, _ = load_model(model_name, progress=False)
    vocab = model.config.get_text_config(decoder=True).vocab_size
    kw = dict(max_new_tokens=new_tokens, min_new_tokens=new_tokens, do_sample=False, pad_token_id=0)
    with tempfile.TemporaryDirectory(prefix="h2o-lens-bench-press-") as tmp:
        root = Path(tmp)
        kept = "" if all(c in THRESHOLD for c, _ in timed) else f"keep {keep:.0%} (compression_ratio {1 - keep:g}), "
        print(f"{type(model).__name__}: {kept}{new_tokens} new tokens, "
              f"{rounds} rounds in ABBA order; ratio = fastest recorded / fastest alone (target <= 1.10)")  # fmt: skip
        worst, failed = 0.0, []
        for context in contexts:
            ids = torch.randint(0, vocab, (1, context), generator=torch.Generator().manual_seed(context))
            kw["attention_mask"] = torch.ones_like(ids)  # a random id equal to the pad id is no padding
            for cls, args in timed:
                if cls in THRESHOLD:  # its threshold, not the keep ratio, sets what it keeps
                    press = build_press(threshold_spec(cls, args))
                else:
                    press = build_press(sweep_spec(sweep_policy(cls, args), keep))  # a wrapper holds its scorer
                eager = cls == "ObservedAttentionPress"
                previous = model.config._attn_implementation
                alone, recorded = [], []
                try:
                    if eager:  # as the recorder runs it (DESIGN.md §17)
                        model.set_attn_implementation("eager")
                    with torch.no_grad():
                        for r in range(rounds + 1):  # round 0 warms up
                            # ABBA order, so that a drift in the machine's speed favours neither side
                            for side in ("alone", "recorded") if r % 2 == 0 else ("recorded", "alone"):
                                t0 = time.perf_counter()
                                if side == "alone":
                                    with press(model):
                                        model.generate(ids, **kw)
                                else:  # the recorder's flush at exit counts
                                    with record(model, press, out=str(root), fsync=False):
                                        model.generate(ids, **kw)
                                if r:
                                    (alone if side == "alone" else recorded).append(time.perf_counter() - t0)
                except (AssertionError, OSError, RuntimeError, ValueError) as exc:
                    # a press kvpress cannot start here (DuoAttention without a local head pattern
                    # offline): one line, and the other presses are still timed
                    name = policy_text(cls, {}).removesuffix("()")
                    print(f"prompt {context:5d}  {name:32s} could not run: {type(exc).__name__}: {exc}")
                    failed.append(name)
                    continue
                finally:
                    model.set_attn_implementation(previous)
                # the fastest round is the one least disturbed by other work on the machine (noise only
                # adds time); the median ratio is printed beside it
                ratio = min(recorded) / min(alone)
                worst = max(worst, ratio)
                # a threshold press with its arguments (they, not the keep ratio, set what it keeps)
                label = sweep_policy(cls, args) if cls in THRESHOLD else policy_text(cls, {}).removesuffix("()")
                print(
                    f"prompt {context:5d}  {label:32s} alone "
                    f"{min(alone):6.2f} s  recorded {min(recorded):6.2f} s  ratio {ratio:.3f}  "
                    f"(medians {statistics.median(recorded) / statistics.median(alone):.3f})"
                )
        print(f"worst ratio {worst:.3f}" + (f"; could not run: {', '.join(dict.fromkeys(failed))}" if failed else ""))
        return 1 if failed else 0
