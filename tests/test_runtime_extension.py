"""The cache's one extension point (DESIGN.md §1.1): what a :class:`~h2o_lens.extension.CacheExtension`
hears, that it changes nothing it does not ask for, that no class outside ``h2o_lens/cache.py``
overrides a private method of the cache layer, and the policy extension of DESIGN.md §1.1, run
from the document itself."""

from __future__ import annotations

import ast
import re
import sys
import threading
import types
from pathlib import Path

import pytest
import torch
from runtime_utils import KeptRecorder
from tiny import tiny_model

import h2o_lens
from h2o_lens import H2OConfig
from h2o_lens.cache import H2OCache, H2OCacheLayer
from h2o_lens.errors import ConfigError
from h2o_lens.extension import CacheExtension, ListenerExtension, StepNeeds, current_extensions, use_extensions
from h2o_lens.guard import grow_rows

ROOT = Path(__file__).resolve().parents[1]
TEXT = types.SimpleNamespace(num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2)


# -- no private overrides -------------------------------------------------------------------------


def _private(name: str) -> bool:
    """A private name: one leading underscore (a ``__dunder__`` is Python's protocol, not the cache's)."""
    return name.startswith("_") and not (name.startswith("__") and name.endswith("__"))


def private_overrides(sources: dict[str, str]) -> list[str]:
    """``path:line Class.method`` for each method with a private name defined in a class that
    derives (by name, through any chain of classes in ``sources``) from ``H2OCacheLayer``, outside
    ``h2o_lens/cache.py``."""
    classes: dict[str, list[tuple[str, ast.ClassDef]]] = {}
    for path, text in sources.items():
        for node in ast.walk(ast.parse(text)):
            if isinstance(node, ast.ClassDef):
                classes.setdefault(node.name, []).append((path, node))

    def base_names(node: ast.ClassDef) -> set[str]:
        named = [b for b in node.bases if isinstance(b, ast.Name | ast.Attribute)]
        return {b.id if isinstance(b, ast.Name) else b.attr for b in named}

    layer_like = {"H2OCacheLayer"}
    grown = True
    while grown:
        grown = False
        for name, defs in classes.items():
            if name not in layer_like and any(base_names(node) & layer_like for _, node in defs):
                layer_like.add(name)
                grown = True
    found = []
    for name, defs in classes.items():
        for path, node in defs:
            if path == "h2o_lens/cache.py" or not base_names(node) & layer_like:
                continue
            for item in node.body:
                if isinstance(item, ast.FunctionDef | ast.AsyncFunctionDef) and _private(item.name):
                    found.append(f"{path}:{item.lineno} {name}.{item.name}")
    return found


def _repository_sources() -> dict[str, str]:
    out = {}
    for folder in ("h2o_lens", "recorders", "runlog", "analyses", "app", "commands", "tests"):
        for path in sorted((ROOT / folder).rglob("*.py")):
            out[path.relative_to(ROOT).as_posix()] = path.read_text(encoding="utf-8")
    return out


def test_no_class_outside_the_cache_module_overrides_a_private_method_of_the_layer():
    """Every module of the packages and the tests (tests/faulty.py's FaultyLayer,
    test_runtime_speculative's ``_Watched`` among them) is read: a subclass of the cache layer
    may override its public verbs, never a ``_`` method."""
    sources = _repository_sources()
    assert "tests/faulty.py" in sources and "h2o_lens/guard.py" in sources
    assert private_overrides(sources) == []


def test_the_private_override_check_can_fail():
    """The check finds a private override through a chain of subclasses and an attribute base."""
    code = (
        "import h2o_lens.cache as c\n"
        "class A(c.H2OCacheLayer):\n    def reset(self): ...\n"
        "class B(A):\n    def _step(self, *a): ...\n    def __repr__(self): ...\n"
        "class C:\n    def _step(self): ...\n"
    )
    assert private_overrides({"x/mod.py": code}) == ["x/mod.py:5 B._step"]
    assert private_overrides({"h2o_lens/cache.py": code.replace("c.H2OCacheLayer", "object")}) == []


def test_the_loaded_subclasses_of_the_layer_override_no_private_method():
    """The same at run time, over the subclasses Python knows after importing the tests' helpers
    (``faulty_layer`` builds its classes with ``type``)."""
    import faulty
    import test_runtime_speculative  # noqa: F401  (defines _Watched)

    faulty.faulty_layer("scores_not_rolled_back", "prefix_without_copy")
    seen, todo = [], [H2OCacheLayer]
    while todo:
        for sub in todo.pop().__subclasses__():
            seen.append(sub)
            todo.append(sub)
    assert {c.__name__ for c in seen} >= {"FaultyLayer", "_Watched"}
    bad = [f"{c.__qualname__}.{n}" for c in seen for n in vars(c) if _private(n) and callable(vars(c)[n])]
    assert bad == []


# -- the events -------------------------------------------------------------------------------------


class Log(CacheExtension):
    """Notes every event it hears, by name and layer."""

    hears_decode = True

    def __init__(self, cache=None):
        self.cache, self.seen = cache, []

    def _note(self, name, layer):
        self.seen.append((name, getattr(layer, "layer_idx", None)))

    def prompt_chosen(self, layer, choice):
        assert choice.keep.shape == choice.positions.shape and choice.scaling is not None
        self._note("prompt_chosen", layer)
        return False

    def on_prefill(self, layer, event):
        self._note("on_prefill", layer)

    def on_decode(self, layer, event):
        self._note("on_decode", layer)

    def step_taken(self, layer, step):
        assert step.event is not None and step.result.slot.shape == step.event.slot.shape
        self._note("step_taken", layer)

    def rows_moved(self, layer, move, kind):
        self._note(f"rows_moved:{kind}", layer)

    def slots_changed(self, cache, rows, slots, kind):
        self.seen.append((f"slots_changed:{kind}", tuple(rows), tuple(slots)))

    def on_state(self, cache, event):
        self.seen.append((f"on_state:{event['event']}", None))

    def reset(self, layer):
        self._note("reset", layer)


def test_an_extension_hears_each_event_of_the_cache_in_order():
    """Prefill, decode steps, a beam search's reorders, a raise, a cancel and a reset: each reaches
    the extension, per layer, in the order the cache takes them."""
    model = tiny_model("llama", layers=2)
    ids = torch.randint(3, 250, (2, 12), generator=torch.Generator().manual_seed(1))
    with use_extensions(Log), h2o_lens.h2o(model, H2OConfig(heavy=4, recent=2)) as session, torch.no_grad():
        model.generate(ids, max_new_tokens=4, do_sample=False, num_beams=2, pad_token_id=0)
    cache = session.last_cache
    (log,) = cache.extensions
    prefill = [("prompt_chosen", 0), ("on_prefill", 0), ("prompt_chosen", 1), ("on_prefill", 1)]
    reorder = [("rows_moved:reorder", 0), ("rows_moved:reorder", 1), ("on_state:reorder", None)]
    step = [("on_decode", 0), ("step_taken", 0), ("on_decode", 1), ("step_taken", 1)]
    assert log.seen == prefill + reorder + (step + reorder) * 3  # 4 tokens: the prefill's and 3 decode steps
    log.seen.clear()
    grow_rows(cache, [1], [9])
    cache.cancel([0])
    assert log.seen[0] == ("on_state:raise", None) and log.seen[1] == ("slots_changed:raise", (1,), (9,))
    assert [n for n, _ in log.seen[2:]] == ["rows_moved:select", "rows_moved:select", "on_state:cancel"]
    cache.layers[0].reset()
    assert log.seen[-1] == ("reset", 0)


def test_an_extension_that_asks_for_candidates_changes_no_kept_set():
    """The torch step with its candidate set and journal keeps the same positions as without:
    an extension that only asks changes nothing (tokens and every layer's kept sets)."""

    class Asks(CacheExtension):
        def __init__(self, cache):
            self.steps = 0

        def step_needs(self, layer):
            return StepNeeds(candidates=True, journal=True)

        def step_taken(self, layer, step):
            assert step.result.cand_scores is not None and step.result.old_key is not None
            self.steps += 1

    model = tiny_model("llama", layers=2)
    ids = torch.randint(3, 250, (2, 14), generator=torch.Generator().manual_seed(2))
    runs = []
    for factories in ((), (Asks,)):
        rec = KeptRecorder()
        with use_extensions(*factories), h2o_lens.h2o(model, H2OConfig(heavy=4, recent=3), listener=rec) as s:
            with torch.no_grad():
                out = model.generate(ids, max_new_tokens=6, do_sample=False, pad_token_id=0)
        runs.append((out, rec.kept, s.last_cache))
    assert torch.equal(runs[0][0], runs[1][0]) and runs[0][1] == runs[1][1]
    assert runs[1][2].extensions[-1].steps == 2 * 5
    assert isinstance(runs[0][2].extensions[0], ListenerExtension) and len(runs[0][2].extensions) == 1


def test_the_block_is_undone_and_stays_in_its_thread_and_bad_extensions_are_refused():
    with pytest.raises(RuntimeError), use_extensions(Log):
        assert len(H2OCache(H2OConfig(heavy=4, recent=2), TEXT).extensions) == 1
        raise RuntimeError("boom")
    assert current_extensions() == () and H2OCache(H2OConfig(heavy=4, recent=2), TEXT).extensions == ()
    seen = []
    with use_extensions(Log):
        thread = threading.Thread(target=lambda: seen.append(current_extensions()))
        thread.start()
        thread.join()
        # an explicit sequence replaces the block's factories
        assert H2OCache(H2OConfig(heavy=4, recent=2), TEXT, extensions=()).extensions == ()
    assert seen == [()]
    with pytest.raises(ConfigError, match="takes callables"), use_extensions(Log()):
        pass
    with pytest.raises(ConfigError, match="is not a CacheExtension"), use_extensions(lambda cache: object()):
        H2OCache(H2OConfig(heavy=4, recent=2), TEXT)


# -- the example of DESIGN.md §1.1 ------------------------------------------------------------------


def design_example() -> types.ModuleType:
    """The policy extension of DESIGN.md §1.1: the Python block after its marker, run as a module."""
    text = (ROOT / "docs" / "DESIGN.md").read_text(encoding="utf-8")
    block = re.search(r"<!-- extension-example -->\n```python\n(.*?)```", text, re.S)
    assert block, "DESIGN.md §1.1 lost its example"
    code = block.group(1)
    assert 15 <= len(code.strip().splitlines()) <= 30
    module = types.ModuleType("design_example")
    exec(compile(code, "DESIGN.md §1.1", "exec"), module.__dict__)  # noqa: S102 - our own document
    sys.modules.pop("design_example", None)
    return module


def test_the_design_documents_extension_runs_and_raises_rows():
    """Never close (``share`` infinite): the plain run, token for token and kept set for kept set.
    Every eviction close (``share`` 0): both rows get 8 more slots after the first evicting step,
    once, and the raise reaches the listener as a state event."""
    close_call = design_example().CloseCall
    model = tiny_model("llama", layers=2)
    ids = torch.randint(3, 250, (2, 14), generator=torch.Generator().manual_seed(3))
    cfg = H2OConfig(heavy=4, recent=3)
    runs = []
    for share in (None, float("inf"), 0.0):
        rec = KeptRecorder()
        rec.states = []
        rec.on_state = lambda cache, event, rec=rec: rec.states.append(event["event"])
        factories = () if share is None else (lambda cache, share=share: close_call(cache, share=share),)
        with use_extensions(*factories), h2o_lens.h2o(model, cfg, listener=rec) as session, torch.no_grad():
            out = model.generate(ids, max_new_tokens=6, do_sample=False, pad_token_id=0)
        runs.append((out, rec, session.last_cache))
    assert torch.equal(runs[0][0], runs[1][0]) and runs[0][1].kept == runs[1][1].kept
    _, rec, cache = runs[2]
    assert cache.extensions[-1].raised == {0, 1} and rec.states == ["raise"]
    assert [c.capacity for c in cache.request_configs] == [7 + 8, 7 + 8]


def test_the_lifecycle_check_refuses_to_run_where_new_caches_get_extensions(tmp_path):
    """Its re-run must be the plain runtime: inside a guarded (or any use_extensions) block the
    check refuses in one sentence before it reads anything."""
    from h2o_lens.guard import GuardConfig, guarded
    from recorders.lifecycle import check_lifecycle
    from runlog.errors import RecorderError

    for scope in (use_extensions(Log), guarded(GuardConfig())):
        with scope, pytest.raises(RecorderError, match="get extensions .* outside that block"):
            check_lifecycle(tmp_path / "no_run")
