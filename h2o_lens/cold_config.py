"""The cold tier's settings: where evicted K/V go and how many of them come back (DESIGN.md §2.13).

A :class:`ColdTier` rides on an :class:`~h2o_lens.config.H2OConfig` (``cold=ColdTier(...)``);
off by default. It imports nothing heavy (the CLI and the log read it without torch).
"""

from __future__ import annotations

import dataclasses
import math
import numbers
from collections.abc import Mapping
from typing import Any

from .errors import ConfigError

__all__ = ["ColdTier", "STORES", "SELECTIONS", "PAGE", "cold_tier", "parse_cold"]

#: where evicted K/V are kept: host memory, or a memory-mapped file per layer
STORES = ("cpu", "disk")
#: how the recalled entries are chosen: q·k over every cold key, or page bounds first (Quest's)
SELECTIONS = ("exact", "pages")
#: positions summarised per page (element-wise min and max of their keys)
PAGE = 16


def _whole(name: str, value: Any, low: int) -> int:
    if isinstance(value, bool) or not isinstance(value, numbers.Integral) or value < low:
        raise ConfigError(f"cold tier {name} must be a whole number >= {low}, got {value!r}")
    return int(value)


@dataclasses.dataclass(frozen=True)
class ColdTier:
    """Evicted K/V kept in a cold store and recalled into a window of the hot slots.

    Parameters
    ----------
    store : str
        ``"cpu"`` (host tensors, pinned when the model is on a GPU) or ``"disk"`` (a
        memory-mapped file per layer under ``directory``, or a temporary folder).
    recall : int
        The recall window: slots taken **inside** the slot count ``B`` (out of ``heavy``
        first, then out of ``recent``), so the hot memory stays ``B``.
    every : int
        Refill the window at every ``every``-th decode step (1: every step).
    select : str
        ``"exact"`` (q·k over every cold key) or ``"pages"`` (pages of :data:`PAGE` cold
        entries ranked by an upper bound of q·k from their element-wise key min/max, then
        q·k inside the ``scan`` best pages).
    scan : int, optional
        Pages read exactly under ``"pages"``; default ``ceil(recall / PAGE)``, as many entries as
        the window holds (Quest's budget).
    directory : str, optional
        Where the ``disk`` store writes its files.
    """

    store: str = "cpu"
    recall: int = 8
    every: int = 1
    select: str = "exact"
    scan: int | None = None
    directory: str | None = None

    def __post_init__(self) -> None:
        if self.store not in STORES:
            raise ConfigError(f"unknown cold store {self.store!r}; expected one of {', '.join(STORES)}")
        if self.select not in SELECTIONS:
            raise ConfigError(f"unknown cold selection {self.select!r}; expected one of {', '.join(SELECTIONS)}")
        _whole("recall", self.recall, 1)
        _whole("every", self.every, 1)
        if self.scan is not None:
            _whole("scan", self.scan, 1)
        if self.directory is not None and not isinstance(self.directory, str):
            object.__setattr__(self, "directory", str(self.directory))

    @property
    def pages_scanned(self) -> int:
        """Pages whose entries are scored exactly under ``select="pages"``."""
        return self.scan if self.scan is not None else max(1, math.ceil(self.recall / PAGE))

    def to_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)

    def describe(self) -> str:
        every = f" every={self.every}" if self.every != 1 else ""
        scan = f"={self.scan}" if self.scan is not None and self.select == "pages" else ""
        return f"cold={self.store}:{self.recall}:{self.select}{scan}{every}"


def cold_tier(value: Any) -> ColdTier | None:
    """``value`` as a :class:`ColdTier`: one already, a dict of its fields (a manifest's), or None."""
    if value is None or isinstance(value, ColdTier):
        return value
    if isinstance(value, Mapping):
        names = {f.name for f in dataclasses.fields(ColdTier)}
        odd = sorted(set(value) - names)
        if odd:
            raise ConfigError(f"unknown cold tier fields {odd}; expected some of {sorted(names)}")
        return ColdTier(**dict(value))
    raise ConfigError(f"cold must be a ColdTier (h2o_lens.cold_config.ColdTier), got {value!r}")


def parse_cold(text: str) -> ColdTier:
    """``STORE:RECALL[:SELECTION[:EVERY]]`` (the CLI's ``--cold``), e.g. ``cpu:32``, ``disk:32:pages``
    or ``cpu:32:pages:4`` (a refill every 4th decode step); ``pages=N`` reads the N best pages
    (default :attr:`ColdTier.pages_scanned`), e.g. ``cpu:32:pages=4``."""
    parts = text.split(":")
    select, given, scan = (parts[2] if len(parts) >= 3 else "exact").partition("=")
    if (
        len(parts) not in (2, 3, 4)
        or not parts[1].isdigit()
        or (len(parts) == 4 and not parts[3].isdigit())
        or (given and (select != "pages" or not scan.isdigit()))
    ):
        raise ConfigError(
            f"--cold takes STORE:RECALL[:SELECTION[:EVERY]] (store {'|'.join(STORES)}, a window of RECALL slots, "
            f"selection {'|'.join(SELECTIONS)} or pages=N for the N best pages, a refill every EVERY decode steps), "
            f"e.g. cpu:32, disk:32:pages, cpu:32:pages=4 or cpu:32:pages:4; got {text!r}"
        )
    every = int(parts[3]) if len(parts) == 4 else 1
    return ColdTier(store=parts[0], recall=int(parts[1]), select=select, every=every, scan=int(scan) if given else None)
