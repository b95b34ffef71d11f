"""What a Job and its pod say of the agent's run: whether the Job is over, the agent
container's state, and why the attempt fails (the controller's terminal conditions, the
container's exit, an image that cannot be pulled)."""

from __future__ import annotations

from typing import Any

__all__ = [
    "IMAGE_ERRORS",
    "container_state",
    "failure",
    "finished",
    "image_error",
    "pods_by_job",
    "waiting_for_secret",
]

IMAGE_ERRORS = frozenset(
    {"ImagePullBackOff", "InvalidImageName", "ErrImageNeverPull", "CreateContainerConfigError"}
)
"""Waiting reasons of the agent's container that fail the attempt at once: Kubernetes would go
on retrying them until the Job's deadline (``ErrImagePull`` is left one retry: it turns into
``ImagePullBackOff`` when the pull fails again)."""


def pods_by_job(pods: list[dict[str, Any]]) -> dict[str, dict[str, Any]]:
    """The newest pod of each Job."""
    out: dict[str, dict[str, Any]] = {}
    for pod in sorted(pods, key=lambda p: str(p["metadata"].get("creationTimestamp") or "")):
        labels = pod["metadata"].get("labels") or {}
        job = labels.get("batch.kubernetes.io/job-name") or labels.get("job-name")
        if job:
            out[job] = pod
    return out


def finished(job: dict[str, Any]) -> str | None:
    """``Complete`` or ``Failed`` once the Job is over (the controller's terminal conditions)."""
    for condition in (job.get("status") or {}).get("conditions") or []:
        if condition.get("type") in ("Complete", "Failed") and condition.get("status") == "True":
            return str(condition["type"])
    return None


def container_state(pod: dict[str, Any] | None, container: str | None) -> dict[str, Any]:
    statuses = ((pod or {}).get("status") or {}).get("containerStatuses") or []
    for status in statuses:
        if container is None or status.get("name") == container:
            return dict(status.get("state") or {})
    return {}


def image_error(pod: dict[str, Any] | None, container: str | None) -> bool:
    waiting = container_state(pod, container).get("waiting") or {}
    return waiting.get("reason") in IMAGE_ERRORS


def waiting_for_secret(pod: dict[str, Any] | None, container: str | None, secret: str) -> bool:
    """The container waits for the Secret ``secret`` (the kubelet's ``CreateContainerConfigError``
    ``secret "NAME" not found``): a pod that started before its Job's Secret was created; the
    kubelet retries it, and it starts once the Secret exists."""
    waiting = container_state(pod, container).get("waiting") or {}
    return waiting.get("reason") == "CreateContainerConfigError" and f'secret "{secret}" not found' in str(
        waiting.get("message") or ""
    )


def failure(job: dict[str, Any], pod: dict[str, Any] | None, container: str | None) -> tuple[str, str] | None:
    """Why the attempt fails (kind, message), or None when the Job completed."""
    state = container_state(pod, container)
    waiting = state.get("waiting") or {}
    if waiting.get("reason") in IMAGE_ERRORS:
        return (
            "ImagePull",
            f"the agent's container cannot start: {waiting['reason']}: {waiting.get('message', '')}",
        )
    conditions = {c.get("type"): c for c in (job.get("status") or {}).get("conditions") or []}
    failed = conditions.get("Failed")
    if failed is None or failed.get("status") != "True":
        return None
    reason, message = failed.get("reason") or "Failed", failed.get("message") or ""
    deadline = (job.get("spec") or {}).get("activeDeadlineSeconds")
    if reason == "DeadlineExceeded":
        return (
            "Timeout",
            f"DeadlineExceeded: the Job ran past its activeDeadlineSeconds ({deadline} s): {message}",
        )
    terminated = state.get("terminated") or {}
    if reason == "BackoffLimitExceeded" and terminated:
        code, why = terminated.get("exitCode"), terminated.get("reason") or ""
        said = f"; {terminated['message']}" if terminated.get("message") else ""
        return (
            "ProgramExit",
            f"BackoffLimitExceeded: the agent's container exited with code {code} ({why}){said}",
        )
    return "JobFailed", f"{reason}: {message}"
