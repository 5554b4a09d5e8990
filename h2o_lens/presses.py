"""kvpress presses as every layer sees them: names, the supported table and the spec a run keeps.

A press of NVIDIA's kvpress is not a policy of the registry (:mod:`h2o_lens.policies`): the
H2O runtime never runs it, kvpress's own hooks do, and the recorder
(:mod:`recorders.press`) records what it kept (DESIGN.md §17). What the other layers need
to know about a press is written once here: the short names a sweep takes
(``kvpress:snapkv``), the presses the recorder supports and why the others are refused,
the policy text a run carries (``kvpress:SnapKVPress(compression_ratio=0.6, window_size=64,
kernel_size=5)``), a chart colour, and :class:`PressSpec`, the plain description a sweep
cell builds its press from.

This module imports neither torch nor kvpress (kvpress only inside :func:`import_kvpress`, when
a press is used), so the analyses and the dashboard read it.
"""

from __future__ import annotations

import dataclasses
import hashlib
import math
import re
from collections.abc import Mapping
from typing import Any

from .errors import ConfigError, MissingExtraError

__all__ = [
    "PREFIX",
    "INSTALL",
    "PressInfo",
    "PressSpec",
    "SUPPORTED",
    "REFUSED",
    "WRAPPERS",
    "find",
    "short_name",
    "is_press_policy",
    "press_class",
    "colour",
    "scored",
    "policy_text",
    "parse_sweep_policy",
    "sweep_policy",
    "import_kvpress",
    "check_args",
    "sweep_spec",
    "parse_press_args",
    "split_wrapper_args",
    "ratio_field",
    "LOCAL_FIELDS",
    "MASKING",
    "GATHERING",
    "DEFAULT_SCORER",
]

#: the prefix of a press's policy name (``kvpress:snapkv``) and of a press run's policy column
PREFIX = "kvpress:"
#: what to run when kvpress is missing (kvpress 0.5.5 needs transformers >= 4.56 and < 5.3)
INSTALL = "pip install 'h2o-lens[kvpress]'"


@dataclasses.dataclass(frozen=True)
class PressInfo:
    """One press the recorder supports.

    Attributes
    ----------
    name : the short name (``kvpress:NAME`` in ``sweep --policies``): kvpress's snake_case name
    cls : the kvpress class name
    colour : its colour in the charts
    scored : attention drives its choice (attribution may call a lost evidence a scoring lag)
    summary : what it keeps, one line
    wrapper : it takes another press (``base_press``, ``press``, ``presses``)
    decoding : it evicts while decoding (its evictions are logged at decode steps)
    eager : its scores read the model's attention weights (the recorder runs the model with
        transformers' eager attention, which returns them)
    scorer_wrapper : it wraps one scorer press in its ``press`` field, which a sweep builds
        (SnapKV unless ``press=NAME`` is given) and sets the compression ratio on
    ratio : the parameter a keep ratio ``r`` sets to ``1 - r`` (DuoAttention's share of streaming
        heads stands for its compression ratio)
    """

    name: str
    cls: str
    colour: str
    scored: bool
    summary: str
    wrapper: bool = False
    decoding: bool = False
    eager: bool = False
    scorer_wrapper: bool = False
    ratio: str = "compression_ratio"


#: the presses recorded and tested (DESIGN.md §17); any other subclass of kvpress's ScorerPress
#: is recorded too, its choice checked the same way
SUPPORTED: tuple[PressInfo, ...] = (
    PressInfo("snapkv", "SnapKVPress", "#d62728", True, "attention of the prompt's last window of queries"),
    PressInfo("streaming_llm", "StreamingLLMPress", "#bcbd22", False, "the first n_sink positions and the newest"),
    PressInfo("tova", "TOVAPress", "#0b6e4f", True, "attention of the prompt's last query"),
    PressInfo(
        "observed_attention",
        "ObservedAttentionPress",
        "#ff9896",
        True,
        "attention received over the prompt's rows (eager attention)",
        eager=True,
    ),
    PressInfo("knorm", "KnormPress", "#98df8a", False, "the lowest key norms"),
    PressInfo("expected_attention", "ExpectedAttentionPress", "#aec7e8", True, "attention expected of future queries"),
    PressInfo("pyramidkv", "PyramidKVPress", "#c49c94", True, "SnapKV's scores with budgets falling over the layers"),
    PressInfo("random", "RandomPress", "#c7c7c7", False, "random positions"),
    PressInfo("keydiff", "KeyDiffPress", "#dbdb8d", False, "keys least similar to the mean key"),
    PressInfo("lagkv", "LagKVPress", "#9edae5", False, "key and value spread against the next chunk"),
    PressInfo(
        "decoding", "DecodingPress", "#393b79", True, "a scorer press applied every few decode steps", True, True
    ),
    PressInfo(
        "compression_ratio_decoding",
        "CompressionRatioDecodingPress",
        "#5254a3",
        True,
        "a decoding press holding a share of the sequence",
        True,
        True,
    ),
    PressInfo(
        "prefill_decoding",
        "PrefillDecodingPress",
        "#6b6ecf",
        True,
        "one press at prefill, one while decoding",
        True,
        True,
    ),
    PressInfo("composed", "ComposedPress", "#8c6d31", True, "presses applied one after another", True),
    PressInfo(
        "per_layer_compression", "PerLayerCompressionPress", "#bd9e39", True, "a press with per-layer ratios", True
    ),
    PressInfo(
        "adakv",
        "AdaKVPress",
        "#b03a2e",
        True,
        "its scorer's top across the KV heads of a layer: a budget per head",
        True,
        scorer_wrapper=True,
    ),
    PressInfo(
        "criticaladakv",
        "CriticalAdaKVPress",
        "#f7b6d2",
        True,
        "AdaKV's head budgets, scores weighted by the projected value norms",
        True,
        scorer_wrapper=True,
    ),
    PressInfo(
        "chunkkv", "ChunkKVPress", "#1a5276", True, "whole chunks by their mean score", True, scorer_wrapper=True
    ),
    PressInfo(
        "block",
        "BlockPress",
        "#7d6608",
        True,
        "its scorer's top, block by block of the prompt",
        True,
        scorer_wrapper=True,
    ),
    PressInfo(
        "dms",
        "DMSPress",
        "#6c3483",
        True,
        "its sliding window, and older positions its scorer puts at or above a threshold",
        True,
        True,
    ),
    PressInfo(
        "duo_attention",
        "DuoAttentionPress",
        "#515a5a",
        False,
        "streaming heads keep their sink and recent positions, from a local head pattern",
        ratio="head_compression_ratio",
    ),
)

#: the wrappers the recorder follows, with the fields that hold their inner presses
WRAPPERS: dict[str, tuple[str, ...]] = {
    "DecodingPress": ("base_press",),
    "CompressionRatioDecodingPress": ("base_press",),
    "PrefillDecodingPress": ("prefilling_press", "decoding_press"),
    "ComposedPress": ("presses",),
    "PerLayerCompressionPress": ("press",),
    "AdaKVPress": ("press",),
    "CriticalAdaKVPress": ("press",),
    "ChunkKVPress": ("press",),
    "BlockPress": ("press",),
    "DMSPress": ("press",),
}

#: presses that leave the cache whole and mask keys of single KV heads inside it
#: (``module.masked_key_indices``, read by kvpress's attention patch at decode): their kept set per
#: layer and KV head is the complement of the mask, of a size that differs by head (DESIGN.md §17.1)
MASKING: frozenset[str] = frozenset({"AdaKVPress", "CriticalAdaKVPress", "DuoAttentionPress", "DMSPress"})
#: presses whose kept columns are found by matching the cache they leave to the cache before them,
#: column by column, bit for bit (their selection is not the top of one score)
GATHERING: frozenset[str] = frozenset({"ChunkKVPress", "BlockPress"})
#: parameters the toolkit adds to a press: DuoAttention's ``pattern``, a local folder holding its head
#: pattern (``config.json`` with ``sink_size`` and ``recent_size``, ``full_attention_heads.tsv`` with a
#: score per layer and KV head), read instead of the download (``recorders.press.build_press``)
LOCAL_FIELDS: dict[str, tuple[str, ...]] = {"DuoAttentionPress": ("pattern",)}
#: the scorer a sweep puts inside a scorer wrapper unless ``press=NAME`` names another
DEFAULT_SCORER = "SnapKVPress"

_OWN_RULE = "by its own selection, not the top of one score per layer and KV head"
_AFTER_PREFILL = (
    "it compresses when its `with press(model):` block exits (a context prefilled inside the block, its "
    "cache reused by later calls), so a generate call recorded inside the block sees no compression"
)
#: presses refused, with why (DESIGN.md §17.1)
REFUSED: dict[str, str] = {
    "ThinKPress": (
        "it zeroes key channels (dimensions of every key of a head), not positions: the log holds kept "
        "positions, and a replay that masks positions cannot zero channels"
    ),
    "LUKVPress": (
        "its head budgets come from a table it downloads, a path not tested offline (its masks are of AdaKV's kind)"
    ),
    "KVzipPress": _AFTER_PREFILL,
    "KVgradPress": _AFTER_PREFILL,
    "RestoreKVPress": _AFTER_PREFILL + "; it also downloads trained embeddings",
    "FastKVzipPress": _AFTER_PREFILL + "; it also downloads trained gate weights",
    "KVComposePress": _AFTER_PREFILL,
    "MergingPress": "it merges evicted keys and values into the kept ones, which are then not the original keys",
    "CAMPress": "it merges evicted values into the kept ones, which are then not the original values",
    "KeyRerotationPress": "it rotates the kept keys to new positions: they are no longer the keys at their positions",
    "FinchPress": "it rotates the kept keys to new positions and compresses the prompt in chunks",
    "SimLayerKVPress": "it keeps positions by a per-layer rule without scores, so there is no choice to check",
    "ChunkPress": "it selects within chunks of the prompt " + _OWN_RULE,
    "EntropyGatedChunkKVPress": "it keeps whole chunks of positions " + _OWN_RULE,
}

_BY_NAME = {p.name: p for p in SUPPORTED}
_BY_CLASS = {p.cls: p for p in SUPPORTED}
#: colours of presses the table does not name (a ScorerPress subclass of another version)
_PALETTE = ("#843c39", "#ad494a", "#d6616b", "#7b4173", "#a55194", "#ce6dbd", "#637939", "#8ca252")


def _snake(cls: str) -> str:
    """``KeyDiffPress`` -> ``keydiff``-like snake case: words split at a lower-to-upper change,
    except before ``KV`` (kvpress writes SnapKV as snapkv)."""
    base = cls.removesuffix("Press")
    base = base.replace("KV", "kv")
    return re.sub(r"(?<=[a-z0-9])(?=[A-Z])", "_", base).lower()


def short_name(cls: str) -> str:
    """The short name of a press class (the table's, else its snake case)."""
    info = _BY_CLASS.get(cls)
    return info.name if info else _snake(cls)


def find(name: str) -> PressInfo | None:
    """The supported press called ``name`` (short name or class name, any case), or None."""
    key = str(name).strip()
    if key in _BY_NAME:
        return _BY_NAME[key]
    low = key.lower()
    for info in SUPPORTED:
        if low in (info.name, info.cls.lower(), info.cls.lower().removesuffix("press")):
            return info
    return None


def is_press_policy(policy: Any) -> bool:
    """Whether a policy name or a run's policy column names a kvpress press (``kvpress:...``)."""
    return isinstance(policy, str) and policy.startswith(PREFIX)


def press_class(policy: str) -> str | None:
    """The press class a policy text names: ``kvpress:SnapKVPress(...)`` or ``kvpress:snapkv`` ->
    ``SnapKVPress`` (an unknown short name gives None)."""
    if not is_press_policy(policy):
        return None
    head = policy[len(PREFIX) :].split("(", 1)[0].strip()
    info = find(head)
    if info is not None:
        return info.cls
    return head if head[:1].isupper() else None


def colour(policy: str) -> str:
    """The chart colour of a press run's policy text (a stable palette colour for a press the table
    does not name)."""
    cls = press_class(policy) or policy
    info = _BY_CLASS.get(cls)
    if info is not None:
        return info.colour
    return _PALETTE[int(hashlib.sha256(cls.encode()).hexdigest(), 16) % len(_PALETTE)]


def scored(policy: str) -> bool:
    """Whether attention drives the choice of the press a policy text names (unknown: False)."""
    info = _BY_CLASS.get(press_class(policy) or "")
    return bool(info and info.scored)


def _show(value: Any) -> str:
    if isinstance(value, Mapping) and "press" in value:  # a nested press
        return policy_text(value["press"], value.get("params") or {}, prefix=False)
    if isinstance(value, list):
        return "[" + ", ".join(_show(v) for v in value) + "]"
    if isinstance(value, float):
        return repr(round(value, 12))
    return repr(value) if isinstance(value, str) else str(value)


def policy_text(cls: str, params: Mapping[str, Any], *, prefix: bool = True) -> str:
    """A press run's policy column: ``kvpress:SnapKVPress(compression_ratio=0.6, window_size=64, kernel_size=5)``,
    its constructor arguments in declaration order (a nested press shown the same way)."""
    args = ", ".join(f"{k}={_show(v)}" for k, v in params.items())
    return f"{PREFIX if prefix else ''}{cls}({args})"


# -- the spec a sweep cell and a counterfactual build a press from --------------------------


def _value(text: str) -> Any:
    """A ``--press-args`` value: a number, a boolean, None, or the text itself."""
    low = text.strip()
    if low in ("True", "true"):
        return True
    if low in ("False", "false"):
        return False
    if low in ("None", "none", "null"):
        return None
    for kind in (int, float):
        try:
            return kind(low)
        except ValueError:
            pass
    return low.strip("'\"")


@dataclasses.dataclass(frozen=True)
class PressSpec:
    """A press described by value: its class and constructor arguments (DESIGN.md §17).

    ``recorders.record(model, spec, ...)`` builds the press and records it as it records a press
    object; a sweep cell builds its press from one (:func:`sweep_spec`). ``params`` may hold a
    nested press as another spec's :meth:`to_dict`.
    """

    press: str
    params: tuple[tuple[str, Any], ...] = ()

    def __post_init__(self) -> None:
        if not isinstance(self.press, str) or not self.press:
            raise ConfigError(f"a press spec needs a kvpress class name, got {self.press!r}")
        if self.press in REFUSED:
            raise ConfigError(f"kvpress {self.press} is not supported: {REFUSED[self.press]} (DESIGN.md §17)")
        object.__setattr__(self, "params", tuple((str(k), v) for k, v in dict(self.params).items()))

    @property
    def kwargs(self) -> dict[str, Any]:
        return dict(self.params)

    @property
    def compression_ratio(self) -> float | None:
        """The press's compression ratio, or its inner scorer's for a scorer wrapper (AdaKV, ChunkKV,
        ...), whose ratio is its scorer's."""
        value = self.kwargs.get(ratio_field(self.press))
        inner = self.kwargs.get("press")
        if value is None and _wraps_scorer(self.press) and isinstance(inner, Mapping):
            value = (inner.get("params") or {}).get("compression_ratio")
        return float(value) if isinstance(value, (int, float)) else None

    def with_ratio(self, ratio: float) -> PressSpec:
        """The same press at compression ratio ``ratio`` (set on the inner scorer of a scorer wrapper)."""
        inner = self.kwargs.get("press")
        if _wraps_scorer(self.press) and isinstance(inner, Mapping) and "compression_ratio" not in self.kwargs:
            nested = {"press": inner["press"], "params": {**(inner.get("params") or {}), "compression_ratio": ratio}}
            return PressSpec(self.press, tuple({**self.kwargs, "press": nested}.items()))
        return PressSpec(self.press, tuple({**self.kwargs, ratio_field(self.press): ratio}.items()))

    def to_dict(self) -> dict[str, Any]:
        return {"press": self.press, "params": self.kwargs}

    @classmethod
    def from_dict(cls, raw: Mapping[str, Any]) -> PressSpec:
        if not isinstance(raw, Mapping) or not isinstance(raw.get("press"), str):
            raise ConfigError(f"a press config needs a 'press' class name, got {raw!r}")
        params = raw.get("params") or {}
        return cls(raw["press"], tuple(dict(params).items()))


def parse_sweep_policy(text: str, *, sweep: bool = True) -> tuple[str, dict[str, Any]]:
    """``kvpress:NAME`` or ``kvpress:NAME(key=value, ...)`` -> (the press class, its arguments).
    ``sweep`` False: a wrapper that no compression ratio builds (DMSPress) and a ratio among the
    arguments are taken (``bench press`` builds such a press from its own arguments).

    Raises
    ------
    ConfigError
        An unknown name (the message lists the short names) or malformed arguments.
    """
    if not is_press_policy(text):
        raise ConfigError(f"{text!r} is not a press policy; write kvpress:NAME, e.g. kvpress:snapkv")
    body = text[len(PREFIX) :].strip()
    name, _, rest = body.partition("(")
    info = find(name)
    refused = {_snake(c): c for c in REFUSED}
    cls = info.cls if info else refused.get(name.strip().lower())
    cls = cls or (name.strip() if name.strip().endswith("Press") else None)
    if cls is None:
        names = ", ".join(p.name for p in SUPPORTED if not p.wrapper or p.scorer_wrapper)
        raise ConfigError(
            f"unknown press {name.strip()!r} in {text!r}; expected kvpress:NAME with NAME one of {names} "
            "(or a kvpress class name such as kvpress:SnapKVPress)"
        )
    if cls in REFUSED:
        raise ConfigError(f"kvpress {cls} is not supported: {REFUSED[cls]} (DESIGN.md §17)")
    if sweep and info is not None and info.wrapper and not info.scorer_wrapper:
        raise ConfigError(
            f"{text!r}: a sweep builds a press from a compression ratio, and {cls} wraps another press; "
            "sweep its scorer press (e.g. kvpress:knorm) or record the wrapper with recorders.record"
        )
    args: dict[str, Any] = {}
    if rest:
        if not rest.endswith(")"):
            raise ConfigError(f"{text!r}: arguments must be closed, e.g. kvpress:snapkv(window_size=32)")
        for part in filter(None, (p.strip() for p in rest[:-1].split(","))):
            key, eq, value = part.partition("=")
            if not eq or not key.strip().isidentifier():
                raise ConfigError(f"{text!r}: {part!r} is not KEY=VALUE")
            args[key.strip()] = _value(value)
    if sweep and (ratio_field(cls) in args or "compression_ratio" in args):
        raise ConfigError(f"{text!r}: the sweep sets {ratio_field(cls)} from each keep ratio (1 - ratio); leave it out")
    return cls, args


def sweep_policy(cls: str, args: Mapping[str, Any]) -> str:
    """The canonical policy name of a press in a sweep grid (its cells' keys hash it):
    ``kvpress:snapkv`` or ``kvpress:snapkv(window_size=32)`` (arguments sorted)."""
    name = short_name(cls)
    if not args:
        return PREFIX + name
    return PREFIX + name + "(" + ", ".join(f"{k}={_show(args[k])}" for k in sorted(args)) + ")"


def import_kvpress() -> Any:
    """The kvpress module, imported now (a press is being used).

    Raises
    ------
    MissingExtraError
        kvpress is not installed: one line naming the install command.
    """
    try:
        import kvpress
    except ImportError as exc:
        raise MissingExtraError(
            f"kvpress presses need the kvpress package, which is not installed ({exc}); run: {INSTALL}"
        ) from None
    return kvpress


def ratio_field(cls: str) -> str:
    """The parameter that holds the press's compression ratio (``compression_ratio``, or
    DuoAttention's ``head_compression_ratio``)."""
    info = _BY_CLASS.get(cls)
    return info.ratio if info else "compression_ratio"


def _wraps_scorer(cls: str) -> bool:
    info = _BY_CLASS.get(cls)
    return bool(info and info.scorer_wrapper)


def _fields(cls: str) -> list[str]:
    """The constructor parameters of kvpress's press ``cls`` (kvpress imported now)."""
    kvpress = import_kvpress()
    press = getattr(kvpress, cls, None)
    if press is None or not dataclasses.is_dataclass(press):
        raise ConfigError(f"kvpress {kvpress.__version__} has no press {cls!r}; check the name (DESIGN.md §17)")
    return [f.name for f in dataclasses.fields(press) if f.init] + list(LOCAL_FIELDS.get(cls, ()))


def _scorer(cls: str, name: Any) -> str:
    """The scorer class ``press=NAME`` names inside the scorer wrapper ``cls`` (SnapKV by default)."""
    if name is None:
        return DEFAULT_SCORER
    info = find(str(name))
    if info is None or info.wrapper or info.decoding or info.eager:
        names = ", ".join(p.name for p in SUPPORTED if not (p.wrapper or p.decoding or p.eager))
        raise ConfigError(f"kvpress {cls} press={name!r}: expected the short name of a scorer press, one of {names}")
    return info.cls


def split_wrapper_args(cls: str, args: Mapping[str, Any]) -> tuple[dict[str, Any], str, dict[str, Any]]:
    """A scorer wrapper's sweep arguments split: (its own, its scorer's class, its scorer's), its
    own being those its constructor takes (``press=NAME`` names the scorer)."""
    own_fields = set(_fields(cls)) - {"press"}
    inner_cls = _scorer(cls, args.get("press"))
    own = {k: v for k, v in args.items() if k in own_fields}
    inner = {k: v for k, v in args.items() if k not in own_fields and k != "press"}
    return own, inner_cls, inner


def check_args(cls: str, args: Mapping[str, Any]) -> list[str]:
    """Check, with kvpress imported, that ``cls`` is a press of the installed kvpress and that it
    takes every argument of ``args`` (a ConfigError naming the press and its parameters); returns
    its parameters (a scorer wrapper's with its scorer's, DESIGN.md §17.1)."""
    fields = _fields(cls)
    if _wraps_scorer(cls):
        _own, inner_cls, inner = split_wrapper_args(cls, args)
        inner_fields = check_args(inner_cls, inner)
        return fields + [f for f in inner_fields if f not in fields]
    unknown = sorted(set(args) - set(fields))
    if unknown:
        raise ConfigError(f"kvpress {cls} takes no {', '.join(unknown)}; its parameters are {', '.join(fields)}")
    if ratio_field(cls) not in fields:
        raise ConfigError(f"kvpress {cls} has no compression_ratio, so a keep ratio cannot set its slot count")
    return fields


def parse_press_args(items: Any) -> dict[str, Any]:
    """``--press-args KEY=VALUE[,KEY=VALUE]`` (repeatable) -> ``{key: value}``."""
    out: dict[str, Any] = {}
    for item in items or ():
        for part in filter(None, (p.strip() for p in str(item).split(","))):
            key, eq, value = part.partition("=")
            if not eq or not key.strip().isidentifier():
                raise ConfigError(f"--press-args {part!r} is not KEY=VALUE; e.g. --press-args window_size=32")
            if key.strip() == "compression_ratio":
                raise ConfigError("--press-args: the sweep sets compression_ratio from each keep ratio (1 - ratio)")
            out[key.strip()] = _value(value)
    return out


def threshold_spec(cls: str, args: Mapping[str, Any]) -> PressSpec:
    """A press that keeps what its scorer puts at or above a threshold (DMSPress): its own
    arguments (``threshold`` required) and its scorer's (``press=NAME``, SnapKV by default), as a
    spec. No compression ratio sets its slot count, so a sweep cannot build it; ``bench press`` can."""
    own, inner_cls, inner = split_wrapper_args(cls, args)
    threshold = own.get("threshold")
    if threshold is None:
        raise ConfigError(f"kvpress:{short_name(cls)} keeps what its scorer puts above a threshold; give one, "
                          f"e.g. kvpress:{short_name(cls)}(threshold=0.5)")  # fmt: skip
    if isinstance(threshold, bool) or not isinstance(threshold, (int, float)) or not math.isfinite(threshold):
        raise ConfigError(f"kvpress:{short_name(cls)}: threshold must be a finite number, got {threshold!r}")
    return PressSpec(cls, tuple({"press": {"press": inner_cls, "params": dict(inner)}, **own}.items()))


def sweep_spec(policy: str, ratio: float) -> PressSpec:
    """The press of a sweep cell: its grid policy (:func:`sweep_policy`) at keep ratio ``ratio``,
    ``compression_ratio = 1 - ratio`` (the same slot count as every policy of the grid)."""
    cls, args = parse_sweep_policy(policy)
    compression = round(1.0 - float(ratio), 12)
    if _wraps_scorer(cls):
        own, inner_cls, inner = split_wrapper_args(cls, args)
        nested = {"press": inner_cls, "params": {**inner, "compression_ratio": compression}}
        return PressSpec(cls, tuple({"press": nested, **own}.items()))
    return PressSpec(cls, tuple({**args, ratio_field(cls): compression}.items()))
