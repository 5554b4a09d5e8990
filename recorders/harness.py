"""EleutherAI's lm-evaluation-harness driving a model under a policy, every request recorded
(DESIGN.md §20.1).

:class:`LensLM` is an lm-eval ``LM``: lm-eval builds the requests of its tasks and scores the
answers; the model answers each ``generate_until`` request under one policy (``full``, a
registered policy at a keep ratio, or a kvpress press) with the recorder on, so that each request
is one run under a runs root (``<task>-<doc>``), replayed against the full-cache teacher, with
lm-eval's own per-request metric as its verdict (``requests.correct``; the metric's name and
value in the manifest's ``lm_eval`` field). Loglikelihood requests are scored with one forward
of the prompt and its continuation: no token is generated, so no policy can evict anything
there (:data:`NO_EVICTION`).

lm-eval is an optional extra (``pip install 'h2o-lens[eval]'``) imported with this module; the
model name ``h2o-lens`` is registered with lm-eval on import, so that
``lm_eval.simple_evaluate(model="h2o-lens", model_args={...})`` works as well.
"""

from __future__ import annotations

import contextlib
import copy
import re
import time
from collections.abc import Iterator, Mapping, Sequence
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F

from h2o_lens.config import H2OConfig
from h2o_lens.errors import ConfigError

try:
    import lm_eval
    import lm_eval.models  # lm-eval's own models first: its registry loads them only while it is empty
    from lm_eval.api.model import TemplateLM
    from lm_eval.api.registry import register_model
except ImportError as exc:  # pragma: no cover - the message is the point
    raise ConfigError(f"lm-eval is not installed ({exc}); pip install 'h2o-lens[eval]'") from None

__all__ = ["LensLM", "NO_EVICTION", "policy_config", "run_name", "task_manager", "verdict_of"]

#: lm-eval request types scored with one forward (no generation, so nothing is evicted)
NO_EVICTION = ("loglikelihood", "loglikelihood_rolling", "multiple_choice")


def policy_config(policy: str, ratio: float | None, gqa: str = "sum") -> Any:
    """The configuration a cell records with: the full cache (``full``, or any policy at keep
    ratio 1), an :class:`H2OConfig` at ``ratio``, or a kvpress press's spec at
    ``compression_ratio = 1 - ratio``."""
    from h2o_lens import policies, presses

    if ratio is None or ratio >= 1.0:
        return H2OConfig(policy=policies.FULL_CACHE)
    if presses.is_press_policy(policy):
        return presses.sweep_spec(policy, float(ratio))
    if not policies.get(policy).evicts:
        return H2OConfig(policy=policies.FULL_CACHE)
    return H2OConfig(policy=policy, ratio=float(ratio), gqa=gqa)


def run_name(task: str, doc_id: int) -> str:
    """The run folder of one request: ``<task>-<doc id>``, the task name made safe for a path."""
    return f"{re.sub(r'[^A-Za-z0-9_.]+', '_', task)}-{int(doc_id)}"


def verdict_of(value: Any, threshold: float = 0.5) -> bool | None:
    """``correct`` from a per-request metric value: a 0/1 metric (exact match, accuracy) is
    correct at 1; any other number at ``threshold`` or above; anything else has no verdict."""
    if isinstance(value, bool):
        return value
    if isinstance(value, int | float):
        return float(value) >= 1.0 if float(value) in (0.0, 1.0) else float(value) >= threshold
    return None


@register_model("h2o-lens")
class LensLM(TemplateLM):
    """An lm-eval model: the wrapped model under one policy, each generation recorded.

    Parameters
    ----------
    pretrained : model folder or id for :func:`h2o_lens.models.load_model` (when ``model`` is not given)
    model, tokenizer : an already loaded model and tokenizer
    policy, ratio, gqa : the policy (``full``, a registered name, ``kvpress:NAME``) and its keep ratio
    out : the runs root; each ``generate_until`` request is the run ``<task>-<doc id>`` there
    record : record the generations (off: the same generation without a recorder, to time it)
    replay : replay each recorded run against the full-cache teacher
    include_path : folder of local lm-eval YAML tasks (for the per-request verdicts)
    threshold : the value from which a metric that is not 0/1 counts as correct
    max_length : context of the model (default: its configuration's)

    Attributes
    ----------
    rows : one dict per generated request: task, doc_id, run_id, metric, value, correct, reused
    """

    def __init__(
        self,
        pretrained: str | None = None,
        *,
        model: Any = None,
        tokenizer: Any = None,
        policy: str = "full",
        ratio: float | None = None,
        gqa: str = "sum",
        out: str = "eval_runs",
        record: bool = True,
        replay: bool = True,
        include_path: str | None = None,
        threshold: float = 0.5,
        max_length: int | None = None,
        batch_size: int | str = 1,
        **_: Any,
    ) -> None:
        super().__init__()
        if model is None:
            from h2o_lens.models import load_model

            model, tokenizer = load_model(pretrained, progress=False)
        self.model, self.tokenizer = model, tokenizer
        self.config = policy_config(policy, None if ratio is None else float(ratio), gqa)
        self.out, self.record, self.replay = str(out), bool(record), bool(replay)
        self.include_path, self.threshold = include_path, float(threshold)
        self._max_length = max_length
        self._tasks: dict[str, Any] = {}
        self.rows: list[dict[str, Any]] = []
        self.seconds = {"generate": 0.0, "replay": 0.0}

    # ------------------------------------------------------------------ tokens, as lm-eval's HF model

    @property
    def eot_token_id(self) -> int:
        return self.tokenizer.eos_token_id

    @property
    def prefix_token_id(self) -> int:
        bos = self.tokenizer.bos_token_id
        return bos if bos is not None else self.eot_token_id

    @property
    def max_length(self) -> int:
        if self._max_length:
            return int(self._max_length)
        for attr in ("n_positions", "max_position_embeddings", "n_ctx"):
            if hasattr(self.model.config, attr):
                return int(getattr(self.model.config, attr))
        return 2048

    @property
    def device(self) -> torch.device:
        return next(self.model.parameters()).device

    def tok_encode(self, string: str, left_truncate_len: int | None = None, add_special_tokens: bool | None = None):
        ids = self.tokenizer.encode(string, add_special_tokens=bool(add_special_tokens))
        return ids[-left_truncate_len:] if left_truncate_len else ids

    def tok_decode(self, tokens: Any, skip_special_tokens: bool = True) -> str:
        return self.tokenizer.decode(tokens, skip_special_tokens=skip_special_tokens)

    # ------------------------------------------------------------------ one forward: no eviction

    def _loglikelihood_tokens(self, requests, disable_tqdm: bool = False, override_bs=None):
        out = []
        for _, context_enc, continuation_enc in requests:
            ids = (context_enc + continuation_enc)[-(self.max_length + 1) :][:-1]
            with torch.no_grad():
                logits = self.model(torch.tensor([ids], device=self.device)).logits[0]
            logp = F.log_softmax(logits[-len(continuation_enc) :].float(), dim=-1)  # (C, V)
            target = torch.tensor(continuation_enc, device=self.device)
            greedy = bool((logp.argmax(dim=-1) == target).all())
            out.append((float(logp.gather(1, target[:, None]).sum()), greedy))
        return out

    def loglikelihood_rolling(self, requests, disable_tqdm: bool = False) -> list[float]:
        from lm_eval.utils import get_rolling_token_windows, make_disjoint_window

        out = []
        for req in requests:
            (string,) = req.args
            windows = [
                make_disjoint_window(w)
                for w in get_rolling_token_windows(
                    token_list=self.tok_encode(string),
                    prefix_token=self.prefix_token_id,
                    max_seq_len=self.max_length,
                    context_len=1,
                )
            ]
            scores = self._loglikelihood_tokens([(None, c, t) for c, t in windows])
            out.append(sum(s for s, _ in scores))
        return out

    # ------------------------------------------------------------------ generation, recorded

    def generate_until(self, requests, disable_tqdm: bool = False) -> list[str]:
        return [self._generate_one(req) for req in requests]

    def _task(self, name: str) -> Any:
        """lm-eval's task object of ``name`` (its filters and ``process_results`` score a request)."""
        if name not in self._tasks:
            manager = task_manager(self.include_path)
            if hasattr(manager, "load"):  # lm-eval 0.4.10 and later
                self._tasks[name] = manager.load([name])["tasks"][name]
            else:
                from lm_eval.tasks import get_task_dict

                self._tasks[name] = next(t for k, t in _leaves(get_task_dict([name], manager)) if k == name)
        return self._tasks[name]

    def _score(self, req: Any, text: str) -> tuple[str | None, Any, str]:
        """lm-eval's metric of one answer, as its evaluator computes it: the task's first filter
        over the answer, then ``process_results``; and the target shown as expected."""
        task = self._task(req.task_name)
        inst = copy.copy(req)
        inst.resps, inst.filtered_resps = [text], {}
        filters = getattr(task, "_filters", [])
        for ensemble in filters[:1]:
            ensemble.apply([inst])
        resp = inst.filtered_resps[filters[0].name] if filters else text
        metrics = task.process_results(req.doc, [resp])
        name = next(iter(metrics), None)
        return name, metrics.get(name) if name else None, str(task.doc_to_target(req.doc))

    def _encode(self, context: str, kwargs: Mapping[str, Any]) -> tuple[torch.Tensor, int, list[str]]:
        if kwargs.get("do_sample"):
            raise ConfigError("h2o-lens eval generates greedily; the task asks do_sample: true")
        until = kwargs.get("until") or []
        until = [until] if isinstance(until, str) else list(until)
        eos = self.tok_decode(self.eot_token_id, skip_special_tokens=False)
        until += [] if eos in until else [eos]
        new = int(kwargs.get("max_gen_toks", 256))
        ids = self.tok_encode(context, left_truncate_len=self.max_length - new)
        return torch.tensor([ids], device=self.device), new, until

    def _generate_one(self, req: Any) -> str:
        context, kwargs = req.args
        input_ids, new, until = self._encode(context, dict(kwargs))
        run_id = run_name(req.task_name, req.doc_id)
        reused = self._reuse(run_id)
        t0 = time.perf_counter()
        if reused is not None:
            text = reused
        elif not self.record:
            text = self._plain(input_ids, new)
        else:
            text = self._recorded(req, input_ids, new, until, run_id)
        self.seconds["generate"] += time.perf_counter() - t0
        for term in until:
            if term:
                text = text.split(term)[0]
        if reused is not None or not self.record:
            metric, value, _ = self._score(req, text)
            self.rows.append(self._row(req, run_id if self.record else None, metric, value, reused is not None))
        return text

    def _row(self, req: Any, run_id: str | None, metric: Any, value: Any, reused: bool) -> dict[str, Any]:
        return {
            "task": req.task_name,
            "doc_id": int(req.doc_id),
            "run_id": run_id,
            "metric": metric,
            "value": value,
            "correct": verdict_of(value, self.threshold),
            "reused": reused,
        }

    def _generate_kwargs(self, input_ids: torch.Tensor, new: int) -> dict[str, Any]:
        return {
            "input_ids": input_ids,
            "attention_mask": torch.ones_like(input_ids),
            "max_new_tokens": new,
            "do_sample": False,
            "pad_token_id": self.tokenizer.pad_token_id
            if self.tokenizer.pad_token_id is not None
            else self.eot_token_id,
        }

    def _plain(self, input_ids: torch.Tensor, new: int) -> str:
        """The same generation under the policy with no recorder (what recording adds is timed against it)."""
        with torch.no_grad(), _policy_scope(self.model, self.config):
            out = self.model.generate(**self._generate_kwargs(input_ids, new))
        return self.tok_decode(out[0, input_ids.shape[1] :])

    def _recorded(self, req: Any, input_ids: torch.Tensor, new: int, until: Sequence[str], run_id: str) -> str:
        from h2o_lens.presses import PressSpec

        from .recorder import record
        from .replay import replay as replay_run

        got: dict[str, Any] = {}

        def annotate(request: int, answer: str | None) -> dict[str, Any]:
            return {"task": req.task_name, "expected": got["expected"], "correct": got["correct"]}

        pressed = isinstance(self.config, PressSpec)
        info = {
            "task": f"{req.task_name}/{req.doc_id}",
            "decoding": {"do_sample": False, "max_new_tokens": new},
        }
        with (
            torch.no_grad(),
            record(
                self.model,
                self.config,
                out=self.out,
                tokenizer=self.tokenizer,
                name=run_id,
                run_id=run_id,
                info=info,
                annotate=annotate,
                keep_prompt_pass=self.replay and not pressed,
            ) as run,
        ):
            out = self.model.generate(**self._generate_kwargs(input_ids, new))
            raw = self.tok_decode(out[0, input_ids.shape[1] :])
            text = raw
            for term in until:
                if term:
                    text = text.split(term)[0]
            metric, value, got["expected"] = self._score(req, text)
            got["correct"] = verdict_of(value, self.threshold)
            run.writer.update(
                lm_eval={
                    "task": req.task_name,
                    "doc_id": int(req.doc_id),
                    "metric": metric,
                    "value": _plain_value(value),
                    "response": raw,
                    "filtered": text,
                    "until": list(until),
                }
            )
        if self.replay:
            t0 = time.perf_counter()
            replay_run(run.run_dir, model=self.model, progress=False, prompt_passes=run.prompt_passes)
            self.seconds["replay"] += time.perf_counter() - t0
        self.rows.append(self._row(req, run_id, metric, value, False))
        return raw

    def _reuse(self, run_id: str) -> str | None:
        """The raw answer of a complete (and, when replays are on, replayed) run of this request
        from an earlier invocation; an incomplete one is removed, to be recorded again."""
        if not self.record:
            return None
        from runlog import read_manifest
        from runlog.catalog import replay_complete

        run_dir = Path(self.out) / run_id
        if not run_dir.exists():
            return None
        try:
            manifest = read_manifest(run_dir)
        except Exception:
            manifest = {}
        done = manifest.get("status") == "complete" and "lm_eval" in manifest
        if done and (not self.replay or replay_complete(run_dir)):
            return str(manifest["lm_eval"]["response"])
        from runlog.ownership import remove_run

        remove_run(run_dir)  # a run of its own only: anything else in the way is refused (DESIGN.md §5.1)
        return None


_MANAGERS: dict[str | None, Any] = {}


def task_manager(include_path: str | None) -> Any:
    """lm-eval's task index with ``include_path`` (built once per folder: it reads every task's YAML)."""
    if include_path not in _MANAGERS:
        from lm_eval.tasks import TaskManager

        _MANAGERS[include_path] = TaskManager(include_path=include_path)
    return _MANAGERS[include_path]


def _plain_value(value: Any) -> Any:
    if isinstance(value, bool | int | float | str) or value is None:
        return value
    if isinstance(value, torch.Tensor) and value.numel() == 1:
        return value.item()
    return repr(value)


def _leaves(tree: Mapping[Any, Any]) -> Iterator[tuple[str, Any]]:
    """The (name, task) leaves of lm-eval's task dictionary (groups are nested dictionaries)."""
    for key, value in tree.items():
        if isinstance(value, Mapping):
            yield from _leaves(value)
        else:
            yield str(getattr(key, "group_name", key)), value


@contextlib.contextmanager
def _policy_scope(model: Any, config: Any) -> Iterator[None]:
    """The model under ``config`` without a recorder: the H2O runtime, or the press around generate."""
    from h2o_lens.presses import PressSpec

    if isinstance(config, PressSpec):
        from .press import build_press

        with build_press(config)(model):
            yield
        return
    from h2o_lens.runtime import h2o

    if not config.spec.evicts:
        yield
        return
    with h2o(model, config):
        yield


_ = lm_eval  # imported for its registry (the model name above) and its version in the cell files
