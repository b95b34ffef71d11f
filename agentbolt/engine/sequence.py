"""One generated sequence (one choice of one request) and the rules that end it.

The token ids and log-probabilities keep everything the model produced, including the token that
completed a stop string and the end-of-sequence token; only the *text* is cut at the stop string.
Training reads the ids, so it sees exactly what was sampled (vLLM behaves the same way).
"""

from __future__ import annotations

import threading
from collections.abc import Callable
from dataclasses import dataclass, field

import torch

from agentbolt.engine.lora_rows import Adapter
from agentbolt.engine.sampling import SamplingParams

__all__ = ["Sequence"]


@dataclass(eq=False)
class Sequence:
    """A prompt, its sampling parameters, and what the engine produced for it so far."""

    prompt_ids: list[int]
    params: SamplingParams
    decode: Callable[[list[int]], str]
    """Token ids -> text, used for stop strings and streaming."""
    on_done: Callable[[Sequence], object] = lambda seq: None
    """Called from the engine thread once the sequence has finished or failed."""
    on_token: Callable[[Sequence], object] | None = None
    """Called from the engine thread after each new token (streaming)."""
    output_ids: list[int] = field(default_factory=list)
    logprobs: list[float] = field(default_factory=list)
    top_logprobs: list[list[tuple[int, float]]] = field(default_factory=list)
    finish_reason: str | None = None
    stop_text_end: int | None = None
    """Where the text ends when a stop string matched (None: the whole decoded text)."""
    adapter: Adapter | None = None
    """The LoRA adapter served beside the weights that generates it (None: the weights alone)."""
    versions: list[int | str] = field(default_factory=list)
    """Model versions that computed this sequence, in order (more than one = weights changed mid-way)."""
    error: BaseException | None = None
    cancelled: threading.Event = field(default_factory=threading.Event)
    closed: bool = False
    """Set once ``on_done`` has been called."""
    generator: torch.Generator = field(init=False)

    def __post_init__(self) -> None:
        self.generator = self.params.make_generator()

    @property
    def finished(self) -> bool:
        return self.finish_reason is not None or self.error is not None

    def append(
        self, token: int, logprob: float, top: list[tuple[int, float]] | None, eos_ids: set[int]
    ) -> None:
        """Record one generated token and decide whether the sequence ends here."""
        self.output_ids.append(token)
        self.logprobs.append(logprob)
        if top is not None:
            self.top_logprobs.append(top)
        if token in self.params.stop_token_ids or (token in eos_ids and not self.params.ignore_eos):
            self.finish_reason = "stop"
        elif self.params.stop and self._match_stop_string():
            self.finish_reason = "stop"
        elif len(self.output_ids) >= self.params.max_tokens:
            self.finish_reason = "length"
        if self.on_token is not None:
            self.on_token(self)

    def _match_stop_string(self) -> bool:
        text = self.decode(self.output_ids)
        hits = [(text.find(s), s) for s in self.params.stop]
        hits = [(pos, s) for pos, s in hits if pos >= 0]
        if not hits:
            return False
        pos, stop = min(hits)
        self.stop_text_end = pos + len(stop) if self.params.include_stop_str_in_output else pos
        return True

    def text(self) -> str:
        text = self.decode(self.output_ids)
        return text if self.stop_text_end is None else text[: self.stop_text_end]

    def finish(self, reason: str | None = None, error: BaseException | None = None) -> None:
        if self.closed:
            return
        if reason is not None and self.finish_reason is None:
            self.finish_reason = reason
        self.error, self.closed = error, True
        self.on_done(self)
