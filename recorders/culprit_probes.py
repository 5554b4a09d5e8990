"""The culprit search's probes on a model (DESIGN.md §19): sets of positions re-run, one row each.

A probe re-runs the parent's request, greedy, with a set of positions pinned inside the parent's
slot count and judges the answer. :func:`probe_sets` evaluates a list of sets as one ``generate``
of the prompt repeated over as many rows, each row pinning its own set
(``session.new_cache(row_pins=...)``, DESIGN.md §2.11); inside a
:func:`~h2o_lens.prompt_reuse.reuse_prompts` scope the prompt is forwarded once, at one row, for
all of them. A lone set runs as the one-row generate of its pinned config. Each row is cut at its
first end-of-sequence token, as its own generate would stop there.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

import torch

from h2o_lens.errors import ConfigError

__all__ = ["probe_sets"]


def _stop_ids(model: Any) -> set[int]:
    eos = getattr(getattr(model, "generation_config", None), "eos_token_id", None)
    if eos is None:
        return set()
    return {int(e) for e in (eos if isinstance(eos, (list, tuple)) else [eos])}


def _until_stop(tokens: list[int], stop: set[int]) -> list[int]:
    """A row's new tokens up to its first end-of-sequence token (kept), as its own generate ends."""
    for i, t in enumerate(tokens):
        if t in stop:
            return tokens[: i + 1]
    return tokens


def _generate(runner: Any, rows: list[tuple[int, ...]]) -> list[list[int]]:
    """Each row's new tokens: the parent's prompt, greedy, row ``r`` pinning ``rows[r]``."""
    import h2o_lens
    from h2o_lens.config import pin

    parent, model = runner.parent, runner.model
    ids = torch.tensor([parent.prompt_ids], dtype=torch.long).expand(len(rows), -1)
    options = dict(
        input_ids=ids,
        attention_mask=torch.ones_like(ids),
        max_new_tokens=parent.max_new_tokens,
        do_sample=False,
        pad_token_id=getattr(runner.tok, "pad_token_id", None),
    )
    single = len(rows) == 1
    with torch.no_grad(), h2o_lens.h2o(model, pin(parent.config, rows[0]) if single else parent.config) as session:
        if not single:
            options["cache"] = session.new_cache(row_pins=rows)
        got = model.generate(**options)
    stop = _stop_ids(model)
    return [_until_stop(got[r, ids.shape[1] :].tolist(), stop) for r in range(len(rows))]


def probe_sets(runner: Any, say: Callable[[str], None]) -> Callable[[Sequence[frozenset[int]]], list[bool]]:
    """The search's ``test_many`` on ``runner``'s parent (a :class:`recorders.counterfactual._Runner`):
    sets of positions -> whether each, pinned, brings the answer back (the runner's judge). A set
    whose pins leave the policy no usable split fails without a re-run (not a fix within the slots)."""
    from h2o_lens.config import pin

    parent = runner.parent

    def many(sets: Sequence[frozenset[int]]) -> list[bool]:
        rows = []
        for s in sets:
            say(f"culprits: {len(s)} restored")
            try:
                pin(parent.config, sorted(s))
                rows.append(tuple(sorted(s)))
            except ConfigError:
                rows.append(None)
        run = [r for r in rows if r is not None]
        tok = runner.tok
        new = _generate(runner, run) if run else []
        texts = iter(tok.decode(t, skip_special_tokens=True) if tok is not None else "" for t in new)
        return [False if r is None else bool(runner.passes(next(texts))) for r in rows]

    return many
