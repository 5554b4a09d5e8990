"""The task suite: synthetic policy cases and real-model tasks.

* :mod:`~h2o_lens.tasks.attention_cases` — attention logits with a known failure
  signature (uniform, far hotspot, hotspot switch, delayed reference, GQA
  split) and a toy output model; numpy only. Written as runs by
  :func:`recorders.policy_cases.write_policy_case`.
* :mod:`~h2o_lens.tasks.real` — prompts for the default model (delayed
  recall, several facts, a topic switch, a long passage) with evidence spans,
  expected answers and answer checkers; plain Python (``calibrate`` loads
  torch when called).
"""

from __future__ import annotations

from .attention_cases import CASES, PolicyCase, policy_case, policy_cases
from .real import KINDS, SIZES, CalibrationRow, Task, budget, calibrate, check_answer, get_task, suite

__all__ = [
    "Task",
    "KINDS",
    "SIZES",
    "suite",
    "get_task",
    "check_answer",
    "budget",
    "calibrate",
    "CalibrationRow",
    "PolicyCase",
    "CASES",
    "policy_case",
    "policy_cases",
]
