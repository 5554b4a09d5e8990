"""The policy registry: every cache policy is one object declared in one file of this package.

>>> from h2o_lens import policies
>>> policies.get("h2o").scored
True
>>> policies.names()
('h2o', 'full', 'local', 'heavy', 'sink', 'random', 'tova', 'scissorhands')

Everything that depends on the policy reads it here: the config (names, split, budget
checks), the runtime (prefill and decode scores), the kernels' dispatch, the recorder,
attribution, the CLI choices, the suite's grids and the dashboard's colours. Adding a
policy is one new file with a :class:`Policy` object plus its line in :data:`_ENTRIES`
and its tests (DESIGN.md §2.9). Importing the registry loads neither torch nor
transformers.
"""
from __future__ import annotations

from ..errors import ConfigError
from .base import Policy, StepContext, half_split, ratio_slots
from .full import FULL
from .h2o import H2O
from .heavy import HEAVY
from .local import LOCAL
from .random import RANDOM
from .scissorhands import SCISSORHANDS
from .sink import SINK
from .tova import TOVA

__all__ = ["Policy", "StepContext", "get", "names", "all_policies", "evicting", "baselines", "alternatives",
           "ratio_slots", "half_split", "DEFAULT", "FULL_CACHE"]

#: registry order: the method, the exact baseline, the baselines at the same slot count, others
_ENTRIES: tuple[Policy, ...] = (H2O, FULL, LOCAL, HEAVY, SINK, RANDOM, TOVA, SCISSORHANDS)
_BY_NAME: dict[str, Policy] = {p.name: p for p in _ENTRIES}
if len(_BY_NAME) != len(_ENTRIES):
    raise RuntimeError("two policies share a name")

#: the method the baselines are compared against
DEFAULT = H2O.name
#: the policy that keeps everything (transformers' own cache): the exact baseline
FULL_CACHE = FULL.name


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
    """The other evicting methods (neither the method nor one of its baselines), e.g. TOVA."""
    return tuple(p.name for p in _ENTRIES if p.evicts and not p.baseline and p.name != DEFAULT)


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
