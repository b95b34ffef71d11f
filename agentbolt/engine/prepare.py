"""An OpenAI request as the engine runs it: parsed, checked against the model (its name, its
context, its vocabulary, the batch) and turned into prompt ids and sampling parameters; a
request the engine cannot serve raises :class:`~agentbolt.engine.protocol.EngineRequestError`
naming the field at fault, before any work is queued."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from agentbolt.engine.chat_format import render_chat_prompt
from agentbolt.engine.config import EngineConfig
from agentbolt.engine.protocol import (
    ChatCompletionRequest,
    CompletionRequest,
    EngineRequestError,
    parse_request,
)
from agentbolt.engine.sampling import SamplingParams

__all__ = ["RequestPreparer"]


class RequestPreparer:
    """Prepares the requests of one engine: its tokenizer and context; its limits come with
    each request (the engine's :class:`EngineConfig` as it is then)."""

    def __init__(self, tokenizer: Any, max_context: int, served_names: set[str]) -> None:
        """``served_names``: the engine's own set (an adapter loaded later adds to it)."""
        self.tokenizer, self.max_context, self.served_names = tokenizer, max_context, served_names

    def completion(
        self, request: Mapping[str, Any], config: EngineConfig
    ) -> tuple[CompletionRequest, list[tuple[str, list[int]]], list[SamplingParams]]:
        req = parse_request(CompletionRequest, request)
        self._check_model(req.model, config)
        prompts = self._completion_prompts(req.prompt)
        params = [
            self._sampling(
                config,
                req,
                len(ids),
                req.max_tokens,
                top=req.logprobs or 0,
                logprobs=req.logprobs is not None,
            )
            for _, ids in prompts
        ]
        return req, prompts, params

    def chat(
        self, request: Mapping[str, Any], config: EngineConfig
    ) -> tuple[ChatCompletionRequest, list[int], SamplingParams]:
        req = parse_request(ChatCompletionRequest, request)
        self._check_model(req.model, config)
        messages = [m.model_dump(exclude_none=True) for m in req.messages]
        prompt_ids = render_chat_prompt(
            self.tokenizer, messages, req.tools, req.add_generation_prompt, req.chat_template_kwargs
        )
        max_tokens = req.max_completion_tokens or req.max_tokens
        params = self._sampling(
            config, req, len(prompt_ids), max_tokens, top=req.top_logprobs or 0, logprobs=req.logprobs
        )
        return req, prompt_ids, params

    def _check_model(self, model: str | None, config: EngineConfig) -> None:
        if config.strict_model_name and model is not None and model not in self.served_names:
            served = ", ".join(sorted(self.served_names))
            raise EngineRequestError(
                f"The model `{model}` does not exist; this engine serves: {served}",
                status_code=404,
                param="model",
                code="model_not_found",
            )

    def _sampling(
        self, config: EngineConfig, req, prompt_len: int, max_tokens: int | None, top: int, logprobs: bool
    ) -> SamplingParams:
        self._check_limits(config, req, prompt_len, max_tokens)
        room = self.max_context - prompt_len
        return SamplingParams(
            max_tokens=max_tokens or min(room, config.default_max_tokens),
            temperature=req.temperature,
            top_p=req.top_p,
            top_k=req.top_k,
            seed=req.seed,
            stop=req.stop_list,
            stop_token_ids=list(req.stop_token_ids or []),
            ignore_eos=req.ignore_eos,
            include_stop_str_in_output=req.include_stop_str_in_output,
            top_logprobs=top,
            logprobs=logprobs,
        )

    def _check_limits(self, config: EngineConfig, req, prompt_len: int, max_tokens: int | None) -> None:
        room = self.max_context - prompt_len
        if room < 1:
            raise EngineRequestError(
                f"the prompt is {prompt_len} tokens; this model's context is {self.max_context} tokens",
                param="messages" if isinstance(req, ChatCompletionRequest) else "prompt",
                code="context_length_exceeded",
            )
        if max_tokens is not None and max_tokens > room:
            raise EngineRequestError(
                f"max_tokens={max_tokens} plus the {prompt_len}-token prompt exceeds the {self.max_context}-token context",
                param="max_tokens",
                code="context_length_exceeded",
            )
        if req.n > config.max_batch:
            raise EngineRequestError(f"n must be at most {config.max_batch}", param="n")
        vocab = len(self.tokenizer)
        if any(not 0 <= t < vocab for t in req.stop_token_ids or []):
            raise EngineRequestError(
                "stop_token_ids holds ids outside the vocabulary", param="stop_token_ids"
            )

    def _completion_prompts(self, prompt: Any) -> list[tuple[str, list[int]]]:
        if isinstance(prompt, str):
            prompt = [prompt]
        elif prompt and isinstance(prompt[0], int):
            prompt = [prompt]
        out = []
        vocab = len(self.tokenizer)
        for p in prompt:
            if isinstance(p, str):
                out.append((p, list(self.tokenizer(p)["input_ids"])))
            elif not p or any(not 0 <= t < vocab for t in p):
                raise EngineRequestError(
                    "token prompts must be non-empty and inside the vocabulary", param="prompt"
                )
            else:
                out.append((self.tokenizer.decode(p), list(p)))
        return out
