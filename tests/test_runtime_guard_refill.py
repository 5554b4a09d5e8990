"""The guard's ``refill``: after it, the same tokens as a fresh run at the higher budget whose prompt
is the tokens so far (DESIGN.md §18.2)."""

from __future__ import annotations

import pytest
import torch
from tiny import local_attention, tiny_model

import h2o_lens
from h2o_lens import H2OConfig
from h2o_lens.errors import ConfigError
from h2o_lens.guard import GuardConfig, guarded

PROMPT, NEW = 24, 12


@pytest.fixture(scope="module")
def model():
    return local_attention(tiny_model("llama", layers=2))


def _ids(seed=0):
    return torch.randint(3, 250, (1, PROMPT), generator=torch.Generator().manual_seed(seed))


@pytest.mark.parametrize("seed", [0, 1])
def test_refill_continues_as_a_fresh_run_at_the_higher_budget(model, seed):
    """At threshold 0 the guard marks the first decode step (position 24); the refill prefills the
    25 tokens so far at 12 slots. The tokens after it are those of a fresh run at 12 slots with
    those 25 tokens as its prompt, teacher-forced on them."""
    ids = _ids(seed)
    cfg = H2OConfig(heavy=4, recent=3)
    with (
        torch.no_grad(),
        h2o_lens.h2o(model, cfg),
        guarded(GuardConfig("refill", threshold=0.0, raise_slots=12, tail=0)) as g,
    ):
        out = model.generate(
            ids, max_new_tokens=NEW, do_sample=False, pad_token_id=0, logits_processor=[g.refill(model)]
        )
    (event,) = g.last.event_rows()
    assert (event["action"], event["step"], event["slots_before"], event["slots_after"]) == ("refill", PROMPT, 7, 12)
    assert event["seconds"] > 0 and g.last.refill_seconds == pytest.approx(event["seconds"])
    cache = g.last.cache
    assert cache.row_capacity(cache.layers[0].budget).tolist() == [12]
    teacher_forced = out[:, : PROMPT + 1]  # the prompt and the token before the refill
    with torch.no_grad(), h2o_lens.h2o(model, H2OConfig(heavy=9, recent=3)):
        fresh = model.generate(teacher_forced, max_new_tokens=NEW - 1, do_sample=False, pad_token_id=0)
    assert out[0, PROMPT + 1 :].tolist() == fresh[0, PROMPT + 1 :].tolist()


def test_refill_needs_its_processor(model):
    with torch.no_grad(), h2o_lens.h2o(model, H2OConfig(heavy=4, recent=3)):
        with guarded(GuardConfig("refill", threshold=0.0, raise_slots=12, tail=0)):
            with pytest.raises(ConfigError, match=r"logits_processor=\[guard.refill\(model\)\]"):
                model.generate(_ids(), max_new_tokens=4, do_sample=False, pad_token_id=0)
