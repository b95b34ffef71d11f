"""The Kubernetes API as the Job launcher uses it: the few calls it makes, through the official
``kubernetes`` client (the ``kubernetes`` extra), on plain dicts in the API's own field names,
each refusal one :class:`KubeError` that says whether trying again may help. Jobs and pods are
listed once, then followed with the client's watch (:meth:`KubeApi.watch`); each attempt's key
goes in a Secret of its own (:meth:`KubeApi.create_secret`)."""

from __future__ import annotations

import contextlib
import os
from collections.abc import Callable, Iterator
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
        with _refusals():
            answer = fn(*args, _request_timeout=30, **kwargs)
        return self.api_client.sanitize_for_serialization(answer) if not isinstance(answer, str) else answer

    def _lister(self, kind: str) -> Callable[..., Any]:
        listers = {"jobs": self.batch.list_namespaced_job, "pods": self.core.list_namespaced_pod}
        return listers[kind]

    def listing(self, kind: str, selector: str) -> tuple[list[dict[str, Any]], str]:
        """The ``jobs`` or ``pods`` matching ``selector``, and the list's resourceVersion (where a
        watch of them starts)."""
        answer = self._call(self._lister(kind), self.namespace, label_selector=selector)
        return list(answer["items"]), str((answer.get("metadata") or {}).get("resourceVersion") or "")

    def watch(
        self, kind: str, selector: str, version: str, timeout: int, watcher: Any
    ) -> Iterator[tuple[str, dict[str, Any]]]:
        """The changes of the ``jobs`` or ``pods`` matching ``selector`` after ``version``, as
        (type, object) with type ``ADDED``, ``MODIFIED``, ``DELETED`` or ``BOOKMARK``, through
        the client's ``watcher`` (a ``kubernetes.watch.Watch``), until the API server ends the
        stream (after ``timeout`` s). A version the server no longer has raises
        :class:`KubeError` 410; a dropped connection, status 0."""
        with _refusals():
            stream = watcher.stream(
                self._lister(kind),
                self.namespace,
                label_selector=selector,
                resource_version=version,
                timeout_seconds=timeout,
                allow_watch_bookmarks=True,
                _request_timeout=(10, timeout + 30),
            )
            for event in stream:
                yield str(event["type"]), event["raw_object"]

    def create_secret(self, body: dict[str, Any]) -> dict[str, Any]:
        result: dict[str, Any] = self._call(self.core.create_namespaced_secret, self.namespace, body)
        return result

    def read_secret(self, name: str) -> dict[str, Any] | None:
        try:
            result: dict[str, Any] = self._call(self.core.read_namespaced_secret, name, self.namespace)
            return result
        except KubeError as exc:
            if exc.status == 404:
                return None
            raise

    def delete_secret(self, name: str) -> bool:
        """Delete the Secret; False when it was already gone (its Job's garbage collector)."""
        try:
            self._call(self.core.delete_namespaced_secret, name, self.namespace)
            return True
        except KubeError as exc:
            if exc.status == 404:
                return False
            raise

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


@contextlib.contextmanager
def _refusals() -> Iterator[None]:
    """The client's errors, as :class:`KubeError`."""
    from kubernetes.client.exceptions import ApiException
    from pydantic import ValidationError

    try:
        yield
    except ApiException as exc:
        raise _kube_error(exc) from None
    except ValidationError as exc:  # the client's models refuse a field's type before sending
        first = exc.errors()[0] if exc.errors() else {"loc": (), "msg": str(exc)}
        place = ".".join(str(p) for p in first["loc"][1:]) or "the object"
        raise KubeError(400, "ClientValidation", f"the client refused it: {place}: {first['msg']}") from None
    except (OSError, ValueError) as exc:  # urllib3's connection errors are OSErrors
        raise KubeError(0, "Unreachable", f"the Kubernetes API is unreachable: {exc}") from None
    except Exception as exc:
        if type(exc).__module__.startswith("urllib3"):
            raise KubeError(0, "Unreachable", f"the Kubernetes API is unreachable: {exc}") from None
        raise


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
