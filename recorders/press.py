"""Recording a kvpress press: what it kept, per layer and KV head, checked against its cache.

``recorders.record(model, press, out=...)`` lands here when ``press`` is a kvpress press (or a
:class:`h2o_lens.presses.PressSpec`). The model runs under ``with press(model):`` exactly as a
kvpress user runs it; the H2O runtime is not involved (DESIGN.md §17). The recorder watches the
press's own choice:

- every ScorerPress inside the press (the press itself, or the inner presses of a wrapper) has
  its ``score`` and ``compress`` observed on the instance: the scores it computed and the number
  of positions its compression returned give the indices behind its pruning
  (``scores.topk(kept)``, kvpress's own rule); the keys and values it returned must equal the
  inputs gathered at those indices, bit for bit;
- the press's ``forward_hook`` is observed around: before it the cache layer holds the full keys,
  after it the compressed ones; the composed indices of the press's compressions must give the
  cache it leaves, bit for bit, or the recording fails with a :class:`RecorderError`.

A position map per layer (cache column -> original position, ``-1`` for padding) follows the
cache through prefill and decode, so a ``DecodingPress``'s compressions are logged at their decode
step. The observers are instance attributes removed on exit, exceptions included.

Two kinds of press are followed otherwise (DESIGN.md §17.1): a masking press (AdaKV,
CriticalAdaKV, DuoAttention, DMS) leaves the cache whole and masks keys of single KV heads, read
from ``module.masked_key_indices`` after each hook call, so its kept sets differ in size by head;
a matched press (ChunkKV, BlockPress) keeps columns by its own rule, each found among the columns
before it by its key and value bits. Presses that keep no subset of the original positions per
layer and KV head are refused before anything runs, in one line naming the press and why
(:data:`h2o_lens.presses.REFUSED`).
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import json
import warnings
from collections.abc import Iterator, Mapping
from typing import Any

import numpy as np
import torch

from h2o_lens import presses as press_table
from h2o_lens.errors import ConfigError
from runlog.errors import RecorderError, RecorderWarning

__all__ = [
    "is_press",
    "check_press",
    "press_spec",
    "build_press",
    "read_duo_pattern",
    "PressObserver",
    "prepare_press",
    "press_scope",
]


def is_press(policy: Any) -> bool:
    """Whether ``policy`` is a kvpress press or a :class:`PressSpec` (kvpress is not imported for
    anything else)."""
    return isinstance(policy, press_table.PressSpec) or _from_kvpress(policy)


def _from_kvpress(obj: Any) -> bool:
    """Whether ``obj`` is an instance of a kvpress class or of a subclass of one."""
    return any(c.__module__.split(".")[0] == "kvpress" for c in type(obj).__mro__)


def _children(press: Any) -> list[Any]:
    """The inner presses of a wrapper (the fields :data:`~h2o_lens.presses.WRAPPERS` names)."""
    for cls in type(press).__mro__:
        fields = press_table.WRAPPERS.get(cls.__name__)
        if fields is not None:
            out = []
            for f in fields:
                value = getattr(press, f)
                out += list(value) if isinstance(value, (list, tuple)) else [value]
            return out
    return []


def _refusal(press: Any, kvpress: Any) -> str | None:
    for cls in type(press).__mro__:
        if cls.__name__ in press_table.REFUSED:
            return press_table.REFUSED[cls.__name__]
    if isinstance(press, kvpress.presses.scorer_press.ScorerPress) or _is_a(press, press_table.MASKING):
        return None
    if not _children(press):
        return (
            "it is not a ScorerPress, so the positions it keeps cannot be recovered from its own choice "
            "(the top of its scores)"
        )
    for inner in _children(press):
        if _is_a(inner, press_table.MASKING):
            return (
                f"its inner {type(inner).__name__} masks keys inside the cache, which the recorder follows "
                "only for the outer press"
            )
        why = _refusal(inner, kvpress)
        if why is not None:
            return f"its inner {type(inner).__name__}: {why}"
    return None


def check_press(press: Any) -> None:
    """Refuse, in one line, a press whose kept set the recorder cannot log (DESIGN.md §17).

    Raises
    ------
    ConfigError
        The press (or a press inside it) merges, quantizes, rotates or prunes channels, or keeps
        per-head budgets; the message names it and why, and the supported presses.
    """
    kvpress = press_table.import_kvpress()
    if not isinstance(press, kvpress.presses.base_press.BasePress):
        raise ConfigError(f"expected a kvpress press (a BasePress), got {type(press).__name__}")
    why = _refusal(press, kvpress)
    if why is not None:
        names = ", ".join(p.name for p in press_table.SUPPORTED)
        raise ConfigError(
            f"kvpress {type(press).__name__} cannot be recorded: {why}; the recorder logs presses that keep "
            f"a subset of positions per layer and KV head ({names}; DESIGN.md §17)"
        )


def _jsonable(value: Any) -> Any:
    if dataclasses.is_dataclass(value) and _from_kvpress(value):
        return press_spec(value).to_dict()
    if isinstance(value, (list, tuple)):
        return [_jsonable(v) for v in value]
    try:
        json.dumps(value)
    except (TypeError, ValueError):
        return repr(value)
    return value


def press_spec(press: Any) -> press_table.PressSpec:
    """The :class:`PressSpec` of a press object: its class and constructor fields, in declaration
    order (nested presses as nested specs)."""
    if isinstance(press, press_table.PressSpec):
        return press
    params = {f.name: _jsonable(getattr(press, f.name)) for f in dataclasses.fields(press) if f.init}
    return press_table.PressSpec(type(press).__name__, tuple(params.items()))


@functools.cache
def _local_duo_attention() -> type:
    """kvpress's DuoAttentionPress reading its head pattern from a local folder (its ``pattern``
    field) instead of downloading it; under the same class name, so its runs read as DuoAttention's."""
    kvpress = press_table.import_kvpress()

    @dataclasses.dataclass
    class DuoAttentionPress(kvpress.DuoAttentionPress):
        pattern: str | None = None

        def load_attention_pattern(self, model: Any) -> tuple[int, int, np.ndarray]:
            return read_duo_pattern(self.pattern, model)

    DuoAttentionPress.__qualname__ = "DuoAttentionPress"
    return DuoAttentionPress


def read_duo_pattern(folder: Any, model: Any = None) -> tuple[int, int, np.ndarray]:
    """``(sink_size, recent_size, head_scores)`` of a DuoAttention head pattern in ``folder``
    (``config.json`` and ``full_attention_heads.tsv``, one row per layer and one score per KV head,
    clipped to [0, 1] as DuoAttention's own loader does).

    Raises
    ------
    ConfigError
        A missing or malformed file, or a table whose shape is not the model's layers × KV heads.
    """
    from pathlib import Path

    root = Path(str(folder))
    try:
        config = json.loads((root / "config.json").read_text())
        sink, recent = int(config["sink_size"]), int(config["recent_size"])
        scores = np.loadtxt(root / "full_attention_heads.tsv", dtype=float, delimiter="\t", ndmin=2)
    except (OSError, ValueError, KeyError, TypeError) as exc:
        raise ConfigError(
            f"DuoAttention pattern {str(root)!r}: expected config.json with sink_size and recent_size and "
            f"full_attention_heads.tsv with a score per layer and KV head ({exc})"
        ) from None
    if model is not None:
        want = (model.config.num_hidden_layers, model.config.num_key_value_heads)
        if scores.shape != want:
            raise ConfigError(
                f"DuoAttention pattern {str(root)!r} holds {scores.shape[0]} × {scores.shape[1]} head scores; "
                f"the model has {want[0]} layers × {want[1]} KV heads"
            )
    return sink, recent, np.clip(scores, 0, 1)


def build_press(spec: press_table.PressSpec) -> Any:
    """The kvpress press a spec describes (kvpress imported now; a DuoAttentionPress with a
    ``pattern`` reads its head pattern from that folder)."""
    kvpress = press_table.import_kvpress()
    cls = getattr(kvpress, spec.press, None)
    if spec.press == "DuoAttentionPress" and spec.kwargs.get("pattern") is not None:
        cls = _local_duo_attention()
    if cls is None:
        raise ConfigError(f"kvpress {kvpress.__version__} has no press {spec.press!r}; check the name")

    def build(value: Any) -> Any:
        if isinstance(value, Mapping) and "press" in value:
            return build_press(press_table.PressSpec.from_dict(value))
        if isinstance(value, list):
            return [build(v) for v in value]
        return value

    try:
        return cls(**{k: build(v) for k, v in spec.kwargs.items()})
    except (TypeError, ValueError, AssertionError) as exc:
        raise ConfigError(f"kvpress {spec.press} refused the arguments {spec.kwargs}: {exc}") from None


def _bits(t: torch.Tensor) -> torch.Tensor:
    """``t``'s bits as integers, so that equality is bit for bit (NaN and -0.0 included)."""
    kind = {1: torch.uint8, 2: torch.int16, 4: torch.int32, 8: torch.int64}[t.element_size()]
    return t.contiguous().view(kind)


def _same_bits(a: torch.Tensor, b: torch.Tensor) -> bool:
    return a.shape == b.shape and a.dtype == b.dtype and torch.equal(_bits(a), _bits(b))


@dataclasses.dataclass
class _Stage:
    """One compression of one ScorerPress: the columns it kept ``(b, h, k)`` of the ``(b, h, n)``
    it was given, and its scores ``(b, h, n)``."""

    kept: torch.Tensor
    scores: torch.Tensor


class PressObserver:
    """Watches one press during a recording and writes its kept sets (DESIGN.md §17).

    Parameters
    ----------
    press : the kvpress press (already checked by :func:`check_press`)
    rec : the :class:`~recorders.recorder.Recording` whose writer and request numbering it uses
    pinned : prompt positions whose scores are raised to the top of every ScorerPress's scores, so
        that its own choice keeps them (``explain``'s pinned variant, DESIGN.md §17.3); a
        compression that keeps fewer positions than are pinned fails the recording
    """

    def __init__(self, press: Any, rec: Any, pinned: tuple[int, ...] = ()):
        self.press = press
        self.rec = rec
        self.pinned = torch.tensor(sorted(set(pinned)), dtype=torch.int64)  # positions raised to the top
        self._cur: torch.Tensor | None = None  # (b, h, n) position of each column the next compression sees
        self._stages: list[_Stage] = []
        self._pos: dict[int, torch.Tensor] = {}  # layer -> (b, h, n) original position per cache column
        self._next: torch.Tensor | None = None  # (b,) position of each row's next token
        self._ids: np.ndarray = np.zeros(0, np.int32)  # the request of each row
        self._patched: list[tuple[Any, str]] = []
        self._steps: dict[int, torch.Tensor] = {}  # layer -> (b,) position of its next decode token
        self.compressions = 0  # compressions logged (one per layer and press call)
        self._padded = False  # the current generate call's prompt has padding columns
        self._warned = False
        self._all_scorers: list[Any] = []  # every ScorerPress of the press, set on installing
        self._masking = _is_a(press, press_table.MASKING)  # it masks keys inside a whole cache
        self._gathering = _holds(press, press_table.GATHERING)  # its kept columns are matched by their bits
        self._pending: dict[str, list[dict[str, Any]]] = {}  # rows of this forward's layers, appended at its end

    # -- installing -------------------------------------------------------------
    def _scorers(self, press: Any) -> list[Any]:
        kvpress = press_table.import_kvpress()
        if isinstance(press, kvpress.presses.scorer_press.ScorerPress):
            return [press]
        return [s for inner in _children(press) for s in self._scorers(inner)]

    def _set(self, obj: Any, name: str, value: Any) -> None:
        if name in vars(obj):
            raise RecorderError(
                f"{type(obj).__name__} already has an instance attribute {name!r}; record a fresh press object"
            )
        setattr(obj, name, value)
        self._patched.append((obj, name))

    @contextlib.contextmanager
    def installed(self) -> Iterator[None]:
        self._all_scorers = self._scorers(self.press)
        try:
            for scorer in self._all_scorers:
                self._set(scorer, "score", functools.partial(self._score, scorer, type(scorer).score))
                self._set(scorer, "compress", functools.partial(self._compress, scorer, type(scorer).compress))
            self._set(self.press, "forward_hook", functools.partial(self._hook, type(self.press).forward_hook))
            yield
        finally:
            self._flush()
            for obj, name in reversed(self._patched):
                vars(obj).pop(name, None)
            self._patched.clear()

    # -- observing ----------------------------------------------------------------
    def _score(self, scorer: Any, original: Any, *args: Any, **kwargs: Any) -> torch.Tensor:
        scores = original(scorer, *args, **kwargs)
        if len(self.pinned):
            scores = self._raise_pinned(scorer, scores)
        # a masking press raises its safeguard in place: keep the scores as the scorer gave them
        scorer.__dict__["_h2o_lens_scores"] = scores.clone() if self._masking else scores
        return scores

    def _raise_pinned(self, scorer: Any, scores: torch.Tensor) -> torch.Tensor:
        """``scores`` with the pinned positions' raised to the dtype's largest value, so that the top
        of the scores (the press's own choice) takes them first (DESIGN.md §17.3)."""
        cur = self._cur
        if cur is None or cur.shape != scores.shape:
            raise RecorderError(
                f"kvpress {type(scorer).__name__} scored {tuple(scores.shape)} columns where the recorder follows "
                f"{None if cur is None else tuple(cur.shape)}; its pinned positions cannot be located"
            )
        mask = torch.isin(cur, self.pinned.to(cur.device))  # (b, h, n)
        scorer.__dict__["_h2o_lens_pins"] = mask
        return scores.masked_fill(mask, torch.finfo(scores.dtype).max)

    def _compress(self, scorer: Any, original: Any, module: Any, hidden, keys, values, attentions, kwargs):
        vars(scorer).pop("_h2o_lens_scores", None)
        vars(scorer).pop("_h2o_lens_pins", None)
        out_k, out_v = original(scorer, module, hidden, keys, values, attentions, kwargs)
        scores = vars(scorer).pop("_h2o_lens_scores", None)
        pins = vars(scorer).pop("_h2o_lens_pins", None)
        if out_k is keys and out_v is values:  # compression ratio 0: nothing pruned
            return out_k, out_v
        name = type(scorer).__name__
        if scores is None or scores.shape != keys.shape[:3]:
            raise RecorderError(
                f"kvpress {name} at layer {module.layer_idx} pruned {keys.shape[2]} -> {out_k.shape[2]} keys "
                f"without scores of shape {tuple(keys.shape[:3])} (got "
                f"{None if scores is None else tuple(scores.shape)}); its choice cannot be recovered"
            )
        kept = scores.topk(out_k.shape[2], dim=-1).indices  # (b, h, k): kvpress's own rule
        idx = kept.unsqueeze(-1).expand(-1, -1, -1, keys.shape[-1])
        if not (_same_bits(keys.gather(2, idx), out_k) and _same_bits(values.gather(2, idx), out_v)):
            raise RecorderError(
                f"kvpress {name} at layer {module.layer_idx}: the keys and values it kept are not the top "
                f"{out_k.shape[2]} of its scores bit for bit, so the recorded kept set would be wrong; "
                "this press selects by a rule the recorder does not follow (DESIGN.md §17)"
            )
        if pins is not None and bool((pins.gather(-1, kept).sum(-1) < pins.sum(-1)).any()):
            raise RecorderError(
                f"kvpress {name} at layer {module.layer_idx} keeps {out_k.shape[2]} positions, fewer than the "
                f"{int(pins.sum(-1).max())} pinned: the pins do not fit in its kept count"
            )
        if self._cur is not None and self._cur.shape == scores.shape:
            self._cur = self._cur.gather(-1, kept)  # the next stage of a chain picks among these
        self._stages.append(_Stage(kept, scores.detach().float()))
        return out_k, out_v

    def _hook(self, original: Any, module: Any, args: Any, kwargs: dict, output: Any) -> Any:
        layer_no = module.layer_idx
        layer = kwargs["past_key_values"].layers[layer_no]
        before_k, before_v = layer.keys, layer.values
        q_len = kwargs["hidden_states"].shape[1]
        prefill = layer_no not in self._pos or bool(kwargs["cache_position"][0] == 0)
        if prefill:
            self._start(layer_no, before_k.shape)
        else:
            self._grow(layer_no, q_len)
        self._stages = []
        self._cur = self._pos[layer_no]
        mask_before = getattr(module, "masked_key_indices", None)
        try:
            output = original(self.press, module, args, kwargs, output)
        finally:
            self._cur = None
        stages, self._stages = self._stages, []
        seen = self._seen_scores(before_k.shape[:3])
        try:
            return self._observe(module, layer, before_k, before_v, prefill, mask_before, seen, stages, output)
        finally:
            if layer_no == len(kwargs["past_key_values"].layers) - 1:  # the forward's last layer
                self._flush()

    def _observe(self, module, layer, before_k, before_v, prefill, mask_before, seen, stages, output) -> Any:
        """What one hook call did to ``layer`` (the cache before it: ``before_k, before_v``), logged."""
        layer_no = module.layer_idx
        if self._masking:
            self._masked(module, layer, before_k, prefill, mask_before, seen)
            return output
        if self._gathering:
            if layer.keys is not before_k:
                cols = _match(before_k, before_v, layer.keys, layer.values, self._pos[layer_no], self._name(layer_no))
                if len(stages) == 1 and stages[0].scores.shape == before_k.shape[:3]:
                    seen = stages[0].scores  # it left the choice to its scorer
                self._log(layer_no, prefill, _or_nan(seen, self._pos[layer_no]), False, cols=cols)
            return output
        if not stages:
            if layer.keys is not before_k or self._pos[layer_no].shape[-1] != layer.keys.shape[2]:
                raise RecorderError(
                    f"kvpress {type(self.press).__name__} changed the cache of layer {layer_no} without a "
                    "ScorerPress choice the recorder saw; it cannot be recorded (DESIGN.md §17)"
                )
            return output
        cols = torch.arange(before_k.shape[2], device=before_k.device).expand(before_k.shape[:3])
        scores = torch.full(before_k.shape[:3], float("nan"), device=before_k.device)
        for st in stages:  # each stage picks among the columns the previous one kept
            scores.scatter_(-1, cols, st.scores)
            cols = cols.gather(-1, st.kept)
        idx = cols.unsqueeze(-1).expand(-1, -1, -1, before_k.shape[-1])
        if not (_same_bits(before_k.gather(2, idx), layer.keys) and _same_bits(before_v.gather(2, idx), layer.values)):
            raise RecorderError(
                f"kvpress {type(self.press).__name__} at layer {layer_no}: the cache it left does not hold the "
                "keys and values of the positions its choice kept, bit for bit; the recording is stopped "
                "rather than logging a wrong kept set (DESIGN.md §17)"
            )
        self._log(layer_no, prefill, scores, len(stages) == 1, cols=cols)
        return output

    def _emit(self, table: str, columns: dict[str, Any]) -> None:
        """Rows of ``table`` for the writer, appended with the rest of the forward's (:meth:`_flush`):
        one batch per table and forward instead of one per layer."""
        self._pending.setdefault(table, []).append(columns)

    def _flush(self) -> None:
        """Append the rows held by :meth:`_emit` to the recording's writer, one batch per table."""
        pending, self._pending = self._pending, {}
        for table, batches in pending.items():
            self.rec.writer.append(table, _joined(batches))

    def _name(self, layer_no: int) -> str:
        return f"kvpress {type(self.press).__name__} at layer {layer_no}"

    def _seen_scores(self, shape: torch.Size) -> torch.Tensor | None:
        """The scores a scorer of the press computed in this hook call and no compression of its took
        (a wrapper that selects by its own rule), if they cover the cache's columns; removed."""
        found = None
        for scorer in self._all_scorers:
            scores = vars(scorer).pop("_h2o_lens_scores", None)
            vars(scorer).pop("_h2o_lens_pins", None)
            if scores is not None and tuple(scores.shape) == tuple(shape):
                found = scores.detach().float()
        return found

    def _masked(self, module: Any, layer: Any, before_k: torch.Tensor, prefill: bool, mask_before: Any, seen) -> None:
        """A masking press's hook call: the cache stays whole; the keys it masked since the last call
        (``module.masked_key_indices``, as kvpress's attention patch reads them) are logged as evicted
        from their KV head."""
        layer_no = module.layer_idx
        if layer.keys is not before_k or layer.keys.shape[2] != self._pos[layer_no].shape[-1]:
            raise RecorderError(
                f"{self._name(layer_no)} changed the cache it should leave whole (it masks keys inside it); "
                "it cannot be recorded (DESIGN.md §17.1)"
            )
        mask = getattr(module, "masked_key_indices", None)
        if mask is None or mask is mask_before:
            return
        pos = self._pos[layer_no]
        masked = torch.zeros(pos.shape, dtype=torch.bool, device=pos.device)
        masked[tuple(t.to(pos.device) for t in mask)] = True
        if len(self.pinned) and bool((masked & torch.isin(pos, self.pinned.to(pos.device))).any()):
            raise RecorderError(
                f"{self._name(layer_no)} masks pinned positions: the pins do not fit in the budget of their head"
            )
        self._log(layer_no, prefill, _or_nan(seen, pos), False, kept=~(masked & (pos >= 0)))

    def _start(self, layer_no: int, shape: torch.Size) -> None:
        """A prefill: the cache's columns are the prompt's, left-padded (``-1`` for padding)."""
        watch = self.rec._watch
        if watch is None or watch.input_ids is None:
            raise RecorderError("a press compressed outside a recorded generate call; call model.generate in the block")
        valid = watch.prompt_mask().to(torch.int64)  # (b, W)
        if valid.shape[1] != shape[2]:
            raise RecorderError(
                f"the prefill cache of layer {layer_no} holds {shape[2]} positions for a prompt of "
                f"{valid.shape[1]} columns; a press is recorded from a fresh prefill (no reused cache)"
            )
        pos = torch.where(valid.bool(), valid.cumsum(-1) - 1, -1)  # (b, W)
        self._pos[layer_no] = pos[:, None, :].expand(shape[0], shape[1], -1).to(torch.int64)
        if layer_no == 0 or self._next is None:
            self._padded = not bool(valid.bool().all())
            self._warned = False
            self._next = valid.sum(-1)  # (b,)
            self._ids = np.arange(self.rec._request_base, self.rec._request_base + shape[0], dtype=np.int32)
            self._steps = {}

    def _grow(self, layer_no: int, q_len: int) -> None:
        """A decode forward: its ``q_len`` tokens join the cache after the columns held."""
        pos = self._pos[layer_no]
        if self._padded and not self._warned and self.compressions and not self._masking:
            self._warned = True
            warnings.warn(
                "kvpress compressed a left-padded batch: at decode steps transformers reads the padding mask "
                "by cache column, and the compressed cache's columns no longer line up with it, so these rows "
                "attend to other positions than the press kept; their replay fails the implementation check "
                "(DESIGN.md §17). Generate one prompt per call to record a press's decode steps",
                RecorderWarning,
                stacklevel=2,
            )
        start = self._steps.get(layer_no, self._next)
        new = start[:, None] + torch.arange(q_len, device=start.device)  # (b, q)
        self._pos[layer_no] = torch.cat([pos, new[:, None, :].expand(pos.shape[0], pos.shape[1], -1).to(pos)], -1)
        self._steps[layer_no] = start + q_len

    def _log(
        self,
        layer_no: int,
        prefill: bool,
        scores: torch.Tensor,
        margins: bool,
        *,
        cols: torch.Tensor | None = None,
        kept: torch.Tensor | None = None,
    ) -> None:
        """The evictions and steps rows of one compression of one layer: ``cols`` the columns kept
        ``(b, h, k)`` of a compressed cache, or ``kept``, a masking press's kept mask ``(b, h, n)`` over
        the whole cache (the masked columns' positions become ``-1``, held by no one)."""
        pos = self._pos[layer_no]  # (b, h, n)
        if kept is not None:
            self._pos[layer_no] = pos.masked_fill(~kept, -1)
        else:
            kept = torch.zeros_like(pos, dtype=torch.bool).scatter_(-1, cols, True)
            self._pos[layer_no] = pos.gather(-1, cols)
        real = pos >= 0
        end = self._next if prefill else self._steps[layer_no]
        step = (end - 1).to(torch.int64)  # (b,): the last position processed
        alive = self.rec._watch.alive if (not prefill and self.rec._watch is not None) else None
        survivors = kept & real
        big = torch.finfo(torch.float32).max
        low = torch.where(survivors, scores, big).amin(-1)  # (b, h)
        victims = real & ~kept
        if alive is not None:
            victims &= alive.to(victims.device)[:, None, None]
        r, h, i = victims.nonzero(as_tuple=True)
        victim_pos = pos[r, h, i].cpu().numpy()
        victim_score = scores[r, h, i]
        margin = (low[r, h] - victim_score) if margins else torch.full_like(victim_score, float("nan"))
        step_np = step.cpu().numpy()
        phase = "prefill" if prefill else "decode"
        if len(victim_pos):
            self._emit(
                "evictions",
                {
                    "request": self._ids[r.cpu().numpy()],
                    "step": step_np[r.cpu().numpy()],
                    "layer": np.full(len(victim_pos), layer_no, np.int16),
                    "kv_head": h.cpu().numpy().astype(np.int16),
                    "position": victim_pos.astype(np.int64),
                    "score": victim_score.cpu().numpy().astype(np.float32),
                    "margin": margin.cpu().numpy().astype(np.float32),
                    "age": step_np[r.cpu().numpy()] - victim_pos,
                    "left_recent": np.zeros(len(victim_pos), bool),
                    "phase": phase,
                },
            )
        b, hs = survivors.shape[:2]
        age = torch.where(survivors, step[:, None, None] - pos, 0).sum(-1) / survivors.sum(-1).clamp(min=1)
        self._emit(
            "steps",
            {
                "request": np.repeat(self._ids, hs),
                "step": np.repeat(step_np, hs),
                "layer": np.full(b * hs, layer_no, np.int16),
                "kv_head": np.tile(np.arange(hs, dtype=np.int16), b),
                "min_heavy_score": np.ma.masked_invalid(
                    torch.where(survivors.any(-1), low, float("nan")).reshape(-1).cpu().numpy().astype(np.float32)
                ),
                "kept": survivors.sum(-1).reshape(-1).cpu().numpy().astype(np.int32),
                "heavy_age_mean": np.ma.masked_invalid(
                    torch.where(survivors.any(-1), age.float(), float("nan")).reshape(-1).cpu().numpy()
                ),
            },
        )
        self.compressions += 1


def _joined(batches: list[dict[str, Any]]) -> dict[str, Any]:
    """Column batches of one table as one: arrays joined in order (masked arrays keep their masks),
    a scalar column repeated over its batch's rows unless every batch holds the same."""
    if len(batches) == 1:
        return batches[0]
    rows = [len(b["request"]) for b in batches]
    out: dict[str, Any] = {}
    for key in batches[0]:
        values = [b[key] for b in batches]
        if all(np.ndim(v) == 0 for v in values) and all(v == values[0] for v in values):
            out[key] = values[0]
            continue
        arrays = [np.full(n, v) if np.ndim(v) == 0 else v for v, n in zip(values, rows)]
        masked = any(isinstance(a, np.ma.MaskedArray) for a in arrays)
        out[key] = np.ma.concatenate(arrays) if masked else np.concatenate(arrays)
    return out


def _holds(press: Any, names: frozenset[str]) -> bool:
    """Whether ``press`` or a press inside it is of a class ``names`` lists."""
    return _is_a(press, names) or any(_holds(p, names) for p in _children(press))


def _is_a(press: Any, names: frozenset[str]) -> bool:
    """Whether ``press`` is of a class ``names`` lists, or of a subclass of one."""
    return any(c.__name__ in names for c in type(press).__mro__)


def _or_nan(scores: torch.Tensor | None, like: torch.Tensor) -> torch.Tensor:
    """``scores``, or NaN scores of ``like``'s shape where no scores cover the cache's columns."""
    return scores if scores is not None else torch.full(like.shape, float("nan"), device=like.device)


#: odd multipliers of a column's bits: a column's hash, to find a kept column among the originals
_MIX = torch.randint(1, 2**62, (4096,), generator=torch.Generator().manual_seed(48)) | 1


def _hashes(keys: torch.Tensor, values: torch.Tensor) -> torch.Tensor:
    """One int64 per cache column ``(b, h, n)`` from its key's and value's bits (wrapping sums)."""
    bits = torch.cat([_bits(keys), _bits(values)], -1).to(torch.int64)
    mix = _MIX[: bits.shape[-1]].to(bits.device)
    return (bits * mix).sum(-1)


def _match(before_k, before_v, after_k, after_v, pos: torch.Tensor, name: str) -> torch.Tensor:
    """The columns ``(b, h, k)`` of the cache before a press whose keys and values the cache after it
    holds, column for column, bit for bit (DESIGN.md §17.1).

    Raises
    ------
    RecorderError
        A column it left is not an original column, or two real positions of one head hold the same
        bits (the kept set would be ambiguous).
    """
    if after_k.shape[:2] != before_k.shape[:2] or after_k.shape[2] > before_k.shape[2]:
        raise RecorderError(f"{name} left a cache of shape {tuple(after_k.shape)} from {tuple(before_k.shape)}")
    hb, ha = _hashes(before_k, before_v), _hashes(after_k, after_v)
    sorted_b, order = hb.sort(-1)
    same = sorted_b[..., 1:] == sorted_b[..., :-1]
    if bool(same.any()):
        twins = torch.maximum(pos.gather(-1, order[..., 1:]), pos.gather(-1, order[..., :-1]))[same]
        if bool((twins >= 0).any()):
            raise RecorderError(f"{name}: two positions of one head hold the same key and value bits")
    at = torch.searchsorted(sorted_b, ha).clamp(max=hb.shape[-1] - 1)
    cols = order.gather(-1, at)
    idx = cols.unsqueeze(-1).expand(-1, -1, -1, before_k.shape[-1])
    if not (_same_bits(before_k.gather(2, idx), after_k) and _same_bits(before_v.gather(2, idx), after_v)):
        raise RecorderError(
            f"{name}: the cache it left holds keys and values that are not original columns, bit for bit; "
            "the recording is stopped rather than logging a wrong kept set (DESIGN.md §17.1)"
        )
    return cols


def _needs_eager(press: Any) -> bool:
    info = press_table.find(type(press).__name__)
    return bool(info and info.eager and not info.wrapper) or any(_needs_eager(p) for p in _children(press))


@contextlib.contextmanager
def _attention(model: Any, press: Any) -> Iterator[None]:
    """Eager attention for the presses that read the attention weights (restored on exit)."""
    if not _needs_eager(press) or model.config._attn_implementation == "eager":
        yield
        return
    previous = model.config._attn_implementation
    model.set_attn_implementation("eager")
    try:
        yield
    finally:
        model.set_attn_implementation(previous)


def prepare_press(press: Any) -> tuple[Any, dict[str, Any], str]:
    """What :func:`recorders.record` needs to record a press: the press object (built from a
    :class:`PressSpec`), checked (:func:`check_press`), the manifest fields of its run (the policy
    text ``kvpress:SnapKVPress(compression_ratio=0.6, ...)`` with every parameter, whether the press
    came as an object or a spec) and a run id prefix (``kvpress-snapkv``)."""
    if not isinstance(press, press_table.PressSpec):
        check_press(press)
    spec = press_spec(press)
    if isinstance(press, press_table.PressSpec):
        press = build_press(spec)
        check_press(press)
        spec = press_spec(press)
    text = press_table.policy_text(spec.press, spec.kwargs)
    ratio = spec.compression_ratio
    manifest = {
        "config": {"policy": text, "press": spec.to_dict()},
        "policy": text,
        "backend": "kvpress",
        "keep_ratio": None if ratio is None else 1.0 - ratio,
    }
    return press, manifest, "kvpress-" + press_table.short_name(spec.press)


@contextlib.contextmanager
def press_scope(model: Any, press: Any, rec: Any, pinned: tuple[int, ...] = ()) -> Iterator[PressObserver]:
    """The model under ``with press(model):`` as kvpress runs it (transformers' own cache, the
    press's hooks), with the :class:`PressObserver` of ``rec`` installed (``pinned``: positions
    whose scores are raised so that the press keeps them); all removed on exit."""
    observer = PressObserver(press, rec, pinned)
    with observer.installed(), _attention(model, press), press(model):
        yield observer
