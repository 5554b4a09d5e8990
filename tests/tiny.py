"""Tiny random-initialised causal LMs of each supported family (no downloads)."""

from __future__ import annotations

import torch

FAMILIES = ("llama", "qwen2", "qwen3", "mistral", "phi3")


def tiny_model(
    family: str = "llama",
    *,
    layers: int = 2,
    q_heads: int = 4,
    kv_heads: int = 2,
    head_dim: int = 16,
    vocab: int = 256,
    seed: int = 0,
    attn: str = "sdpa",
):
    """A random model of ``family`` with real GQA, RoPE and the family's attention code."""
    import transformers as tf

    common = dict(
        vocab_size=vocab,
        hidden_size=q_heads * head_dim,
        intermediate_size=2 * q_heads * head_dim,
        num_hidden_layers=layers,
        num_attention_heads=q_heads,
        num_key_value_heads=kv_heads,
        max_position_embeddings=1024,
        tie_word_embeddings=False,
    )
    if family == "llama":
        cfg, cls = tf.LlamaConfig(**common), tf.LlamaForCausalLM
    elif family == "qwen2":
        cfg, cls = tf.Qwen2Config(**common, use_sliding_window=False), tf.Qwen2ForCausalLM
    elif family == "qwen3":
        cfg, cls = tf.Qwen3Config(**common, head_dim=head_dim, use_sliding_window=False), tf.Qwen3ForCausalLM
    elif family == "mistral":
        cfg, cls = tf.MistralConfig(**common, sliding_window=None), tf.MistralForCausalLM
    elif family == "phi3":
        cfg, cls = tf.Phi3Config(**common, pad_token_id=0, bos_token_id=1, eos_token_id=2), tf.Phi3ForCausalLM
    else:
        raise ValueError(family)
    cfg._attn_implementation = attn
    torch.manual_seed(seed)
    model = cls(cfg).eval()
    # sharper attention than the default init, so that heads prefer positions
    with torch.no_grad():
        for name, p in model.named_parameters():
            if any(k in name for k in ("q_proj", "k_proj", "qkv_proj")):
                p.mul_(4.0)
    return model


def local_attention(model, strength: float = 8.0, mix: float = 0.3, head_dim: int = 16):
    """Make a tiny model's heads prefer nearby positions, so H2O's kept sets keep changing.

    Random weights attend mostly to the first positions, which freezes the heavy set (every
    decode step evicts the token leaving the recent window). This adds to every query and key
    a constant component on the rotary pair of dims 2 and ``2 + head_dim / 2`` (frequency
    0.1 at base 10000), whose logit is ``cos(0.1 · distance)``, and scales the content part
    by ``mix``: attention then follows the recent tokens and evictions compete.
    """
    import torch

    with torch.no_grad():
        for layer in model.model.layers:
            attn = layer.self_attn
            for proj in (attn.q_proj, attn.k_proj):
                w = proj.weight.view(-1, head_dim, proj.weight.shape[-1])  # (heads, d, hidden)
                w.mul_(mix)
                w[:, 2, :] += strength / proj.weight.shape[-1] ** 0.5
    return model


def left_padded(lengths, seed: int = 0, vocab: int = 250) -> tuple[torch.Tensor, torch.Tensor]:
    """``(ids, mask)`` of random prompts of ``lengths`` tokens (ids 3 to ``vocab - 1``), left-padded
    with id 0 to the longest, as ``generate`` lays a batch out."""
    g = torch.Generator().manual_seed(seed)
    width = max(lengths)
    ids = torch.zeros(len(lengths), width, dtype=torch.long)
    mask = torch.zeros(len(lengths), width, dtype=torch.long)
    for r, n in enumerate(lengths):
        ids[r, width - n :] = torch.randint(3, vocab, (n,), generator=g)
        mask[r, width - n :] = 1
    return ids, mask


SPECIALS = ("<pad>", "<s>", "</s>")


def byte_tokenizer():
    """A byte-level BPE tokenizer without merges: 3 special tokens, then the 256 bytes (no chat template)."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    alphabet = pre_tokenizers.ByteLevel.alphabet()
    vocab = {s: i for i, s in enumerate(SPECIALS)} | {c: len(SPECIALS) + i for i, c in enumerate(sorted(alphabet))}
    inner = Tokenizer(models.BPE(vocab=vocab, merges=[]))
    inner.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)
    inner.decoder = decoders.ByteLevel()
    return PreTrainedTokenizerFast(
        tokenizer_object=inner, pad_token="<pad>", bos_token="<s>", eos_token="</s>", padding_side="left"
    )


def save_tiny(path, *, seed: int = 0, layers: int = 2):
    """A tiny llama with :func:`byte_tokenizer` saved in ``path``, loadable with ``load_model(path)``
    like a user's model folder (another ``seed``: another model of the same shape)."""
    from transformers.utils import logging as hf_logging

    tok = byte_tokenizer()
    model = tiny_model("llama", vocab=len(tok), seed=seed, layers=layers)
    model.config.pad_token_id, model.config.bos_token_id, model.config.eos_token_id = 0, 1, 2
    model.generation_config.pad_token_id, model.generation_config.eos_token_id = 0, 2
    shown = hf_logging.is_progress_bar_enabled()
    hf_logging.disable_progress_bar()
    try:
        model.save_pretrained(path)
    finally:
        if shown:
            hf_logging.enable_progress_bar()
    tok.save_pretrained(path)
    return path
