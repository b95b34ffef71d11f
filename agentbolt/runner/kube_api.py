"""The Kubernetes API as the Job launcher uses it: the few calls it makes, through the official
``kubernetes`` client (the ``kubernetes`` extra), on plain dicts in the API's own field names,
each refusal one :class:`KubeError` that says whether trying again may help."""

from __future__ import annotations

import os
from collections.abc import Callable
from typing import Any

from agentbolt.errors import AgentboltError, ConfigError, MissingExtra

__all__ = ["KubeApi", "KubeError", "kube_api_client", "missing_extra"]


def missing_extra() -> MissingExtra:
    """What is raised where the ``kubernetes`` extra is not installed."""
    return MissingExtra("agentbolt runner --kubernetes", ("kubernetes",), "kubernetes")


def kube_api_client(context: str | None = None) -> Any:
    """An API client for the cluster this process is in (its service account), else the
    kubeconfig's (current or named ``context``) one."""
    try:
        from kubernetes import client, config
    except ImportError:
        raise missing_extra() from None
    if context is None and os.environ.get("KUBERNETES_SERVICE_HOST"):
        config.load_incluster_config()
        return client.ApiClient()
    try:
        return config.new_client_from_config(context=context)
    except Exception as exc:  # the kubeconfig's own errors: no file, no such context
        raise ConfigError(f"cannot load the Kubernetes configuration: {exc}") from None


class KubeError(AgentboltError):
    """The Kubernetes API refused a call (``status``: its HTTP status; 0: unreachable)."""

    def __init__(self, status: int, reason: str, message: str) -> None:
        super().__init__(f"{status} {reason}: {message}" if status else message)
        self.status, self.reason, self.message = status, reason, message

    @property
    def transient(self) -> bool:
        return self.status == 0 or self.status == 429 or self.status >= 500


class KubeApi:
    """The calls the launcher makes, through the official client, on plain dicts in the API's
    own field names (the client's models, serialised back)."""

    def __init__(self, api_client: Any, namespace: str) -> None:
        try:
            from kubernetes import client
        except ImportError:
            raise missing_extra() from None
        self.api_client, self.namespace = api_client, namespace
        self.batch = client.BatchV1Api(api_client)
        self.core = client.CoreV1Api(api_client)

    def _call(self, fn: Callable[..., Any], *args: Any, **kwargs: Any) -> Any:
        from kubernetes.client.exceptions import ApiException
        from pydantic import ValidationError

        try:
            answer = fn(*args, _request_timeout=30, **kwargs)
        except ApiException as exc:
            raise _kube_error(exc) from None
        except ValidationError as exc:  # the client's models refuse a field's type before sending
            first = exc.errors()[0] if exc.errors() else {"loc": (), "msg": str(exc)}
            place = ".".join(str(p) for p in first["loc"][1:]) or "the object"
            raise KubeError(
                400, "ClientValidation", f"the client refused it: {place}: {first['msg']}"
            ) from None
        except (OSError, ValueError) as exc:  # urllib3's connection errors are OSErrors
            raise KubeError(0, "Unreachable", f"the Kubernetes API is unreachable: {exc}") from None
        except Exception as exc:
            if type(exc).__module__.startswith("urllib3"):
                raise KubeError(0, "Unreachable", f"the Kubernetes API is unreachable: {exc}") from None
            raise
        return self.api_client.sanitize_for_serialization(answer) if not isinstance(answer, str) else answer

    def create_job(self, body: dict[str, Any]) -> dict[str, Any]:
        result: dict[str, Any] = self._call(self.batch.create_namespaced_job, self.namespace, body)
        return result

    def read_job(self, name: str) -> dict[str, Any] | None:
        try:
            result: dict[str, Any] = self._call(self.batch.read_namespaced_job, name, self.namespace)
            return result
        except KubeError as exc:
            if exc.status == 404:
                return None
            raise

    def list_jobs(self, selector: str) -> list[dict[str, Any]]:
        return list(
            self._call(self.batch.list_namespaced_job, self.namespace, label_selector=selector)["items"]
        )

    def list_pods(self, selector: str) -> list[dict[str, Any]]:
        return list(
            self._call(self.core.list_namespaced_pod, self.namespace, label_selector=selector)["items"]
        )

    def delete_job(self, name: str) -> bool:
        """Delete the Job and (in the background) its pods; False when it was already gone."""
        try:
            self._call(
                self.batch.delete_namespaced_job, name, self.namespace, propagation_policy="Background"
            )
            return True
        except KubeError as exc:
            if exc.status == 404:
                return False
            raise

    def pod_log(self, pod: str, container: str | None, limit: int) -> str | None:
        try:
            text = self._call(
                self.core.read_namespaced_pod_log, pod, self.namespace, container=container, limit_bytes=limit
            )
        except KubeError as exc:
            if exc.status in (400, 404):  # the pod is gone, or its container never started
                return None
            raise
        return str(text)


def _kube_error(exc: Any) -> KubeError:
    """The API's Status (reason, message) of a refused call."""
    import json

    reason, message = str(exc.reason or ""), ""
    try:
        status = json.loads(exc.body or "{}")
        reason, message = status.get("reason") or reason, status.get("message") or ""
    except (ValueError, AttributeError):
        message = str(exc.body or "")[:500]
    return KubeError(int(exc.status or 0), reason, message or reason)
