"""Compile the kernels ahead of time for CUDA targets, on a machine without a GPU.

Triton's interpreter (``TRITON_INTERPRET=1``) checks what the kernels compute,
not whether they compile: block shapes that ``tl.dot`` refuses, type clashes of
loop-carried values or a shared-memory budget are only seen by the compiler.
:func:`compile_kernels` runs the whole pipeline (Triton IR → PTX → ``ptxas`` →
cubin, with the ``ptxas`` that ships in the triton wheel) for the launch
configurations the runtime uses, so those errors show up in CPU-only CI.

Triton decides at import whether it interprets, so this must run in a process
where ``TRITON_INTERPRET`` is unset (``python -m h2o_lens.kernels.aot``).
"""

from __future__ import annotations

import argparse
import dataclasses
import sys
import time
from collections.abc import Sequence

import torch

from ._checks import dot_options, interpret_mode, next_pow2

__all__ = ["TARGETS", "Compiled", "launch_configs", "compile_kernels", "main"]

#: (backend, compute capability, warp size): A100 and H100/H200.
TARGETS = (("cuda", 80, 32), ("cuda", 90, 32))
_PTR = {torch.float16: "*fp16", torch.bfloat16: "*bf16", torch.float32: "*fp32"}
_POS_MAX = 2**62


@dataclasses.dataclass(frozen=True)
class Compiled:
    """One kernel compiled for one target: where, what, and what it needs."""

    kernel: str
    target: str
    config: str
    shared_bytes: int
    cubin_bytes: int
    seconds: float


def _decode(dtype: torch.dtype, group: int, d: int, cap: int, gqa: str, scored: bool, fill: bool):
    from .decode import _kernels

    t = _PTR[dtype]
    sig = dict(
        q_ptr=t,
        kn_ptr=t,
        vn_ptr=t,
        k_ptr=t,
        v_ptr=t,
        s_ptr="*fp32",
        p_ptr="*i32",
        step_ptr="*i32",
        fill_ptr="*i32",
        out_ptr=t,
        logit_ptr="*fp32",
        slot_ptr="*i64",
        evict_ptr="*i1",
        rows_ptr="*i32",  # the step ids stand in when there is no per-row table (HAS_ROWS False)
        B="i32",
        HQ="i32",
        HEAD_DIM="i32",
        scale="fp32",
        recent="i32",
        sink="i32",
    )
    block_n = max(16, min(64 if d > 64 else 128, next_pow2(cap)))  # as decode_step_triton chooses
    const = dict(
        G=group,
        G_PAD=max(16, next_pow2(group)),
        BLOCK_N=block_n,
        BLOCK_D=max(16, next_pow2(d)),
        SCORED=scored,
        AGG_MAX=gqa == "max",
        HAS_FILL=fill,
        HAS_ROWS=False,
        POS_MAX=_POS_MAX,
        **dot_options(dtype),
    )
    return "decode_step", _kernels(), sig, const


def _prefill(dtype: torch.dtype, group: int, d: int, gqa: str, padded: bool, which: str):
    from .prefill import _kernels

    t = _PTR[dtype]
    row_lse, col_sums = _kernels()
    sig = dict(q_ptr=t, k_ptr=t, valid_ptr="*i1" if padded else t, lse_ptr="*fp32")
    if which == "col_sums":
        sig["out_ptr"] = "*fp32"
    sig.update(P="i32", HQ="i32", HS="i32", HEAD_DIM="i32", scale2="fp32")
    const = dict(G=group, BLOCK_M=64, BLOCK_N=64, BLOCK_D=max(16, next_pow2(d)), HAS_VALID=padded, **dot_options(dtype))
    if which == "col_sums":
        const["AGG_MAX"] = gqa == "max"
    return f"prefill_{which}", row_lse if which == "row_lse" else col_sums, sig, const


def _replay(dtype: torch.dtype, group: int, d: int, oracle: str | None = None):
    from .replay import _kernels

    t = _PTR[dtype]
    dropped, oracle_cols = _kernels()
    common = dict(N="i32", M="i32", HQ="i32", HS="i32", HEAD_DIM="i32", scale2="fp32")
    const = dict(G=group, BLOCK_M=64, BLOCK_N=64, BLOCK_D=max(16, next_pow2(d)), **dot_options(dtype))
    if oracle is None:
        sig = dict(q_ptr=t, k_ptr=t, ev_ptr="*i64", out_ptr="*fp32", lse_ptr="*fp32", **common)
        return "replay_dropped_mass", dropped, sig, {**const, "WANT_LSE": True}
    sig = dict(q_ptr=t, k_ptr=t, ev_ptr="*i64", lse_ptr="*fp32", before_ptr="*fp32", after_ptr="*fp32", **common)
    return "replay_oracle", oracle_cols, sig, {**const, "AGG_MAX": oracle == "max"}


def launch_configs(level: str = "default") -> list[tuple]:
    """Launch configurations to compile: ``(name, kernel, signature, constexprs)``.

    ``"quick"`` (the CI test): every kernel in bf16 with the default model's GQA
    group of 3 (sum and max, padded prefill, scored and unscored decode, with and
    without a fill vector), fp16 with a group of 1 and head dim 128, and the fp32
    decode step. ``"default"`` adds every dtype × groups 1 and 3 × head dims 64
    and 128; ``"full"`` also groups of 4 and 8 in every combination.
    """
    if level not in ("quick", "default", "full"):
        raise ValueError(f"level must be quick, default or full, got {level!r}")
    bf16, fp16, fp32 = torch.bfloat16, torch.float16, torch.float32
    if level == "quick":
        return [
            _decode(bf16, 3, 64, 2048, "sum", True, True),
            _decode(bf16, 3, 64, 2048, "max", True, False),
            _decode(bf16, 3, 64, 300, "sum", False, True),
            _prefill(bf16, 3, 64, "sum", True, "col_sums"),
            _prefill(bf16, 3, 64, "max", False, "col_sums"),
            _prefill(bf16, 3, 64, "sum", True, "row_lse"),
            _replay(bf16, 3, 64),
            _replay(bf16, 3, 64, "sum"),
            _decode(fp16, 1, 128, 4096, "sum", True, False),
            _prefill(fp16, 1, 128, "sum", False, "col_sums"),
            _prefill(fp16, 1, 128, "sum", False, "row_lse"),
            _replay(fp16, 1, 128),
            _decode(fp32, 4, 64, 512, "sum", True, True),
        ]
    full = level == "full"
    groups = (1, 3, 4, 8) if full else (1, 3)
    out = []
    for dtype in (bf16, fp16, fp32):
        for group in groups:
            for d in (64, 128):
                for gqa in ("sum", "max"):
                    if not full and (dtype, d) != (bf16, 64) and gqa == "max":
                        continue
                    out.append(_decode(dtype, group, d, 2048, gqa, True, dtype != fp16))
                    out.append(_prefill(dtype, group, d, gqa, dtype == fp16, "col_sums"))
                out.append(_prefill(dtype, group, d, "sum", dtype == fp16, "row_lse"))
                out.append(_replay(dtype, group, d))
                out.append(_replay(dtype, group, d, "max" if full else "sum"))
    out.append(_decode(bf16, 3, 64, 300, "sum", False, True))  # local/sink: unscored
    return out


def compile_kernels(
    targets: Sequence[tuple[str, int, int]] = TARGETS,
    *,
    level: str = "default",
    num_warps: int = 4,
    progress: bool = False,
) -> list[Compiled]:
    """Compile every configuration of :func:`launch_configs` for every target; raise on the first failure.

    Returns one :class:`Compiled` per (configuration, target).
    """
    if interpret_mode():
        raise RuntimeError(
            "TRITON_INTERPRET=1 is set: the kernels would be interpreted, not compiled; "
            "run the ahead-of-time check in a process without it"
        )
    import triton
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource

    done = []
    configs = launch_configs(level)
    for backend_name, arch, warp in targets:
        target = GPUTarget(backend_name, arch, warp)
        backend = triton.compiler.make_backend(target)
        options = backend.parse_options({"num_warps": num_warps})
        for name, kernel, sig, const in configs:
            sig = {**sig, **{k: "constexpr" for k in const}}
            label = ", ".join(f"{k}={v}" for k, v in const.items() if k not in ("POS_MAX",))
            label = f"{sig[next(iter(sig))][1:]}, {label}"
            t0 = time.perf_counter()
            try:
                cc = triton.compile(
                    ASTSource(fn=kernel, signature=sig, constexprs=const), target=target, options=options.__dict__
                )
            except Exception as exc:
                raise RuntimeError(
                    f"{name} does not compile for {backend_name} sm_{arch} ({label}): {type(exc).__name__}: {exc}"
                ) from exc
            done.append(
                Compiled(
                    name,
                    f"{backend_name}:{arch}",
                    label,
                    int(cc.metadata.shared),
                    len(cc.asm.get("cubin", b"")),
                    time.perf_counter() - t0,
                )
            )
            if progress:
                print(
                    f"  {name:<22} sm_{arch}  {done[-1].seconds:5.1f} s  shared {done[-1].shared_bytes:>6} B  {label}",
                    flush=True,
                )
    return done


def main(argv: Sequence[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m h2o_lens.kernels.aot", description=__doc__.split("\n")[0])
    p.add_argument(
        "--level",
        choices=["quick", "default", "full"],
        default="default",
        help="how many launch configurations (see launch_configs)",
    )
    p.add_argument(
        "--target",
        action="append",
        default=None,
        help="compute capability to compile for, e.g. 90 (repeatable; default 80 and 90)",
    )
    args = p.parse_args(argv)
    targets = TARGETS if not args.target else tuple(("cuda", int(t), 32) for t in args.target)
    t0 = time.perf_counter()
    done = compile_kernels(targets, level=args.level, progress=True)
    largest = max(done, key=lambda c: c.shared_bytes)
    print(
        f"{len(done)} kernel configurations compiled to cubin in {time.perf_counter() - t0:.0f} s; "
        f"largest shared memory {largest.shared_bytes} B ({largest.kernel}, {largest.target})"
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
