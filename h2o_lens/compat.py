"""What differs between the transformers releases H2O Lens supports (DESIGN.md §3.1).

H2O Lens supports every transformers release from 4.56 (the first with per-layer cache
objects, ``CacheLayerMixin``) up to the next major version, 6. Whatever differs between those
releases lives here, one small function per difference, each with a comment naming the
releases; no other module asks for the transformers version. ``make compat`` runs the
compatibility tier on 4.56, 5.2 and the newest release.
"""

from __future__ import annotations

import functools
import threading
from typing import Any

from .errors import UnsupportedVersionError

__all__ = [
    "SUPPORTED",
    "Cache",
    "CacheLayerMixin",
    "version",
    "check_supported",
    "cache_name",
    "cache_kwargs",
    "cache_from",
    "rename_cache_kwarg",
    "stage_layer",
    "staged_layer",
    "mask_query_length",
    "crop_count",
    "checkpoint_folder",
    "reads_checkpoint_of",
    "gguf_tokenizer",
]

#: the supported transformers releases, as pyproject.toml pins them (a test keeps the two equal)
SUPPORTED = ">=4.56,<6"

try:  # both exist from 4.56 on; an older release is refused by check_supported, not at import
    from transformers.cache_utils import Cache
    from transformers.cache_utils import CacheLayerMixin as _CacheLayerMixin
except ImportError:  # pragma: no cover - only on a release outside the range

    class Cache:  # type: ignore[no-redef]
        """Stand-in so that the runtime imports; :func:`check_supported` refuses the release."""

        def __init__(self, *args: Any, **kwargs: Any) -> None:
            check_supported()

    class _CacheLayerMixin:  # type: ignore[no-redef]
        def __init__(self, *args: Any, **kwargs: Any) -> None:
            check_supported()


class CacheLayerMixin(_CacheLayerMixin):
    """transformers' ``CacheLayerMixin`` with the attributes every supported release sets:
    4.56 sets ``keys`` and ``values`` only, 4.57 on also ``is_initialized``."""

    def __init__(self) -> None:
        super().__init__()
        self.is_initialized = False


def version() -> str:
    """The installed transformers version, e.g. ``"5.2.0"``."""
    import transformers

    return transformers.__version__


@functools.lru_cache(maxsize=8)
def _parsed(text: str) -> tuple[int, int]:
    from packaging.version import InvalidVersion, Version

    try:
        release = Version(text).release
    except InvalidVersion:
        return (0, 0)
    return (release + (0, 0))[:2]


def _at_least(major: int, minor: int) -> bool:
    return _parsed(version()) >= (major, minor)


def check_supported() -> None:
    """Raise :class:`UnsupportedVersionError` unless the installed transformers is in :data:`SUPPORTED`.

    Called first by :func:`h2o_lens.h2o`, :func:`h2o_lens.load_model` and
    :func:`recorders.record`, so an unsupported release fails in one line before
    anything is hooked or written, never from inside a hook.
    """
    from packaging.specifiers import SpecifierSet
    from packaging.version import InvalidVersion, Version

    installed = version()
    try:
        inside = Version(installed) in SpecifierSet(SUPPORTED, prereleases=True)
    except InvalidVersion:
        inside = False
    if not inside:
        raise UnsupportedVersionError(
            f"transformers {installed} is installed; H2O Lens supports transformers{SUPPORTED} "
            f"(4.56 or newer, before 6); install a supported release, e.g. pip install 'transformers{SUPPORTED}'"
        )


# -- the cache argument ------------------------------------------------------------------------------
# 4.56 to 5.23: models and generate take the cache as ``past_key_values=``; 5.24 renamed it
# ``cache=`` (``past_key_values`` still works there, with a deprecation notice). H2O Lens passes
# ``cache=`` in its own calls and renames it here, at the boundary with transformers.


def cache_name() -> str:
    """The keyword under which this transformers takes the cache: ``cache`` or ``past_key_values``."""
    return "cache" if _at_least(5, 24) else "past_key_values"


def cache_kwargs(cache: Any) -> dict[str, Any]:
    """``{name: cache}`` for a forward call or a model output: ``model(ids, **cache_kwargs(cache))``."""
    return {cache_name(): cache}


def cache_from(kwargs: dict[str, Any]) -> Any:
    """The cache in the keyword arguments of a forward or ``generate`` call (either name), or None."""
    cache = kwargs.get("cache")
    return cache if cache is not None else kwargs.get("past_key_values")


def rename_cache_kwarg(kwargs: dict[str, Any]) -> dict[str, Any]:
    """``kwargs`` with its cache (given under either name) under this release's name alone (same dict)."""
    cache = cache_from(kwargs)
    if cache is not None:
        kwargs.pop("cache", None)
        kwargs.pop("past_key_values", None)
        kwargs[cache_name()] = cache
    return kwargs


# -- how the attention function reaches its cache layer --------------------------------------------
# 5.24 on: the attention module passes its kwargs dict to ``cache.update(..., kwargs=kwargs)`` and
# then unpacks the same dict into the attention function, so the layer rides in it. 4.56 to 5.23:
# ``update`` gets ``cache_kwargs`` (sin, cos, cache_position; to 5.3) or nothing, and the attention
# function a fresh dict; the layer waits in a per-thread slot that the very next attention call of
# the same layer index takes.
_staged = threading.local()


def stage_layer(layer: Any, kwargs: dict | None) -> bool:
    """Hand ``layer`` (with ``layer_idx``) to the attention call that follows its ``update``.

    Returns False when this release passes the module's kwargs dict but ``kwargs`` is None: the
    attention module is not one that routes the cache to its attention function.
    """
    if kwargs is not None:
        kwargs["h2o_layer"] = layer
        return True
    if _at_least(5, 24):
        return False
    _staged.layer = layer
    return True


def staged_layer(module: Any, given: Any) -> Any:
    """The H2O layer of ``module``'s attention call: ``given`` (5.24 on) or the staged one, else None."""
    layer = getattr(_staged, "layer", None)
    _staged.layer = None
    if given is not None:
        return given
    if layer is not None and getattr(module, "layer_idx", layer.layer_idx) == layer.layer_idx:
        return layer
    return None


# -- cache layer methods whose arguments changed ---------------------------------------------------


def mask_query_length(arg: Any) -> int:
    """The query length given to ``CacheLayerMixin.get_mask_sizes``: 4.56 to 5.3 pass the
    ``cache_position`` tensor ``(q,)``, 5.4 on the length itself."""
    shape = getattr(arg, "shape", None)
    return int(shape[-1]) if shape is not None else int(arg)


def crop_count(arg: int, seen: int) -> int | None:
    """Tokens to remove for ``Cache.crop(arg)`` on a layer holding ``seen`` tokens, or None where
    this release refuses the call: to 5.14 a positive ``arg`` is the length to keep
    (``crop(new_length)``, what assisted decoding passed); from 5.15 only the negated count
    (``crop(-r)``, ``crop(0)`` when nothing goes) is allowed, as transformers' own layers do."""
    if arg <= 0:
        return -arg
    return None if _at_least(5, 15) else max(seen - arg, 0)


# -- the converted default model -------------------------------------------------------------------
# A checkpoint saved by one release does not load right in another: 5.x configs have
# ``rope_parameters`` (4.x reads ``rope_theta`` and falls back to 10000) and a ``TokenizersBackend``
# tokenizer class (unknown to 4.x), and 5.24 reading the tokenizer files 5.2 saved maps "\n" to the
# unknown token. So the converted default model is kept per transformers release.


def checkpoint_folder() -> str:
    """The folder of this release's converted models, e.g. ``transformers-5.2.0``."""
    return f"transformers-{version()}"


def reads_checkpoint_of(saved_by: str | None) -> bool:
    """Whether a checkpoint saved by transformers ``saved_by`` is this release's own."""
    return saved_by == version()


# -- the default model's GGUF file -----------------------------------------------------------------


def gguf_tokenizer(tokenizer: Any, gguf_path: Any) -> Any:
    """The tokenizer transformers built from a GGUF file, adding a BOS token only where the file says so.

    4.x (seen on 4.56) builds a ``LlamaTokenizerFast`` that adds BOS whatever the file's
    ``tokenizer.ggml.add_bos_token`` says (the default model's says false); 5.x follows the file.
    """
    if not getattr(tokenizer, "add_bos_token", False):
        return tokenizer
    import gguf

    field = gguf.GGUFReader(str(gguf_path)).fields.get("tokenizer.ggml.add_bos_token")
    if field is not None and field.data and not bool(field.parts[field.data[0]][0]):
        tokenizer.add_bos_token = False
    return tokenizer
