"""Every section reference in the code resolves into the repository's design document.

A reference is ``DESIGN.md`` followed by one or more section numbers, each written with the
section sign (U+00A7), e.g. ``DESIGN.md <sign>6, <sign>8.2``; ``docs/DESIGN.md`` is the same
document. Every .py and .md file of the repository is read (files git ignores, such as the
virtual environment, are not). A reference fails when its section has no numbered heading in
``docs/DESIGN.md``, when it names another document (one outside the repository) or when it
names none. Inside ``docs/DESIGN.md`` a bare section number refers to the document itself.

The section sign is written as an escape in this file so that the file checks itself cleanly.
"""

from __future__ import annotations

import re
import subprocess
from dataclasses import dataclass
from pathlib import Path

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
