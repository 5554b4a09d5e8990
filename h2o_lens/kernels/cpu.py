"""The fused H2O decode step on CPU: ``decode_cpu.cpp`` beside this file, built on first use.

The torch step (:func:`h2o_lens.ops.decode_step`) runs some forty small tensor operations per
layer; at batch 1 their dispatch, not the slots' bytes, sets the step's time (docs/BENCHMARKS.md,
"The limit"). This step does the same work in one call per layer, a loop per (request, KV set),
with the torch step's semantics and what it gives when asked (DESIGN.md §2.8). It is compiled with the C++
compiler and ninja of the machine (:func:`torch.utils.cpp_extension.load_inline`) into
torch's extension folder, once per source version; :func:`cpu_step_available` says whether
that works here, and :func:`cpu_step_problem` why not.
"""

from __future__ import annotations

import contextlib
import functools
import hashlib
import os
import shutil
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import torch

from .. import ops, policies
from ._checks import KernelInputError, check_step_inputs, rows_table

__all__ = ["decode_step_cpu", "cpu_step_available", "cpu_step_problem", "cold_refill_cpu", "cold_append_cpu"]

#: compiled as one unit, in this order: what they share, the step, the cold tier's calls, the bindings
_SOURCES = tuple(
    Path(__file__).with_name(f) for f in ("cpu_common.cpp", "decode_cpu.cpp", "cold_cpu.cpp", "cpu_bindings.cpp")
)
_BUILD_ROOM = 16 * 2**20  # bytes a build writes (its object file and library), with room to spare


@functools.cache
def _module():
    """The built extension (built here the first time; later processes load it)."""
    from torch.utils import cpp_extension

    sources = [p.read_text() for p in _SOURCES]
    flags = _arch_flags()
    key = "\n".join([*sources, torch.__version__, *flags])
    tag = hashlib.sha256(key.encode()).hexdigest()[:12]  # a build per source, torch and instruction set
    bin_dir = os.path.dirname(sys.executable)  # a ninja installed in this environment
    if shutil.which("ninja") is None and os.path.exists(os.path.join(bin_dir, "ninja")):
        os.environ["PATH"] = bin_dir + os.pathsep + os.environ.get("PATH", "")
    name = f"h2o_lens_decode_cpu_{tag}"
    root = _build_root()
    build = root / name
    build.mkdir(parents=True, exist_ok=True)
    with _build_lock(root / f"{name}.lock"):
        # torch's own lock file is left behind by a build killed half way, and every later load
        # would wait on it for ever; under this lock (released when its holder dies) it is stale
        (build / "lock").unlink(missing_ok=True)
        if not (build / f"{name}.so").exists():
            print(
                "h2o-lens: building the fused CPU calls, the decode step and the cold tier's refill and append "
                "(once per machine and version, about 40 s)",
                file=sys.stderr,
            )
        return cpp_extension.load_inline(
            name=name,
            cpp_sources=sources,
            extra_cflags=["-O3", "-fopenmp", *flags],
            extra_ldflags=["-fopenmp"],
            build_directory=str(build),
            verbose=False,
        )


def _build_root() -> Path:
    """torch's extension folder (``TORCH_EXTENSIONS_DIR``, else its default)."""
    from torch.utils import cpp_extension

    return Path(os.environ.get("TORCH_EXTENSIONS_DIR") or cpp_extension.get_default_build_root())


@contextlib.contextmanager
def _build_lock(path: Path) -> Iterator[None]:
    """An exclusive lock between the processes that build or load the step (pytest's workers, two
    commands at once), held on an open file, so the system releases it when its holder dies."""
    try:
        import fcntl
    except ImportError:  # no fcntl (Windows): torch's own lock only
        yield
        return
    with open(path, "a") as f:
        fcntl.flock(f, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(f, fcntl.LOCK_UN)


def _arch_flags() -> list[str]:
    """Vector instructions for the compiler where torch found them on this CPU (AVX2 with FMA, or
    AVX-512): the loops over ``d`` then run 8 or 16 lanes wide. Part of the build's name, so a
    build is never loaded on a CPU without them."""
    cap = torch.backends.cpu.get_cpu_capability()
    if cap in ("AVX2", "AVX512"):
        return ["-mavx2", "-mfma"]
    return []


@functools.cache
def cpu_step_problem() -> str | None:
    """Why the fused CPU step cannot be built here (no C++ compiler, no ninja, a failed build),
    in one line, or None when it loads."""
    if shutil.which(os.environ.get("CXX", "c++")) is None:
        return "no C++ compiler (c++ or $CXX) on the PATH"
    try:
        _module()
    except Exception as exc:  # a missing ninja, a compiler error, a full disk: the torch step runs instead
        root = _build_root()
        free = shutil.disk_usage(root).free if root.exists() else None
        if free is not None and free < _BUILD_ROOM:  # the assembler's own words do not say so
            return f"building the fused CPU step failed: {free / 2**20:.1f} MiB free in {root} (it needs about 10)"
        return f"building the fused CPU step failed: {_reason(exc)}"
    return None


def _reason(exc: Exception) -> str:
    """The line of a failed build that says why (the compiler's error, a full disk), not the
    command line it ran; at most 200 characters."""
    lines = [line.strip() for line in str(exc).splitlines() if line.strip()]
    said = [line for line in lines if "error" in line.lower() or "no space" in line.lower()]
    why = next((line for line in said if not line.startswith("[")), lines[0] if lines else type(exc).__name__)
    return why if len(why) <= 200 else why[:197] + "..."


def cpu_step_available() -> bool:
    """Whether the fused CPU step builds and loads on this machine."""
    return cpu_step_problem() is None


def decode_step_cpu(
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    keys: torch.Tensor,
    values: torch.Tensor,
    scores: torch.Tensor,
    positions: torch.Tensor,
    step: torch.Tensor,
    fill: torch.Tensor | None,
    scaling: float,
    args: ops.PolicyArgs,
    *,
    layer: int = 0,
    rows: ops.RowBudgets | None = None,
    want_candidates: bool = False,
    weights: bool = False,
    journal: bool = False,
    protected: torch.Tensor | None = None,
) -> ops.DecodeResult:
    """Fused H2O decode step on CPU: the contract, arguments and results of
    :func:`h2o_lens.ops.decode_step` (in place), on CPU tensors, for the policies with a fused step
    (:func:`h2o_lens.kernels.decode_step_triton`'s). What the torch step gives besides, it gives
    when asked: ``want_candidates`` the candidate set D (``cand_scores``, ``cand_positions``,
    ``(b, Hs, B + 1)``; a recorder reads it), ``weights`` the softmax weights ``(b, Hs, G, B + 1)``
    (the guard's signals), ``journal`` the key and value the write overwrote (``old_key``,
    ``old_value``; a rollback, the cold tier); ``protected`` as :func:`h2o_lens.ops.decode_step`
    takes it (pins: never eligible).

    Keys and values may be any storage whose last axis is contiguous (the torch backend's block
    storage included, DESIGN.md §2.7); scores and positions need a contiguous slot axis. A
    policy without a ``"decode"`` kernel runs :func:`h2o_lens.ops.decode_step`.
    """
    fn = "decode_step_cpu"
    spec = args.spec
    if not spec.evicts:
        raise KernelInputError(
            f"{fn}: policy {args.policy!r} does not evict, so it has no decode step; "
            f"expected one of {', '.join(p.name for p in policies.evicting())}"
        )
    inputs = (query, key, value, keys, values, scores, positions, step, fill, scaling, args)
    if "decode" not in spec.kernels:
        extra = dict(want_candidates=want_candidates, journal=journal, protected=protected)
        return ops.decode_step(*inputs, layer=layer, rows=rows, **extra)
    if spec.scored and not spec.accumulates:
        raise KernelInputError(f"{fn}: policy {args.policy!r} is scored but does not accumulate; no fused step")
    b, hs, cap, d, _ = check_step_inputs(fn, query, key, value, keys, values, scores, positions, step, fill, True)
    for name, t in (("keys", keys), ("values", values)):
        if t.stride(3) != 1:
            raise KernelInputError(f"{fn}: {name} needs a contiguous last axis (stride {t.stride()})")
    for name, t in (("scores", scores), ("positions", positions)):
        if t.stride(2) != 1:
            raise KernelInputError(f"{fn}: {name} needs a contiguous slot axis (stride {t.stride()})")
    table = None if rows is None else rows_table(rows, b, hs, keys.device)
    pins = None
    if protected is not None and protected.numel():  # (b, K) int64, each row sorted
        pins = protected.to(torch.int64).reshape(-1, protected.shape[-1]).expand(b, -1).sort(-1).values.contiguous()
    problem = cpu_step_problem()
    if problem is not None:
        raise KernelInputError(f"{fn}: {problem}")
    res = _module().decode_step(
        query.contiguous(),
        key.contiguous(),
        value.contiguous(),
        keys,
        values,
        scores,
        positions,
        step.to(torch.int64),
        None if fill is None else fill.to(torch.int64),
        table,
        float(scaling),
        int(args.recent),
        int(args.sink),
        bool(spec.accumulates),
        args.gqa == "max",
        want_candidates,
        pins,
        weights,
        journal,
    )
    out, slot, evicts, cand_scores, cand_positions, w, old_key, old_value = res
    return ops.DecodeResult(
        out=out,
        slot=slot,
        evicts=evicts,
        cand_scores=cand_scores,
        cand_positions=cand_positions,
        old_key=old_key,
        old_value=old_value,
        weights=w,
    )


def cold_refill_cpu(
    query: torch.Tensor, store: Any, window: torch.Tensor, layer: Any, start: int, agg_max: bool, scan: int | None
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, int, int]:
    """The cold tier's refill of one layer's recall window in one call (``cold_cpu.cpp``), with
    the semantics of the torch refill in :mod:`h2o_lens.cold` (DESIGN.md §2.13). ``query (b, Hq,
    d)`` the step's; ``store`` the layer's :class:`~h2o_lens.cold_store.ColdStore` (float32
    scores); ``window (b, Hs, r)`` its records in the window; ``layer`` the cache layer (its
    slots, written in place, and its ``scaling``), the window at slots ``start …``; ``agg_max``
    the group's aggregation (else the sum); ``scan`` the pages read (None: ``exact``).
    Returns the new window, the slots filled, each slot's score and position ``(b, Hs, r)``, the
    keys scored and the records brought in."""
    problem = cpu_step_problem()
    if problem is not None:
        raise KernelInputError(f"cold_refill_cpu: {problem}")
    pages = scan is not None
    new, filled, score, held, totals = _module().cold_refill(
        query.contiguous(),
        *_store_args(store, pages),
        window.contiguous(),
        layer.keys,
        layer.values,
        layer.scores,
        layer.positions,
        int(start),
        float(layer.scaling),
        bool(agg_max),
        int(scan) if pages else 0,
    )
    keys_read, entries = totals.tolist()
    return new, filled, score, held, keys_read, entries


def cold_append_cpu(store: Any, result: ops.DecodeResult, key: torch.Tensor, value: torch.Tensor, width: int) -> int:
    """A decode step's victims (``result``: its slot, evicts, candidate set and overwritten K/V;
    ``key, value (b, Hs, d)`` the step's new ones, a victim where the slot is ``width`` or past it)
    appended to ``store`` in one call (``cold_cpu.cpp``); the store has room for one more record
    per row. Returns the number written."""
    return int(
        _module().cold_append(
            *_store_args(store, store.summaries),
            result.slot.contiguous(),
            result.evicts.contiguous(),
            result.cand_scores.contiguous(),
            result.cand_positions.contiguous(),
            result.old_key.contiguous(),
            result.old_value.contiguous(),
            key.contiguous(),
            value.contiguous(),
            int(width),
        )
    )


def _store_args(store: Any, summaries: bool) -> tuple:
    """A cold store's tensors as the compiled calls take them (its page summaries, or None)."""
    low, high = (store.low, store.high) if summaries else (None, None)
    return store.kv, store.positions, store.scores, store.count, low, high
