"""Text from the logs, the manifests and the link, shown as text in Streamlit's Markdown.

Streamlit renders the body of ``st.markdown``, ``st.caption``, alerts and
subheaders as Markdown (links, images, emphasis, colour directives, maths).
A run name, an error message, a file name or a query parameter must show the
characters it holds and nothing more: :func:`md` backslash-escapes the
characters of that syntax, :func:`code` wraps the text in a code span, where
nothing is parsed.
"""

from __future__ import annotations

import re
from typing import Any

__all__ = ["md", "code"]

# Markdown syntax, Streamlit's ":colour[...]" and ":icon:" directives, "$" maths, HTML tags and entities
_SYNTAX = re.compile(r"([\\`*_{}\[\]()<>#+!|~$:&])")
# GFM turns bare URLs and e-mail addresses of a text into links after escapes are resolved: a word
# joiner (U+2060, invisible, no line break) after the scheme or "www" and before "@" keeps them text
_AUTOLINK = re.compile(r"(?i)\b(https?|ftp|www)(?=\\?[:.])")
_JOINER = "\N{WORD JOINER}"


def _one_line(value: Any) -> str:
    return " ".join(("" if value is None else str(value)).splitlines())


def md(value: Any) -> str:
    """``value`` as Markdown that shows its characters, on one line: no link, image, HTML,
    emphasis, colour or maths (bare URLs and addresses get an invisible word joiner)."""
    text = _SYNTAX.sub(r"\\\1", _one_line(value))
    return _AUTOLINK.sub(r"\1" + _JOINER, text).replace("@", _JOINER + "@")


def code(value: Any) -> str:
    """``value`` as an inline code span (its fence is longer than any backtick run inside)."""
    text = _one_line(value)
    longest = max((len(m) for m in re.findall(r"`+", text)), default=0)
    fence = "`" * (longest + 1)
    pad = " " if text.startswith("`") or text.endswith("`") or not text else ""
    return f"{fence}{pad}{text}{pad}{fence}"
