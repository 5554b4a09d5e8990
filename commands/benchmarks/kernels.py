"""``h2o-lens bench kernels``: the fused decode step and the kernels ÷ the torch path
(:mod:`h2o_lens.kernels.bench`)."""

from __future__ import annotations

import argparse

__all__ = ["add_arguments", "run"]

NAME = "kernels"
HELP = "the Triton kernels / the torch path, on the GPU when there is one"


def _case(text: str) -> tuple[int, int]:
    batch, _, context = text.lower().partition("x")
    try:
        pair = int(batch), int(context)
    except ValueError:
        pair = (0, 0)
    if min(pair) < 1:
        raise argparse.ArgumentTypeError(
            f"expected BATCHxCONTEXT with two positive whole numbers (8x4096), got {text!r}"
        )
    return pair


def add_arguments(b: argparse.ArgumentParser) -> None:
    """The end-to-end table's model shape, cases and graphs; the dtype is bfloat16."""
    b.add_argument(
        "--shape",
        choices=("default", "llama3-8b"),
        default="default",
        help="the end-to-end table's random-weight Llama: the default model's shape (8x4096, 8x32768) or "
        "Llama-3-8B's (32 layers, 32/8 heads, d 128: 8x4096, 8x16384, 8x32768, 1x65536)",
    )
    b.add_argument("--cases", nargs="+", type=_case, metavar="BxN", help="batch x context cases, e.g. 8x4096")
    b.add_argument(
        "--no-graphs",
        action="store_true",
        help="leave out the graph-captured paths (StaticCache and H2O under CUDA graphs, DESIGN.md §2.16)",
    )
    b.add_argument("--no-kernels", action="store_true", help="the end-to-end table only")
    b.add_argument(
        "--max-batch",
        type=int,
        default=None,
        metavar="CONTEXT",
        help="then the largest batch of CONTEXT-token requests the full cache and H2O at 20 %% each hold on the "
        "GPU, and the tokens/s of each at its batch",
    )


def run(args: argparse.Namespace) -> int:
    from h2o_lens.kernels.bench import bench_kernels

    from .common import check_ints

    if args.max_batch is not None:
        check_ints("kernels", "max-batch", [args.max_batch], 2)
    bench_kernels(
        shape=args.shape,
        cases=tuple(args.cases or ()),
        graphs=not args.no_graphs,
        kernels=not args.no_kernels,
        max_batch=args.max_batch,
    )
    return 0
