"""The oracle at any budget, from one full-cache teacher pass (DESIGN.md §2.12).

>>> teacher = OracleTeacher(model, "runs/full-0001", gqa="sum")
>>> teacher.passes(48)                         # no run written: one masked forward
>>> run = teacher.record(48, out="runs")       # a normal, replayable run folder

:class:`OracleTeacher` forwards the full-cache run's tokens (the prompt, then its generated
tokens) once with full attention, keeping per layer the aggregated attention rows of the
generated queries as a :class:`~h2o_lens.oracle.TeacherTable` of remaining attention, and the
prompt's keys and values. Every budget then reuses both:

* :meth:`OracleTeacher.record` runs the ``oracle`` policy in the runtime, teacher-forced on the
  full run's tokens, under :func:`~h2o_lens.oracle.teacher_scores`, and records it like any
  run (the recorder, the replay and the analyses need nothing special);
* :meth:`OracleTeacher.check` (and :meth:`~OracleTeacher.passes`) computes the oracle's kept
  sets from the table alone (:func:`~h2o_lens.oracle.schedule`) and forwards only the generated
  tokens once over the stored prompt, each query seeing what the oracle kept at its step, as
  the replay's masked forward does (DESIGN.md §6.1). Its logits equal the runtime's within the replay's
  implementation tolerance; a top-1 choice can only differ from the recorded run's on a tie
  closer than that tolerance.

The oracle is judged teacher-forced: it passes when every answer token (the full run's
generated tokens, up to its EOS) is the top-1 of its forward at that step.
"""

from __future__ import annotations

import functools
import os
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
import torch
from transformers import DynamicCache

from h2o_lens import compat
from h2o_lens.config import H2OConfig
from h2o_lens.hooks import attention_implementation
from h2o_lens.oracle import TeacherTable, remaining_attention, schedule, teacher_rows, teacher_scores
from h2o_lens.policies.oracle import ORACLE
from h2o_lens.shape import model_shape

from .errors import RecorderError
from .store import load_run

__all__ = ["OracleTeacher", "OracleCheck"]

ORACLE_ATTN = "h2o_lens_oracle"


@dataclass
class OracleCheck:
    """The oracle's teacher-forced answer at one slot count.

    ``steps (M,)`` query positions ``P − 1 … N − 1``; ``top1 (M,)`` the oracle forward's top-1
    token at each step; ``answer (M,)`` the full run's tokens they are judged against;
    ``agree (M,)`` bool; ``first_wrong`` the first step whose top-1 is not the answer token
    (None when all agree); ``passed`` all agree; ``logits (M, V)`` the forward's logits.
    """

    slots: int | None
    steps: np.ndarray
    top1: np.ndarray
    answer: np.ndarray
    agree: np.ndarray
    logits: torch.Tensor = field(repr=False)

    @property
    def passed(self) -> bool:
        return bool(self.agree.all())

    @property
    def first_wrong(self) -> int | None:
        wrong = np.flatnonzero(~self.agree)
        return int(self.steps[wrong[0]]) if len(wrong) else None

    @property
    def agreement(self) -> float:
        """Share of steps whose top-1 is the answer token."""
        return float(self.agree.mean()) if len(self.agree) else 1.0


class _State:
    """What the oracle's attention function needs for the current forward."""

    def __init__(self, gqa: str, sets_per_kv: int, chunk: int):
        self.mode = "prompt"  # prompt | teacher | masked
        self.gqa = gqa
        self.sets_per_kv = sets_per_kv  # G under gqa='none' (one set per query head), else 1
        self.chunk = chunk
        self.rows: dict[int, torch.Tensor] = {}  # layer -> (Hs, T, N) aggregated teacher rows
        self.leave: dict[int, torch.Tensor] = {}  # layer -> (1, Hs, N) step each position leaves


def _attention(state: _State, module, query, key, value, attention_mask, scaling=None, dropout=0.0, **kwargs):
    """Attention of the oracle's forwards; the queries are the last rows of the keys.

    ``prompt``: full causal attention. ``teacher``: full attention of the generated rows, whose
    aggregated weights are kept. ``masked``: each generated row sees what the oracle kept at
    its step (a position that leaves at step t is still seen at t).
    """
    b, hq, m, d = query.shape
    hkv, n = key.shape[1], key.shape[2]
    group = hq // hkv
    scaling = scaling if scaling is not None else d**-0.5
    sdpa = torch.nn.functional.scaled_dot_product_attention
    if state.mode == "prompt":
        return sdpa(query, key, value, is_causal=True, scale=scaling, enable_gqa=group > 1).transpose(1, 2), None
    rows = torch.arange(n - m, n, device=query.device)[:, None]  # positions of the query rows
    cols = torch.arange(n, device=query.device)[None, :]
    if state.mode == "teacher":
        out = sdpa(query, key, value, attn_mask=cols <= rows, scale=scaling, enable_gqa=group > 1)
        rep = state.sets_per_kv
        k_sets = key.repeat_interleave(rep, dim=1) if rep > 1 else key
        state.rows[module.layer_idx] = teacher_rows(query, k_sets, scaling, state.gqa, state.chunk)[0]
        return out.transpose(1, 2), None
    leave = state.leave[module.layer_idx].to(query.device)  # (1, Hs, N)
    per_q = leave.repeat_interleave(hq // leave.shape[1], dim=1)[:, :, None, :]  # (1, Hq, 1, N)
    out = torch.empty_like(query)
    for s in range(0, m, state.chunk):
        e = min(m, s + state.chunk)
        r = rows[s:e]
        visible = (cols <= r) & (per_q >= r)  # (1, Hq, c, N)
        out[:, :, s:e] = sdpa(query[:, :, s:e], key, value, attn_mask=visible, scale=scaling, enable_gqa=group > 1)
    return out.transpose(1, 2), None


def _no_mask(*args, **kwargs):
    return None


class OracleTeacher:
    """One full-cache teacher pass over a run's request, then the oracle at any slot count.

    Parameters
    ----------
    model : the model the full-cache run used
    full_run_dir : the full-cache run's folder (its ``tokens`` table gives the prompt and the
        generated tokens of ``request``)
    gqa : how a KV set's query heads aggregate, as in the run being explained (``"sum"``,
        ``"max"``, or ``"none"``: one set per query head)
    request : the request of the full run
    chunk : query rows per block of the attention rows (memory ``O(chunk · N)`` per head)

    Attributes
    ----------
    table : the :class:`~h2o_lens.oracle.TeacherTable` (remaining attention per layer)
    prompt, answer : token ids of the prompt (P) and of the full run's generated tokens (M)
    teacher : the :class:`OracleCheck` of the full cache itself (does the teacher reproduce
        the answer? it does unless the full run was sampled or tied)
    forwards : model forwards run so far (two for the teacher pass, one per new slot count
        :meth:`check` is asked about)
    """

    def __init__(
        self, model: Any, full_run_dir: str | os.PathLike, *, gqa: str = "sum", request: int = 0, chunk: int = 256
    ):
        if gqa not in ("sum", "max", "none"):
            raise RecorderError(f"unknown gqa {gqa!r}; expected sum, max or none (the run's own setting)")
        run = load_run(full_run_dir, tables=("tokens",))
        tok = run["tokens"].to_pydict()
        req = np.asarray(tok["request"])
        sel = np.flatnonzero(req == request)
        if not len(sel):
            known = sorted(set(req.tolist()))
            raise RecorderError(f"{full_run_dir}: no request {request} in the run's tokens; it has {known}")
        order = sel[np.argsort(np.asarray(tok["position"])[sel])]
        ids = np.asarray(tok["token_id"], dtype=np.int64)[order]
        is_prompt = np.asarray(tok["is_prompt"])[order]
        self.model = model
        self.gqa = gqa
        self.request = request
        self.run_id = run.run_id
        self.run_dir = Path(full_run_dir)
        self.prompt = ids[is_prompt]
        self.answer = ids[~is_prompt]
        self.evidence = [tok["evidence"][i] for i in order[is_prompt]]
        if not len(self.answer):
            raise RecorderError(
                f"{full_run_dir}: request {request} generated no token, so there is no answer to judge the oracle on"
            )
        shape = model_shape(model.config)
        self._state = _State(gqa, shape.copies(gqa), chunk)
        self._layers = shape.layers
        self._sets = shape.sets(gqa)  # KV sets of the run
        self.forwards = 0
        self._checks: dict[int, OracleCheck] = {}
        self._teacher_pass()

    @property
    def prompt_len(self) -> int:
        return len(self.prompt)

    @property
    def positions(self) -> int:
        """N, the positions a teacher-forced run feeds (its last token is never fed)."""
        return len(self.prompt) + len(self.answer) - 1

    def _attention(self):
        return attention_implementation(self.model, ORACLE_ATTN, functools.partial(_attention, self._state), _no_mask)

    def _forward(self, ids: torch.Tensor) -> torch.Tensor:
        self.forwards += 1
        return self.model(input_ids=ids, **compat.cache_kwargs(self._cache), use_cache=True).logits[0].float()

    def _teacher_pass(self) -> None:
        """The one full-cache forward: prompt, then the generated rows with their weights kept."""
        p, n = self.prompt_len, self.positions
        device = next(self.model.parameters()).device
        x = torch.as_tensor(np.concatenate([self.prompt, self.answer])[:n], dtype=torch.long, device=device)[None]
        state = self._state
        self._cache = DynamicCache(config=self.model.config)
        with torch.no_grad(), self._attention():
            state.mode = "prompt"
            self._first = self._forward(x[:, :p])[-1:]  # (1, V) step P − 1
            logits = self._first
            if n > p:
                state.mode = "teacher"
                logits = torch.cat([logits, self._forward(x[:, p:])])
                self._cache.crop(p - n)  # keep the prompt's keys and values
        self._x = x
        if n > p:
            remaining = tuple(remaining_attention(state.rows[layer]) for layer in range(self._layers))
        else:  # one generated token: no decode step, nothing remains
            shape = (self._sets, 1, n)
            remaining = tuple(torch.zeros(shape, device=self._first.device) for _ in range(self._layers))
        state.rows.clear()
        self.table = TeacherTable(remaining, p, self.gqa)
        self.teacher = self._judge(None, logits)

    def _judge(self, slots: int | None, logits: torch.Tensor) -> OracleCheck:
        top1 = logits.argmax(-1).cpu().numpy()
        p = self.prompt_len
        return OracleCheck(
            slots=slots,
            steps=np.arange(p - 1, p - 1 + len(self.answer), dtype=np.int64),
            top1=top1,
            answer=self.answer.copy(),
            agree=top1 == self.answer,
            logits=logits,
        )

    def _check_slots(self, slots: Any) -> int:
        if isinstance(slots, bool) or not isinstance(slots, (int, np.integer)) or slots < 1:
            raise RecorderError(f"slots must be a whole number >= 1, got {slots!r}")
        return int(slots)

    def check(self, slots: int) -> OracleCheck:
        """The oracle's top-1 at every step with ``slots`` slots, without writing a run.

        One forward of the generated tokens; a slot count already checked is answered from
        memory (a bisection may ask twice).
        """
        slots = self._check_slots(slots)
        if slots in self._checks:
            return self._checks[slots]
        p, n = self.prompt_len, self.positions
        logits = self._first
        if n > p:
            leave = schedule(self.table, slots)  # per layer (Hs, N)
            self._state.leave = {layer: t[None] for layer, t in enumerate(leave)}
            self._state.mode = "masked"
            with torch.no_grad(), self._attention():
                try:
                    logits = torch.cat([logits, self._forward(self._x[:, p:])])
                finally:
                    self._cache.crop(p - n)
        self._checks[slots] = self._judge(slots, logits)
        return self._checks[slots]

    def passes(self, slots: int) -> bool:
        """Whether the oracle with ``slots`` slots answers every token right (teacher-forced top-1)."""
        return self.check(slots).passed

    def record(
        self,
        slots: int,
        *,
        out: str | os.PathLike,
        tokenizer: Any = None,
        name: str | None = None,
        run_id: str | None = None,
        info: dict[str, Any] | None = None,
        annotate: Callable[[int, str | None], Mapping[str, Any]] | None = None,
        fsync: bool = True,
    ):
        """Record the oracle with ``slots`` slots, teacher-forced on the full run's tokens.

        A normal run folder under ``out`` (request 0 of it is this teacher's request), with
        ``source_run`` = the full run, ``teacher_forced`` and ``oracle`` ({request, slots}) in
        its manifest, plus ``info``; ``annotate`` adds columns to its ``requests`` table (an answer
        checker, as for :func:`~recorders.recorder.record`). Returns the
        :class:`~recorders.recorder.Recording`.
        """
        from .recorder import record

        slots = self._check_slots(slots)
        config = H2OConfig(policy=ORACLE.name, heavy=slots, recent=0, gqa=self.gqa)
        meta = {
            "source_run": self.run_id,
            "teacher_forced": True,
            "oracle": {"request": self.request, "slots": slots},
            **dict(info or {}),
        }
        with (
            teacher_scores(self.table),
            record(
                self.model,
                config,
                out=str(out),
                tokenizer=tokenizer,
                name=name,
                run_id=run_id,
                info=meta,
                fsync=fsync,
                annotate=annotate,
            ) as rec,
        ):
            rec.force(self.prompt.tolist(), self.answer.tolist(), evidence_labels=self.evidence)
        return rec
