"""Decode steps captured once and replayed: CUDA graphs on a GPU, a traced rehearsal on CPU
(DESIGN.md §2.16).

An H2O cache has a fixed shape once every slot is filled (``B`` slots per layer and KV set,
whatever the context), so a decode step's forward is the same launches on the same buffers at
every step: exactly what a CUDA graph records. :class:`GraphedForward` wraps a model's
``forward`` inside ``h2o(model, ..., graphs=True)``: a one-token forward over a steady H2O cache
(every slot filled, no verification segment, no extension but the recorder's listener) is run
eagerly for :data:`WARMUP` steps, then captured, then replayed with its inputs copied into static
buffers. Every other forward (the prompt, a filling cache, a guarded or tiered cache, a draft)
runs eagerly, and the reason is kept (:attr:`GraphedForward.fallbacks`).

What a replay cannot redo is done around it: the layers' Python counters (``seen``) advance,
and the decode events of the step, held back during the capture, go to the listeners as copies
of the graph's output buffers, so a recording under graphs writes the log it writes without.

On a CPU there are no CUDA graphs. :class:`TracedGraph` stands in for them, with their
semantics: capturing runs the step once under a dispatch mode that records every operator with
its arguments, refusing the operators that read a tensor's value on the host
(``tensor.item()``, ``bool(tensor)``, ``nonzero``: a CUDA capture fails on them); a replay runs
the recorded operators again on the same buffers. Python values read during the capture are
frozen in the trace as in a CUDA graph, so a step that depends on host state it did not put in a
buffer replays wrongly: the rehearsal's tests compare tokens, kept sets and logs with the eager
path. It runs the torch step only (the Triton interpreter is no dispatched operator) and makes
nothing faster.
"""

from __future__ import annotations

import dataclasses
import inspect
from collections.abc import Callable
from typing import Any

import torch
from torch.utils._python_dispatch import TorchDispatchMode

from . import compat
from .errors import ConfigError, UnsupportedModelError

__all__ = [
    "GRAPH_MODES",
    "WARMUP",
    "GraphCaptureError",
    "GraphedForward",
    "TracedGraph",
    "check_graphs",
    "graph_kind",
]

#: values of ``h2o(model, ..., graphs=...)``: off, on (a CUDA graph on a GPU, the traced
#: rehearsal on a CPU), or on where the model sits on a CUDA device
GRAPH_MODES = (False, True, "auto")
#: eager steady steps before the capture (lazy initialisations, Triton's compilation)
WARMUP = 2


class GraphCaptureError(UnsupportedModelError):
    """A decode step did something a captured graph cannot replay (it read a tensor on the host)."""


def check_graphs(graphs: Any) -> bool | str:
    """``graphs`` validated: False, True or ``"auto"``."""
    if graphs not in GRAPH_MODES or isinstance(graphs, int) and not isinstance(graphs, bool):
        raise ConfigError(f"graphs must be False, True or 'auto', got {graphs!r}")
    return graphs


def graph_kind(graphs: bool | str, device: torch.device) -> str | None:
    """``"cuda"``, ``"traced"`` or None (eager) for the mode ``graphs`` on ``device``."""
    if graphs is False or (graphs == "auto" and device.type != "cuda"):
        return None
    return "cuda" if device.type == "cuda" else "traced"


# -- the CPU rehearsal -------------------------------------------------------------------------------


def _host_read(func) -> bool:
    tags = getattr(func, "tags", ())
    return torch.Tag.data_dependent_output in tags or torch.Tag.dynamic_output_shape in tags


class _Trace(TorchDispatchMode):
    """Records ``(op, args, kwargs, out)`` of every operator; refuses host reads."""

    def __init__(self):
        super().__init__()
        self.ops: list[tuple[Any, tuple, dict, Any]] = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if _host_read(func):
            raise GraphCaptureError(
                f"the decode step called {func} while it was being captured: it reads a tensor's value "
                "on the host, which a captured graph cannot replay; run without graphs (graphs=False)"
            )
        out = func(*args, **kwargs)
        self.ops.append((func, args, kwargs, out))
        return out


def _assign(kept: Any, new: Any) -> None:
    """Make the captured output ``kept`` hold the replayed ``new`` (same buffer, as a graph does)."""
    if isinstance(kept, torch.Tensor):
        if new is kept:
            return
        same = (
            new.data_ptr() == kept.data_ptr()
            and new.shape == kept.shape
            and new.stride() == kept.stride()
            and new.dtype == kept.dtype
        )
        if not same:  # a view recomputed over the same buffer is already there
            kept.copy_(new)
    elif isinstance(kept, (tuple, list)):
        for k, n in zip(kept, new):
            _assign(k, n)


class TracedGraph:
    """A CUDA graph's semantics on any device: :meth:`capture` runs ``fn`` once and records its
    operators, :meth:`replay` runs them again on the same buffers (module docstring)."""

    executes_capture = True

    def __init__(self):
        self._ops: list[tuple[Any, tuple, dict, Any]] | None = None

    def capture(self, fn: Callable[[], Any]) -> Any:
        trace = _Trace()
        with trace:
            out = fn()
        self._ops = trace.ops
        return out

    def replay(self) -> None:
        if self._ops is None:
            raise RuntimeError("replay before capture")
        for func, args, kwargs, kept in self._ops:
            _assign(kept, func(*args, **kwargs))


class _CudaGraph:
    """``torch.cuda.CUDAGraph`` behind :class:`TracedGraph`'s two verbs; a capture runs nothing."""

    executes_capture = False

    def __init__(self):
        self._graph = torch.cuda.CUDAGraph()

    def capture(self, fn: Callable[[], Any]) -> Any:
        with torch.cuda.graph(self._graph):
            return fn()

    def replay(self) -> None:
        self._graph.replay()


# -- the wrapped forward -----------------------------------------------------------------------------


@dataclasses.dataclass
class _Captured:
    key: tuple
    graph: Any = None
    inputs: dict[str, torch.Tensor] = dataclasses.field(default_factory=dict)
    out: Any = None
    events: list = dataclasses.field(default_factory=list)  # (layer, DecodeEvent) of the captured step
    warm: int = 0


def _steady_reason(cache: Any) -> str | None:
    """Why ``cache`` cannot be replayed from a graph now, or None. Besides an H2O cache, a cache of
    transformers' whose layers keep a fixed shape (``StaticCache``: the full cache's fair baseline
    under graphs) is replayed once its prompt is in."""
    from .cache import H2OCache
    from .extension import ListenerExtension

    if cache is None:
        return "no cache"
    if not isinstance(cache, H2OCache):
        if not getattr(cache, "is_compileable", False):
            return f"{type(cache).__name__} changes shape every step (a StaticCache does not)"
        if not all(getattr(layer, "is_initialized", True) for layer in cache.layers):  # 4.56 allocates at once
            return "the prompt has not been prefilled"
        return None
    others = [type(e).__name__ for e in cache.extensions if not isinstance(e, ListenerExtension)]
    if others:
        return f"the cache has extensions a graph cannot replay ({', '.join(sorted(set(others)))})"
    for layer in cache.layers:
        if layer.keys is None:
            return "the prompt has not been prefilled"
        if layer.fill is not None:
            return "the cache is still filling its slots (shapes change until every slot is used)"
        if layer.segment is not None or layer.held_prompt is not None:
            return "a verification segment is open"
    if cache.backend == "cpp":
        return "the fused CPU step is a compiled call that a trace cannot record"
    if cache.backend == "triton" and not torch.cuda.is_available():
        return "the Triton interpreter cannot be traced"
    return None


def _buffers(cache: Any) -> tuple:
    """Where the layers' state lives: a graph replays on these buffers only (rows moved, a
    reset or a restore allocate new ones, and the step is captured again)."""
    names = ("keys", "values", "scores", "positions", "history", "next_pos", "cumulative_length")
    return tuple(
        tuple(None if (t := getattr(layer, n, None)) is None else (t.data_ptr(), tuple(t.shape)) for n in names)
        for layer in cache.layers
    )


def _restore_seen(cache: Any, seen: list) -> None:
    for layer, n in zip(cache.layers, seen):
        if n is not None:
            layer.seen = n


class GraphedForward:
    """A model's ``forward`` that replays one-token decode steps over a steady H2O cache from a
    captured graph (module docstring). ``kind``: ``"cuda"`` or ``"traced"``."""

    def __init__(self, forward: Callable[..., Any], kind: str, model: Any = None):
        self.forward = forward
        self.kind = kind
        #: the model's forward takes ``cache_position`` (transformers to 5.23): a replay must feed it,
        #: or the model derives it from the cache's count on the host, frozen into the graph
        target = model.forward if model is not None else forward
        self.takes_cache_position = "cache_position" in inspect.signature(target).parameters
        self.replayed = 0  # decode steps served by a graph (each captured step included)
        self.captures = 0
        self.fallbacks: dict[str, int] = {}  # reason -> eager forwards

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        cache = compat.cache_from(kwargs)
        reason = self._reason(args, kwargs, cache)
        if reason is not None:
            self.fallbacks[reason] = self.fallbacks.get(reason, 0) + 1
            return self.forward(*args, **kwargs)
        inputs, frozen = self._split(kwargs, cache)
        key = (frozen, tuple((k, tuple(t.shape), t.dtype) for k, t in sorted(inputs.items())), _buffers(cache))
        state = getattr(cache, "_captured", None)
        if state is None:
            state = cache._captured = _Captured(key)
        if state.warm < WARMUP:  # eager steady steps first
            state.warm += 1
            return self._eager(kwargs)
        if state.graph is None or state.key != key:  # first, or the buffers or arguments changed
            state.key, state.events = key, []
            return self._capture(state, cache, inputs, kwargs)
        for name, t in inputs.items():
            state.inputs[name].copy_(t)
        state.graph.replay()
        self.replayed += 1
        return self._after(state, cache)

    def summary(self) -> dict[str, Any]:
        """``{"kind", "replayed", "captures", "eager"}``: what the graphs served, and the eager
        forwards by reason (the manifest's ``graphs``)."""
        return {"kind": self.kind, "replayed": self.replayed, "captures": self.captures, "eager": dict(self.fallbacks)}

    # -- pieces ----------------------------------------------------------------------------------
    def _reason(self, args: tuple, kwargs: dict, cache: Any) -> str | None:
        if args:
            return "positional arguments"
        ids = kwargs.get("input_ids")
        if ids is None or ids.dim() != 2 or ids.shape[1] != 1:
            return "not a one-token forward"
        if (
            kwargs.get("inputs_embeds") is not None
            or kwargs.get("output_attentions")
            or kwargs.get("output_hidden_states")
        ):
            return "embeddings, attentions or hidden states asked"
        if self.kind == "cuda" and ids.device.type != "cuda":
            return "the inputs are not on a CUDA device"
        return _steady_reason(cache)

    def _split(self, kwargs: dict, cache: Any) -> tuple[dict[str, torch.Tensor], tuple]:
        """The tensors a replay copies in, and the other arguments (frozen in the graph: its key).
        The 2-D padding mask is dropped (a decode step does not read it, DESIGN.md §2.16); the
        positions (and ``cache_position`` where the model takes it) come from the cache's count
        when the call does not give them, as the model itself would compute them."""
        inputs, frozen = {}, []
        for name, value in kwargs.items():
            if name in ("cache", "past_key_values", "attention_mask"):
                continue
            if isinstance(value, torch.Tensor):
                inputs[name] = value
            else:
                frozen.append((name, repr(value)))
        missing = "cache_position" not in inputs and self.takes_cache_position
        if "position_ids" not in inputs or missing:
            ids = inputs["input_ids"]
            seen = int(cache.get_seq_length())
            if missing:
                inputs["cache_position"] = torch.full((1,), seen, dtype=torch.long, device=ids.device)
            if "position_ids" not in inputs:
                inputs["position_ids"] = torch.full((1, 1), seen, dtype=torch.long, device=ids.device)
        return inputs, tuple(sorted(frozen))

    def _call(self, kwargs: dict, inputs: dict[str, torch.Tensor]) -> Any:
        call = {k: v for k, v in kwargs.items() if k not in inputs and k != "attention_mask"}
        return self.forward(**call, **inputs)

    def _eager(self, kwargs: dict) -> Any:
        if self.kind != "cuda":
            return self.forward(**kwargs)
        side = torch.cuda.Stream()  # warm-up on a side stream, as CUDA graph captures want
        side.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(side):
            out = self.forward(**kwargs)
        torch.cuda.current_stream().wait_stream(side)
        return out

    def _capture(self, state: _Captured, cache: Any, inputs: dict, kwargs: dict) -> Any:
        state.inputs = {k: t.clone() for k, t in inputs.items()}
        graph = _CudaGraph() if self.kind == "cuda" else TracedGraph()
        seen = [getattr(layer, "seen", None) for layer in cache.layers]  # an H2O layer's count
        cache.graph_events = state.events
        try:
            state.out = graph.capture(lambda: self._call(kwargs, state.inputs))
        finally:
            cache.graph_events = None
        state.graph = graph
        self.captures += 1
        _restore_seen(cache, seen)
        if not graph.executes_capture:  # a CUDA capture recorded the step: run it
            graph.replay()
        self.replayed += 1
        return self._after(state, cache)

    def _after(self, state: _Captured, cache: Any) -> Any:
        """The step's host side: counters, the held-back events, a copy of the logits."""
        q = state.inputs["input_ids"].shape[1]
        for layer in cache.layers:
            if hasattr(layer, "seen"):
                layer.seen += q
        for layer, event in state.events:
            copy = dataclasses.replace(
                event,
                **{
                    f.name: getattr(event, f.name).clone()
                    for f in dataclasses.fields(event)
                    if isinstance(getattr(event, f.name), torch.Tensor)
                },
            )
            layer.announce(copy)
        out = state.out
        return type(out)(**{k: (v.clone() if k == "logits" else v) for k, v in out.items()})
