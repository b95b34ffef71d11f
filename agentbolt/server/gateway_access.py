"""Who calls the upstream with which key, and where agents are sent.

- :func:`rewrite_claim` points a dequeued claim's ``LLM`` resources at the attempt's gateway
  URL, with the attempt's own agent key as ``api_key``: it authorises that attempt's gateway
  routes and events URL only, never the runner's rights, so agent code holds no more than its
  own attempt. ``openai.OpenAI(base_url=llm.base_url, api_key=llm.api_key)`` just works. The
  resource's ``upstreams`` (its other model servers) are dropped: the agent sees the gateway only.
- :class:`UpstreamKeys` finds the real key for an upstream call. Keys never leave the server
  except in the upstream request's header: the API serves resources with keys redacted.
"""

from __future__ import annotations

from typing import Any

from fastapi import Request

from agentbolt.client_api import gateway_url
from agentbolt.errors import NotFound
from agentbolt.schemas import LLM, Claim, Resources
from agentbolt.server.config import ServerConfig
from agentbolt.server.store_caller import REDACTED, StoreCaller

__all__ = ["PLACEHOLDER_KEY", "UpstreamKeys", "rewrite_claim"]

PLACEHOLDER_KEY = "agentbolt"  # the api_key of a claim whose store minted no agent key


def rewrite_claim(claim: Claim, request: Request) -> Claim:
    """Point the claim's LLM resources at this attempt's gateway, with the attempt's agent key
    as api_key: never the caller's own bearer token (a runner's or an admin's rights). With
    several (the roles of a system of agents), each gets its role's own URL: a call there naming
    the model of several roles is that role's (``Target.pick``). Their example turns are left out: the gateway puts them into
    every call itself."""
    if claim.resources is None or not any(isinstance(r, LLM) for r in claim.resources.resources.values()):
        return claim
    base = str(request.base_url).rstrip("/")
    key = claim.agent_key or PLACEHOLDER_KEY
    roles = sum(isinstance(r, LLM) for r in claim.resources.resources.values()) > 1
    resources = {
        name: res.model_copy(
            update={
                "base_url": gateway_url(base, claim.rollout.id, claim.attempt.id, name if roles else None),
                "api_key": key,
                "upstreams": [],
                "examples": [],
            }
        )
        if isinstance(res, LLM)
        else res
        for name, res in claim.resources.resources.items()
    }
    return claim.model_copy(update={"resources": claim.resources.model_copy(update={"resources": resources})})


class UpstreamKeys:
    def __init__(self, call: StoreCaller, config: ServerConfig) -> None:
        self.call, self.store, self.config = call, call.store, config
        self._history: dict[tuple[str, int], str | None] = {}

    async def resolve(self, llm: LLM, version: int | None, server: str | None = None) -> str | None:
        """The key for a call to ``server`` (one of the resource's servers; its ``base_url``
        when None): the resource's key, else the one configured for that server (else for the
        resource's ``base_url``), else (for a resource re-published from a redacted read) the
        key last published for that resource, else ``"*"``."""
        if llm.api_key and llm.api_key != REDACTED:
            return llm.api_key
        keys = self.config.upstream_api_keys
        if keys:
            for url in (server or llm.base_url, llm.base_url):
                for form in (url, url.rstrip("/")):
                    if form in keys:
                        return keys[form]
        if llm.api_key == REDACTED and version is not None:
            found = await self._from_history(llm.base_url, version)
            if found:
                return found
        return keys.get("*")

    async def _from_history(self, base_url: str, version: int) -> str | None:
        cache_key = (base_url, version)
        if cache_key not in self._history:
            self._history[cache_key] = await self.call(_published_key, self.store, base_url, version)
        return self._history[cache_key]


def _published_key(store: Any, base_url: str, version: int) -> str | None:
    """The api_key last published (at or before ``version``) for an LLM at ``base_url``."""
    for v in range(version, max(0, version - 1000), -1):
        try:
            resources: Resources = store.get_resources(v)
        except NotFound:
            continue
        for res in resources.resources.values():
            if isinstance(res, LLM) and res.base_url == base_url and res.api_key and res.api_key != REDACTED:
                return res.api_key
    return None
