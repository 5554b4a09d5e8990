"""``record``'s options are one frozen object (:class:`recorders.record_options.RecordOptions`); the
public call still takes them as keywords, the same names with the same defaults."""

from __future__ import annotations

import dataclasses
import inspect

import pytest

from recorders.record_options import RecordOptions
from recorders.recorder import _record, record


def test_record_takes_every_option_as_a_keyword_with_the_objects_default():
    params = inspect.signature(record.__wrapped__).parameters
    fields = {f.name: f for f in dataclasses.fields(RecordOptions)}
    keywords = {n: p for n, p in params.items() if p.kind is inspect.Parameter.KEYWORD_ONLY}
    assert set(keywords) == set(fields) - {"manifest"}  # a press recording's manifest is internal
    for name, p in keywords.items():
        want = fields[name].default
        assert p.default == (inspect.Parameter.empty if want is dataclasses.MISSING else want), name
    # the private twin takes the object, not the keywords again
    assert list(inspect.signature(_record.__wrapped__).parameters) == ["model", "config", "opts"]


def test_the_options_are_frozen():
    opts = RecordOptions(out="runs")
    with pytest.raises(dataclasses.FrozenInstanceError):
        opts.out = "elsewhere"
    assert dataclasses.replace(opts, fsync=False).fsync is False and opts.fsync is True
