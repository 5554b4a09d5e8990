"""The culprit tokens of a run's explained requests on the Tokens page (DESIGN.md §19)."""

from __future__ import annotations

from typing import Any

import streamlit as st

from analyses.culprits import culprit_sets, culprit_summary, why_left

from .state import Root, cursor

__all__ = ["culprits_of", "caption"]


@st.cache_data(show_spinner=False, max_entries=64)
def _searches(root: Root, run_id: str) -> dict[int, dict[str, Any]]:
    with cursor(root) as cur:
        return {r: s for (_, r), s in culprit_sets(cur, run_id).items()}


def culprits_of(root: Root, run_id: str, request: int) -> tuple[dict[int, str], dict[str, Any] | None]:
    """``position -> when and why it left`` for the request's culprits, and its search (None: none ran)."""
    search = _searches(root, run_id).get(int(request))
    if not search:
        return {}, None
    return {int(c["position"]): why_left(c) for c in search.get("culprits") or []}, search


def caption(search: dict[str, Any] | None) -> str | None:
    """One line under the text: the culprit search of the request, when one ran."""
    line = culprit_summary(search)
    return None if line is None else f"Culprit tokens (boxed in red; hover for when and why each left): {line}."
