"""Token ids from an upstream's own ``/responses``: what the gateway adds to a Responses call it
passes through, what it takes out of the answer again, and the ids it records (see
:mod:`agentbolt.server.gateway_responses`).

vLLM 0.34.0's ``ResponsesResponse`` has no ``prompt_token_ids`` or ``token_ids`` field. Asked
with ``enable_response_messages: true`` it returns ``input_messages`` and ``output_messages``,
and for a model without the Harmony format (vLLM's ``SimpleContext``) each holds one
``{"type": "raw_message_tokens", "message", "tokens"}``: the prompt as the chat template
rendered it, with its ids, and the completion with its ids
(``vllm/entrypoints/openai/responses/context.py``). Asked with
``include: ["message.output_text.logprobs"]`` it puts one logprob per generated token on the
answer's output text (``serving.py``, ``_make_response_output_items``). The gateway asks for
both, as it asks chat completions for ``return_token_ids`` and ``logprobs``, and records them in
the chat shape (``prompt_token_ids``, a choice's ``token_ids`` and ``logprobs``), so
:mod:`agentbolt.adapters` reads a passed-through call like any other.

Ids are recorded only in that shape: one input and one output message, each with its tokens.
Anything else is recorded text-only (``token_ids: false``): gpt-oss models (Harmony messages
carry no tokens), a call whose built-in tools ran several model turns in one Response (several
output messages), and an upstream that refuses the field (a hosted API: the gateway asks once,
then remembers, as for chat). Logprobs that do not line up one per completion token (a
streamed answer whose text left some tokens out) are recorded as none.
"""

from __future__ import annotations

from typing import Any

from agentbolt.server.openai_format import Wants

__all__ = ["LOGPROBS", "prepare", "recorded_ids", "strip", "strip_event"]

LOGPROBS = "message.output_text.logprobs"  # the ``include`` entry that asks for logprobs


def prepare(body: dict[str, Any], ask_token_ids: bool, ask_logprobs: bool) -> tuple[dict[str, Any], Wants]:
    """The body to send (the agent's, plus the asks for ids and logprobs) and what the agent
    itself asked for; ``ask_*`` False: the upstream is known to refuse that ask."""
    include = body.get("include")
    wants = Wants(
        token_ids=body.get("enable_response_messages") is True,
        logprobs=isinstance(include, list) and LOGPROBS in include,
        usage=True,
    )
    upstream = dict(body)
    if ask_token_ids and not wants.token_ids:
        upstream["enable_response_messages"] = True
    if ask_logprobs and not wants.logprobs and (include is None or isinstance(include, list)):
        upstream["include"] = [*(include or []), LOGPROBS]
    return upstream, wants


def recorded_ids(response: dict[str, Any]) -> tuple[list[int] | None, list[int] | None, list[float] | None]:
    """The prompt's and the completion's token ids and the completion's logprobs in a
    Responses answer (each ``None`` where the answer does not hold them as above)."""
    prompt, completion = _tokens(response.get("input_messages")), _tokens(response.get("output_messages"))
    logprobs = _logprobs(response.get("output"))
    if completion is None or logprobs is None or len(logprobs) != len(completion):
        logprobs = None
    return prompt, completion, logprobs


def _logprobs(output: Any) -> list[float] | None:
    """The logprobs on the output text parts of ``output``, in order; ``None`` when there are
    none or one is malformed."""
    parts = [
        part
        for item in output or []
        if isinstance(item, dict) and item.get("type") == "message"
        for part in item.get("content") or []
        if isinstance(part, dict) and part.get("type") == "output_text"
    ]
    try:
        values = [float(lp["logprob"]) for part in parts for lp in part.get("logprobs") or []]
    except (KeyError, TypeError, ValueError):
        return None
    return values or None


def _tokens(messages: Any) -> list[int] | None:
    if not (isinstance(messages, list) and len(messages) == 1 and isinstance(messages[0], dict)):
        return None
    message = messages[0]
    tokens = message.get("tokens")
    if message.get("type") != "raw_message_tokens" or not isinstance(tokens, list) or not tokens:
        return None
    return [int(t) for t in tokens]


def strip(response: dict[str, Any], wants: Wants) -> dict[str, Any]:
    """Take out (in place) what the gateway asked for and the agent did not, leaving what vLLM
    answers without the ask: ``null`` messages, ``null`` logprobs and ``top_logprobs``."""
    if not wants.token_ids:
        for key in ("input_messages", "output_messages"):
            if response.get(key) is not None:
                response[key] = None
    if not wants.logprobs:
        if response.get("top_logprobs") is not None:
            response["top_logprobs"] = None
        for item in response.get("output") or []:
            _strip_item(item)
    return response


def strip_event(event: dict[str, Any], wants: Wants) -> dict[str, Any]:
    """:func:`strip` for one event of a Responses stream: its response, item or content part,
    and a text event's own logprobs (``[]`` without the ask)."""
    if isinstance(event.get("response"), dict):
        strip(event["response"], wants)
    if not wants.logprobs:
        if event.get("logprobs"):
            event["logprobs"] = []
        if isinstance(event.get("item"), dict):
            _strip_item(event["item"])
        if isinstance(event.get("part"), dict):
            _strip_part(event["part"])
    return event


def _strip_item(item: Any) -> None:
    if isinstance(item, dict) and item.get("type") == "message":
        for part in item.get("content") or []:
            _strip_part(part)


def _strip_part(part: Any) -> None:
    if isinstance(part, dict) and part.get("type") == "output_text" and part.get("logprobs"):
        part["logprobs"] = None
