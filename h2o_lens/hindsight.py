"""The oracle's teacher: remaining attention of a full-cache run, and the scope that installs it.

The ``oracle`` policy (:mod:`h2o_lens.policies.oracle`, DESIGN.md §2.12) ranks a slot by the
attention a full-cache teacher will still give it: for a KV set and key i after step t,
``R_t(i) = Σ_{s>t} A_s(i)`` over the generated query rows s, with ``A_s(i)`` the teacher's
weight of row s on key i aggregated over the set's query heads like the run (DESIGN.md §2.6). It cannot
be computed from the run itself, so a :class:`TeacherTable` holds it per layer and
:func:`teacher_scores` installs the table for the runtime's score hooks:

>>> with teacher_scores(table), h2o_lens.h2o(model, H2OConfig(policy="oracle", heavy=32, recent=0)):
...     ...  # prefill the prompt, then feed the teacher's tokens one per step

Because the table fixes every choice in advance, :func:`schedule` computes the oracle's kept
sets of all layers and sets from the table alone (the step at which each position leaves),
which a masked forward can use without running the cache step by step.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from dataclasses import dataclass

import torch

from . import eviction
from .errors import ConfigError

__all__ = [
    "TeacherTable",
    "teacher_scores",
    "active_table",
    "teacher_rows",
    "remaining_attention",
    "schedule",
    "NEVER",
]

#: eviction step of a position that never leaves the cache (as :data:`runlog.eviction_steps.NEVER`)
NEVER = torch.iinfo(torch.int64).max // 2

_ACTIVE: list[TeacherTable] = []  # installed tables, innermost last


@dataclass(frozen=True, eq=False)
class TeacherTable:
    """Remaining teacher attention of one request, per layer.

    Attributes
    ----------
    remaining : one tensor per layer, ``(Hs, T + 1, N)`` float: row ``k`` is ``R_t`` for step
        ``t = P − 1 + k`` (row 0 ranks the prompt at prefill, row ``T`` is all zero), column
        ``i`` the key position; ``Hs`` the run's KV sets (query heads under ``gqa="none"``)
    prompt_len : P, the prompt length the table was built for
    gqa : the aggregation the rows were built with (``"sum"``, ``"max"`` or ``"none"``)
    """

    remaining: tuple[torch.Tensor, ...]
    prompt_len: int
    gqa: str = "sum"

    def __post_init__(self) -> None:
        if not self.remaining:
            raise ConfigError("a teacher table needs one (Hs, T + 1, N) tensor per layer, got none")
        shape = tuple(self.remaining[0].shape)
        for layer, r in enumerate(self.remaining):
            if r.dim() != 3 or tuple(r.shape) != shape:
                raise ConfigError(
                    f"teacher table layer {layer}: shape {tuple(r.shape)}; expected (Hs, T + 1, N) = {shape} "
                    "in every layer"
                )
        sets, rows, n = shape
        if not 1 <= self.prompt_len <= n or rows != n - self.prompt_len + 1:
            raise ConfigError(
                f"teacher table of {rows} rows over {n} positions for a prompt of {self.prompt_len} tokens; "
                f"expected N − P + 1 = {n - self.prompt_len + 1} rows (steps P − 1 … N − 1)"
            )

    @property
    def positions(self) -> int:
        """N, the positions the teacher covers (the prompt and the tokens fed after it)."""
        return self.remaining[0].shape[-1]

    @property
    def sets(self) -> int:
        return self.remaining[0].shape[0]

    def lookup(self, layer: int, step: torch.Tensor | int, positions: torch.Tensor) -> torch.Tensor:
        """``R_step`` of ``positions (b, Hs, S)`` in ``layer``, ``(b, Hs, S)``; 0 on empty slots (-1).

        ``step`` is an int or a tensor broadcastable to ``(b, Hs, 1)``, the query position.
        """
        if not 0 <= layer < len(self.remaining):
            raise ConfigError(f"the teacher table has {len(self.remaining)} layers; the run asked for layer {layer}")
        rem = self.remaining[layer]
        b, hs, _ = positions.shape
        if hs != rem.shape[0]:
            raise ConfigError(
                f"layer {layer}: the run has {hs} KV sets but the teacher table has {rem.shape[0]}; "
                "build the table with the run's gqa and model"
            )
        if b != 1:
            raise ConfigError(
                f"the oracle runs one request at a time (a teacher table belongs to one request), got a batch of {b}"
            )
        rem = rem.to(positions.device)
        k = torch.as_tensor(step, device=positions.device).to(torch.int64) - (self.prompt_len - 1)
        k = k.expand(b, hs, 1) if k.dim() == 3 else k.reshape(-1)[:1].expand(b, hs, 1)
        lo, hi = int(k.min()), int(k.max())
        if lo < 0 or hi >= rem.shape[1]:
            bad = (lo if lo < 0 else hi) + self.prompt_len - 1
            raise ConfigError(
                f"the oracle reached step {bad}, outside the teacher's steps {self.prompt_len - 1} … "
                f"{self.positions - 1}: feed the oracle run the teacher's own prompt and tokens "
                "(teacher forcing), no more"
            )
        pos = positions.to(torch.int64)
        if int(pos.max()) >= self.positions:
            raise ConfigError(
                f"position {int(pos.max())} is beyond the teacher's {self.positions} positions; the oracle "
                "run must be fed the teacher's tokens"
            )
        row = rem[None].expand(b, -1, -1, -1).gather(2, k[..., None].expand(b, hs, 1, rem.shape[-1]))[:, :, 0]
        return row.gather(-1, pos.clamp(min=0)).masked_fill(pos < 0, 0.0)  # (b, Hs, S)


@contextlib.contextmanager
def teacher_scores(table: TeacherTable) -> Iterator[TeacherTable]:
    """Install ``table`` for the ``oracle`` policy's score hooks inside the block (scopes nest)."""
    if not isinstance(table, TeacherTable):
        raise ConfigError(f"teacher_scores needs a TeacherTable, got {type(table).__name__}")
    _ACTIVE.append(table)
    try:
        yield table
    finally:
        _ACTIVE.remove(table)


def active_table(policy_name: str = "oracle") -> TeacherTable:
    """The innermost installed table; a :class:`ConfigError` saying how to get one when none is."""
    if not _ACTIVE:
        raise ConfigError(
            f"policy {policy_name!r} ranks slots by the attention a full-cache teacher will still give "
            "them, so it runs only with a teacher table installed: build one with "
            "recorders.oracle_runs.OracleTeacher(model, full_run_dir) and record with its .record(slots, out=...), "
            "or wrap the run in h2o_lens.hindsight.teacher_scores(table)"
        )
    return _ACTIVE[-1]


def teacher_rows(query: torch.Tensor, key: torch.Tensor, scaling: float, gqa: str, chunk: int = 256) -> torch.Tensor:
    """Aggregated full-attention weights of the last query rows, ``(b, Hs, m, N)``.

    ``query (b, Hq, m, d)`` are the rows at positions ``N − m … N − 1``, ``key (b, Hs, N, d)``
    the keys of the KV sets (repeated per query head under ``gqa="none"``). Each row's
    softmax is over its causal keys (FP32, FP64 for FP64 inputs); future keys weigh 0; the
    group's heads aggregate by ``gqa`` (DESIGN.md §2.6). Memory is ``O(chunk · N)`` per head.
    """
    b, hq, m, d = query.shape
    hs, n = key.shape[1], key.shape[2]
    acc = torch.promote_types(query.dtype, torch.float32)
    qg = query.reshape(b, hs, hq // hs, m, d).to(acc)
    kt = key.to(acc).transpose(-1, -2)[:, :, None]  # (b, Hs, 1, d, N)
    out = torch.empty(b, hs, m, n, dtype=acc, device=query.device)
    cols = torch.arange(n, device=query.device)[None, :]
    for s in range(0, m, chunk):
        e = min(m, s + chunk)
        rows = torch.arange(n - m + s, n - m + e, device=query.device)[:, None]
        logits = torch.matmul(qg[..., s:e, :], kt) * scaling  # (b, Hs, G, c, N)
        w = torch.softmax(logits.masked_fill(cols > rows, float("-inf")), dim=-1)
        out[:, :, s:e] = eviction.aggregate_group(w, gqa, 2)
    return out


def remaining_attention(rows: torch.Tensor, dtype: torch.dtype | None = None) -> torch.Tensor:
    """``(..., T, N)`` aggregated rows of the generated queries → ``(..., T + 1, N)`` suffix sums.

    Row ``k`` of the result is ``Σ_{j ≥ k} rows[j]`` (summed in FP64), row ``T`` is zero: with
    the rows at positions ``P … N − 1``, row ``k`` is ``R_t`` for step ``t = P − 1 + k``.
    """
    acc = rows.to(torch.float64)
    suffix = acc.flip(-2).cumsum(-2).flip(-2)
    zero = acc.new_zeros(*acc.shape[:-2], 1, acc.shape[-1])
    return torch.cat([suffix, zero], -2).to(dtype or rows.dtype)


def schedule(table: TeacherTable, slots: int) -> list[torch.Tensor]:
    """The oracle's choices with ``slots`` slots, from the table alone: per layer ``(Hs, N)`` int64,
    the step at which each position leaves the cache (:data:`NEVER` if it stays).

    The same rule as the runtime (DESIGN.md §2.12): at prefill the top ``slots`` prompt positions by
    ``R_{P−1}`` (a tie keeps the newer), then at each step t over D = C ∪ {t} the lowest ``R_t``
    leaves when ``|D| > slots`` (a tie evicts the older). Positions are visible to the query of
    step t while their step is ``>= t``.
    """
    if isinstance(slots, bool) or not isinstance(slots, int) or slots < 1:
        raise ConfigError(f"slots must be a whole number >= 1, got {slots!r}")
    rem = torch.stack([r.cpu() for r in table.remaining])  # (L, Hs, T + 1, N)
    layers, hs, _, n = rem.shape
    p = table.prompt_len
    pos = torch.arange(n)
    out = torch.full((layers, hs, n), NEVER, dtype=torch.int64)
    prompt = pos[None, None, :p].expand(layers, hs, p)
    keep = eviction.prefill_keep(rem[:, :, 0, :p], prompt, slots, 0)  # (L, Hs, P)
    out[:, :, :p][~keep] = p - 1
    kept = torch.zeros(layers, hs, n, dtype=torch.bool)
    kept[:, :, :p] = keep
    big = torch.finfo(rem.dtype).max
    for t in range(p, n):
        kept[:, :, t] = True
        if int(kept[0, 0].sum()) <= slots:  # |D| <= slots (the same count in every set)
            continue
        r = rem[:, :, t - p + 1].masked_fill(~kept, big)  # (L, Hs, N) R_t on D
        tied = r == r.amin(-1, keepdim=True)
        victim = torch.where(tied, pos, n).argmin(-1)  # (L, Hs): the older of the lowest
        kept.scatter_(-1, victim[..., None], False)
        out.scatter_(-1, victim[..., None], t)
    return list(out)
