"""Creating an attempt's Job and the Secret that holds its key, for the Job launcher
(:mod:`agentbolt.runner.kubernetes`), and the variables its agent container is given.

The attempt's agent key is a credential (the program's events URL and gateway take it), so it
is not in the Job: anyone who may read Jobs (or pods) in the namespace would read it. It goes
in a Secret of its own, named as the Job, which the container reads through
``valueFrom.secretKeyRef``; what reads it is then who may read Secrets there.

Order: the Job first, then the Secret, with the Job (its uid, from the create's answer) as its
owner. The Secret is then never without an owner, so no failure at any point (the launcher
killed included) can leave a Secret behind: the garbage collector deletes it with its Job. The
other order (the Secret first, its owner patched in later) would leave a key without an owner
when the launcher dies between the steps. The cost of this order: the Job's pod may reach the
kubelet before the Secret exists; the container then waits (``CreateContainerConfigError``,
``secret "..." not found``) and the kubelet starts it once the Secret is there; the launcher
does not fail a pod for that while it has created the Secret
(:func:`~agentbolt.runner.kube_state.waiting_for_secret`). If the Secret cannot be created,
the launcher deletes the Job (:class:`SecretFailed` says so), and the attempt is released or
failed as for a Job that could not be created.
"""

from __future__ import annotations

import asyncio
import logging
from dataclasses import dataclass
from typing import Any
from urllib.parse import urlsplit

from agentbolt.client_api import gateway_url
from agentbolt.errors import ConfigError
from agentbolt.runner.attempt import AttemptCycle
from agentbolt.runner.kube_api import KubeApi, KubeError
from agentbolt.runner.kube_template import ATTEMPT_ANNOTATION, SECRET_KEY, job_secret
from agentbolt.runner.program import PLACEHOLDER_KEY, llm_of
from agentbolt.runner.program_io import prompt_variables, role_variables
from agentbolt.schemas import LLM, Claim

__all__ = [
    "SECRET_ENV",
    "SecretFailed",
    "Tracked",
    "check_public_url",
    "create_job",
    "create_secret",
    "variables",
]

log = logging.getLogger("agentbolt.kubernetes")

SECRET_ENV = {"OPENAI_API_KEY": SECRET_KEY}
"""The container's variables read from its Job's Secret: the attempt's agent key."""


@dataclass
class Tracked:
    """One attempt this launcher holds, and its Job."""

    attempt_id: str
    rollout_id: str
    job: str
    cycle: AttemptCycle | None = None
    """The attempt's talk with the server: its lease, events and finish."""
    lease_seconds: float | None = None
    created: float | None = None
    """When (monotonic) the Job was known to exist; None while it is being created."""
    keeper: asyncio.Task[None] | None = None
    ending: bool = False
    """Being reported or deleted: the watch's changes leave it alone."""
    adopted: bool = False
    secret: bool = False
    """Its Secret exists: a container waiting for it is not failed (the kubelet retries)."""


class SecretFailed(KubeError):
    """The Job's Secret could not be created (the Job has been deleted again)."""


def variables(claim: Claim, public_url: str, llm: str | None) -> tuple[dict[str, str], dict[str, str]]:
    """The contract's variables (docs/agents.md), on the public address, and what goes in the
    Job's Secret (its key -> value)."""
    rollout_id, attempt_id = claim.rollout.id, claim.attempt.id
    llms = {
        n: r for n, r in (claim.resources.resources if claim.resources else {}).items() if isinstance(r, LLM)
    }

    def url_of(name: str, _: LLM) -> str:  # with several roles, each its own URL (rewrite_claim's)
        return gateway_url(public_url, rollout_id, attempt_id, name if len(llms) > 1 else None)

    env: dict[str, str] = {}
    resource = llm_of(claim.resources, llm)
    if resource is not None:
        name = next(n for n, r in llms.items() if r is resource)
        env.update(
            OPENAI_BASE_URL=url_of(name, resource),
            OPENAI_MODEL=resource.model,
            AGENTBOLT_MODEL=resource.model,
        )
    env.update(
        AGENTBOLT_TASK_ID=claim.rollout.task.id,
        AGENTBOLT_ROLLOUT_ID=rollout_id,
        AGENTBOLT_ATTEMPT_ID=attempt_id,
        AGENTBOLT_EVENTS_URL=f"{public_url}/agent/{rollout_id}/{attempt_id}/events",
    )
    env.update(prompt_variables(claim.resources, None))  # the prompts' text; no file in a pod
    env.update(role_variables(claim.resources, url_of))
    return env, {SECRET_KEY: claim.agent_key or PLACEHOLDER_KEY}


async def _retried(what: str, call: Any, *args: Any) -> Any:
    """``call`` in a thread; a transient refusal (or a lost answer) is tried again, twice."""
    for attempt in range(3):
        try:
            return await asyncio.to_thread(call, *args)
        except KubeError as exc:
            if exc.status == 409 or not exc.transient or attempt == 2:
                raise
            log.info("%s: %s; trying again", what, exc)
            await asyncio.sleep(0.5 * (attempt + 1))
    raise AssertionError("unreachable")


async def create_job(api: KubeApi, body: dict[str, Any], attempt_id: str) -> dict[str, Any]:
    """Create the Job and return it as the API server has it (its uid). A create whose answer
    was lost is tried again, and 409 AlreadyExists for this attempt's own Job means it exists:
    taken as created, never a second one."""
    name = body["metadata"]["name"]
    try:
        job: dict[str, Any] = await _retried(f"creating Job {name}", api.create_job, body)
        return job
    except KubeError as exc:
        if not (exc.status == 409 and exc.reason == "AlreadyExists"):
            raise
    existing = await asyncio.to_thread(api.read_job, name)
    notes = ((existing or {}).get("metadata") or {}).get("annotations") or {}
    if existing is None or notes.get(ATTEMPT_ANNOTATION) != attempt_id:
        raise KubeError(409, "AlreadyExists", f"Job {name} exists for another attempt")
    log.info("Job %s already exists for attempt %s: adopted", name, attempt_id)
    return existing


async def create_secret(api: KubeApi, job: dict[str, Any], data: dict[str, str]) -> None:
    """Create the Secret of a created ``job``, owned by it. If it cannot be, delete the Job
    (and the Secret, were it created after all) and raise :class:`SecretFailed`."""
    body = job_secret(job, data)
    name, uid = body["metadata"]["name"], job["metadata"]["uid"]
    try:
        try:
            await _retried(f"creating Secret {name}", api.create_secret, body)
            return
        except KubeError as exc:
            if not (exc.status == 409 and exc.reason == "AlreadyExists"):
                raise
        # a create whose answer was lost: the Secret is ours if this Job owns it
        existing = await asyncio.to_thread(api.read_secret, name)
        owners = ((existing or {}).get("metadata") or {}).get("ownerReferences") or []
        if not any(owner.get("uid") == uid for owner in owners):
            raise KubeError(409, "AlreadyExists", f"Secret {name} exists, not owned by Job {name} ({uid})")
    except KubeError as exc:
        await _discard(api, name)
        said = f"{exc.message} (the Secret for the agent's key; the Job was deleted)"
        raise SecretFailed(exc.status, exc.reason, said) from None


async def _discard(api: KubeApi, name: str) -> None:
    """Delete a Job whose Secret failed, and the Secret (if the failure was a lost answer)."""
    for what, delete in (("Job", api.delete_job), ("Secret", api.delete_secret)):
        try:
            await asyncio.to_thread(delete, name)
        except KubeError as exc:  # the launcher's next pass finds the Job (not its attempt's) and deletes it
            log.warning("could not delete %s %s after its Secret failed: %s", what, name, exc)


def check_public_url(url: str, defaulted: bool) -> None:
    parts = urlsplit(url)
    if parts.scheme not in ("http", "https") or not parts.hostname:
        raise ConfigError(f"--public-url {url!r} must be an http(s) URL of the server")
    if parts.hostname in ("127.0.0.1", "localhost", "::1") or parts.hostname.startswith("127."):
        hint = "the server URL is a loopback address" if defaulted else f"--public-url {url!r} is loopback"
        raise ConfigError(
            f"{hint}, which a pod cannot reach: give --public-url, the server's address inside the "
            "cluster (e.g. http://agentbolt-server.agentbolt.svc:8765)"
        )
