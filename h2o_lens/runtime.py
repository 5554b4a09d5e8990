"""The scoped way in: run a Hugging Face causal LM with an H2O cache.

>>> with h2o_lens.h2o(model, H2OConfig(heavy=64, recent=64)) as session:
...     out = model.generate(**inputs, max_new_tokens=64)
...     session.last_cache.nbytes()

Inside the scope ``model.generate`` builds a fresh :class:`H2OCache` for each
call (unless one is passed as ``cache=``); on exit, exceptions included, the
model's attention implementation and ``generate`` are restored exactly.
"""

from __future__ import annotations

import contextlib
import functools
import hashlib
import json
import os
import pickle
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import torch

from . import compat, hooks
from .cache import CacheListener, H2OCache
from .config import H2OConfig
from .errors import ConfigError, UnsupportedModelError
from .graphs import GraphedForward, check_graphs, graph_kind
from .models import planned_positions, warn_past_context
from .packed import packed_linears
from .shape import model_shape
from .speculative import check_mode

__all__ = ["h2o", "H2OSession", "check_model", "full_kv_bytes", "STATE_FORMAT", "STATE_VERSION", "model_identity"]

#: the saved-state file: ``torch.save`` of {"format", "header" (JSON text), "tensors"} (DESIGN.md §15.2)
STATE_FORMAT = "h2o_lens.state"
STATE_VERSION = 1

_TESTED = ("llama", "qwen2", "qwen3", "mistral", "phi3")


def check_model(model: Any) -> None:
    """Raise :class:`UnsupportedModelError` unless the runtime can hook ``model``."""
    config = getattr(model, "config", None)
    if config is None or not hasattr(model, "generate"):
        raise UnsupportedModelError(
            f"expected a transformers causal LM (PreTrainedModel with .config and .generate), "
            f"got {type(model).__name__}"
        )
    text = config.get_text_config(decoder=True)
    if getattr(text, "is_encoder_decoder", False) or getattr(config, "is_encoder_decoder", False):
        raise UnsupportedModelError(
            f"{type(model).__name__} is an encoder-decoder model; H2O Lens hooks decoder-only causal LMs"
        )
    can_set = getattr(model, "_can_set_attn_implementation", None)
    if can_set is None or not can_set():
        raise UnsupportedModelError(
            f"{type(model).__name__} does not route attention through transformers' "
            "AttentionInterface, so the H2O attention cannot be installed; supported families: " + ", ".join(_TESTED)
        )
    types = getattr(text, "layer_types", None) or []
    odd = sorted({t for t in types if t != "full_attention"})
    if odd:
        raise UnsupportedModelError(
            f"{type(model).__name__} has layers of type {odd}; H2O Lens supports models whose "
            "layers all use full attention"
        )
    model_shape(config)  # raises UnsupportedModelError without head counts, or for heads that do not divide


def full_kv_bytes(model: Any, tokens: int, batch: int = 1, dtype: torch.dtype | None = None) -> int:
    """Bytes of a full KV cache of ``tokens`` positions (K and V, all layers)."""
    shape = model_shape(model.config)
    if shape.head_dim is None:
        raise UnsupportedModelError(f"{type(model).__name__}'s config gives neither head_dim nor hidden_size")
    dtype = dtype or next(model.parameters()).dtype
    elem = torch.empty((), dtype=dtype).element_size()
    return 2 * shape.layers * shape.kv_heads * shape.head_dim * tokens * batch * elem


def model_identity(model: Any) -> dict[str, Any]:
    """What a saved state must match: the model's shape, dtype and a fingerprint of its weights.

    The fingerprint is a SHA-256 of the first 4096 values of the first and the last
    parameter tensors (a restored state only makes sense with the very weights that
    computed its keys and values).
    """
    from .models import model_info

    info = model_info(model)
    params = [p for p in model.parameters()]
    digest = hashlib.sha256()
    for p in (params[0], params[-1]):
        digest.update(p.detach().reshape(-1)[:4096].float().cpu().numpy().tobytes())
    keys = ("architecture", "model_type", "num_layers", "num_query_heads", "num_kv_heads", "head_dim", "dtype")
    return {
        **{k: info.get(k) for k in keys},
        "num_parameters": info.get("num_parameters"),
        "weights": digest.hexdigest()[:16],
    }


class H2OSession:
    """Handle of an active scope: makes caches and remembers the last one."""

    def __init__(
        self, model: Any, config: H2OConfig, listener: CacheListener | None = None, speculative: str = "rollback"
    ):
        self.model = model
        self.config = config
        self.listener = listener
        self.speculative = check_mode(speculative)
        self.last_cache: H2OCache | None = None
        #: the forward that replays decode steps from captured graphs (``h2o(..., graphs=True)``,
        #: DESIGN.md §2.16): its counts of replayed steps and of eager forwards by reason; None: off
        self.graphs: GraphedForward | None = None

    def new_cache(self, listener: CacheListener | None = None, *, row_pins: Any = None) -> H2OCache:
        """A fresh cache for one generation (one batch of prompts); with ``row_pins`` (one set of
        positions per row) each row pins its own set in place of the config's (DESIGN.md §2.11):
        ``model.generate(input_ids=..., cache=session.new_cache(row_pins=[(3,), (3, 9)]))``."""
        cache = H2OCache(
            self.config,
            self.model.config,
            listener=listener or self.listener,
            speculative=self.speculative,
            row_pins=row_pins,
        )
        self.last_cache = cache
        return cache

    # -- save and restore (DESIGN.md §15.2) ---------------------------------------------------------
    def save(self, path: str | os.PathLike, cache: H2OCache | None = None) -> Path:
        """Write the whole H2O state of ``cache`` (default: the last one) to ``path``.

        The file holds K, V, scores, original positions, histories, fill counters,
        next positions and per-request budgets of every layer, plus a JSON header with
        the config, the model identity (:func:`model_identity`) and the format version;
        it is written atomically (temporary name, then rename). Restore it with
        :meth:`restore` into the same model and config.
        """
        cache = cache if cache is not None else self.last_cache
        if cache is None:
            raise ConfigError("session.save: no cache to save; generate first or pass cache=")
        state, tensors = cache.export_state()
        header = {
            "format": STATE_FORMAT,
            "version": STATE_VERSION,
            "config": self.config.to_dict(),
            "model": model_identity(self.model),
            "cache": state,
        }
        path = Path(path)
        tmp = path.with_name(path.name + ".tmp")
        torch.save({"format": STATE_FORMAT, "header": json.dumps(header), "tensors": tensors}, tmp)
        os.replace(tmp, path)
        cache.notify({"event": "save", "path": str(path), "requests": cache.request_ids, "next_pos": state["next_pos"]})
        return path

    def restore(
        self, path: str | os.PathLike, *, listener: CacheListener | None = None, device: Any = None
    ) -> H2OCache:
        """A cache holding the state saved in ``path``, ready to continue the generation.

        Pass it to ``model.generate(input_ids=<the sequences so far>, cache=...)`` (or to
        the forward): the next token fed is the last one of each sequence. Refuses a
        file of another format or version, another model (shape, dtype or weights) or
        another config, naming what differs.
        """
        try:
            blob = torch.load(Path(path), map_location="cpu", weights_only=True)
        except (OSError, RuntimeError, EOFError, pickle.UnpicklingError) as exc:
            raise ConfigError(f"cannot read the saved H2O state {os.fspath(path)!r}: {exc}") from exc
        if not isinstance(blob, dict) or blob.get("format") != STATE_FORMAT:
            raise ConfigError(f"{os.fspath(path)!r} is not a saved H2O state (expected format {STATE_FORMAT!r})")
        header = json.loads(blob["header"])
        if header.get("version") != STATE_VERSION:
            raise ConfigError(
                f"{os.fspath(path)!r} is a saved state of version {header.get('version')}; this H2O Lens "
                f"reads version {STATE_VERSION}; restore it with the version that saved it"
            )
        mine = model_identity(self.model)
        differ = {k: (v, mine.get(k)) for k, v in header["model"].items() if mine.get(k) != v}
        if differ:
            shown = ", ".join(f"{k} saved {a!r} vs here {b!r}" for k, (a, b) in differ.items())
            raise ConfigError(f"the saved H2O state comes from another model ({shown}); restore it into that model")
        saved_config = H2OConfig(**header["config"])
        if saved_config != self.config:
            saved = saved_config.describe()
            raise ConfigError(
                f"the saved H2O state was made with config {saved!r}, this session has {self.config.describe()!r}; "
                "restore it inside h2o(model, <the saved config>)"
            )
        if device is None:
            device = next(self.model.parameters()).device
        cache = self.new_cache(listener=listener)
        cache.import_state(header["cache"], blob["tensors"], device=device)
        cache.notify(
            {
                "event": "restore",
                "path": os.fspath(path),
                "requests": cache.request_ids,
                "next_pos": header["cache"]["next_pos"],
            }
        )
        return cache

    # -- a shared prompt prefix (DESIGN.md §15.4) ----------------------------------------------------
    def prefill_shared(
        self, prefix_ids: Any, suffixes: Any, *, listener: CacheListener | None = None
    ) -> tuple[H2OCache, Any, Any, Any]:
        """Prefill requests that share a prompt prefix, the prefix once.

        Parameters
        ----------
        prefix_ids : the common prefix, a sequence of token ids (or a ``(1, P0)`` tensor)
        suffixes : one sequence of token ids per request (at least one token each)

        The prefix runs through the model once; its K/V and the column sums of its own
        rows are shared read-only by every request, whose suffix then attends to them and
        adds its share to a copy (copy-on-write) before the policy's keep rule runs over
        the whole prompt. Kept sets equal those of each ``prefix + suffix`` prefilled
        alone. Returns ``(cache, input_ids, attention_mask, logits)``: the cache, the
        prompts left-padded as ``generate`` lays them out, their mask, and the logits of
        each prompt's last position ``(b, vocab)``. Continue with
        ``model.generate(input_ids=cat(input_ids, next_tokens), attention_mask=..., cache=cache)``.
        """
        if not self.config.spec.evicts:
            raise ConfigError(f"policy {self.config.policy!r} keeps everything; a shared prefix needs an H2O cache")
        if self.config.spec.prefill == "rows":
            raise ConfigError(
                f"policy {self.config.policy!r} ranks the prompt by its last rows, which a shared prefix does "
                "not hold per request; share prefixes with a column-sum policy (h2o, heavy) or local, sink, random"
            )
        device = next(self.model.parameters()).device
        prefix = torch.as_tensor(prefix_ids, dtype=torch.long, device=device).reshape(1, -1)
        tails = [torch.as_tensor(x, dtype=torch.long).reshape(-1).tolist() for x in suffixes]
        if prefix.shape[1] == 0 or not tails or any(len(t) == 0 for t in tails):
            raise ConfigError(
                f"prefill_shared needs a non-empty prefix and at least one token per suffix, got a prefix of "
                f"{prefix.shape[1]} tokens and suffix lengths {[len(t) for t in tails]}"
            )
        b, p0, width = len(tails), prefix.shape[1], max(len(t) for t in tails)
        pad = getattr(self.model.generation_config, "pad_token_id", None) or 0
        pad = pad[0] if isinstance(pad, (list, tuple)) else pad
        suffix = torch.full((b, width), int(pad), dtype=torch.long, device=device)
        mask_s = torch.zeros(b, width, dtype=torch.long, device=device)
        for r, t in enumerate(tails):
            suffix[r, width - len(t) :] = torch.tensor(t, device=device)
            mask_s[r, width - len(t) :] = 1
        cache = self.new_cache(listener=listener)
        prompts = [prefix[0].tolist() + t for t in tails]
        cache.notify({"event": "prefix_share", "prefix_len": p0, "prompts": prompts})
        with torch.no_grad():
            cache.sharing = "prefix"
            try:
                self.model(input_ids=prefix, **compat.cache_kwargs(cache), use_cache=True, logits_to_keep=1)
            finally:
                cache.sharing = None
            mask = torch.cat([torch.ones(b, p0, dtype=torch.long, device=device), mask_s], 1)
            pos = (p0 + mask_s.cumsum(-1) - 1).clamp(min=0)
            out = self.model(
                input_ids=suffix,
                attention_mask=mask,
                position_ids=pos,
                **compat.cache_kwargs(cache),
                use_cache=True,
                logits_to_keep=1,
            )
        # what generate sees: padding first, then prefix and suffix
        ids = torch.full((b, p0 + width), int(pad), dtype=torch.long, device=device)
        full_mask = torch.zeros_like(ids)
        for r, t in enumerate(prompts):
            ids[r, p0 + width - len(t) :] = torch.tensor(t, device=device)
            full_mask[r, p0 + width - len(t) :] = 1
        cache.notify({"event": "prefix_copy", "prefix_len": p0, "requests": cache.request_ids or list(range(b))})
        return cache, ids, full_mask, out.logits[:, -1]

    def _generate(self, original, *args: Any, **kwargs: Any):
        if compat.cache_from(kwargs) is None:
            kwargs["cache"] = self.new_cache()
        cache = compat.cache_from(kwargs)
        compat.rename_cache_kwarg(kwargs)  # cache= is past_key_values= before transformers 5.24
        ids = kwargs.get("input_ids", args[0] if args else None)
        if isinstance(cache, H2OCache) and ids is not None:
            # assisted decoding's first forward is the prompt plus a draft (DESIGN.md §14)
            cache.prompt_width = ids.shape[-1]
        if ids is not None:
            warn_past_context(self.model, planned_positions(self.model, ids.shape[-1], kwargs), stacklevel=4)
        rows = _decode_rows(self.model, ids, kwargs) if ids is not None else 1
        with packed_linears(self.model, rows):  # batched decode steps on CPU (DESIGN.md §16)
            out = original(*args, **kwargs)
        if isinstance(cache, H2OCache):
            cache.end_segments()  # a segment no crop closed stands in full
        return out


def _decode_rows(model: Any, ids: Any, kwargs: dict[str, Any]) -> int:
    """Rows of each decode step of a ``generate`` call: prompts times beams (or returned samples)."""
    config = kwargs.get("generation_config") or getattr(model, "generation_config", None)
    beams = kwargs.get("num_beams") or getattr(config, "num_beams", 1) or 1
    samples = kwargs.get("num_return_sequences") or getattr(config, "num_return_sequences", 1) or 1
    return int(ids.shape[0]) * int(beams if beams > 1 else samples)


@contextlib.contextmanager
def h2o(
    model: Any,
    config: H2OConfig | None = None,
    *,
    listener: CacheListener | None = None,
    speculative: str = "rollback",
    graphs: bool | str = False,
    **options: Any,
) -> Iterator[H2OSession]:
    """Run ``model`` with H2O eviction inside a ``with`` block.

    Parameters
    ----------
    model : transformers causal LM (Llama, Qwen2/3, Mistral, Phi-3 families)
    config : H2OConfig, optional
        The policy; or give its fields as keyword arguments
        (``h2o(model, heavy=64, recent=64, gqa="max")``).
    listener : CacheListener, optional
        Receives eviction events (the recorder uses this).
    speculative : str
        ``rollback`` (default) or ``defer``: how a rejected draft of assisted or
        speculative decoding (``assistant_model=``, ``prompt_lookup_num_tokens=``)
        is taken back (DESIGN.md §14).
    graphs : bool or ``"auto"``
        Replay the decode steps over a full cache from a captured graph (DESIGN.md §2.16):
        a CUDA graph on a GPU, a traced rehearsal on a CPU (same results, no speed-up);
        ``"auto"``: on a CUDA device only. ``session.graphs`` counts what ran how.

    The policy ``full`` leaves the model untouched (transformers' own cache),
    so a comparison runs the exact baseline. A transformers release outside the supported
    range (:data:`h2o_lens.compat.SUPPORTED`) is refused before anything is hooked.
    """
    compat.check_supported()
    if config is None:
        config = H2OConfig(**options)
    elif options:
        raise ConfigError(f"give either a config or keyword options, not both (got {sorted(options)})")
    if not isinstance(config, H2OConfig):
        raise ConfigError(f"config must be an H2OConfig, got {type(config).__name__}")
    session = H2OSession(model, config, listener, speculative)
    graphs = check_graphs(graphs)
    if not config.spec.evicts:
        yield session
        return
    check_model(model)
    kind = graph_kind(graphs, next(model.parameters()).device)
    with (
        hooks.attention_implementation(model, hooks.ATTN_NAME, hooks.h2o_attention, hooks.h2o_mask),
        _instance_attribute(model, "generate", lambda original: functools.partial(session._generate, original)),
        _instance_attribute(model, "forward", lambda original: _graphed(session, original, kind), kind is not None),
    ):
        yield session


def _graphed(session: H2OSession, forward: Any, kind: str) -> GraphedForward:
    session.graphs = GraphedForward(forward, kind, session.model)
    return session.graphs


@contextlib.contextmanager
def _instance_attribute(obj: Any, name: str, wrap: Any, enabled: bool = True) -> Iterator[None]:
    """``obj.<name>`` replaced by ``wrap(obj.<name>)`` on the instance, restored on exit."""
    if not enabled:
        yield
        return
    had, saved = name in vars(obj), vars(obj).get(name)
    original = getattr(obj, name)
    setattr(obj, name, functools.wraps(original)(wrap(original)))
    try:
        yield
    finally:
        if had:
            setattr(obj, name, saved)
        else:
            vars(obj).pop(name, None)
