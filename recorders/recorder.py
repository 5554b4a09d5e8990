"""The eviction recorder: wrap any ``model.generate(...)`` and log every eviction.

>>> with recorders.record(model, H2OConfig(heavy=64, recent=64), out="runs",
...                      tokenizer=tok, evidence={"code": "4419"}) as run:
...     model.generate(**inputs, max_new_tokens=64)
>>> run.run_id, run.status

What is logged is what each returned sequence really went through:

* the prompt is the tokens generate attended to: its ``attention_mask``, or
  the mask generate inferred from ``pad_token_id`` when none was given (the
  mask of the prefill forward is captured, so the two cannot differ);
* one request per returned sequence: with ``num_return_sequences = n`` the
  prompt ``i`` of a call gives the requests of rows ``i·n .. i·n + n - 1``
  (``requests.prompt_index`` / ``requests.sample_index`` map them back);
* a sequence ends at its first EOS (included): the padding generate appends
  while other rows continue is not generated text, and the decode steps that
  fed the EOS or padding are not logged (no eviction or steps rows), so the
  log equals that of the sequence generated on its own;
* a ``generate`` call on a cache that already holds requests (restored with
  ``session.restore``, reused after ``cache.cancel`` or a reorder, or prefilled by
  ``session.prefill_shared``) continues those requests: rows map to requests by
  the cache's ``request_ids``, only the new tokens are written, and the manifest's
  ``state_events`` log each save, restore, cancel, reorder and prefix copy
  (DESIGN.md §15); the ``requests`` rows are written when the recording ends;
* beam search, ``stop_strings`` and custom ``stopping_criteria`` are refused:
  beams reorder the cache rows every step and the other criteria end rows
  at points the recorder cannot observe, so their logs would not be exact.

This module imports torch (it listens to the runtime); the rest of
``recorders`` does not, so logs still open without a model.
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import os
from collections.abc import Callable, Iterator, Mapping, Sequence
from typing import Any

import numpy as np
import torch
from transformers import LogitsProcessorList

from h2o_lens import compat
from h2o_lens.config import H2OConfig, pin_positions
from h2o_lens.models import planned_positions, warn_past_context
from h2o_lens.runtime import H2OSession, h2o
from runlog.errors import RecorderError
from runlog.manifest import new_run_id
from runlog.run import RunWriter

from .capture import Pending, StepCapture
from .cold_log import cold_manifest, drop_store, storage_failure, store_in_run, write_recall_rows
from .guard_log import write_guard_rows
from .prompt_pass import PromptPass, PromptSink
from .record_inputs import (
    GenerateWatch,
    StepTimer,
    eos_ids,
    generation_config,
    locate_evidence,
    refuse_inexact,
    token_pieces,
)
from .record_options import EvidenceSpec, RecordOptions

__all__ = ["record", "record_teacher_forced", "Recording", "RecordOptions", "EvidenceSpec", "locate_evidence"]


class Recording(StepCapture):
    """An active recording: a :class:`~h2o_lens.cache.CacheListener` plus the run writer.

    Attributes
    ----------
    run_id, run_dir : the run folder
    status : ``running``, then ``complete`` or ``failed``
    session : the runtime's :class:`~h2o_lens.runtime.H2OSession`
    """

    def __init__(
        self,
        writer: RunWriter,
        config: H2OConfig,
        tokenizer: Any,
        evidence: EvidenceSpec | None,
        prompts: Sequence[str] | None,
        flush_every: int,
        model: Any,
    ):
        self.writer = writer
        self.config = config
        self.tokenizer = tokenizer
        self.evidence = evidence
        self.prompts = prompts
        self.flush_every = flush_every
        self.model = model
        self.session: H2OSession | None = None
        self._pending = Pending()
        self._request_base = 0  # requests recorded by earlier generate calls
        self._raised: dict[int, int] = {}  # request -> slots after a guard's raise (DESIGN.md §18.5)
        self._prompt_base = 0  # prompts of earlier generate calls
        self._watch: GenerateWatch | None = None
        self._ids: list[int] = []  # the request of each row of the events being converted
        self._group = 1
        self._last_layer = 0
        self._segments: dict[int, int] = {}  # request -> verification segments logged so far
        self._segment_no = np.zeros(0, np.int32)  # (b,) the number of the segment ending now
        self._segment_undone = torch.zeros(0, dtype=torch.int64)  # (b,) its undone evictions so far
        self._labels_override: Sequence[str | None] | None = None
        self.annotate: Callable[[int, str | None], Mapping[str, Any]] | None = None
        self.step_times: list[float] = []  # wall-clock seconds of each decode step
        self.prefill_seconds: list[float] = []
        self.prompts_reused = 0  # generate calls that started from a reused prompt forward (DESIGN.md §12.5)
        #: the guard's own seconds, its refills' seconds and the steps it scored (DESIGN.md §18.5)
        self.guard_cost: list[float] | None = None
        self.prompt_len = 0
        self.new_tokens = 0
        self.requests = 0
        self.generations = 0
        self.budgets: list[H2OConfig] = []  # the budget of each request, resolved on its own prompt
        self._reqs: dict[int, dict[str, Any]] = {}  # request -> tokens written so far and its requests row
        self.state_events: list[dict[str, Any]] = []  # saves, restores, cancels, reorders, prefix copies
        #: request -> its prompt pass, for the replay (``record(..., keep_prompt_pass=True)``, DESIGN.md §6.1)
        self.prompt_passes: dict[int, PromptPass] | None = None
        self._prompt_sink: PromptSink | None = None
        #: each multi-row prefill a replay can forward again as one batch (DESIGN.md §6.1)
        self.prefill_batches: list[dict[str, Any]] = []

    @property
    def run_id(self) -> str:
        return self.writer.run_id

    @property
    def run_dir(self):
        return self.writer.run_dir

    @property
    def status(self) -> str | None:
        return self.writer.status

    # -- CacheListener ---------------------------------------------------------
    def _row_ids(self) -> list[int]:
        """The request of each batch row of the current cache (named at its first prefill)."""
        cache = self.session.last_cache
        if cache.request_ids is None:
            cache.request_ids = list(range(self._request_base, self._request_base + cache.batch_size))
        return cache.request_ids

    def on_state(self, cache: Any, event: Mapping[str, Any]) -> None:
        """A state event of the cache (DESIGN.md §15): logged in the manifest's ``state_events``."""
        self.flush()  # pending decode events belong to the rows as they were
        if event.get("event") == "prefix_share":  # new requests: name them and write their prompts
            prompts = event["prompts"]
            cache.request_ids = list(range(self._request_base, self._request_base + len(prompts)))
            for r, prompt in enumerate(prompts):
                request = self._request_base + r
                info = self._new_request(request, list(prompt), self._prompt_base + r, 0)
                pieces = token_pieces(self.tokenizer, prompt) if self.tokenizer is not None else None
                self.writer.append(
                    "tokens",
                    {
                        "request": np.full(len(prompt), request, np.int32),
                        "position": np.arange(len(prompt), dtype=np.int64),
                        "token_id": np.asarray(prompt, dtype=np.int32),
                        "text": pieces,
                        "is_prompt": np.ones(len(prompt), dtype=bool),
                        "evidence": info["labels"],
                    },
                )
                self.prompt_len = max(self.prompt_len, len(prompt))
                self.requests = max(self.requests, request + 1)
            self._request_base += len(prompts)
            self._prompt_base += len(prompts)
            self.generations += 1
            event = {k: v for k, v in event.items() if k != "prompts"}
            event = {**event, "requests": list(cache.request_ids)}
        if event.get("event") == "raise":  # a guard's raise: the request's slot count from here on
            ids = cache.request_ids  # None at a raise at the prefill: the rows are named just after
            requests = [ids[r] if ids is not None else self._request_base + r for r in event["rows"]]
            self._raised.update({req: int(n) for req, n in zip(requests, event["slots"])})
            event = {**event, "requests": requests}
        entry = {k: v for k, v in event.items() if k != "index"}
        if "index" in event and cache.request_ids is not None:
            entry["requests"] = list(cache.request_ids)  # the request of each row after the reorder
        self.state_events.append({"seq": len(self.state_events), **entry})

    # -- generate --------------------------------------------------------------
    def _generate(self, original, *args: Any, **kwargs: Any):
        want_dict = kwargs.get("return_dict_in_generate", False)
        kwargs["return_dict_in_generate"] = True
        want_logits = kwargs.get("output_logits", False)
        kwargs["output_logits"] = True
        input_ids = kwargs.get("input_ids", args[0] if args else None)
        if input_ids is None:
            raise RecorderError("record needs model.generate(input_ids=..., ...) (token ids, not embeddings)")
        gen_config = generation_config(self.model, kwargs)
        refuse_inexact(gen_config, kwargs)
        if self.session is None or not self.config.spec.evicts:  # else the H2O session warns
            warn_past_context(self.model, planned_positions(self.model, input_ids.shape[-1], kwargs), stacklevel=4)
        cache = None
        continued: list[int] | None = None  # the requests a restored or reused cache continues
        if self.session is not None and self.config.spec.evicts:
            cache = compat.cache_from(kwargs) or self.session.new_cache()
            kwargs["cache"] = cache
            self.session.last_cache = cache
            self._last_layer = len(cache.layers) - 1
            continued = cache.request_ids
        ended = None
        if continued is not None:
            if (getattr(gen_config, "num_return_sequences", 1) or 1) > 1 or len(continued) != input_ids.shape[0]:
                raise RecorderError(
                    f"a continued generation must feed one row per request of its cache ({len(continued)} "
                    f"requests {continued}), got {input_ids.shape[0]} rows; pass the sequences so far, "
                    "in the cache's row order, without num_return_sequences"
                )
            ended = torch.tensor([self._reqs.get(q, {}).get("ended", False) for q in continued])
        watch = GenerateWatch(eos_ids(gen_config), ended, input_ids.shape[-1])
        self._pending = Pending()
        timer = StepTimer()
        kwargs["logits_processor"] = LogitsProcessorList([*(kwargs.get("logits_processor") or []), timer])
        timer.start()
        hook = self.model.register_forward_pre_hook(watch, with_kwargs=True)
        self._watch = watch
        head_hook = None
        if cache is not None:
            cache.prompt_reused = False  # set again if this call's prefill is a reused forward
        if cache is not None and continued is None:  # what a replay needs to compute this prefill again
            self._prompt_sink = cache.prompt_sink = PromptSink(keep=self.prompt_passes is not None)
            head_hook = self.model.get_output_embeddings().register_forward_hook(self._prompt_sink.on_head)
        try:
            out = original(*args, **kwargs)
            self.flush()
        finally:
            hook.remove()
            self._watch = None
            if cache is not None:
                cache.prompt_sink = None
            if head_hook is not None:
                head_hook.remove()
        self.step_times.extend(timer.decode_steps())
        if cache is not None and cache.prompt_reused:  # no prefill ran: its time is not a prefill's
            self.prompts_reused += 1
        elif timer.prefill is not None:
            self.prefill_seconds.append(timer.prefill)
        if watch.input_ids is None:
            raise RecorderError("generate ran no forward pass, so there is nothing to record")
        if continued is not None:
            mask = kwargs.get("attention_mask")
            valid = torch.ones_like(input_ids, dtype=torch.bool) if mask is None else mask.bool()
            self._write_tokens(input_ids, valid, out, eos=eos_ids(gen_config), requests=continued)
            self._write_guard(cache)
            self.generations += 1
            if not want_logits:
                out.logits = None
            return out if want_dict else out.sequences
        rows = watch.input_ids.shape[0]
        if rows % input_ids.shape[0]:
            raise RecorderError(
                f"generate ran {rows} rows for {input_ids.shape[0]} prompts; the recorder "
                "maps rows to prompts only for num_return_sequences expansion"
            )
        self._write_tokens(
            watch.input_ids, watch.prompt_mask(), out, samples=rows // input_ids.shape[0], eos=eos_ids(gen_config)
        )
        self._write_guard(cache)
        if self._prompt_sink is not None:
            self._hear_prefill(watch.input_ids, watch.prompt_mask(), out)
        self._request_base += rows
        self._prompt_base += input_ids.shape[0]
        self.generations += 1
        if not want_logits:
            out.logits = None
        return out if want_dict else out.sequences

    def _hear_prefill(self, input_ids: torch.Tensor, mask: torch.Tensor | None, out: Any) -> None:
        """What the sink heard of the prefill of the requests just written: the batch a replay can
        forward again with the same bits (``prefill_batches`` in the manifest), and with
        ``keep_prompt_pass`` one :class:`PromptPass` per request (DESIGN.md §6.1)."""
        sink, self._prompt_sink = self._prompt_sink, None
        cache = self.session.last_cache
        layers = len(cache.layers)
        ids = input_ids.cpu()
        valid = torch.ones_like(ids, dtype=torch.bool) if mask is None else mask.cpu().bool()
        if ids.shape[0] > 1 and sink.complete(layers):
            self.prefill_batches.append(
                {
                    "requests": list(range(self._request_base, self._request_base + ids.shape[0])),
                    "width": ids.shape[1],
                    "starts": valid.int().argmax(-1).tolist(),  # each row's first prompt column
                    "masked": sink.masked,
                    "chunk": cache.prefill_chunk,
                }
            )
        if self.prompt_passes is None:
            return
        rows = {r: ids[r][valid[r]].tolist() for r in range(ids.shape[0])}
        first = out.logits[0] if out.logits else None  # (rows, vocab): the prefill's last positions
        for r, prompt_pass in sink.passes(rows, first, layers).items():
            self.prompt_passes[self._request_base + r] = prompt_pass

    def force(
        self, prompt_ids: Sequence[int], new_ids: Sequence[int], evidence_labels: Sequence[str | None] | None = None
    ) -> Any:
        """Run one request on a given token sequence (teacher forcing) and record it.

        The prompt is prefilled, then ``new_ids`` are fed one per step instead
        of being generated; everything else (cache, events, tables) is as in
        ``model.generate``. Returns an object with ``sequences`` and ``logits``.
        """
        from types import SimpleNamespace

        from transformers import DynamicCache

        model = self.model
        prompt = torch.as_tensor(list(prompt_ids), dtype=torch.long)[None]
        new = [int(t) for t in new_ids]
        if not self.config.spec.evicts:
            cache = DynamicCache(config=model.config)
        else:
            cache = self.session.new_cache()
            self._last_layer = len(cache.layers) - 1
        self._pending = Pending()
        logits = []
        with torch.no_grad():
            out = model(input_ids=prompt, **compat.cache_kwargs(cache), use_cache=True)
            logits.append(out.logits[:, -1].float())
            for j, tok in enumerate(new[:-1]):
                pos = torch.tensor([[prompt.shape[1] + j]])
                out = model(
                    input_ids=torch.tensor([[tok]]), **compat.cache_kwargs(cache), use_cache=True, position_ids=pos
                )
                logits.append(out.logits[:, -1].float())
        self.flush()
        result = SimpleNamespace(
            sequences=torch.cat([prompt, torch.tensor([new], dtype=torch.long)], 1), logits=tuple(logits[: len(new)])
        )
        self._labels_override = evidence_labels
        try:
            self._write_tokens(prompt, None, result)
        finally:
            self._labels_override = None
        self._request_base += 1
        self._prompt_base += 1
        self.generations += 1
        return result

    def _write_guard(self, cache: Any) -> None:
        """The guard's risk and actions of this call (DESIGN.md §18.5), once its requests' tokens
        are known: a row's steps after its last token (EOS, then padding) are left out."""
        if cache is not None:
            last = {req: len(info["prompt"]) + len(info["new"]) - 2 for req, info in self._reqs.items()}
            write_guard_rows(self.writer, cache, last)
            write_recall_rows(self.writer, cache, self._row_ids(), last, self.config.gqa == "none")
        state = getattr(cache, "guard", None)
        if state is not None:  # what this call added to the guard's cost (a cache may serve several)
            now = (state.seconds, state.refill_seconds, state.scored)
            cost = self.guard_cost or [0.0, 0.0, 0]
            self.guard_cost = [c + n - w for c, n, w in zip(cost, now, state.cost_written)]
            state.cost_written = now

    def _write_tokens(
        self,
        input_ids: torch.Tensor,
        mask: torch.Tensor | None,
        out: Any,
        *,
        samples: int = 1,
        eos: Sequence[int] = (),
        requests: Sequence[int] | None = None,
    ) -> None:
        """The ``tokens`` and ``run_logits`` rows of each row of ``input_ids``; its ``requests`` row later.

        ``input_ids (rows, width)`` are the rows generate ran (prompts repeated
        ``samples`` times), ``mask (rows, width)`` its padding mask; each row's
        generated tokens end at its first token in ``eos`` (included). With
        ``requests`` the rows continue those requests (a restored or reused cache):
        ``input_ids`` are their sequences so far and only the new tokens are written.
        The ``requests`` rows are written when the recording ends (:meth:`finish`).
        """
        ids = input_ids.cpu()
        valid = torch.ones_like(ids, dtype=torch.bool) if mask is None else mask.cpu().bool()
        seq = out.sequences.cpu()
        width = ids.shape[1]
        logits = torch.stack(out.logits, 1).float() if out.logits else None  # (rows, T, V)
        tok = self.tokenizer
        for r in range(ids.shape[0]):
            so_far = ids[r][valid[r]].tolist()
            new = seq[r, width:].tolist()
            ends = [j for j, t in enumerate(new) if t in eos][:1]
            new = new[: ends[0] + 1] if ends else new  # what follows the EOS is padding
            if requests is not None:
                request = int(requests[r])
                info = self._reqs.get(request)
                if info is None:
                    raise RecorderError(
                        f"the cache continues request {request}, which this recording has not seen; "
                        "restore a state inside the recording that saved it"
                    )
                written = info["prompt"] + info["new"]
                if so_far[: len(written)] != written:
                    raise RecorderError(
                        f"request {request}: the continued generation was fed {len(so_far)} tokens that do "
                        f"not start with the {len(written)} tokens recorded so far; pass the sequences the "
                        "first generate returned (same rows, with their attention mask)"
                    )
                if info["ended"]:
                    continue
            else:
                request = self._request_base + r
                prompt_index, sample = self._prompt_base + r // samples, r % samples
                info = self._new_request(request, so_far, prompt_index, sample)
                written = []
            n_prompt = len(info["prompt"])
            start = len(written)
            first = len(so_far)  # position of the first token generated here (earlier ones came without logits)
            all_ids = so_far + new
            pieces = token_pieces(tok, all_ids[start:]) if tok is not None else None
            self.writer.append(
                "tokens",
                {
                    "request": np.full(len(all_ids) - start, request, np.int32),
                    "position": np.arange(start, len(all_ids), dtype=np.int64),
                    "token_id": np.asarray(all_ids[start:], dtype=np.int32),
                    "text": pieces,
                    "is_prompt": np.arange(start, len(all_ids)) < n_prompt,
                    "evidence": info["labels"][start:] + [None] * (len(all_ids) - max(start, n_prompt)),
                },
            )
            info["new"] = all_ids[n_prompt:]
            info["ended"] = bool(ends)
            if logits is not None and len(new):
                lg = logits[r, : len(new)]  # (T, V): the step at position q - 1 predicts the token at q
                chosen = torch.tensor(new)
                top = lg.max(-1)
                self.writer.append(
                    "run_logits",
                    {
                        "request": np.full(len(new), request, np.int32),
                        "step": np.arange(first - 1, first - 1 + len(new), dtype=np.int64),
                        "token_id": chosen.numpy().astype(np.int32),
                        "token_logit": lg.gather(-1, chosen[:, None])[:, 0].numpy(),
                        "top1_id": top.indices.numpy().astype(np.int32),
                        "top1_logit": top.values.numpy(),
                        "lse": torch.logsumexp(lg, -1).numpy(),
                    },
                )
            self.prompt_len = max(self.prompt_len, n_prompt)
            self.new_tokens = max(self.new_tokens, len(info["new"]))
            self.requests = max(self.requests, request + 1)

    def _new_request(self, request: int, prompt: list[int], prompt_index: int, sample: int) -> dict[str, Any]:
        """Book-keeping of a request seen for the first time: its prompt, evidence labels and budget."""
        tok = self.tokenizer
        n_prompt = len(prompt)
        labels: list[str | None] = [None] * n_prompt
        spans = self._evidence_for(prompt_index)
        if self._labels_override is not None:
            labels[:n_prompt] = list(self._labels_override)[:n_prompt]
        elif spans:
            if tok is None:
                raise RecorderError("evidence needs the tokenizer: pass record(..., tokenizer=tok)")
            prompt_text = self.prompts[prompt_index] if self.prompts else None
            labels = locate_evidence(token_pieces(tok, prompt), spans, prompt_text)
        budget = self.config.resolve(n_prompt)  # what the cache resolved for this row
        self.budgets.append(budget)
        info = {
            "prompt": list(prompt),
            "new": [],
            "ended": False,
            "labels": list(labels),
            "prompt_index": prompt_index,
            "sample": sample,
            "budget": budget,
        }
        self._reqs[request] = info
        return info

    def finish(self) -> None:
        """Write the ``requests`` row of every request (their answers are final now)."""
        tok = self.tokenizer
        for request in sorted(self._reqs):
            info = self._reqs.pop(request)
            new, budget = info["new"], info["budget"]
            if request in self._raised and budget.capacity is not None:  # its split at the end of the run
                budget = dataclasses.replace(
                    budget, heavy=int(budget.heavy) + self._raised.pop(request) - budget.capacity
                )
            answer = tok.decode(new, skip_special_tokens=True) if tok is not None else None
            extra = dict(self.annotate(request, answer)) if self.annotate is not None else {}
            full = not budget.spec.evicts
            self.writer.append(
                "requests",
                {
                    "request": np.array([request], np.int32),
                    "prompt_len": np.array([len(info["prompt"])]),
                    "new_tokens": np.array([len(new)]),
                    "answer": [answer],
                    "heavy": [None if full else budget.heavy],
                    "recent": [None if full else budget.recent],
                    "prompt_index": np.array([info["prompt_index"]], np.int32),
                    "sample_index": np.array([info["sample"]], np.int32),
                    **{k: [v] for k, v in extra.items()},
                },
            )

    def _evidence_for(self, prompt_index: int) -> Mapping[str, Any] | None:
        ev = self.evidence
        if not ev:
            return None
        if isinstance(ev, Mapping):
            return ev
        if prompt_index >= len(ev):
            raise RecorderError(
                f"evidence was given for {len(ev)} prompts, but prompt {prompt_index} was "
                "generated; give one evidence mapping per prompt"
            )
        return ev[prompt_index]


@contextlib.contextmanager
def record(
    model: Any,
    config: Any = None,
    *,
    out: str,
    tokenizer: Any = None,
    evidence: EvidenceSpec | None = None,
    name: str | None = None,
    run_id: str | None = None,
    prompts: Sequence[str] | None = None,
    info: Mapping[str, Any] | None = None,
    flush_every: int = 32,
    fsync: bool = True,
    rows_per_segment: int | None = None,
    annotate: Callable[[int, str | None], Mapping[str, Any]] | None = None,
    speculative: str = "rollback",
    keep_prompt_pass: bool = False,
    graphs: bool | str = False,
    **options: Any,
) -> Iterator[Recording]:
    """Record every eviction of the ``model.generate`` calls inside the block.

    Parameters
    ----------
    model : transformers causal LM
    config : H2OConfig (or its fields as keyword ``options``), or a kvpress press (or a
        :class:`h2o_lens.presses.PressSpec`): the model then runs under ``with press(model):``
        and the run logs what the press kept, checked against its cache (DESIGN.md §17)
    out : runs root; the run is written to ``<out>/<run_id>/``
    tokenizer : decodes token texts and locates evidence spans
    evidence : ``{label: substring | (start, end)}`` for all requests, or one
        mapping per prompt (character ranges are relative to ``prompts[i]``); the
        ``num_return_sequences`` samples of a prompt share its evidence
    name : free-form run name; run_id : folder name (default: generated)
    prompts : the user prompts (before any chat template), one per prompt, for character-range evidence
    info : extra manifest fields (``source_run``, ``task`` ...)
    flush_every : decode steps buffered (on the device) between conversions to rows
    fsync : make every segment durable before it becomes visible
    rows_per_segment : rows of one table per closed Parquet segment
    annotate : ``(request, answer) -> {"task": ..., "expected": ..., "correct": ...}``, extra
        columns of the ``requests`` table (an answer checker, for the task suite)
    speculative : how assisted or speculative decoding takes a rejected draft back,
        ``rollback`` or ``defer``; its segments go to ``spec_segments`` and
        ``spec_undone``, never to ``evictions`` (DESIGN.md §14)
    keep_prompt_pass : keep each request's prompt pass (its K/V per layer, column sums and
        first logits, as a replay computes them) in ``Recording.prompt_passes`` for
        ``replay(..., prompt_passes=...)``, which then skips the prompt forward (DESIGN.md §6.1);
        held in memory, about 2 × layers × KV heads × head dim × prompt length values a request
    graphs : replay the decode steps over a full cache from a captured graph (``h2o(..., graphs=)``,
        DESIGN.md §2.16); the log is the one written without, and the manifest's ``graphs`` says
        how many steps a graph served and why the others ran eagerly

    With a kvpress press, ``speculative`` and ``keep_prompt_pass`` do not apply (the press runs on
    transformers' own cache) and ``Recording.press_observer`` counts its logged compressions; the
    one option it takes is ``pinned``, prompt positions whose scores are raised so that every
    ScorerPress of the press keeps them within its count (DESIGN.md §17.3).

    On an exception inside the block the run is marked ``failed`` with the
    error, and the model is restored; the exception propagates.
    """
    opts = RecordOptions(
        out=out,
        tokenizer=tokenizer,
        evidence=evidence,
        name=name,
        run_id=run_id,
        prompts=prompts,
        info=info,
        flush_every=flush_every,
        fsync=fsync,
        rows_per_segment=rows_per_segment,
        annotate=annotate,
        speculative=speculative,
        keep_prompt_pass=keep_prompt_pass,
        graphs=graphs,
    )
    if config is None or isinstance(config, H2OConfig):
        if config is not None and options:
            raise RecorderError(f"give either a config or keyword options, not both (got {sorted(options)})")
        with _record(model, config if config is not None else H2OConfig(**options), opts) as rec:
            yield rec
        return
    with _record_press(model, config, opts, options) as rec:
        yield rec


@contextlib.contextmanager
def _record_press(model: Any, config: Any, opts: RecordOptions, options: dict[str, Any]) -> Iterator[Recording]:
    """:func:`record` for a kvpress press: its checks, then the full policy under the press's hooks."""
    from .press import is_press, prepare_press, press_scope

    if not is_press(config):
        raise RecorderError(f"record takes an H2OConfig or a kvpress press as its config, got {type(config).__name__}")
    pinned = pin_positions(options.pop("pinned", ()))
    if options:
        raise RecorderError(
            f"a press takes no keyword options but pinned (got {sorted(options)}); set its parameters on the press"
        )
    if opts.graphs:
        raise RecorderError(
            "graphs replay the H2O cache's decode steps; a press runs on transformers' own cache: record it "
            "without graphs"
        )
    press, manifest, prefix = prepare_press(config)  # refused presses: before anything is written
    if pinned:
        manifest["config"]["pinned"] = list(pinned)
    run = opts.run_id if opts.run_id is not None else new_run_id(prefix)
    opts = dataclasses.replace(opts, run_id=run, speculative="rollback", keep_prompt_pass=False, manifest=manifest)
    # the full policy leaves the model to transformers' cache; the press's hooks compress it
    with _record(model, H2OConfig(policy="full"), opts) as rec:
        with press_scope(model, press, rec, pinned) as observer:
            rec.press_observer = observer
            yield rec


@contextlib.contextmanager
def _record(model: Any, config: H2OConfig, opts: RecordOptions) -> Iterator[Recording]:
    """:func:`record` for an :class:`H2OConfig`; ``opts.manifest`` (the press recording's) replaces
    the run's config and manifest fields (``config``, ``policy`` ...) where it names them."""
    from h2o_lens.models import model_info

    compat.check_supported()  # before anything is written
    sizing = {"rows_per_segment": opts.rows_per_segment} if opts.rows_per_segment else {}
    manifest = dict(opts.manifest or {})
    writer = RunWriter(
        opts.out,
        opts.run_id,
        config=manifest.get("config", config.to_dict()),
        model=model_info(model),
        fsync=opts.fsync,
        name=opts.name,
        **sizing,
        **dict(opts.info or {}),
    )
    rec = Recording(writer, config, opts.tokenizer, opts.evidence, opts.prompts, opts.flush_every, model)
    rec.annotate = opts.annotate
    rec.prompt_passes = {} if opts.keep_prompt_pass else None
    writer.start()
    live = store_in_run(config, writer.run_dir)  # a disk cold store lives in the run's folder while it records
    try:
        with h2o(model, live, listener=rec, speculative=opts.speculative, graphs=opts.graphs) as session:
            rec.session = session
            inner = model.generate
            model.generate = functools.wraps(inner)(functools.partial(rec._generate, inner))
            try:
                yield rec
                rec.flush()
                rec.finish()
            finally:
                if not config.spec.evicts:
                    vars(model).pop("generate", None)
                else:
                    model.generate = inner
        if session.graphs is not None:  # what the graphs served (DESIGN.md §2.16)
            writer.update(graphs=session.graphs.summary())
        _write_manifest(writer, rec, config, session.last_cache, manifest)
    except BaseException as exc:
        exc = storage_failure(exc)  # a cold store's full disk reads as any write's (DESIGN.md §2.13)
        drop_store(config, writer.run_dir)
        if writer.status == "running":
            with contextlib.suppress(Exception):  # the requests seen so far, for the failed run's log
                rec.finish()
            with contextlib.suppress(Exception):  # a full disk may refuse the manifest too: the cause matters
                writer.close("failed", exc)
        raise exc
    drop_store(config, writer.run_dir)
    writer.close("complete")


def _write_manifest(writer: RunWriter, rec: Recording, config: H2OConfig, cache: Any, manifest: dict) -> None:
    """The manifest fields known once the block ends: the budget, the timings, the state events,
    the guard's configuration and cost (DESIGN.md §18.5), and ``manifest``'s own."""
    # one budget for the run when every request shares it; else null here, and each
    # request's own in the requests table (a keep ratio resolves per prompt length)
    shared = rec.budgets[0] if rec.budgets and all(b == rec.budgets[0] for b in rec.budgets) else None
    resolved = config if config.resolved else shared
    if not config.spec.evicts:  # no slots: a budget given with it is ignored
        resolved = dataclasses.replace(config, heavy=None, recent=None, ratio=None)
    writer.update(
        config=(resolved or config).to_dict(),
        policy=config.policy,
        heavy=resolved.heavy if resolved else None,
        recent=resolved.recent if resolved else None,
        budget_per_request=resolved is None,
        gqa=config.gqa,
        sink=config.sink,
        seed=config.seed,
        backend=cache.backend if cache is not None else "torch",
        prompt_len=rec.prompt_len,
        new_tokens=rec.new_tokens,
        requests=rec.requests,
        seconds_per_token=float(np.median(rec.step_times)) if rec.step_times else None,
        prefill_seconds=float(np.median(rec.prefill_seconds)) if rec.prefill_seconds else None,
        keep_ratio=config.ratio,
        state_events=rec.state_events or None,
        prefill_batches=rec.prefill_batches or None,
    )
    guard = getattr(cache, "guard", None) if cache is not None else None
    if guard is not None:  # the guard's configuration, beside its tables (DESIGN.md §18.5)
        writer.update(guard=dataclasses.asdict(guard.config))
    if rec.guard_cost is not None:  # and what it cost, against the generation it ran in
        generated = float(sum(rec.step_times) + sum(rec.prefill_seconds))
        seconds, refill, scored = rec.guard_cost
        writer.update(
            guard_cost={
                "seconds": seconds,
                "refill_seconds": refill,
                "steps_scored": int(scored),
                "generate_seconds": generated,
                "share": seconds / generated if generated > 0 else None,
            }
        )
    cold = cold_manifest(cache)
    if cold is not None:  # the cold tier's settings and what it moved (DESIGN.md §2.13)
        writer.update(cold=cold)
    if rec.prompts_reused:  # the prefill time above leaves these generate calls out
        writer.update(prompt_forward_reused=rec.prompts_reused)
    if manifest:
        writer.update(**manifest)


def record_teacher_forced(
    model: Any,
    source_dir: str | os.PathLike,
    config: H2OConfig,
    *,
    out: str,
    tokenizer: Any = None,
    name: str | None = None,
    run_id: str | None = None,
    fsync: bool = True,
) -> Recording:
    """Re-record the exact token sequence of a recorded run under another setting.

    Every request of ``source_dir`` is prefilled with its prompt and fed its
    generated tokens one per step, so that two policies (or ``gqa`` sum and
    max, or two budgets) are compared on the same text. The new run carries
    ``source_run`` = the source run id and copies its evidence labels.
    """
    from runlog.store import load_run, request_order

    src = load_run(source_dir, tables=("tokens",))
    tok = src["tokens"].to_pydict()
    req = np.asarray(tok["request"])
    if not len(req):
        raise RecorderError(f"{source_dir}: the source run has no tokens to replay")
    info = {"source_run": src.run_id, "teacher_forced": True}
    with record(model, config, out=out, tokenizer=tokenizer, name=name, run_id=run_id, info=info, fsync=fsync) as rec:
        for r in sorted(set(req.tolist())):
            order = request_order(tok, r)
            ids = np.asarray(tok["token_id"])[order]
            prompt = np.asarray(tok["is_prompt"])[order]
            labels = [tok["evidence"][i] for i in order[prompt]]
            rec.force(ids[prompt].tolist(), ids[~prompt].tolist(), evidence_labels=labels)
    return rec
