"""The policy registry: every cache policy is one object declared in one file of this package.

>>> from h2o_lens import policies
>>> policies.get("h2o").scored
True
>>> policies.names()
('h2o', 'full', 'local', 'heavy', 'sink', 'random', 'tova', 'scissorhands', 'oracle')

Everything that depends on the policy reads it here: the config (names, split, budget
checks), the runtime (prefill and decode scores), the kernels' dispatch, the recorder,
attribution, the CLI choices, the suite's grids and the dashboard's colours. Adding a
policy is one new file in this package declaring a :class:`Policy` object (the registry
finds it), plus its tests (DESIGN.md §2.9). Importing the registry loads neither torch
nor transformers.
"""

from __future__ import annotations

import importlib
import pkgutil

from ..errors import ConfigError
from .base import Policy, StepContext, half_split, ratio_slots

__all__ = [
    "Policy",
    "StepContext",
    "get",
    "names",
    "all_policies",
    "evicting",
    "baselines",
    "alternatives",
    "ratio_slots",
    "half_split",
    "DEFAULT",
    "FULL_CACHE",
]


def _discover() -> tuple[Policy, ...]:
    """Every :class:`Policy` object declared in a module of this package, in ``rank`` order."""
    found: dict[int, Policy] = {}
    for info in pkgutil.iter_modules(__path__):
        if info.name != "base":
            module = importlib.import_module(f"{__name__}.{info.name}")
            found.update({id(v): v for v in vars(module).values() if isinstance(v, Policy)})
    entries = tuple(sorted(found.values(), key=lambda p: (p.rank, p.name)))
    seen = [p.name for p in entries]
    if len(set(seen)) != len(seen):
        raise RuntimeError(f"two policy objects share a name: {sorted(n for n in seen if seen.count(n) > 1)}")
    return entries


#: registry order (``Policy.rank``): the method, the exact baseline, its baselines, the alternatives
_ENTRIES: tuple[Policy, ...] = _discover()
_BY_NAME: dict[str, Policy] = {p.name: p for p in _ENTRIES}

#: the method the baselines are compared against
DEFAULT = "h2o"
#: the policy that keeps everything (transformers' own cache): the exact baseline
FULL_CACHE = next(p.name for p in _ENTRIES if not p.evicts)


def names() -> tuple[str, ...]:
    """Every policy name, in registry order."""
    return tuple(_BY_NAME)


def all_policies() -> tuple[Policy, ...]:
    """Every policy, in registry order."""
    return _ENTRIES


def evicting() -> tuple[Policy, ...]:
    """The policies that evict (all but the full cache)."""
    return tuple(p for p in _ENTRIES if p.evicts)


def baselines() -> tuple[str, ...]:
    """The ablations of the method at the same slot count (``Policy.baseline``, DESIGN.md §2.5)."""
    return tuple(p.name for p in _ENTRIES if p.baseline)


def alternatives() -> tuple[str, ...]:
    """The other evicting methods (neither the method nor one of its baselines), e.g. TOVA; a policy
    that needs a teacher (the oracle, ``Policy.teacher``) is none of them."""
    return tuple(p.name for p in _ENTRIES if p.evicts and not p.baseline and not p.teacher and p.name != DEFAULT)


def get(name: str | Policy) -> Policy:
    """The policy called ``name``; a :class:`Policy` is returned as is.

    Raises
    ------
    ConfigError
        For an unknown name, listing the known ones.
    """
    if isinstance(name, Policy):
        return name
    try:
        return _BY_NAME[name]
    except (KeyError, TypeError):
        raise ConfigError(f"unknown policy {name!r}; expected one of {', '.join(_BY_NAME)}") from None
