"""``h2o-lens bench kernels``: the fused decode step and the kernels ÷ the torch path
(:mod:`h2o_lens.kernels.bench`)."""

from __future__ import annotations

import argparse

__all__ = ["add_arguments", "run"]

NAME = "kernels"
HELP = "the Triton kernels / the torch path, on the GPU when there is one"


def add_arguments(b: argparse.ArgumentParser) -> None:
    """No options: the shapes are the default model's and the dtype bfloat16."""


def run(args: argparse.Namespace) -> int:
    from h2o_lens.kernels.bench import bench_kernels

    bench_kernels()
    return 0
