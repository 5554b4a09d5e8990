"""``h2o-lens generate``: generate with an H2O cache and print the physical KV bytes."""

from __future__ import annotations

import argparse
import sys
from typing import Any

from .limits import check_new_tokens
from .options import DEFAULT_PROMPT, add_policy_args, at_least, mib, policy_config, positive, share

__all__ = ["add_parser", "run"]


def add_parser(sub: Any) -> None:
    g = sub.add_parser("generate", help="generate with an H2O cache and print the physical KV bytes")
    g.add_argument("--prompt", default=None)
    g.add_argument("--prompt-file", default=None)
    g.add_argument("--model", default=None, help="HF id or local path (default: the packaged SmolLM2-135M-Instruct)")
    g.add_argument("--max-new-tokens", type=at_least(1), default=64)
    g.add_argument("--sample", action="store_true", help="sample instead of greedy decoding")
    g.add_argument("--temperature", type=positive, default=0.7)
    g.add_argument("--top-p", type=share, default=0.9)
    g.add_argument("--raw", action="store_true", help="do not apply the chat template")
    add_policy_args(g)
    g.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    import torch

    from h2o_lens.models import load_model
    from h2o_lens.runtime import full_kv_bytes, h2o

    config = policy_config(args)
    check_new_tokens(args.model, args.max_new_tokens)
    prompt = args.prompt
    if args.prompt_file:
        with open(args.prompt_file, encoding="utf-8") as f:
            prompt = f.read()
    if prompt is None:
        prompt = DEFAULT_PROMPT
    model, tok = load_model(args.model)
    if not args.raw and getattr(tok, "chat_template", None):
        text = tok.apply_chat_template(
            [{"role": "user", "content": prompt}], tokenize=False, add_generation_prompt=True
        )
    else:
        text = prompt
    enc = tok(text, return_tensors="pt", add_special_tokens=args.raw, return_token_type_ids=False)
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
        print(
            f"policy: full cache | prompt {prompt_len} tokens, generated {len(new)} | KV {mib(full)}", file=sys.stderr
        )
        return 0
    b = cache.nbytes()
    print(
        f"policy: {cache.resolved_config.describe()} | prompt {prompt_len} tokens, generated {len(new)} | "
        f"decode step: {cache.backend}",
        file=sys.stderr,
    )
    print(
        f"physical KV: {mib(b['kv'])} (+ {b['metadata'] / 1024:.1f} KiB scores and positions) "
        f"vs full cache {mib(full)} at {total} tokens: {b['kv'] / full:.3f} of full",
        file=sys.stderr,
    )
    return 0
