"""The oracle at any budget, from one full-cache teacher pass (DESIGN.md §2.12).

>>> teacher = OracleTeacher(model, "runs/full-0001", gqa="sum", max_new_tokens=16)
>>> got = teacher.generate(48)                   # its own greedy answer: no run written
>>> run = teacher.record(48, answer=got, out="runs")  # a normal, replayable run folder

:class:`OracleTeacher` forwards the full-cache run's tokens (the prompt, then its generated
tokens) once with full attention, keeping per layer the aggregated attention rows of the
generated queries as a :class:`~h2o_lens.hindsight.TeacherTable` of remaining attention, and the
prompt's keys and values (or takes them from a recording's :class:`~recorders.prompt_pass.PromptPass`:
no prompt forward at all). Every budget then reuses both:

* :meth:`OracleTeacher.generate` is the oracle's own greedy answer. While its top-1 follows
  the teacher's tokens it ranks by the teacher's hindsight; its kept sets come from the table
  alone (:func:`~h2o_lens.hindsight.schedule`) and one masked forward of the generated tokens over
  the stored prompt gives its logits at every step, each query seeing what the oracle kept at
  its step, as the replay's masked forward does (DESIGN.md §6.1). At the first step whose
  top-1 departs from the teacher's token it *re-plans*: a fresh teacher pass continues its own
  prefix with the full cache (greedy, to EOS or ``max_new_tokens``), whose remaining attention
  ranks the steps from the departing token on, and the masked forward runs again over the new
  plan; and so on at each departure. Past ``replan_tokens`` teacher tokens it stops the
  hindsight instead and ranks as H2O does (the attention its own queries gave each slot).
* :meth:`OracleTeacher.check` is the teacher-forced view: the oracle's top-1 at every step of
  the teacher's own tokens, and how many agree with them.
* :meth:`OracleTeacher.record` runs the ``oracle`` policy in the runtime on that answer, with
  the table the answer ranked by (the teacher's, re-planned or ranked as H2O past its
  departures), and records it like any run (the recorder, the replay and the analyses need
  nothing special). Its logits equal the masked forward's within the replay's implementation
  tolerance; the planned tokens are fed, so a tie closer than that cannot change them.
"""

from __future__ import annotations

import functools
import os
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
import torch
from transformers import DynamicCache

from h2o_lens import compat, eviction
from h2o_lens.config import H2OConfig
from h2o_lens.hindsight import NEVER, TeacherTable, remaining_attention, schedule, teacher_rows, teacher_scores
from h2o_lens.hooks import attention_implementation
from h2o_lens.policies.oracle import ORACLE
from h2o_lens.shape import model_shape
from runlog.errors import RecorderError
from runlog.store import load_run, request_order

__all__ = ["OracleTeacher", "OracleCheck", "OracleAnswer", "DEPARTURES"]

ORACLE_ATTN = "h2o_lens_oracle"
#: what the oracle does where its own token departs from the teacher's (DESIGN.md §2.12)
DEPARTURES = ("replan", "h2o")
#: default re-planning allowance: teacher tokens per ``max_new_tokens`` of the request
REPLAN_FACTOR = 4


@dataclass
class OracleCheck:
    """The oracle's teacher-forced top-1 at one slot count.

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


@dataclass
class OracleAnswer:
    """The oracle's own greedy answer at one slot count (:meth:`OracleTeacher.generate`).

    ``tokens (K,)`` its generated tokens (to its EOS, included, or ``max_new_tokens``);
    ``table`` the remaining attention it ranked by, over its own positions (the teacher's,
    re-planned at each departure, or its own accumulated attention past ``switched``);
    ``departures`` the steps whose top-1 left the plan of the moment; ``replans`` the fresh
    teacher passes; ``switched`` the first step ranked as H2O does (None: hindsight to the
    end); ``agree`` and ``steps``: teacher-forced, its top-1 equals the teacher's token at
    ``agree`` of the teacher's ``steps`` tokens (:meth:`OracleTeacher.check`).
    """

    slots: int
    tokens: np.ndarray
    table: TeacherTable = field(repr=False)
    departures: tuple[int, ...]
    replans: int
    switched: int | None
    agree: int
    steps: int
    departure: str = "replan"

    @property
    def follows_teacher(self) -> bool:
        """Its answer is the teacher's, token for token."""
        return not self.departures

    def summary(self) -> dict[str, Any]:
        """What a run's manifest keeps of it (``oracle`` object)."""
        return {
            "slots": self.slots,
            "answer": "own",
            "departure": self.departure,
            "departures": list(self.departures),
            "replans": self.replans,
            "switched_at": self.switched,
            "teacher_agreement": [self.agree, self.steps],
        }


class _State:
    """What the oracle's attention function needs for the current forward."""

    def __init__(self, gqa: str, sets_per_kv: int, chunk: int):
        self.mode = "prompt"  # prompt | columns | teacher | masked | scored (an H2O step)
        self.gqa = gqa
        self.sets_per_kv = sets_per_kv  # G under gqa='none' (one set per query head), else 1
        self.chunk = chunk
        self.rows: dict[int, list[torch.Tensor]] = {}  # layer -> (Hs, m, N) aggregated teacher rows per forward
        self.cols: dict[int, torch.Tensor] = {}  # layer -> (Hs, P) prompt column sums (mode columns)
        self.leave: dict[int, torch.Tensor] = {}  # layer -> (Hs, N) step each position leaves
        # mode h2o: one query row per forward, the oracle's slots ranked by accumulated attention
        self.scores: dict[int, torch.Tensor] = {}  # layer -> (Hs, N) FP64 accumulated weights
        self.ranked: dict[int, list[torch.Tensor]] = {}  # layer -> the ranking values of each step
        self.slots = 0
        self.switch = NEVER  # first step ranked by the scores; earlier ones follow ``leave``
        self.dtype = torch.float32  # the table's dtype: the ranking is compared in it


def _attention(state: _State, module, query, key, value, attention_mask, scaling=None, dropout=0.0, **kwargs):
    """Attention of the oracle's forwards; the queries are the last rows of the keys.

    ``prompt``: full causal attention. ``columns``: the same, keeping the column sums of the
    aggregated weights (H2O's prefill scores). ``teacher``: full attention of the generated
    rows, whose aggregated weights are kept. ``masked``: each generated row sees what the
    oracle kept at its step (a position that leaves at step t is still seen at t). ``h2o``:
    one row, which sees what is kept, adds its aggregated weights to the scores and, from
    ``state.switch`` on, evicts the lowest score when the slots overflow.
    """
    b, hq, m, d = query.shape
    hkv, n = key.shape[1], key.shape[2]
    group = hq // hkv
    scaling = scaling if scaling is not None else d**-0.5
    sdpa = torch.nn.functional.scaled_dot_product_attention
    if state.mode == "prompt":
        return sdpa(query, key, value, is_causal=True, scale=scaling, enable_gqa=group > 1).transpose(1, 2), None
    if state.mode == "columns":
        state.cols[module.layer_idx] = _column_sums(state, query, key, scaling)
        return sdpa(query, key, value, is_causal=True, scale=scaling, enable_gqa=group > 1).transpose(1, 2), None
    if state.mode == "scored":
        return _h2o_step(state, module.layer_idx, query, key, value, scaling), None
    rows = torch.arange(n - m, n, device=query.device)[:, None]  # positions of the query rows
    cols = torch.arange(n, device=query.device)[None, :]
    if state.mode == "teacher":
        out = sdpa(query, key, value, attn_mask=cols <= rows, scale=scaling, enable_gqa=group > 1)
        rep = state.sets_per_kv
        k_sets = key.repeat_interleave(rep, dim=1) if rep > 1 else key
        state.rows.setdefault(module.layer_idx, []).append(
            teacher_rows(query, k_sets, scaling, state.gqa, state.chunk)[0]
        )
        return out.transpose(1, 2), None
    leave = state.leave[module.layer_idx][None, :, :n].to(query.device)  # (1, Hs, N)
    per_q = leave.repeat_interleave(hq // leave.shape[1], dim=1)[:, :, None, :]  # (1, Hq, 1, N)
    out = torch.empty_like(query)
    for s in range(0, m, state.chunk):
        e = min(m, s + state.chunk)
        r = rows[s:e]
        visible = (cols <= r) & (per_q >= r)  # (1, Hq, c, N)
        out[:, :, s:e] = sdpa(query[:, :, s:e], key, value, attn_mask=visible, scale=scaling, enable_gqa=group > 1)
    return out.transpose(1, 2), None


def _column_sums(state: _State, query: torch.Tensor, key: torch.Tensor, scaling: float) -> torch.Tensor:
    """``(Hs, P)`` column sums of the prompt's causal weights, aggregated like the run (H2O's prefill scores)."""
    b, hq, p, d = query.shape
    rep = state.sets_per_kv
    k_sets = key.repeat_interleave(rep, dim=1) if rep > 1 else key  # (1, Hs, P, d)
    hs = k_sets.shape[1]
    acc = torch.promote_types(query.dtype, torch.float32)
    qg = query.reshape(b, hs, hq // hs, p, d).to(acc)
    kt = k_sets.to(acc).transpose(-1, -2)[:, :, None]  # (1, Hs, 1, d, P)
    cols = torch.arange(p, device=query.device)[None, :]
    total = torch.zeros(hs, p, dtype=torch.float64, device=query.device)
    for s in range(0, p, state.chunk):
        e = min(p, s + state.chunk)
        rows = torch.arange(s, e, device=query.device)[:, None]
        w = torch.softmax((torch.matmul(qg[..., s:e, :], kt) * scaling).masked_fill(cols > rows, float("-inf")), -1)
        total += eviction.aggregate_group(w, state.gqa, 2, rows=3)[0].double()  # (Hs, P)
    return total


def _h2o_step(state: _State, layer: int, query, key, value, scaling: float) -> torch.Tensor:
    """One decode row at position ``t = N − 1`` over the oracle's kept positions; its weights add to
    the scores, and from ``state.switch`` on the lowest score over D = C ∪ {t} leaves when
    ``|D| > slots`` (a tie evicts the older), as H2O ranks its slots (DESIGN.md §2.1, §2.4)."""
    b, hq, m, d = query.shape
    n = key.shape[2]
    t = n - 1
    leave = state.leave[layer]  # (Hs, cap)
    hs = leave.shape[0]
    visible = leave[:, :n] >= t  # (Hs, N): kept, and t itself
    per_q = visible.repeat_interleave(hq // hs, dim=0)  # (Hq, N)
    acc = torch.promote_types(query.dtype, torch.float32)
    k = key.repeat_interleave(hq // key.shape[1], dim=1).to(acc)
    v = value.repeat_interleave(hq // value.shape[1], dim=1)
    logits = torch.matmul(query.to(acc), k.transpose(-1, -2)) * scaling  # (1, Hq, 1, N)
    w = torch.softmax(logits.masked_fill(~per_q[None, :, None, :], float("-inf")), dim=-1)
    out = torch.matmul(w.to(v.dtype), v)  # (1, Hq, 1, d)
    agg = eviction.aggregate_group(w.reshape(b, hs, hq // hs, m, n), state.gqa, 2)[0, :, 0]  # (Hs, N)
    scores = state.scores[layer]
    scores[:, :n] += agg.double()
    if t >= state.switch:
        ranked = scores[:, :n].to(state.dtype)  # compared in the table's dtype, as the runtime will
        if int(visible[0].sum()) > state.slots:
            r = ranked.masked_fill(~visible, float("inf"))
            tied = r == r.amin(-1, keepdim=True)
            pos = torch.arange(n, device=r.device)
            victim = torch.where(tied, pos, n).argmin(-1)  # (Hs,) the older of the lowest
            leave[torch.arange(hs, device=r.device), victim] = t
        state.ranked.setdefault(layer, []).append(ranked)
    return out.transpose(1, 2)


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
    prompt_pass : the prompt's keys, values, column sums and first logits from a recording of
        the same prompt (:class:`~recorders.prompt_pass.PromptPass`): the prompt is not forwarded
    max_new_tokens : the most tokens the oracle generates (default: the teacher's count)
    departure : where its token departs from the plan: ``"replan"`` (a fresh teacher pass over
        its own prefix; past ``replan_tokens`` teacher tokens, as ``"h2o"``) or ``"h2o"`` (stop
        the hindsight and rank by its own accumulated attention, as H2O does)
    replan_tokens : teacher tokens re-plans may generate per answer (default
        ``REPLAN_FACTOR · max_new_tokens``)

    Attributes
    ----------
    table : the :class:`~h2o_lens.hindsight.TeacherTable` (remaining attention per layer)
    prompt, answer : token ids of the prompt (P) and of the full run's generated tokens (M)
    teacher : the :class:`OracleCheck` of the full cache itself (does the teacher reproduce
        the answer? it does unless the full run was sampled or tied)
    forwards : model forwards run so far (one for the prompt unless a prompt pass was given,
        one for the teacher's rows, one per masked forward and per re-planned token)
    """

    def __init__(
        self,
        model: Any,
        full_run_dir: str | os.PathLike,
        *,
        gqa: str = "sum",
        request: int = 0,
        chunk: int = 256,
        prompt_pass: Any = None,
        max_new_tokens: int | None = None,
        departure: str = "replan",
        replan_tokens: int | None = None,
    ):
        if gqa not in ("sum", "max", "none"):
            raise RecorderError(f"unknown gqa {gqa!r}; expected sum, max or none (the run's own setting)")
        if departure not in DEPARTURES:
            raise RecorderError(f"unknown departure rule {departure!r}; expected one of {', '.join(DEPARTURES)}")
        run = load_run(full_run_dir, tables=("tokens",))
        tok = run["tokens"].to_pydict()
        order = request_order(tok, request)
        if not len(order):
            known = sorted(set(tok["request"]))
            raise RecorderError(f"{full_run_dir}: no request {request} in the run's tokens; it has {known}")
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
        eos = getattr(getattr(model, "generation_config", None), "eos_token_id", None)
        self.eos = frozenset(int(e) for e in (eos if isinstance(eos, (list, tuple)) else [eos]) if e is not None)
        self.max_new_tokens = int(max_new_tokens) if max_new_tokens else len(self.answer)
        self.departure = departure
        self.replan_tokens = REPLAN_FACTOR * self.max_new_tokens if replan_tokens is None else int(replan_tokens)
        self.forwards = 0
        self._checks: dict[int, OracleCheck] = {}
        self._answers: dict[int, OracleAnswer] = {}
        self._prompt_cols: list[torch.Tensor] | None = None
        self._teacher_pass(prompt_pass)

    @property
    def prompt_len(self) -> int:
        return len(self.prompt)

    @property
    def positions(self) -> int:
        """N, the positions a teacher-forced run feeds (its last token is never fed)."""
        return len(self.prompt) + len(self.answer) - 1

    def _attention(self):
        return attention_implementation(self.model, ORACLE_ATTN, functools.partial(_attention, self._state), _no_mask)

    def _forward(self, ids: torch.Tensor, **kwargs: Any) -> torch.Tensor:
        self.forwards += 1
        return self.model(input_ids=ids, **compat.cache_kwargs(self._cache), use_cache=True, **kwargs).logits[0].float()

    def _device(self) -> torch.device:
        return next(self.model.parameters()).device

    def _ids(self, tokens: Sequence[int]) -> torch.Tensor:
        return torch.as_tensor(np.asarray(tokens, dtype=np.int64), device=self._device())[None]

    def _teacher_pass(self, prompt_pass: Any) -> None:
        """The full-cache forward: the prompt (or a recording's pass of it), then the generated
        rows with their weights kept."""
        p, n = self.prompt_len, self.positions
        state = self._state
        self._cache = DynamicCache(config=self.model.config)
        fits = prompt_pass is not None and prompt_pass.fits(
            tuple(self.prompt.tolist()), self._layers, self._sets // state.sets_per_kv, self.model.dtype
        )
        with torch.no_grad(), self._attention():
            if fits:
                for layer, (key, value) in enumerate(zip(prompt_pass.keys, prompt_pass.values)):
                    self._cache.update(key.to(self._device()), value.to(self._device()), layer)
                self._first = prompt_pass.first.to(self._device()).float()  # (1, V) step P − 1
                if all(c.shape[0] == self._sets for c in prompt_pass.cols):
                    self._prompt_cols = [c.double() for c in prompt_pass.cols]
            else:
                state.mode = "prompt"
                self._first = self._forward(self._ids(self.prompt), logits_to_keep=1)[-1:]  # (1, V) step P − 1
            logits = self._first
            if n > p:
                state.mode = "teacher"
                logits = torch.cat([logits, self._forward(self._ids(self.answer[: n - p]))])
                self._cache.crop(p - n)  # keep the prompt's keys and values
        self.table = self._table_from_rows(n)
        self.teacher = self._judge(None, logits)

    def _table_from_rows(self, n: int) -> TeacherTable:
        """The table of the teacher rows the last forwards kept (positions ``P … n − 1``)."""
        p, state = self.prompt_len, self._state
        if n > p:
            remaining = []
            for layer in range(self._layers):
                parts = state.rows.get(layer, [])
                rows = torch.zeros(self._sets, n - p, n, dtype=parts[0].dtype, device=parts[0].device)
                r = 0
                for part in parts:  # (Hs, m, width): later keys weigh 0
                    rows[:, r : r + part.shape[1], : part.shape[2]] = part
                    r += part.shape[1]
                remaining.append(remaining_attention(rows))
        else:  # one generated token: no decode step, nothing remains
            remaining = [torch.zeros(self._sets, 1, n, device=self._first.device) for _ in range(self._layers)]
        state.rows.clear()
        return TeacherTable(tuple(remaining), p, self.gqa)

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

    def _masked(self, table: TeacherTable, slots: int, tokens: np.ndarray) -> torch.Tensor:
        """Logits ``(len(tokens), V)`` of the steps ``P − 1 …`` of the oracle with ``slots`` slots
        ranked by ``table``, fed ``tokens`` (one masked forward over the stored prompt)."""
        p, n = self.prompt_len, self.prompt_len + len(tokens) - 1
        if n == p:
            return self._first
        leave = schedule(table, slots)  # per layer (Hs, N)
        self._state.leave = dict(enumerate(leave))
        self._state.mode = "masked"
        with torch.no_grad(), self._attention():
            try:
                return torch.cat([self._first, self._forward(self._ids(tokens[:-1]))])
            finally:
                self._cache.crop(p - n)

    def check(self, slots: int) -> OracleCheck:
        """The oracle's teacher-forced top-1 at every step with ``slots`` slots, without writing a run.

        One forward of the generated tokens; a slot count already checked is answered from
        memory (a bisection may ask twice).
        """
        slots = self._check_slots(slots)
        if slots not in self._checks:
            self._checks[slots] = self._judge(slots, self._masked(self.table, slots, self.answer))
        return self._checks[slots]

    # -- the oracle's own answer
    def _ends(self, tokens: Sequence[int]) -> bool:
        return len(tokens) >= self.max_new_tokens or (len(tokens) > 0 and int(tokens[-1]) in self.eos)

    def generate(self, slots: int) -> OracleAnswer:
        """The oracle's own greedy answer with ``slots`` slots, without writing a run (see the module).

        From memory for a slot count already asked.
        """
        slots = self._check_slots(slots)
        if slots in self._answers:
            return self._answers[slots]
        teacher_forced = self.check(slots)
        p = self.prompt_len
        plan, table, top1 = self.answer.copy(), self.table, teacher_forced.top1
        departures: list[int] = []
        replans, spent, start, switched = 0, 0, 0, None
        while True:
            off = np.flatnonzero(top1[start : len(plan)] != plan[start:])
            if not len(off):
                tokens = plan
                break
            k = start + int(off[0])
            departures.append(p - 1 + k)
            own = np.concatenate([plan[:k], top1[k : k + 1]])
            if self._ends(own):
                tokens, table = own, _cut(table, p + k)
                break
            if self.departure == "replan" and spent < self.replan_tokens:
                cont, replanned = self._replan(own)
                spent += len(cont)
                replans += 1
                plan = np.concatenate([own, cont])
                table = _join(table, replanned, k + 1)
                top1 = self._masked(table, slots, plan).argmax(-1).cpu().numpy()
                start = k + 1
                continue
            tokens, table = self._continue_as_h2o(slots, _cut(table, p + k), own)
            switched = p + k
            break
        got = OracleAnswer(
            slots,
            np.asarray(tokens, dtype=np.int64),
            table,
            tuple(departures),
            replans,
            switched,
            int(teacher_forced.agree.sum()),
            len(teacher_forced.agree),
            self.departure,
        )
        self._answers[slots] = got
        return got

    def _replan(self, own: np.ndarray) -> tuple[np.ndarray, TeacherTable]:
        """A fresh teacher pass over the oracle's prefix ``own`` (its last token departed): the
        full cache continues it greedily to EOS or ``max_new_tokens``; returns the continuation
        and the table of remaining attention over ``own`` and it."""
        p, state = self.prompt_len, self._state
        tokens = [int(t) for t in own]
        state.mode = "teacher"
        state.rows.clear()
        with torch.no_grad(), self._attention():
            try:
                logits = self._forward(self._ids(tokens))
                while not self._ends(tokens):
                    tokens.append(int(logits[-1].argmax()))
                    if not self._ends(tokens):
                        logits = self._forward(self._ids(tokens[-1:]))
            finally:
                self._cache.crop(p - self._cache.get_seq_length())
        n = p + len(tokens) - 1
        return np.asarray(tokens[len(own) :], dtype=np.int64), self._table_from_rows(n)

    def _prompt_columns(self) -> list[torch.Tensor]:
        """H2O's prefill scores of the prompt, ``(Hs, P)`` per layer (a prompt forward unless a
        prompt pass gave them)."""
        if self._prompt_cols is None:
            state, kept = self._state, self._cache
            state.mode = "columns"
            self._cache = DynamicCache(config=self.model.config)
            with torch.no_grad(), self._attention():
                try:
                    self._forward(self._ids(self.prompt), logits_to_keep=1)
                finally:
                    self._cache = kept
            self._prompt_cols = [state.cols.pop(layer) for layer in range(self._layers)]
        return self._prompt_cols

    def _continue_as_h2o(self, slots: int, table: TeacherTable, own: np.ndarray) -> tuple[np.ndarray, TeacherTable]:
        """The oracle's answer past its departure without hindsight: the steps before the
        departing token keep the table's choices, the later ones rank its slots by the attention
        its own queries gave them since the prompt (H2O's score: the prompt's column sums, then
        each row's aggregated weights), the lowest leaving. Returns its tokens and the table of
        the ranking values it used."""
        p, state = self.prompt_len, self._state
        cap = p + self.max_new_tokens
        leave = schedule(table, slots)
        state.leave = {}
        for layer, steps in enumerate(leave):
            full = torch.full((steps.shape[0], cap), NEVER, dtype=torch.int64, device=self._device())
            full[:, : steps.shape[1]] = steps.to(self._device())
            state.leave[layer] = full
        state.scores = {}
        for layer, c in enumerate(self._prompt_columns()):
            scores = torch.zeros(c.shape[0], cap, dtype=torch.float64, device=self._device())
            scores[:, :p] = c.to(self._device())
            state.scores[layer] = scores
        state.ranked.clear()
        state.slots, state.switch = slots, p + len(own) - 1
        state.dtype = table.remaining[0].dtype
        state.mode = "scored"
        tokens = [int(t) for t in own]
        with torch.no_grad(), self._attention():
            try:
                for tok in tokens[:-1]:  # the oracle's own steps up to the departing token
                    self._forward(self._ids([tok]))
                while not self._ends(tokens):
                    tokens.append(int(self._forward(self._ids(tokens[-1:]))[-1].argmax()))
            finally:
                self._cache.crop(p - self._cache.get_seq_length())
        n = p + len(tokens) - 1
        remaining = []
        for layer in range(self._layers):
            rows = torch.zeros(table.sets, n - p + 1, n, dtype=state.dtype, device=self._device())
            k = len(own) - 1
            rows[:, : k + 1, : table.positions] = table.remaining[layer][:, : k + 1, : min(n, table.positions)].to(
                rows.device
            )
            for j, ranked in enumerate(state.ranked.get(layer, [])):  # step p + k + j
                rows[:, k + 1 + j, : ranked.shape[1]] = ranked
            remaining.append(rows)
        state.ranked.clear()
        state.scores.clear()
        return np.asarray(tokens, dtype=np.int64), TeacherTable(tuple(remaining), p, self.gqa)

    # -- recording
    def record(
        self,
        slots: int,
        *,
        out: str | os.PathLike,
        answer: OracleAnswer | None = None,
        tokenizer: Any = None,
        name: str | None = None,
        run_id: str | None = None,
        info: dict[str, Any] | None = None,
        annotate: Callable[[int, str | None], Mapping[str, Any]] | None = None,
        fsync: bool = True,
        keep_prompt_pass: bool = False,
    ):
        """Record the oracle with ``slots`` slots: its own ``answer`` (:meth:`generate`), or, without
        one, teacher-forced on the full run's tokens.

        A normal run folder under ``out`` (request 0 of it is this teacher's request), with
        ``source_run`` = the full run and ``oracle`` ({request, slots, and for its own answer
        :meth:`OracleAnswer.summary`}) in its manifest (``teacher_forced`` for the forced one),
        plus ``info``; ``annotate`` adds columns to its ``requests`` table (an answer checker, as
        for :func:`~recorders.recorder.record`). Returns the :class:`~recorders.recorder.Recording`.
        """
        from .recorder import record

        slots = self._check_slots(slots)
        config = H2OConfig(policy=ORACLE.name, heavy=slots, recent=0, gqa=self.gqa)
        if answer is not None and answer.slots != slots:
            raise RecorderError(f"the answer was generated with {answer.slots} slots, not {slots}")
        meta: dict[str, Any] = {"source_run": self.run_id, "oracle": {"request": self.request, "slots": slots}}
        if answer is None:
            meta["teacher_forced"] = True
        else:
            meta["oracle"].update(answer.summary())
        meta.update(info or {})
        with (
            teacher_scores(self.table if answer is None else answer.table),
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
                keep_prompt_pass=keep_prompt_pass,
            ) as rec,
        ):
            if answer is None:
                rec.force(self.prompt.tolist(), self.answer.tolist(), evidence_labels=self.evidence)
            else:
                self._generate_recorded(rec, answer.tokens, tokenizer)
        return rec

    def _generate_recorded(self, rec: Any, tokens: np.ndarray, tokenizer: Any) -> None:
        """``generate`` inside the recording, fed the planned tokens (a tie closer than the
        runtime's tolerance to the masked forward cannot change them)."""
        from transformers import LogitsProcessorList

        ids = self._ids(self.prompt)
        pad = getattr(tokenizer, "pad_token_id", None)
        if pad is None:
            pad = min(self.eos) if self.eos else 0
        rec._labels_override = self.evidence
        with torch.no_grad():
            self.model.generate(
                input_ids=ids,
                attention_mask=torch.ones_like(ids),
                max_new_tokens=len(tokens),
                do_sample=False,
                pad_token_id=pad,
                logits_processor=LogitsProcessorList([_Follow(tokens, ids.shape[1])]),
            )


class _Follow:
    """A logits processor that makes generate emit the planned tokens (the raw logits the
    recorder logs are untouched)."""

    def __init__(self, tokens: np.ndarray, prompt_len: int):
        self.tokens = [int(t) for t in tokens]
        self.prompt_len = prompt_len

    def __call__(self, input_ids: torch.Tensor, scores: torch.Tensor) -> torch.Tensor:
        j = input_ids.shape[1] - self.prompt_len
        out = torch.full_like(scores, float("-inf"))
        out[:, self.tokens[j]] = 0.0
        return out


def _cut(table: TeacherTable, n: int) -> TeacherTable:
    """``table`` over its first ``n`` positions (the steps ``P − 1 … n − 1``)."""
    p = table.prompt_len
    if n == table.positions:
        return table
    return TeacherTable(tuple(r[:, : n - p + 1, :n] for r in table.remaining), p, table.gqa)


def _join(before: TeacherTable, after: TeacherTable, k: int) -> TeacherTable:
    """Rows ``0 … k − 1`` (steps ``P − 1 … P + k − 2``) of ``before``, the later ones of ``after``,
    over ``after``'s positions (the two share the positions the earlier rows can hold)."""
    n = after.positions
    width = min(n, before.positions)
    out = []
    for old, new in zip(before.remaining, after.remaining):
        rows = new.clone()
        rows[:, :k] = 0
        rows[:, :k, :width] = old[:, :k, :width].to(rows.dtype)
        out.append(rows)
    return TeacherTable(tuple(out), after.prompt_len, after.gqa)
