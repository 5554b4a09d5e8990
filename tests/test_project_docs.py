"""The documents hold together: references, links, the design's contents and the README's shape.

Section references. A reference is ``DESIGN.md`` followed by one or more section numbers, each
written with the section sign (U+00A7), e.g. ``DESIGN.md <sign>6, <sign>8.2``; ``docs/DESIGN.md``
is the same document. Every .py and .md file of the repository is read (files git ignores, such
as the virtual environment, are not). A reference fails when its section has no numbered heading
in ``docs/DESIGN.md``, when it names another document (one outside the repository) or when it
names none. Inside ``docs/DESIGN.md`` a bare section number refers to the document itself.

Links. Every relative link of ``README.md`` and ``docs/*.md`` (outside code) leads to a file or
folder of the repository, and a ``#anchor`` into a Markdown file to one of its headings (GitHub's
anchor for it). Contents. ``docs/DESIGN.md`` opens with a ``## Contents`` list that names exactly
its numbered headings, in order, each linked to its anchor. README. Under 250 lines, opening with
the two commands ``make demo`` and ``make test``.

Each checker takes a repository root, so the tests also run it on planted trees that must fail.
The section sign is written as an escape in this file so that the file checks itself cleanly.
"""

from __future__ import annotations

import re
import subprocess
from dataclasses import dataclass
from pathlib import Path, PurePosixPath

import pytest

REPO = Path(__file__).resolve().parent.parent
DESIGN = Path("docs/DESIGN.md")
SIGN = "\u00a7"

_NUMBER = rf"{SIGN}\s*(\d+(?:\.\d+)*)"
#: One run of section numbers: "<sign>3, <sign>6" or "<sign>2 and <sign>5".
_RUN = re.compile(rf"{_NUMBER}(?:\s*(?:,|;|and|&)\s*{SIGN}\s*\d+(?:\.\d+)*)*")
_EACH = re.compile(_NUMBER)
#: The word right before a run: what the run refers to ("DESIGN.md", "seed", "(" ...).
_OWNER = re.compile(r"([\w./'-]+)\W*$")
_HEADING = re.compile(r"^#{1,6}\s+(\d+(?:\.\d+)*)\.?\s", re.M)
_DOCS = ("DESIGN.md", "docs/DESIGN.md")
_SKIP_PARTS = {".git", ".venv", "__pycache__", "node_modules"}


@dataclass(frozen=True)
class Reference:
    path: str
    line: int
    owner: str | None  # the word before the run of numbers, None at the start of a file
    section: str


def repo_files(root: Path) -> list[Path]:
    """The .py and .md files of the repository: tracked or new, never ones git ignores."""
    try:
        out = subprocess.run(
            ["git", "ls-files", "--cached", "--others", "--exclude-standard", "-z"],
            cwd=root,
            capture_output=True,
            check=True,
            text=True,
        ).stdout
        names = [n for n in out.split("\0") if n]
    except (OSError, subprocess.CalledProcessError):
        names = [str(p.relative_to(root)) for p in root.rglob("*")]
    files = []
    for name in sorted(set(names)):
        path = Path(name)
        if path.suffix in (".py", ".md") and not _SKIP_PARTS & set(path.parts) and (root / path).is_file():
            files.append(path)
    return files


def references(root: Path, path: Path) -> list[Reference]:
    """Every section number in ``path`` with the word that owns its run."""
    text = (root / path).read_text(encoding="utf-8")
    found = []
    for run in _RUN.finditer(text):
        before = text[max(0, run.start() - 80) : run.start()]
        owner = _OWNER.search(before.rstrip(" \t\n#*`'\"(["))
        line = text.count("\n", 0, run.start()) + 1
        for number in _EACH.finditer(run.group(0)):
            found.append(Reference(str(path), line, owner.group(1) if owner else None, number.group(1)))
    return found


def headings(root: Path) -> set[str]:
    """Section numbers of the numbered headings of the design document."""
    return set(_HEADING.findall((root / DESIGN).read_text(encoding="utf-8")))


def problems(root: Path) -> list[str]:
    """Every reference that does not resolve into ``docs/DESIGN.md``, as a readable line."""
    if not (root / DESIGN).is_file():
        return [f"{DESIGN} is missing: the design document every {SIGN} reference points into"]
    known = headings(root)
    bad = []
    for path in repo_files(root):
        own = path == DESIGN
        for ref in references(root, path):
            where = f"{ref.path}:{ref.line}: {SIGN}{ref.section}"
            owner = ref.owner or ""
            if owner in _DOCS or (own and not _names_document(owner)):
                if ref.section not in known:
                    bad.append(
                        f"{where} names a section with no heading in {DESIGN} "
                        f"(headings: {', '.join(sorted(known, key=_key))})"
                    )
            elif _names_document(owner):
                bad.append(
                    f"{where} points into {owner!r}, a document outside the repository; "
                    f"point it at a section of {DESIGN} ('DESIGN.md {SIGN}n')"
                )
            else:
                bad.append(f"{where} names no document; write 'DESIGN.md {SIGN}{ref.section}'")
    return bad


def _names_document(word: str) -> bool:
    """Whether the word before a reference names a document (a file name, the seed article, ...)."""
    w = word.lower().removesuffix("'s")
    return w in ("seed", "article", "paper", "design") or bool(re.search(r"\.[a-z]{1,4}$", w))


def _key(section: str) -> tuple[int, ...]:
    return tuple(int(p) for p in section.split("."))


# -- the repository ---------------------------------------------------------------------------


def test_every_section_reference_resolves_into_the_design_document():
    bad = problems(REPO)
    assert not bad, "section references that do not resolve:\n" + "\n".join(bad)


def test_the_code_does_reference_the_design_document():
    refs = [r for p in repo_files(REPO) if p != DESIGN for r in references(REPO, p)]
    assert len(refs) >= 30, f"expected the code's design references, found {len(refs)}"
    assert {r.section for r in refs} >= {"2", "3", "4", "5", "6", "7"}


def test_design_headings_are_unique_and_cover_the_contract():
    text = (REPO / DESIGN).read_text(encoding="utf-8")
    numbers = _HEADING.findall(text)
    assert len(numbers) == len(set(numbers)), f"duplicate section numbers in {DESIGN}: {numbers}"
    top = [int(n) for n in numbers if "." not in n]
    assert top == list(range(1, len(top) + 1)), f"top-level sections are not 1..n in order: {top}"
    for section, words in {"2.4": "Tie rules", "5.3": "Tables", "6.10": "Attribution", "9": "Out of scope"}.items():
        assert re.search(rf"^#+ {re.escape(section)}\.? {words}", text, re.M), (section, words)


def test_readme_points_to_the_design_document():
    readme = (REPO / "README.md").read_text(encoding="utf-8")
    assert "docs/DESIGN.md" in readme.split("## ", 2)[0] + readme.split("## ", 2)[1]


# -- the checker itself, on planted references --------------------------------------------------


def _tree(tmp_path: Path, files: dict[str, str]) -> Path:
    (tmp_path / "docs").mkdir()
    (tmp_path / "docs" / "DESIGN.md").write_text(
        "# Design\n\n## 1. Layers\n\nSee " + SIGN + "2.1.\n\n## 2. Semantics\n\n### 2.1 Decode\n", encoding="utf-8"
    )
    for name, text in files.items():
        (tmp_path / name).parent.mkdir(parents=True, exist_ok=True)
        (tmp_path / name).write_text(text, encoding="utf-8")
    return tmp_path


def test_checker_accepts_references_that_resolve(tmp_path):
    root = _tree(
        tmp_path,
        {
            "pkg/a.py": f'"""Decode step (DESIGN.md {SIGN}2.1, {SIGN}1).\n\nSplit (DESIGN.md\n{SIGN}2)."""\n',
            "pkg/b.py": f"# the layers (docs/DESIGN.md {SIGN}1)\n",
            "NOTES.md": f"Semantics: DESIGN.md {SIGN}2 and {SIGN}2.1.\n",
        },
    )
    assert problems(root) == []
    refs = references(root, Path("pkg/a.py"))
    assert [(r.owner, r.section, r.line) for r in refs] == [
        ("DESIGN.md", "2.1", 1),
        ("DESIGN.md", "1", 1),
        ("DESIGN.md", "2", 4),
    ]


@pytest.mark.parametrize(
    "text, expected",
    [
        (f'"""Cases with a failure signature (seed {SIGN}5.1)."""\n', "outside the repository"),
        (f"# The seed's {SIGN}2.2 step\n", "outside the repository"),
        (f"# Verdicts (DESIGN {SIGN}2)\n", "outside the repository"),
        (f"# see NOTES.txt {SIGN}3\n", "outside the repository"),
        (f'"""Measures (DESIGN.md {SIGN}6)."""\n', "no heading"),
        (f'"""Decode (DESIGN.md {SIGN}2.1, {SIGN}2.7)."""\n', "no heading"),
        (f"# the worked example ({SIGN}2.1)\n", "names no document"),
    ],
)
def test_checker_rejects_a_planted_bad_reference(tmp_path, text, expected):
    root = _tree(tmp_path, {"pkg/planted.py": text})
    bad = problems(root)
    assert len(bad) == 1 and expected in bad[0] and bad[0].startswith("pkg/planted.py:1:"), bad


def test_checker_rejects_a_bad_reference_inside_the_design_document(tmp_path):
    root = _tree(tmp_path, {})
    design = root / "docs" / "DESIGN.md"
    design.write_text(design.read_text() + f"\nSee {SIGN}3 and the seed {SIGN}5.1.\n", encoding="utf-8")
    bad = problems(root)
    assert len(bad) == 2 and "no heading" in bad[0] and "outside the repository" in bad[1], bad


def test_checker_needs_the_design_document(tmp_path):
    (tmp_path / "a.py").write_text(f"# DESIGN.md {SIGN}1\n", encoding="utf-8")
    assert problems(tmp_path) == [f"{DESIGN} is missing: the design document every {SIGN} reference points into"]


# -- links in the documents ---------------------------------------------------------------------

README = Path("README.md")
README_MAX_LINES = 250
CONTENTS = "## Contents"

_FENCE = re.compile(r"^\s*(```|~~~)")
_ATX = re.compile(r"^(#{1,6})\s+(.*?)\s*#*\s*$")
_CODE_SPAN = re.compile(r"(`+).*?\1")
_INLINE_LINK = re.compile(r"!?\[((?:[^\[\]]|\[[^\]]*\])*)\]\(\s*<?([^)\s>]*)>?(?:\s+[\"'(][^)]*)?\)")
_REF_DEF = re.compile(r"^\s{0,3}\[[^\]]+\]:\s*<?(\S+?)>?(?:\s.*)?$")
_HTML_ANCHOR = re.compile(r"<a\s+(?:name|id)=[\"']([^\"']+)[\"']", re.I)
_SCHEME = re.compile(r"^[a-zA-Z][a-zA-Z0-9+.-]*:|^//")


def doc_files(root: Path) -> list[Path]:
    """The documents whose links are checked: README.md and every docs/*.md."""
    found = [README] if (root / README).is_file() else []
    return found + sorted(p.relative_to(root) for p in (root / "docs").glob("*.md"))


def prose_lines(text: str) -> list[tuple[int, str]]:
    """``(line number, line)`` of the lines outside fenced code blocks."""
    out, fence = [], None
    for number, line in enumerate(text.splitlines(), 1):
        m = _FENCE.match(line)
        if m:
            fence = None if fence == m.group(1) else (fence or m.group(1))
            continue
        if fence is None:
            out.append((number, line))
    return out


def slug(heading: str) -> str:
    """GitHub's anchor for a heading's text: markup dropped, lower case, punctuation out, spaces to '-'."""
    text = re.sub(r"!?\[([^\]]*)\]\([^)]*\)", r"\1", heading)  # a link keeps its text
    text = re.sub(r"<[^>]+>", "", text).replace("`", "").replace("*", "")
    return re.sub(r"[^\w\- ]", "", text.strip().lower()).replace(" ", "-")


def anchors(text: str) -> set[str]:
    """Every anchor a Markdown file offers: its headings' (repeats get -1, -2, ...) and HTML ones."""
    seen: dict[str, int] = {}
    found = set()
    for _, line in prose_lines(text):
        found.update(_HTML_ANCHOR.findall(line))
        m = _ATX.match(line)
        if m:
            base = slug(m.group(2))
            n = seen.get(base, 0)
            seen[base] = n + 1
            found.add(base if n == 0 else f"{base}-{n}")
    return found


def links(text: str) -> list[tuple[int, str]]:
    """``(line, target)`` of every inline link, image and link definition outside code."""
    out = []
    for number, line in prose_lines(text):
        m = _REF_DEF.match(line)
        if m:
            out.append((number, m.group(1)))
            continue
        for link in _INLINE_LINK.finditer(_CODE_SPAN.sub("", line)):
            out.append((number, link.group(2)))
    return out


def link_problems(root: Path) -> list[str]:
    """Every relative link of the documents that leads nowhere, as a readable line."""
    root = root.resolve()
    texts: dict[Path, str] = {}
    bad = []
    for doc in doc_files(root):
        for line, target in links((root / doc).read_text(encoding="utf-8")):
            if not target or _SCHEME.match(target):
                continue  # a web address or a mail link: not checked here
            where = f"{doc}:{line}: link {target!r}"
            path, _, anchor = target.partition("#")
            dest = (root / doc).parent / PurePosixPath(path) if path else root / doc
            dest = Path(dest).resolve()
            if root not in dest.parents and dest != root:
                bad.append(f"{where} leads outside the repository")
                continue
            if not dest.exists():
                bad.append(f"{where}: no file or folder {dest.relative_to(root).as_posix()!r}")
                continue
            if anchor and dest.suffix == ".md" and dest.is_file():
                if dest not in texts:
                    texts[dest] = dest.read_text(encoding="utf-8")
                if anchor not in anchors(texts[dest]):
                    bad.append(
                        f"{where}: {dest.relative_to(root).as_posix()} has no heading with the anchor "
                        f"#{anchor} (a heading's anchor is its text in lower case, punctuation dropped, "
                        "spaces as '-')"
                    )
    return bad


# -- the design document's contents ---------------------------------------------------------------

_NUMBERED = re.compile(r"^(#{1,6})\s+((\d+(?:\.\d+)*)\.?\s.*?)\s*$")
_ENTRY = re.compile(r"^(\s*)[-*]\s+\[(.+)\]\(#([^)\s]+)\)\s*$")


@dataclass(frozen=True)
class Heading:
    line: int
    level: int  # the number of '#'
    number: str
    text: str  # the heading without its '#'s, e.g. "2.1 The decode step"

    @property
    def entry(self) -> str:
        """The contents line that names this heading."""
        return f"{'  ' * self.number.count('.')}- [{self.text}](#{slug(self.text)})"


def numbered_headings(text: str) -> list[Heading]:
    """The numbered headings of a document, in order, outside code blocks."""
    out = []
    for number, line in prose_lines(text):
        m = _NUMBERED.match(line)
        if m:
            out.append(Heading(number, len(m.group(1)), m.group(3), m.group(2)))
    return out


def contents_problems(root: Path) -> list[str]:
    """Where the ``## Contents`` list of the design document and its numbered headings disagree."""
    text = (root / DESIGN).read_text(encoding="utf-8")
    heads = numbered_headings(text)
    lines = prose_lines(text)
    start = next((i for i, (_, line) in enumerate(lines) if line.strip() == CONTENTS), None)
    if start is None:
        return [
            f"{DESIGN} has no '{CONTENTS}' section: put one before the first numbered heading, one line per "
            f"numbered heading, e.g.\n{heads[0].entry if heads else '- [1. Title](#1-title)'}"
        ]
    contents_line = lines[start][0]
    bad = []
    if heads and contents_line > heads[0].line:
        bad.append(
            f"{DESIGN}:{contents_line}: '{CONTENTS}' must come before the first numbered heading (line {heads[0].line})"
        )
    entries = []  # (line, indent, text, anchor)
    for number, line in lines[start + 1 :]:
        if _ATX.match(line):
            break
        m = _ENTRY.match(line)
        if m:
            entries.append((number, len(m.group(1)), m.group(2), m.group(3)))
    named = {e[2] for e in entries}
    known = {h.text for h in heads}
    for i, h in enumerate(heads):
        if h.text not in named:
            after = f"after the line for {heads[i - 1].text!r}" if i else "as its first entry"
            bad.append(
                f"{DESIGN}:{h.line}: the heading {'#' * h.level + ' ' + h.text!r} is not in the table of "
                f"contents; add this line to '{CONTENTS}' {after}:\n{h.entry}"
            )
    by_text = {h.text: h for h in heads}
    for line, indent, text, anchor in entries:
        if text not in known:
            bad.append(
                f"{DESIGN}:{line}: the contents entry {text!r} names no numbered heading; make it the heading's "
                "exact text, or remove it if the section is gone"
            )
            continue
        h = by_text[text]
        if anchor != slug(h.text):
            bad.append(
                f"{DESIGN}:{line}: the entry for {text!r} links #{anchor}; its heading's anchor is #{slug(h.text)}"
            )
        if indent != 2 * h.number.count("."):
            bad.append(
                f"{DESIGN}:{line}: indent the entry for {text!r} by {2 * h.number.count('.')} spaces:\n{h.entry}"
            )
    listed = [e[2] for e in entries if e[2] in known]
    if len(listed) != len(set(listed)):
        twice = sorted({t for t in listed if listed.count(t) > 1})
        bad.append(f"{DESIGN}: contents entries listed more than once: {twice}")
    elif not bad and listed != [h.text for h in heads]:
        order = ", ".join(h.number for h in heads)
        bad.append(f"{DESIGN}: the contents entries are not in the headings' order ({order})")
    return bad


# -- the README -----------------------------------------------------------------------------------


def readme_problems(root: Path) -> list[str]:
    """Whether README.md is short and opens with the two commands a newcomer runs first."""
    text = (root / README).read_text(encoding="utf-8")
    lines = text.splitlines()
    bad = []
    if len(lines) >= README_MAX_LINES:
        bad.append(
            f"{README} has {len(lines)} lines; keep it under {README_MAX_LINES}: measured figures go to "
            "docs/BENCHMARKS.md, details to docs/DESIGN.md, testing to docs/TESTING.md"
        )
    body = [line for line in lines if line.strip()]
    opening = body[1:] if body and body[0].startswith("# ") else body
    commands = []
    if opening and _FENCE.match(opening[0]):
        for line in opening[1:]:
            if _FENCE.match(line):
                break
            if not line.lstrip().startswith("#"):
                commands.append(line.split("#")[0].strip())
    if commands[:2] != ["make demo", "make test"]:
        bad.append(
            f"{README} must open (after its title) with a code block whose first two commands are "
            f"'make demo' and 'make test'; it opens with {opening[:3]!r}"
        )
    return bad


def test_every_relative_link_of_the_documents_resolves():
    assert doc_files(REPO)[0] == README and len(doc_files(REPO)) >= 4, doc_files(REPO)
    relative = [t for d in doc_files(REPO) for _, t in links((REPO / d).read_text()) if not _SCHEME.match(t)]
    assert len(relative) >= 20, f"expected the documents' cross-links, found {relative}"
    bad = link_problems(REPO)
    assert not bad, "links that lead nowhere:\n" + "\n".join(bad)


def test_the_design_contents_list_exactly_its_numbered_headings():
    bad = contents_problems(REPO)
    assert not bad, "\n".join(bad)


def test_readme_is_short_and_opens_with_the_two_commands():
    bad = readme_problems(REPO)
    assert not bad, "\n".join(bad)
    makefile = (REPO / "Makefile").read_text(encoding="utf-8")
    for target in ("demo", "test"):
        assert re.search(rf"^{target}:", makefile, re.M), f"the Makefile has no '{target}' target"


def test_the_documents_link_to_each_other():
    readme = (REPO / README).read_text(encoding="utf-8")
    for doc in ("docs/DESIGN.md", "docs/BENCHMARKS.md", "docs/TESTING.md"):
        assert any(target.partition("#")[0] == doc for _, target in links(readme)), f"README.md does not link {doc}"


# -- the link, contents and README checkers, on planted trees ---------------------------------------


_DESIGN_OK = (
    "# Design\n\n## Contents\n\n- [1. Layers](#1-layers)\n- [2. Semantics](#2-semantics)\n"
    "  - [2.1 Decode, step by step](#21-decode-step-by-step)\n\n"
    "## 1. Layers\n\n```bash\n# 3. not a heading: inside code\n```\n\n## 2. Semantics\n\n"
    "### 2.1 Decode, step by step\n"
)


def _docs(tmp_path: Path, files: dict[str, str]) -> Path:
    base = {
        "README.md": "# Tool\n\n```bash\nmake demo   # the demo\nmake test\n```\n\nSee [design](docs/DESIGN.md).\n",
        "docs/DESIGN.md": _DESIGN_OK,
        "Makefile": "demo:\ntest:\n",
    }
    for name, text in {**base, **files}.items():
        (tmp_path / name).parent.mkdir(parents=True, exist_ok=True)
        (tmp_path / name).write_text(text, encoding="utf-8")
    return tmp_path


def test_link_checker_accepts_links_that_resolve(tmp_path):
    root = _docs(
        tmp_path,
        {
            "docs/OTHER.md": (
                "# Other\n\n## Same name\n\n## Same name\n\n<a id=\"kept\"></a>\n"
                "[top](#other) [second](#same-name-1) [html](#kept) [design](DESIGN.md#21-decode-step-by-step)\n"
                "[readme](../README.md) [folder](../pkg/) [web](https://example.org/x#y) [mail](mailto:a@b.c)\n"
                "`[in code](missing.md)`\n\n```\n[in a block](missing.md)\n```\n\n"
                "[def]: ../pkg/a.py\n"
            ),
            "pkg/a.py": "",
        },
    )
    assert link_problems(root) == []
    assert anchors((root / "docs/OTHER.md").read_text()) >= {"other", "same-name", "same-name-1", "kept"}


@pytest.mark.parametrize(
    "text, expected",
    [
        ("[gone](missing.md)\n", "no file or folder 'docs/missing.md'"),
        ("[gone](DESIGN.md#3-layers)\n", "no heading with the anchor #3-layers"),
        ("[gone](#nowhere)\n", "no heading with the anchor #nowhere"),
        ("[up](../../outside.md)\n", "outside the repository"),
        ("![image](img/none.png)\n", "no file or folder 'docs/img/none.png'"),
        ("[ref]: ../nope.md\n", "no file or folder 'nope.md'"),
    ],
)
def test_link_checker_rejects_a_planted_bad_link(tmp_path, text, expected):
    root = _docs(tmp_path, {"docs/PLANTED.md": "# Planted\n\n" + text})
    bad = link_problems(root)
    assert len(bad) == 1 and expected in bad[0] and bad[0].startswith("docs/PLANTED.md:3: link"), bad


def test_section_checker_reads_the_new_documents(tmp_path):
    root = _docs(tmp_path, {"docs/PLANTED.md": f"# Planted\n\nSee DESIGN.md {SIGN}2.1 and DESIGN.md {SIGN}7.\n"})
    bad = problems(root)
    assert len(bad) == 1 and bad[0].startswith(f"docs/PLANTED.md:3: {SIGN}7 names a section with no heading"), bad


def test_contents_checker_accepts_a_complete_list(tmp_path):
    root = _docs(tmp_path, {})
    assert contents_problems(root) == []
    assert [h.number for h in numbered_headings(_DESIGN_OK)] == ["1", "2", "2.1"]


def _planted_design(tmp_path: Path, old: str, new: str) -> list[str]:
    assert old in _DESIGN_OK
    return contents_problems(_docs(tmp_path, {"docs/DESIGN.md": _DESIGN_OK.replace(old, new)}))


def test_contents_checker_says_which_line_a_new_heading_needs(tmp_path):
    bad = _planted_design(tmp_path, "### 2.1 Decode, step by step\n", "### 2.1 Decode, step by step\n\n### 2.2 Ties\n")
    assert len(bad) == 1, bad
    assert "'### 2.2 Ties' is not in the table of contents" in bad[0]
    assert "after the line for '2.1 Decode, step by step'" in bad[0]
    assert bad[0].endswith("\n  - [2.2 Ties](#22-ties)")


@pytest.mark.parametrize(
    "old, new, expected",
    [
        ("- [1. Layers](#1-layers)\n", "- [1. Layers](#1-layers)\n- [9. Gone](#9-gone)\n", "names no numbered heading"),
        ("(#21-decode-step-by-step)", "(#21-decode)", "its heading's anchor is #21-decode-step-by-step"),
        ("  - [2.1 Decode", "- [2.1 Decode", "indent the entry for '2.1 Decode, step by step' by 2 spaces"),
        (
            "- [1. Layers](#1-layers)\n- [2. Semantics](#2-semantics)\n",
            "- [2. Semantics](#2-semantics)\n- [1. Layers](#1-layers)\n",
            "not in the headings' order",
        ),
        ("## 1. Layers\n", "## 1. Layers and data\n", "'## 1. Layers and data' is not in the table of contents"),
        ("## Contents\n", "## Sections\n", "has no '## Contents' section"),
    ],
)
def test_contents_checker_rejects_a_planted_mismatch(tmp_path, old, new, expected):
    bad = _planted_design(tmp_path, old, new)
    assert bad and any(expected in b for b in bad), bad


def test_contents_must_come_first(tmp_path):
    moved = _DESIGN_OK.replace("## 1. Layers\n", "").replace("# Design\n", "# Design\n\n## 1. Layers\n")
    bad = contents_problems(_docs(tmp_path, {"docs/DESIGN.md": moved}))
    assert len(bad) == 1 and "must come before the first numbered heading" in bad[0], bad


def test_readme_checker_accepts_a_short_readme_that_opens_with_the_commands(tmp_path):
    assert readme_problems(_docs(tmp_path, {})) == []


@pytest.mark.parametrize(
    "readme, expected",
    [
        ("# Tool\n\n```bash\nmake demo\nmake test\n```\n" + "text\n" * 244, "has 250 lines"),
        ("# Tool\n\nWhat it is.\n\n```bash\nmake demo\nmake test\n```\n", "must open"),
        ("# Tool\n\n```bash\nmake test\nmake demo\n```\n", "must open"),
        ("# Tool\n\n```bash\nmake setup\nmake demo\nmake test\n```\n", "must open"),
    ],
)
def test_readme_checker_rejects_a_planted_readme(tmp_path, readme, expected):
    bad = readme_problems(_docs(tmp_path, {"README.md": readme}))
    assert len(bad) == 1 and expected in bad[0], bad
