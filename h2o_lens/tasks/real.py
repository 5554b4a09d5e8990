"""Real-model tasks for the default model: prompts, evidence spans, expected answers, checkers.

Four kinds, generated deterministically from a seed out of the word banks
below (nothing is downloaded):

``delayed_recall``
    An ID or code stated at the start, unrelated filler, then a question
    that recalls it.
``multi_fact``
    Several facts stated together; the question needs two of them at once.
``topic_switch``
    Notes on one topic, a long passage on another, then a question that
    switches back to an early note.
``long_passage``
    A passage about several people; one question about a detail stated
    early in it.

Every :class:`Task` carries the user prompt (the caller applies the chat
template: :meth:`Task.messages`), evidence spans as labelled substrings of
the prompt, the expected answer, an answer checker (normalised number or
word match, all required items present and no distractor) and
``max_new_tokens``.

Calibration on SmolLM2-135M-Instruct (CPU, greedy, :func:`calibrate`; the
same slot count ``B = round(r·P)`` for H2O and local, half heavy, half
recent), seed 0::

    task                  P   full  h2o 20%  local 20%  h2o 10%  local 10%
    delayed_recall_0    175     ok       ok       FAIL     FAIL       FAIL
    delayed_recall_1    191     ok     FAIL       FAIL     FAIL       FAIL
    multi_fact_0        155     ok     FAIL       FAIL     FAIL       FAIL
    multi_fact_1        163     ok     FAIL       FAIL     FAIL       FAIL
    topic_switch_0      159     ok       ok       FAIL     FAIL       FAIL
    topic_switch_1      198     ok       ok       FAIL     FAIL       FAIL
    long_passage_0      212     ok       ok       FAIL     FAIL       FAIL
    long_passage_1      252     ok       ok       FAIL       ok       FAIL
    demo (8)                   8/8      5/8        0/8      1/8        0/8
    full, indices 2-3 (8)      8/8      5/8        0/8      2/8        0/8

Other seeds use the same templates but are not individually checked: the
model is small and some wordings it does not answer even with a full cache.
"""

from __future__ import annotations

import random
import re
import time
import unicodedata
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

from ..config import H2OConfig
from ..policies import DEFAULT, half_split, ratio_slots

__all__ = [
    "token_f1",
    "f1_tokens",
    "Task",
    "KINDS",
    "SIZES",
    "suite",
    "get_task",
    "check_answer",
    "normalise",
    "budget",
    "calibrate",
    "CalibrationRow",
]

# ------------------------------------------------------------------------------- word banks

NAMES = (
    "Alice",
    "Bruno",
    "Chloe",
    "Daniel",
    "Elena",
    "Farid",
    "Grace",
    "Hugo",
    "Irene",
    "Jonas",
    "Kira",
    "Liam",
    "Maya",
    "Nadia",
    "Oscar",
    "Paula",
)
CITIES = (
    "Lisbon",
    "Oslo",
    "Nairobi",
    "Denver",
    "Osaka",
    "Dublin",
    "Lima",
    "Prague",
    "Cairo",
    "Vienna",
    "Madrid",
    "Boston",
    "Sydney",
    "Berlin",
    "Toronto",
    "Athens",
)
PASSWORDS = ("falcon", "orange", "river", "silver", "tiger", "maple", "violet", "thunder", "copper", "meadow")
COLOURS = ("red", "blue", "green", "yellow", "purple", "black", "white", "orange")
PETS = ("dog", "cat", "parrot", "rabbit", "horse", "turtle")
JOBS = ("teacher", "nurse", "pilot", "baker", "farmer", "doctor", "lawyer", "painter")

#: neutral filler: a day in a small town
TOWN = (
    "The weather was mild and the streets were quiet.",
    "People walked their dogs in the park.",
    "A bus stopped at the corner and a few students got on.",
    "The bakery on Main Street sold fresh bread every morning.",
    "Children played football near the old library.",
    "The river was calm and a few boats drifted by.",
    "An old man sat on a bench and read the newspaper.",
    "The market was busy with people buying fruit and vegetables.",
    "Somebody was playing a guitar near the fountain.",
    "The trains were on time all day.",
    "A cat slept in the sun on a windowsill.",
    "The shops opened their doors early.",
    "A delivery van was parked outside the post office.",
    "Two friends drank coffee at a small table outside the cafe.",
    "The school bell rang at noon.",
    "A gardener was cutting the grass in front of the town hall.",
    "Clouds moved slowly across the sky in the afternoon.",
    "A young woman was painting the door of her house.",
    "The museum had a new exhibition about old maps.",
    "Cyclists rode along the path next to the river.",
    "The pharmacy closed for lunch for one hour.",
    "A group of tourists took photos of the church.",
    "The library was quiet except for the sound of pages.",
    "In the evening, the lights in the square were turned on.",
)

#: a second topic for the topic switch: cooking
COOKING = (
    "To make the soup, first chop two onions and a carrot.",
    "Fry the onions slowly in olive oil until they are soft.",
    "Add the carrot, a little salt and a spoon of pepper.",
    "Pour in a litre of water and let it boil.",
    "Lower the heat and let the soup simmer for twenty minutes.",
    "Meanwhile, toast some bread in the oven.",
    "Taste the soup and add more salt if needed.",
    "Blend the soup until it is smooth.",
    "Serve it hot with the toasted bread.",
    "Fresh herbs on top make it look nicer.",
    "A good soup needs fresh vegetables.",
    "Potatoes make the soup thicker.",
    "Some people add a little cream at the end.",
    "Leftover soup keeps well in the fridge for two days.",
    "Wash the vegetables before you cut them.",
    "A sharp knife makes chopping much easier.",
)


# ---------------------------------------------------------------------------------- checking

_SEPARATOR = re.compile(r"(?<=\d)[,\u202f\u00a0'](?=\d{3}\b)")
_NON_WORD = re.compile(r"[^0-9a-z]+")


def normalise(text: str) -> str:
    """Lower-case, accents and punctuation removed, thousands separators dropped, single spaces."""
    text = unicodedata.normalize("NFKD", text)
    text = "".join(ch for ch in text if not unicodedata.combining(ch)).lower()
    text = _SEPARATOR.sub("", text)
    return " ".join(_NON_WORD.sub(" ", text).split())


def _contains(norm_answer: str, item: str) -> bool:
    """Whole-word (or whole-number) occurrence of ``item`` in a normalised answer."""
    needle = normalise(item)
    if not needle:
        return False
    return re.search(rf"(?<![0-9a-z]){re.escape(needle)}(?![0-9a-z])", norm_answer) is not None


_ARTICLES = re.compile(r"\b(a|an|the)\b")
_ASCII_PUNCTUATION = frozenset("!\"#$%&'()*+,-./:;<=>?@[\\]^_`{|}~")


def f1_tokens(text: str) -> list[str]:
    """The words a token F1 compares: lower case, ASCII punctuation removed, the articles a, an and
    the dropped, split on white space (the normalisation of SQuAD-style QA scoring)."""
    text = "".join(ch for ch in text.lower() if ch not in _ASCII_PUNCTUATION)
    return _ARTICLES.sub(" ", text).split()


def token_f1(answer: str, reference: str) -> float:
    """Token F1 of ``answer`` against ``reference`` over :func:`f1_tokens` (each word counted with
    its multiplicity): ``2 p r / (p + r)`` with p the share of the answer's words found in the
    reference and r the share of the reference's words found in the answer; 0 when none is shared."""
    pred, ref = f1_tokens(answer), f1_tokens(reference)
    counts: dict[str, int] = {}
    for w in ref:
        counts[w] = counts.get(w, 0) + 1
    shared = 0
    for w in pred:
        if counts.get(w, 0) > 0:
            counts[w] -= 1
            shared += 1
    if shared == 0:
        return 0.0
    precision, recall = shared / len(pred), shared / len(ref)
    return 2 * precision * recall / (precision + recall)


def check_answer(answer: str, required: Sequence[str], distractors: Sequence[str] = ()) -> bool:
    """True when every ``required`` item and no ``distractor`` occurs in ``answer``.

    Items match as whole words or whole numbers after :func:`normalise`
    (``"6604"`` matches ``"The code is 6,604."`` but not ``"66045"`` or
    ``"660"``; ``"Lisbon"`` matches ``"lisbon!"``).
    """
    norm = normalise(answer)
    return all(_contains(norm, r) for r in required) and not any(_contains(norm, d) for d in distractors)


# -------------------------------------------------------------------------------------- tasks


@dataclass(frozen=True)
class Task:
    """One real-model task instance.

    Attributes
    ----------
    name : str
        Unique within a suite, ``<kind>_<index>`` (e.g. ``delayed_recall_0``).
    kind : str
        One of :data:`KINDS`.
    prompt : str
        The user message (apply the model's chat template to :meth:`messages`).
    evidence : dict label -> str
        Evidence spans, each a substring of ``prompt`` (for the recorder's
        ``evidence=``).
    expected : str
        The expected answer, for humans and the ``requests`` table.
    required : tuple of str
        Items the answer must contain (all of them).
    distractors : tuple of str
        Items that make the answer wrong (other facts of the prompt).
    max_new_tokens : int
    seed : int
    """

    name: str
    kind: str
    prompt: str
    evidence: dict[str, str] = field(hash=False)
    expected: str
    required: tuple[str, ...]
    distractors: tuple[str, ...] = ()
    max_new_tokens: int = 12
    seed: int = 0

    def __post_init__(self) -> None:
        for label, span in self.evidence.items():
            if not span or span not in self.prompt:
                raise ValueError(f"task {self.name!r}: evidence {label!r} = {span!r} is not a substring of the prompt")

    def check(self, answer: str) -> bool:
        """Answer checker (see :func:`check_answer`)."""
        return check_answer(answer, self.required, self.distractors)

    def messages(self) -> list[dict[str, str]]:
        """The chat messages of the task (one user turn)."""
        return [{"role": "user", "content": self.prompt}]

    def chat_text(self, tokenizer: Any) -> str:
        """The prompt with ``tokenizer``'s chat template and the generation prompt applied."""
        return tokenizer.apply_chat_template(self.messages(), tokenize=False, add_generation_prompt=True)


def _sentences(rng: random.Random, bank: Sequence[str], count: int) -> list[str]:
    """``count`` sentences of ``bank`` in a seeded order, each used once per pass over the bank."""
    out: list[str] = []
    while len(out) < count:
        order = list(bank)
        rng.shuffle(order)
        out += order
    return out[:count]


def _filler(rng: random.Random, bank: Sequence[str], count: int) -> str:
    return " ".join(_sentences(rng, bank, count))


def _code(rng: random.Random, digits: int) -> str:
    return str(rng.randrange(10 ** (digits - 1), 10**digits))


# one builder per kind; ``index`` picks the variant (filler length, kind of ID or question)


def _delayed_recall(rng: random.Random, index: int) -> dict[str, Any]:
    sentences = (12, 14, 24, 8)[index % 4]
    name = rng.choice(NAMES)
    if index % 2 == 0:
        city = rng.choice(CITIES)
        fact, question = f"{name} moved to {city} last year.", f"Which city did {name} move to?"
        answer, evidence = city, {"city": f"moved to {city}"}
        distractors = tuple(c for c in CITIES if c != city)
    else:
        answer = _code(rng, 4)
        fact, question = f"The secret code is {answer}.", "What is the secret code?"
        evidence, distractors = {"code": f"code is {answer}"}, ()
    prompt = f"{fact}\n{_filler(rng, TOWN, sentences)}\n{question}"
    return dict(prompt=prompt, evidence=evidence, expected=answer, required=(answer,), distractors=distractors)


def _multi_fact(rng: random.Random, index: int) -> dict[str, Any]:
    sentences = (10, 10, 14, 20)[index % 4]
    a, b = rng.sample(NAMES, 2)
    if index % 2 == 0:
        ca, cb = rng.sample(CITIES, 2)
        facts, question = f"{a} lives in {ca}. {b} lives in {cb}.", f"Which cities do {a} and {b} live in?"
        required = (ca, cb)
        evidence = {f"city_{a.lower()}": f"{a} lives in {ca}", f"city_{b.lower()}": f"{b} lives in {cb}"}
        distractors = tuple(c for c in CITIES if c not in required)
    else:
        city, job = rng.choice(CITIES), rng.choice(JOBS)
        facts = f"{a} lives in {city} and works as a {job}."
        question = f"Where does {a} live, and what is {a}'s job?"
        required = (city, job)
        evidence = {"city": f"lives in {city}", "job": f"works as a {job}"}
        distractors = tuple(c for c in CITIES if c != city) + tuple(j for j in JOBS if j != job)
    prompt = f"{facts}\n{_filler(rng, TOWN, sentences)}\n{question}"
    return dict(
        prompt=prompt, evidence=evidence, expected=" and ".join(required), required=required, distractors=distractors
    )


def _topic_switch(rng: random.Random, index: int) -> dict[str, Any]:
    name, city = rng.choice(NAMES), rng.choice(CITIES)
    sentences = (10, 14, 16, 12)[index % 4]
    if index % 4 != 1:
        notes = f"{name} is travelling to {city} next week. Before leaving, {name} cooks a soup."
    else:
        notes = f"Trip notes: {name} is travelling to {city} next week."
    prompt = f"{notes}\n{_filler(rng, COOKING, sentences)}\nWhich city is {name} travelling to?"
    return dict(
        prompt=prompt,
        evidence={"destination": f"travelling to {city}"},
        expected=city,
        required=(city,),
        distractors=tuple(c for c in CITIES if c != city),
    )


def _long_passage(rng: random.Random, index: int) -> dict[str, Any]:
    people, jobs, cities = rng.sample(NAMES, 3), rng.sample(JOBS, 3), rng.sample(CITIES, 3)
    per_person = (5, 6, 4, 4)[index % 4]
    filler = _sentences(rng, TOWN, 3 * per_person)
    passage = "\n".join(
        f"{p} is a {j} from {c}. " + " ".join(filler[k * per_person : (k + 1) * per_person])
        for k, (p, j, c) in enumerate(zip(people, jobs, cities))
    )
    k = 1 if index % 4 == 2 else 0  # the person asked about: the first, or the second
    who = people[k]
    if index % 4 in (0, 3):
        question, answer = f"Where is {who} from?", cities[k]
        distractors, evidence = tuple(c for c in cities if c != answer), {"origin": f"from {answer}"}
    else:
        question, answer = f"What is {who}'s job?", jobs[k]
        distractors, evidence = tuple(j for j in jobs if j != answer), {"job": f"{who} is a {answer}"}
    return dict(
        prompt=f"{passage}\n{question}", evidence=evidence, expected=answer, required=(answer,), distractors=distractors
    )


_BUILDERS: dict[str, Callable[[random.Random, int], dict[str, Any]]] = {
    "delayed_recall": _delayed_recall,
    "multi_fact": _multi_fact,
    "topic_switch": _topic_switch,
    "long_passage": _long_passage,
}
KINDS: tuple[str, ...] = tuple(_BUILDERS)

#: instances per kind in each suite size
SIZES: dict[str, int] = {"small": 1, "demo": 2, "full": 4}
_MAX_NEW = {"delayed_recall": 12, "multi_fact": 16, "topic_switch": 12, "long_passage": 12}


def _build(kind: str, index: int, seed: int) -> Task:
    rng = random.Random(seed * 10_007 + KINDS.index(kind) * 101 + index)
    fields = _BUILDERS[kind](rng, index)
    return Task(name=f"{kind}_{index}", kind=kind, max_new_tokens=_MAX_NEW[kind], seed=seed, **fields)


def suite(seed: int = 0, size: str = "demo") -> list[Task]:
    """The task instances of one suite, in a fixed order (kind, then index).

    Parameters
    ----------
    seed : int
        Same seed, same prompts.
    size : {"small", "demo", "full"}
        Instances per kind (see :data:`SIZES`); a smaller suite is a prefix of
        a larger one kind by kind, so names stay stable.
    """
    if size not in SIZES:
        raise ValueError(f"unknown suite size {size!r}; expected one of {', '.join(SIZES)}")
    return [_build(kind, i, seed) for kind in KINDS for i in range(SIZES[size])]


def get_task(name: str, seed: int = 0) -> Task:
    """The task instance ``<kind>_<index>`` (e.g. ``"multi_fact_1"``) of seed ``seed``."""
    kind, _, index = name.rpartition("_")
    if kind not in _BUILDERS or not index.isdigit():
        raise KeyError(
            f"unknown task {name!r}; expected <kind>_<index> with kind one of {', '.join(KINDS)}, e.g. {KINDS[0]}_0"
        )
    return _build(kind, int(index), seed)


# ------------------------------------------------------------------------------- calibration


@dataclass
class CalibrationRow:
    """One task of a calibration: prompt tokens and ``{column: (correct, answer)}``."""

    task: str
    prompt_len: int
    results: dict[str, tuple[bool, str]] = field(default_factory=dict)


def budget(policy: str, ratio: float, prompt_len: int) -> H2OConfig:
    """The config of ``policy`` at keep ratio ``ratio`` of a ``prompt_len``-token prompt.

    The slots of the keep ratio, halved into heavy and recent (DESIGN.md §2.7,
    :func:`h2o_lens.policies.ratio_slots`): every policy gets the same slot count
    (baselines re-split it, see :attr:`H2OConfig.split`).
    """
    heavy, recent = half_split(ratio_slots(ratio, prompt_len))
    return H2OConfig(policy=policy, heavy=heavy, recent=recent)


def _answer(model: Any, tokenizer: Any, task: Task, config: H2OConfig | None) -> tuple[int, str]:
    """Greedy answer of ``model`` to ``task`` (full cache when ``config`` is None)."""
    import contextlib

    import torch

    from ..runtime import h2o

    enc = tokenizer(
        task.chat_text(tokenizer), return_tensors="pt", add_special_tokens=False, return_token_type_ids=False
    )
    p = enc["input_ids"].shape[1]
    with torch.no_grad(), h2o(model, config) if config is not None else contextlib.nullcontext():
        ids = model.generate(
            **enc, max_new_tokens=task.max_new_tokens, do_sample=False, pad_token_id=tokenizer.pad_token_id
        )
    return p, tokenizer.decode(ids[0, p:], skip_special_tokens=True)


def calibrate(
    tasks: Sequence[Task] | None = None,
    *,
    model: Any = None,
    tokenizer: Any = None,
    ratios: Sequence[float] = (0.2, 0.1),
    policies: Sequence[str] = (DEFAULT, "local"),
    out: Callable[[str], Any] = print,
) -> list[CalibrationRow]:
    """Answer every task with the full cache and each policy at each keep ratio; print a table.

    Budgets come from :func:`budget` (same slot count for every policy);
    greedy decoding with each task's ``max_new_tokens``. Loads the default
    model unless ``model`` and ``tokenizer`` are given; ``tasks`` defaults to
    the ``demo`` suite of seed 0. Command::

        python -c "from h2o_lens.tasks import calibrate; calibrate()"

    Returns
    -------
    list of :class:`CalibrationRow`, one per task.
    """
    from ..models import load_model

    if model is None or tokenizer is None:
        model, tokenizer = load_model(progress=False)
    tasks = list(tasks) if tasks is not None else suite()
    columns = [("full", None, 0.0)] + [(f"{p} {round(r * 100)}%", p, r) for r in ratios for p in policies]
    out(f"{'task':<18} {'P':>4}  " + "  ".join(f"{c:>9}" for c, _, _ in columns))
    rows = []
    t0 = time.perf_counter()
    for task in tasks:
        row = CalibrationRow(
            task.name, len(tokenizer(task.chat_text(tokenizer), add_special_tokens=False)["input_ids"])
        )
        for label, policy, ratio in columns:
            config = budget(policy, ratio, row.prompt_len) if policy else None
            _, answer = _answer(model, tokenizer, task, config)
            row.results[label] = (task.check(answer), answer)
        rows.append(row)
        out(
            f"{task.name:<18} {row.prompt_len:>4}  "
            + "  ".join(f"{'ok' if row.results[c][0] else 'FAIL':>9}" for c, _, _ in columns)
        )
    totals = [sum(r.results[c][0] for r in rows) for c, _, _ in columns]
    out(f"{'correct':<18} {'':>4}  " + "  ".join(f"{f'{n}/{len(rows)}':>9}" for n in totals))
    out(f"({time.perf_counter() - t0:.0f} s)")
    return rows
