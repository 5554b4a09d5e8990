"""The ``h2o-lens`` command line."""
from __future__ import annotations

import argparse
import os
import sys
from typing import Sequence

__all__ = ["main", "build_parser"]

DEFAULT_PROMPT = (
    "Read the notes and answer the question.\n"
    "Notes: The orange cable goes to port 7. The backup server is called Heron. "
    "Lunch is at noon on Fridays. The access code for the lab is 4419. "
    "The printer on the second floor is out of toner. Maria moved to the Lisbon office in May.\n"
    "Question: What is the access code for the lab, and where did Maria move?"
)


def _add_policy_args(p: argparse.ArgumentParser) -> None:
    g = p.add_argument_group("policy")
    g.add_argument("--policy", default="h2o", help="h2o | full | local | heavy | sink | random")
    g.add_argument("--heavy", type=int, default=None, help="heavy-hitter slots per layer and KV head")
    g.add_argument("--recent", type=int, default=None, help="recent-window slots per layer and KV head")
    g.add_argument("--ratio", type=float, default=None, help="total keep ratio of the prompt instead of slots")
    g.add_argument("--gqa", default="sum", help="sum | max | none")
    g.add_argument("--sink", type=int, default=4, help="first tokens kept by the sink policy")
    g.add_argument("--seed", type=int, default=0, help="seed of the random policy and of sampling")


def _config(args: argparse.Namespace):
    from .config import H2OConfig

    heavy, recent = args.heavy, args.recent
    if args.policy != "full" and args.ratio is None and heavy is None and recent is None:
        heavy, recent = 64, 64
    return H2OConfig(policy=args.policy, heavy=heavy, recent=recent, ratio=args.ratio,
                     gqa=args.gqa, sink=args.sink, seed=args.seed)


def _mib(n: int) -> str:
    return f"{n / 2**20:.2f} MiB"


def cmd_generate(args: argparse.Namespace) -> int:
    import torch

    from .models import load_model
    from .runtime import full_kv_bytes, h2o

    config = _config(args)
    prompt = args.prompt
    if args.prompt_file:
        with open(args.prompt_file, encoding="utf-8") as f:
            prompt = f.read()
    if prompt is None:
        prompt = DEFAULT_PROMPT
    model, tok = load_model(args.model)
    if not args.raw and getattr(tok, "chat_template", None):
        text = tok.apply_chat_template([{"role": "user", "content": prompt}], tokenize=False,
                                       add_generation_prompt=True)
    else:
        text = prompt
    enc = tok(text, return_tensors="pt", add_special_tokens=args.raw)
    gen = dict(max_new_tokens=args.max_new_tokens, do_sample=args.sample, pad_token_id=tok.pad_token_id)
    if args.sample:
        torch.manual_seed(args.seed)
        gen.update(temperature=args.temperature, top_p=args.top_p)
    with torch.no_grad(), h2o(model, config) as session:
        out = model.generate(**enc, **gen)
    prompt_len = enc["input_ids"].shape[1]
    new = out[0, prompt_len:]
    print(tok.decode(new, skip_special_tokens=True).strip())
    total = prompt_len + len(new)
    full = full_kv_bytes(model, total)
    print("---", file=sys.stderr)
    cache = session.last_cache
    if cache is None:
        print(f"policy: full cache | prompt {prompt_len} tokens, generated {len(new)} | "
              f"KV {_mib(full)}", file=sys.stderr)
        return 0
    b = cache.nbytes()
    print(f"policy: {cache.resolved_config.describe()} | prompt {prompt_len} tokens, generated {len(new)}",
          file=sys.stderr)
    print(f"physical KV: {_mib(b['kv'])} (+ {b['metadata'] / 1024:.1f} KiB scores and positions) "
          f"vs full cache {_mib(full)} at {total} tokens: {b['kv'] / full:.3f} of full",
          file=sys.stderr)
    return 0


def cmd_bench(args: argparse.Namespace) -> int:
    from . import bench

    if args.what == "decode":
        return bench.bench_decode(model_name=args.model, contexts=args.contexts, keep=args.keep,
                                  steps=args.steps, rounds=args.rounds)
    raise SystemExit(f"unknown benchmark {args.what!r}")


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="h2o-lens", description="Exact H2O KV-cache eviction, recorded and explained.")
    sub = p.add_subparsers(dest="command", required=True)

    g = sub.add_parser("generate", help="generate with an H2O cache and print the physical KV bytes")
    g.add_argument("--prompt", default=None)
    g.add_argument("--prompt-file", default=None)
    g.add_argument("--model", default=None, help="HF id or local path (default: the packaged SmolLM2-135M-Instruct)")
    g.add_argument("--max-new-tokens", type=int, default=64)
    g.add_argument("--sample", action="store_true", help="sample instead of greedy decoding")
    g.add_argument("--temperature", type=float, default=0.7)
    g.add_argument("--top-p", type=float, default=0.9)
    g.add_argument("--raw", action="store_true", help="do not apply the chat template")
    _add_policy_args(g)
    g.set_defaults(func=cmd_generate)

    b = sub.add_parser("bench", help="benchmarks that print ratios measured side by side")
    b.add_argument("what", choices=["decode"])
    b.add_argument("--model", default=None)
    b.add_argument("--contexts", type=int, nargs="+", default=[512, 2048, 4096])
    b.add_argument("--keep", type=float, default=0.2, help="B as a share of the context")
    b.add_argument("--steps", type=int, default=16, help="decode steps timed per round")
    b.add_argument("--rounds", type=int, default=3)
    b.set_defaults(func=cmd_bench)
    return p


def main(argv: Sequence[str] | None = None) -> int:
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    args = build_parser().parse_args(argv)
    from .errors import H2OLensError

    try:
        return int(args.func(args) or 0)
    except H2OLensError as e:
        print(f"h2o-lens: error: {e}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
