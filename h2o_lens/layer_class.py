"""The layer class of new H2O caches (DESIGN.md §15.5): :func:`use_layer_class` builds the caches
of a block with a subclass of :class:`~h2o_lens.cache.H2OCacheLayer` that overrides public verbs
only (the tests' known state bugs). Read from :mod:`h2o_lens.cache`, which re-exports both."""

from __future__ import annotations

import contextlib
import contextvars
from collections.abc import Iterator
from typing import Any

from .errors import ConfigError

__all__ = ["use_layer_class", "current_layer_class", "check_layer_class", "register_plain"]

#: the class of the block in effect; None outside one (the plain layer)
_LAYER_CLASS: contextvars.ContextVar[type | None] = contextvars.ContextVar("h2o_lens_layer_class", default=None)
#: the plain layer class, registered by :mod:`h2o_lens.cache` when it is imported (it imports this
#: module, never the other way round)
_PLAIN: list[type] = []


def register_plain(cls: type) -> type:
    """Record ``cls`` as the plain layer class (the cache module's ``H2OCacheLayer``)."""
    _PLAIN[:] = [cls]
    return cls


def _plain() -> type:
    return _PLAIN[0]


def check_layer_class(cls: Any) -> type:
    """``cls`` if it is :class:`~h2o_lens.cache.H2OCacheLayer` or a subclass, else a ConfigError."""
    if not (isinstance(cls, type) and issubclass(cls, _plain())):
        raise ConfigError(f"layer_class must be H2OCacheLayer or a subclass of it, got {cls!r}")
    return cls


def current_layer_class() -> type:
    """The layer class a new :class:`~h2o_lens.cache.H2OCache` gets: the plain
    :class:`~h2o_lens.cache.H2OCacheLayer` outside a :func:`use_layer_class` block."""
    return _LAYER_CLASS.get() or _plain()


@contextlib.contextmanager
def use_layer_class(cls: type) -> Iterator[None]:
    """Build the H2O caches made inside the block with layers of class ``cls``, a subclass of
    :class:`~h2o_lens.cache.H2OCacheLayer`, also those the runtime makes itself
    (:func:`h2o_lens.h2o`, the recorder). The choice holds for the block, in its thread or task
    only (a context variable), and is undone on exit, exceptions included. The tests build the
    runtime's known state bugs this way (DESIGN.md §15.5); a cache that exists already keeps its
    layers.
    """
    token = _LAYER_CLASS.set(check_layer_class(cls))
    try:
        yield
    finally:
        _LAYER_CLASS.reset(token)
