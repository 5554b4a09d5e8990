"""Long-context task families: prompts of 1k to 32k tokens, generated from a seed (DESIGN.md §11).

Each family is a function ``family(*, seed=0, length=None, count=None,
tokenizer=None) -> list[FileTask]`` (the registry of
:mod:`h2o_lens.tasks.builtins`). ``length`` is the prompt length in tokens of
``tokenizer`` counted on :meth:`FileTask.chat_text` (the default model's
tokenizer when ``None``); the generator fits it within 2 % by choosing how many
filler sentences to use. Filler is composed from templates × word banks (tens
of thousands of distinct sentences, no numbers, names or cities, so it never
collides with a key). Nothing is downloaded.

``needle``
    One secret code at a chosen depth (``depth`` in [0, 1], the needle's
    character position over the prompt length; ``count`` requests spread
    the depths over 0.1-0.9).
``multi_needle``
    Four box codes along the text, one asked; the others are distractors.
``delayed_reference``
    A fact stated once at the start, asked at the end.
``restated_fact``
    The same fact restated five times along the text, meant as H2O's good
    case (a statement is never far); on the default model at 20 % it is not
    (see the table).
``variable_tracking``
    A chain ``X1 = 48213 ... X2 = X1 ... X3 = X2`` spread over the text and a
    distractor chain; asks the value of the last variable.
``topic_switch_long``
    Trip notes, a long cooking passage, a question back on the notes.
``long_generation``
    The first three entries of a warehouse log (record ID, day, count, city,
    manager) at the start, filler, then a request to continue the log to entry
    40; 640 new tokens. The checker wants the record ID in the last 400
    characters of the answer: the first new entry must copy it from about
    ``length`` tokens back, later ones from the entries before them.

Every task has evidence spans as ``(start, end)`` character ranges of the
prompt and ``meta``: ``family, seed, index, depth, length`` (requested),
``tokens`` (measured), ``evidence_tokens`` (label -> token index in the chat
text), ``full_cache_solves``.

Calibration on SmolLM2-135M-Instruct (CPU, greedy; H2O at 20 % keep, half
heavy half recent, :func:`h2o_lens.tasks.real.budget`), seed 0, three
requests per family and length (the command runs two for ``long_generation``;
the table has one)::

    python -m h2o_lens.tasks.longctx          # calibrate_families()

    family               P   full  h2o 20%
    needle            1024    3/3      0/3
    needle            2048    3/3      0/3
    multi_needle      1024    3/3      2/3
    multi_needle      2048    1/3      2/3
    delayed_reference 1024    3/3      3/3
    delayed_reference 2048    2/3      1/3
    restated_fact     1024    3/3      1/3
    restated_fact     2048    3/3      0/3
    variable_tracking 1024    0/3      0/3
    variable_tracking 2048    0/3      0/3
    topic_switch_long 1024    3/3      2/3
    topic_switch_long 2048    0/3      2/3
    long_generation   1024    1/1      0/1

    (long_generation: one request, 1k only; the full-cache answer repeats
    the entry format with the right ID to the end, H2O at 20 % loses the
    format after a few lines and never writes the ID. 2k was not run.)

A family counts as solved with a full cache (:data:`FULL_CACHE_SOLVES`,
``meta["full_cache_solves"]``, the family's line in ``h2o-lens tasks list``)
when the full cache answers at least 2 of 3 requests at every calibrated
length: ``multi_needle`` and ``topic_switch_long`` are solved at 1k but not
at 2k, ``variable_tracking`` never (the model answers "1" or "3"). Their
verdicts under a policy are not a quality signal for H2O on this model.
"""

from __future__ import annotations

import bisect
import functools
import random
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

from .real import CITIES, COOKING, JOBS, NAMES, TOWN
from .taskfile import FileTask

__all__ = [
    "LONG_FAMILIES",
    "FULL_CACHE_SOLVES",
    "DEFAULT_LENGTH",
    "TOLERANCE",
    "calibrate_families",
    "filler_sentences",
]

DEFAULT_LENGTH = 1024
#: the fitted prompt length is within this fraction of the request
TOLERANCE = 0.02
_MIN_LENGTH, _MAX_LENGTH = 256, 65_536

# ------------------------------------------------------------------------------- word banks

_SUBJECTS = (
    "A young woman",
    "An old man",
    "Two students",
    "The baker",
    "A tired driver",
    "A small boy",
    "The postman",
    "A group of tourists",
    "The gardener",
    "A nurse on her break",
    "Three friends",
    "The shop owner",
    "A cyclist",
    "The teacher",
    "A street musician",
    "An old couple",
    "The mayor",
    "A fisherman",
    "The librarian",
    "A delivery driver",
    "A quiet girl",
    "The painter",
)
_ACTIONS = (
    "bought fresh bread",
    "read a newspaper",
    "walked a brown dog",
    "painted a wooden fence",
    "carried a basket of apples",
    "fixed a broken bicycle",
    "drank a cup of tea",
    "talked about the weather",
    "fed the pigeons",
    "waited for the bus",
    "looked at old photographs",
    "planted some tulips",
    "swept the pavement",
    "played a slow tune",
    "wrote a short letter",
    "counted the empty crates",
    "sold a few flowers",
    "watched the boats",
    "cleaned the windows",
    "folded a large map",
    "tied a red ribbon to a gate",
    "sorted a pile of books",
)
_PLACES = (
    "near the fountain",
    "in the park",
    "by the river",
    "outside the post office",
    "at the market",
    "on the bridge",
    "behind the church",
    "next to the library",
    "in the square",
    "at the train station",
    "under the old trees",
    "on Main Street",
    "near the harbour",
    "in a quiet garden",
    "outside the bakery",
    "at the corner cafe",
)
_TIMES = (
    "in the morning",
    "after lunch",
    "in the afternoon",
    "before dinner",
    "at noon",
    "early in the day",
    "in the evening",
    "later that day",
)
_SCENES = ("The sky", "The wind", "The air", "The street", "The water", "The square", "The old road", "The harbour")
_MOODS = ("calm", "quiet", "grey", "bright", "cold", "warm", "still", "empty", "clear", "damp")

_VERBS = ("Chop", "Wash", "Fry", "Boil", "Slice", "Stir", "Season", "Roast", "Peel", "Mix", "Grate", "Steam")
_INGREDIENTS = (
    "the onions",
    "the carrots",
    "the potatoes",
    "the tomatoes",
    "the garlic",
    "the mushrooms",
    "the beans",
    "the rice",
    "the peppers",
    "the leeks",
    "the cabbage",
    "the lentils",
)
_MANNERS = (
    "slowly",
    "for a few minutes",
    "until soft",
    "in a large pan",
    "with a little oil",
    "over a low heat",
    "with fresh herbs",
    "until golden",
    "in a deep bowl",
    "with a pinch of salt",
)
_KITCHEN_FACTS = (
    "keep well in a cool dark place",
    "taste better when they are fresh",
    "should be washed before cooking",
    "make a soup thicker",
    "go well with a little butter",
    "can be frozen for later",
)

_ITEMS = ("boxes of nails", "bags of flour", "rolls of paper", "crates of apples", "tins of paint", "sacks of rice")
_BOXES = ("red", "blue", "green", "yellow", "purple", "black", "white", "brown")


def _town_sentence(rng: random.Random) -> str:
    kind = rng.randrange(6)
    if kind == 0:
        return rng.choice(TOWN)
    if kind == 1:
        return f"{rng.choice(_SCENES)} was {rng.choice(_MOODS)} {rng.choice(_TIMES)}."
    subject, action, place = rng.choice(_SUBJECTS), rng.choice(_ACTIONS), rng.choice(_PLACES)
    if kind == 2:
        time_ = rng.choice(_TIMES)
        return f"{time_[0].upper()}{time_[1:]}, {subject[0].lower()}{subject[1:]} {action} {place}."
    if kind == 3:
        return f"{subject} {action} {place} {rng.choice(_TIMES)}."
    return f"{subject} {action} {place}."


def _cooking_sentence(rng: random.Random) -> str:
    kind = rng.randrange(4)
    if kind == 0:
        return rng.choice(COOKING)
    ingredient = rng.choice(_INGREDIENTS)
    if kind == 1:
        return f"{ingredient[4].upper()}{ingredient[5:]} {rng.choice(_KITCHEN_FACTS)}."
    return f"{rng.choice(_VERBS)} {ingredient} {rng.choice(_MANNERS)}."


_TOPICS: dict[str, Callable[[random.Random], str]] = {"town": _town_sentence, "cooking": _cooking_sentence}


def filler_sentences(rng: random.Random, count: int, topic: str = "town") -> list[str]:
    """``count`` filler sentences on ``topic`` (``"town"`` or ``"cooking"``), no two neighbours equal."""
    make = _TOPICS[topic]
    out: list[str] = []
    while len(out) < count:
        s = make(rng)
        if not out or s != out[-1]:
            out.append(s)
    return out


def _code(rng: random.Random, digits: int = 5) -> str:
    return str(rng.randrange(10 ** (digits - 1), 10**digits))


# ------------------------------------------------------------------------------- layouts


@dataclass
class _Insert:
    """A sentence placed in the filler at ``depth`` (fraction of the prompt's characters)."""

    depth: float
    label: str
    text: str


@dataclass
class _Layout:
    """What a family decides before the length fit: head, inserts, question, answer."""

    head: str
    inserts: list[_Insert]
    question: str
    answer: Any
    depth: float | None = None
    topic: str = "town"
    max_new_tokens: int = 24
    extra: dict[str, Any] = field(default_factory=dict)


def _render(layout: _Layout, filler: Sequence[str], n: int) -> tuple[str, dict[str, tuple[int, int]]]:
    """The prompt with ``n`` filler sentences and the inserts at their depths; evidence ranges."""
    sentences = filler[:n]
    head = layout.head + "\n\n"
    tail = "\n\n" + layout.question
    lengths = [len(s) + 1 for s in sentences]
    total = len(head) + sum(lengths) + sum(len(i.text) + 1 for i in layout.inserts) + len(tail)
    starts = [len(head)]
    for length in lengths:
        starts.append(starts[-1] + length)
    gaps: dict[int, list[_Insert]] = {}
    for ins in sorted(layout.inserts, key=lambda i: i.depth):
        k = bisect.bisect_left(starts, ins.depth * total)
        if 0 < k <= n and abs(starts[k - 1] - ins.depth * total) <= abs(starts[min(k, n)] - ins.depth * total):
            k -= 1
        gaps.setdefault(min(k, n), []).append(ins)
    parts = [head]
    pos = len(head)
    evidence: dict[str, tuple[int, int]] = {}
    for k in range(n + 1):
        for ins in gaps.get(k, ()):
            evidence[ins.label] = (pos, pos + len(ins.text))
            parts.append(ins.text + " ")
            pos += len(ins.text) + 1
        if k < n:
            parts.append(sentences[k] + " ")
            pos += len(sentences[k]) + 1
    body = "".join(parts).rstrip(" ")
    return body + tail, evidence


def _fit(
    layout: _Layout, rng: random.Random, length: int, tokenizer: Any, name: str
) -> tuple[str, dict[str, tuple[int, int]], int, str]:
    """Choose the filler count whose prompt is closest to ``length`` tokens; (prompt, evidence, tokens, chat)."""
    filler = filler_sentences(rng, max(16, length // 6), layout.topic)

    def measure(n: int) -> tuple[str, dict[str, tuple[int, int]], int, str]:
        while n > len(filler):
            filler.extend(filler_sentences(rng, len(filler), layout.topic))
        prompt, evidence = _render(layout, filler, n)
        chat = FileTask(name=name, prompt=prompt).chat_text(tokenizer)
        return prompt, evidence, len(tokenizer(chat, add_special_tokens=False)["input_ids"]), chat

    base = measure(0)
    per_sentence = 11.0
    n = max(0, round((length - base[2]) / per_sentence))
    best, tried = base, {0: base}
    for _ in range(12):
        if n in tried:
            break
        got = tried[n] = measure(n)
        if abs(got[2] - length) < abs(best[2] - length):
            best = got
        if n > 0 and got[2] > base[2]:
            per_sentence = (got[2] - base[2]) / n
        if got[2] == length:
            break
        n = max(0, n + round((length - got[2]) / per_sentence))
    # the closest count may sit between two tried ones: step one sentence towards the target
    for n0, got in sorted(tried.items()):
        if got is best:
            step = 1 if got[2] < length else -1
            for k in (n0 + step, n0 + 2 * step):
                if k >= 0 and k not in tried:
                    tried[k] = measure(k)
                    if abs(tried[k][2] - length) < abs(best[2] - length):
                        best = tried[k]
            break
    if abs(best[2] - length) > TOLERANCE * length:
        raise ValueError(
            f"{name}: cannot fit {length} prompt tokens (closest {best[2]}: the fixed text alone is "
            f"{base[2]} tokens); ask for a longer --length"
        )
    return best


# ------------------------------------------------------------------------------- families


def _spread(index: int, count: int, lo: float = 0.1, hi: float = 0.9) -> float:
    return round(lo + (hi - lo) * index / (count - 1), 4) if count > 1 else round((lo + hi) / 2, 4)


def _needle(rng: random.Random, index: int, count: int, depth: float | None) -> _Layout:
    d = _spread(index, count) if depth is None else depth
    code = _code(rng)
    return _Layout(
        head="Read the following text. A secret code is hidden in it; remember it.",
        inserts=[_Insert(d, "needle", f"The secret code is {code}.")],
        question="What is the secret code? Answer with the number only.",
        answer=code,
        depth=d,
        max_new_tokens=16,
    )


def _multi_needle(rng: random.Random, index: int, count: int, depth: float | None) -> _Layout:
    boxes = rng.sample(_BOXES, 4)
    codes = [_code(rng) for _ in boxes]
    while len(set(codes)) < len(codes):
        codes = [_code(rng) for _ in boxes]
    asked = rng.randrange(len(boxes))
    depths = [0.1 + 0.8 * k / (len(boxes) - 1) for k in range(len(boxes))]
    if depth is not None:
        depths[asked] = depth
    inserts = [
        _Insert(d, "needle" if k == asked else f"distractor_{box}", f"The code of the {box} box is {code}.")
        for k, (d, box, code) in enumerate(zip(depths, boxes, codes))
    ]
    return _Layout(
        head="Read the following text. It gives the codes of several boxes; remember them.",
        inserts=inserts,
        question=f"What is the code of the {boxes[asked]} box? Answer with the number only.",
        answer={"all": [codes[asked]], "none": [c for k, c in enumerate(codes) if k != asked]},
        depth=round(depths[asked], 4),
        max_new_tokens=16,
    )


def _delayed_reference(rng: random.Random, index: int, count: int, depth: float | None) -> _Layout:
    name, city = rng.choice(NAMES), rng.choice(CITIES)
    d = 0.0 if depth is None else depth
    return _Layout(
        head="Read the following story.",
        inserts=[_Insert(d, "fact", f"{name} moved to {city} last year.")],
        question=f"Which city did {name} move to? Answer with the city only.",
        answer={"all": [city], "none": [c for c in CITIES if c != city]},
        depth=d,
        max_new_tokens=12,
    )


def _restated_fact(rng: random.Random, index: int, count: int, depth: float | None) -> _Layout:
    name, code = rng.choice(NAMES), _code(rng)
    wordings = (
        f"{name}'s locker number is {code}.",
        f"Remember: the locker of {name} has number {code}.",
        f"Again, {name}'s locker number is {code}.",
    )
    inserts = [_Insert(0.05 + 0.2 * k, f"fact_{k}", wordings[k % len(wordings)]) for k in range(5)]
    return _Layout(
        head="Read the following text.",
        inserts=inserts,
        question=f"What is {name}'s locker number? Answer with the number only.",
        answer=code,
        depth=None,
        max_new_tokens=16,
    )


def _variable_tracking(rng: random.Random, index: int, count: int, depth: float | None) -> _Layout:
    value, other = _code(rng), _code(rng)
    while other == value:
        other = _code(rng)
    hops = 3
    names = [f"X{k + 1}" for k in range(hops)]
    inserts = [_Insert(0.05, "assign_X1", f"VAR X1 = {value}.")]
    inserts += [
        _Insert(0.05 + 0.8 * k / (hops - 1), f"assign_{names[k]}", f"VAR {names[k]} = {names[k - 1]}.")
        for k in range(1, hops)
    ]
    inserts += [_Insert(0.15, "decoy_Y1", f"VAR Y1 = {other}."), _Insert(0.55, "decoy_Y2", "VAR Y2 = Y1.")]
    return _Layout(
        head="Read the following text. It contains variable assignments (lines starting with VAR); keep track of them.",
        inserts=inserts,
        question=f"Which value does {names[-1]} have? Follow the assignments. Answer with the number only.",
        answer={"all": [value], "none": [other]},
        depth=0.05,
        max_new_tokens=16,
    )


def _topic_switch_long(rng: random.Random, index: int, count: int, depth: float | None) -> _Layout:
    name, city, job = rng.choice(NAMES), rng.choice(CITIES), rng.choice(JOBS)
    return _Layout(
        head=f"Trip notes: {name}, a {job}, is travelling to {city} next week.\n\nRecipe notes:",
        inserts=[],
        question=f"Back to the trip notes: which city is {name} travelling to? Answer with the city only.",
        answer={"all": [city], "none": [c for c in CITIES if c != city]},
        depth=0.0,
        topic="cooking",
        max_new_tokens=12,
        extra={"evidence_in_head": f"travelling to {city}"},
    )


def _long_generation(rng: random.Random, index: int, count: int, depth: float | None) -> _Layout:
    code, name, city, item = _code(rng), rng.choice(NAMES), rng.choice(CITIES), rng.choice(_ITEMS)
    counts = rng.sample(range(5, 60), 3)
    entries = "\n".join(
        f"{k}. Record {code}, day {k}: {n} {item} arrived in {city}, checked by {name}."
        for k, n in enumerate(counts, 1)
    )
    return _Layout(
        head=f"Warehouse log of {name} in {city}.\n{entries}\n\nNotes about the town around the warehouse:",
        inserts=[],
        question="Continue the warehouse log from entry 4 to entry 40, one line per day, in exactly the same format.",
        # the record ID still written in the last ~5 entries of the 640 new tokens
        answer={"regex": rf"\b{code}\b(?=[\s\S]{{0,400}}\Z)"},
        depth=0.0,
        max_new_tokens=640,
        extra={"evidence_in_head": f"Record {code}"},
    )


_LAYOUTS: dict[str, Callable[[random.Random, int, int, float | None], _Layout]] = {
    "needle": _needle,
    "multi_needle": _multi_needle,
    "delayed_reference": _delayed_reference,
    "restated_fact": _restated_fact,
    "variable_tracking": _variable_tracking,
    "topic_switch_long": _topic_switch_long,
    "long_generation": _long_generation,
}

#: whether the default model answers the family with a full cache (2 of 3 at 1k and at 2k; see the table)
FULL_CACHE_SOLVES: dict[str, bool] = {
    "needle": True,
    "multi_needle": False,
    "delayed_reference": True,
    "restated_fact": True,
    "variable_tracking": False,
    "topic_switch_long": False,
    "long_generation": True,
}
_DEFAULT_COUNT = 3
#: one line per family, for ``h2o-lens tasks list``
_DESCRIPTIONS = {
    "needle": "one secret code at a chosen depth (count spreads the depths)",
    "multi_needle": "four box codes along the text, one asked, the others distractors",
    "delayed_reference": "a fact stated once at the start, asked at the end",
    "restated_fact": "the same fact restated five times along the text",
    "variable_tracking": "multi-hop assignments X1 = value, X2 = X1, X3 = X2 and a decoy chain",
    "topic_switch_long": "trip notes, a long cooking passage, a question back on the notes",
    "long_generation": "a log's first entries stated early, continued for 640 new tokens, reusing the record ID",
}


@functools.cache
def _default_tokenizer() -> Any:
    from ..models import load_tokenizer

    return load_tokenizer()


def _build(
    family: str,
    *,
    seed: int = 0,
    length: int | None = None,
    count: int | None = None,
    tokenizer: Any = None,
    depth: float | None = None,
) -> list[FileTask]:
    length = DEFAULT_LENGTH if length is None else length
    count = _DEFAULT_COUNT if count is None else count
    if isinstance(length, bool) or not isinstance(length, int) or not _MIN_LENGTH <= length <= _MAX_LENGTH:
        raise ValueError(
            f"builtin:{family}: length must be a whole number of prompt tokens in "
            f"[{_MIN_LENGTH}, {_MAX_LENGTH}] (1k to 32k is the tested range), got {length!r}"
        )
    if isinstance(count, bool) or not isinstance(count, int) or count < 1:
        raise ValueError(f"builtin:{family}: count must be a positive whole number of requests, got {count!r}")
    if depth is not None and not 0.0 <= depth <= 1.0:
        raise ValueError(f"builtin:{family}: depth must be in [0, 1] (0: start, 1: end of the prompt), got {depth!r}")
    tok = tokenizer if tokenizer is not None else _default_tokenizer()
    tasks = []
    for index in range(count):
        rng = random.Random(f"{family}:{seed}:{index}")
        layout = _LAYOUTS[family](rng, index, count, depth)
        name = f"{family}_{index}"
        prompt, evidence, tokens, chat = _fit(layout, rng, length, tok, name)
        head_span = layout.extra.get("evidence_in_head")
        if head_span is not None:
            start = prompt.index(head_span)
            evidence = {"fact": (start, start + len(head_span)), **evidence}
        offset = chat.index(prompt)
        evidence_tokens = {
            label: len(tok(chat[: offset + start], add_special_tokens=False)["input_ids"])
            for label, (start, _) in evidence.items()
        }
        meta = {
            "family": family,
            "seed": seed,
            "index": index,
            "depth": layout.depth,
            "length": length,
            "tokens": tokens,
            "evidence_tokens": evidence_tokens,
            "full_cache_solves": FULL_CACHE_SOLVES[family],
        }
        meta.update({k: v for k, v in layout.extra.items() if k != "evidence_in_head"})
        tasks.append(
            FileTask(
                name=name,
                prompt=prompt,
                answer=layout.answer,
                evidence=evidence,
                max_new_tokens=layout.max_new_tokens,
                meta=meta,
                kind=family,
            )
        )
    return tasks


def _family(name: str) -> Callable[..., list[FileTask]]:
    def build(
        *,
        seed: int = 0,
        length: int | None = None,
        count: int | None = None,
        tokenizer: Any = None,
        depth: float | None = None,
    ) -> list[FileTask]:
        return _build(name, seed=seed, length=length, count=count, tokenizer=tokenizer, depth=depth)

    solves = "" if FULL_CACHE_SOLVES[name] else "; NOT solved by the default model with a full cache"
    build.__doc__ = f"Long context: {_DESCRIPTIONS[name]} (--length, default {DEFAULT_LENGTH} tokens){solves}."
    build.__name__ = name
    return build


#: name -> family, registered in :data:`h2o_lens.tasks.builtins.FAMILIES`
LONG_FAMILIES: dict[str, Callable[..., list[FileTask]]] = {name: _family(name) for name in _LAYOUTS}


# ------------------------------------------------------------------------------- calibration


def calibrate_families(
    families: Sequence[str] | None = None,
    *,
    lengths: Sequence[int] = (1024, 2048),
    count: int = 3,
    ratio: float = 0.2,
    seed: int = 0,
    model: Any = None,
    tokenizer: Any = None,
    out: Callable[[str], Any] = print,
) -> list[dict[str, Any]]:
    """Answer each family's requests with the full cache and with H2O at ``ratio`` keep; print a table.

    Greedy, each request's ``max_new_tokens``; ``long_generation`` runs
    ``min(count, 2)`` requests (640 new tokens each). Loads the default model
    unless ``model`` and ``tokenizer`` are given. Command::

        python -m h2o_lens.tasks.longctx

    Returns
    -------
    list of dict
        One per (family, length): ``family, length, requests, full, h2o`` (counts
        of correct answers) and ``answers`` (``[(full answer, h2o answer)]``).
    """
    from ..policies import DEFAULT
    from .real import _answer, budget

    if model is None or tokenizer is None:
        from ..models import load_model

        model, tokenizer = load_model(progress=False)
    names = list(families) if families is not None else list(_LAYOUTS)
    label = f"h2o {round(ratio * 100)}%"
    out(f"{'family':<20} {'P':>5}  {'full':>5}  {label:>8}")
    rows, t0 = [], time.perf_counter()
    for name in names:
        for length in lengths:
            n = min(count, 2) if name == "long_generation" else count
            tasks = _build(name, seed=seed, length=length, count=n, tokenizer=tokenizer)
            row: dict[str, Any] = {"family": name, "length": length, "requests": n, "full": 0, "h2o": 0, "answers": []}
            for task in tasks:
                p, full = _answer(model, tokenizer, task, None)
                _, kept = _answer(model, tokenizer, task, budget(DEFAULT, ratio, p))
                row["full"] += task.check(full)
                row["h2o"] += task.check(kept)
                row["answers"].append((full, kept))
            rows.append(row)
            full_score, h2o_score = f"{row['full']}/{n}", f"{row['h2o']}/{n}"
            out(f"{name:<20} {length:>5}  {full_score:>5}  {h2o_score:>8}")
    out(f"({time.perf_counter() - t0:.0f} s)")
    return rows


if __name__ == "__main__":
    calibrate_families()
