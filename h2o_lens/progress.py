"""A progress bar for ``model.generate`` (a transformers streamer that counts tokens)."""

from __future__ import annotations

from typing import Any

__all__ = ["GenerationProgress"]


class GenerationProgress:
    """Pass as ``model.generate(..., streamer=GenerationProgress(max_new_tokens))``.

    The first ``put`` is the prompt; every later one is one decode step.
    """

    def __init__(self, total: int, desc: str = "generate", disable: bool = False):
        from tqdm.auto import tqdm

        self.bar = tqdm(total=total, desc=desc, unit="tok", disable=disable, leave=False)
        self._prompt_seen = False

    def put(self, value: Any) -> None:
        if not self._prompt_seen:
            self._prompt_seen = True
            return
        self.bar.update(1)

    def end(self) -> None:
        self.bar.close()
