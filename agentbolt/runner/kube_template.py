"""The Kubernetes Job a rollout runs as: the user's template, read and checked once, and
rendered per attempt with the attempt's variables (the program runner's contract, see
docs/agents.md) and the launcher's labels.

Reading the template needs only PyYAML; nothing here talks to a cluster. Every problem with a
template is one :class:`~agentbolt.errors.ConfigError` line naming the file and the place.
"""

from __future__ import annotations

import base64
import copy
import hashlib
import json
import math
import re
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from agentbolt.errors import ConfigError
from agentbolt.runner.program_io import TOKEN_VARIABLES, ProgramFailed, check_template, render

__all__ = [
    "ATTEMPT_ANNOTATION",
    "ATTEMPT_LABEL",
    "LAUNCHER_LABEL",
    "MANAGED_BY",
    "ROLLOUT_ANNOTATION",
    "SECRET_KEY",
    "TASK_ENV_LIMIT",
    "JobTemplate",
    "job_name",
    "job_secret",
    "label_value",
    "schema_problem",
]

LAUNCHER_LABEL = "agentbolt.dev/launcher"
"""On every Job and pod a launcher creates: which launcher owns it (what it lists and adopts)."""
ATTEMPT_LABEL = "agentbolt.dev/attempt"
ROLLOUT_LABEL = "agentbolt.dev/rollout"
ATTEMPT_ANNOTATION = "agentbolt.dev/attempt-id"
"""The attempt's id exactly (a label value is limited to 63 characters of a narrow alphabet)."""
ROLLOUT_ANNOTATION = "agentbolt.dev/rollout-id"
MANAGED_BY = ("app.kubernetes.io/managed-by", "agentbolt")

SECRET_KEY = "agent-key"
"""The key, in each Job's Secret, of the attempt's agent key (the container's ``OPENAI_API_KEY``)."""

TASK_ENV_LIMIT = 256 * 1024
"""Bytes of task JSON passed in ``AGENTBOLT_TASK``: a Job is one API object (etcd keeps at
most ~1.5 MB), so a larger task fails its attempt with the reason instead of the API's 413."""

DEFAULT_TTL = 3600
"""``ttlSecondsAfterFinished`` when the template sets none: a backstop, since the launcher
deletes each Job once its attempt is reported."""

MIN_TTL = 60
"""The shortest ``ttlSecondsAfterFinished`` a template may set."""

SCHEMA_VERSION = "1.33"
"""The Kubernetes version whose OpenAPI schema (bundled with kubernetes-validate) a template
is checked against when that package is installed."""

_NAME_OK = re.compile(r"^[a-z0-9]([-a-z0-9]*[a-z0-9])?$")
_LABEL_OK = re.compile(r"^[A-Za-z0-9]([-A-Za-z0-9_.]*[A-Za-z0-9])?$")


def _digest(text: str, n: int) -> str:
    return hashlib.sha256(text.encode()).hexdigest()[:n]


def job_name(attempt_id: str) -> str:
    """The Job of an attempt: always the same name for the same attempt, so a second create
    for it is refused by the API (409) instead of starting a second pod. A DNS label (at most
    63 characters: the Job controller copies the name into a pod label)."""
    plain = f"agentbolt-{attempt_id.lower()}"
    if len(plain) <= 63 and _NAME_OK.match(plain) and plain == f"agentbolt-{attempt_id}":
        return plain
    cleaned = re.sub(r"[^a-z0-9-]+", "-", attempt_id.lower()).strip("-")[:30].strip("-")
    return f"agentbolt-{cleaned + '-' if cleaned else ''}{_digest(attempt_id, 16)}"


def label_value(value: str) -> str:
    """``value`` as a label value (<= 63 characters, alphanumerics and ``-_.`` inside); an id
    that is not one already gets a digest in place of what does not fit."""
    if len(value) <= 63 and _LABEL_OK.match(value):
        return value
    cleaned = re.sub(r"[^A-Za-z0-9_.-]+", "-", value)[:40].strip("-_.")
    return f"{cleaned}-{_digest(value, 16)}" if cleaned else _digest(value, 16)


@dataclass(frozen=True)
class Injected:
    """What one attempt's Job is given."""

    name: str
    labels: dict[str, str]
    annotations: dict[str, str]
    env: dict[str, str]
    deadline: float | None
    secret_env: dict[str, str] = field(default_factory=dict)
    """Variables read from the Job's Secret (same name as the Job): name -> key in it."""


@dataclass
class JobTemplate:
    """A Job read from ``path``: the one ``kind: Job`` document of the file, or the one held in
    a ConfigMap's data (as ``deploy/k8s/job-template.yaml`` ships it, ready for
    ``kubectl apply``).

    * ``namespace``: where the Jobs go (a template naming another namespace is refused);
    * ``container``: the agent's container (default: the one named ``agent``, else the only
      one); it gets the attempt's variables, and ``command`` when given;
    * ``command``: an argv template (``{field}`` from the task) replacing the container's
      command and args; without it the image's own entrypoint (and the template's args) run;
    * ``env``: more variables, ``{"NAME": "template"}``, rendered from the task;
    * ``secrets``: values that must not appear in the template (the runner's token).
    """

    path: Path
    namespace: str
    container: str | None = None
    command: Sequence[str] | None = None
    env: Mapping[str, str] = field(default_factory=dict)
    secrets: Sequence[str] = ()
    ttl_seconds: int = DEFAULT_TTL

    def __post_init__(self) -> None:
        self.path = Path(self.path)
        self.job = self._read()
        self.container_index = self._agent_container()
        for arg in self.command or ():
            check_template(arg, "the command")
        for name, template in self.env.items():
            check_template(template, f"variable {name}")
        self._check_secrets()

    # ------------------------------------------------------------------ reading

    def _where(self, place: str = "") -> str:
        return f"Kubernetes template {self.path}{': ' + place if place else ''}"

    def _read(self) -> dict[str, Any]:
        import yaml

        try:
            text = self.path.read_text()
        except OSError as exc:
            raise ConfigError(f"{self._where()}: cannot read it ({exc.strerror or exc})") from None
        try:
            docs = [d for d in yaml.safe_load_all(text) if d is not None]
        except yaml.YAMLError as exc:
            mark = getattr(exc, "problem_mark", None)
            at = f" at line {mark.line + 1}" if mark is not None else ""
            problem = getattr(exc, "problem", None) or str(exc).splitlines()[0]
            raise ConfigError(f"{self._where()}: not YAML{at} ({problem})") from None
        jobs = [d for d in docs if isinstance(d, dict) and d.get("kind") == "Job"]
        if not jobs:
            jobs = self._from_config_maps(docs)
        if len(jobs) != 1:
            raise ConfigError(
                f"{self._where()}: holds {len(jobs) or 'no'} Job documents; it must hold exactly one "
                "(kind: Job, apiVersion: batch/v1)"
            )
        job = jobs[0]
        if job.get("apiVersion") != "batch/v1":
            raise ConfigError(f"{self._where('apiVersion')} is {job.get('apiVersion')!r}, not 'batch/v1'")
        spec = job.get("spec")
        ttl = spec.get("ttlSecondsAfterFinished") if isinstance(spec, dict) else None
        if isinstance(ttl, int) and ttl < MIN_TTL:
            raise ConfigError(
                f"{self._where('spec.ttlSecondsAfterFinished')} is {ttl}: under {MIN_TTL} s the Job may be "
                "gone before the launcher reads how it ended (it deletes each Job once reported)"
            )
        meta = job.get("metadata") or {}
        if not isinstance(meta, dict):
            raise ConfigError(f"{self._where('metadata')} must be a mapping")
        if meta.get("namespace") not in (None, self.namespace):
            raise ConfigError(
                f"{self._where('metadata.namespace')} is {meta['namespace']!r}, but the Jobs go to "
                f"namespace {self.namespace!r} (--namespace): drop it from the template or make them agree"
            )
        return job

    def _from_config_maps(self, docs: list[Any]) -> list[dict[str, Any]]:
        import yaml

        found = []
        for doc in docs:
            if not (isinstance(doc, dict) and doc.get("kind") == "ConfigMap"):
                continue
            for key, value in (doc.get("data") or {}).items():
                try:
                    inner = yaml.safe_load(value) if isinstance(value, str) else None
                except yaml.YAMLError as exc:
                    raise ConfigError(
                        f"{self._where(f'ConfigMap data {key!r}')} is not YAML ({exc})"
                    ) from None
                if isinstance(inner, dict) and inner.get("kind") == "Job":
                    found.append(inner)
        return found

    def _pod_spec(self, job: dict[str, Any]) -> dict[str, Any]:
        spec = job.get("spec")
        template = spec.get("template") if isinstance(spec, dict) else None
        pod = template.get("spec") if isinstance(template, dict) else None
        if not isinstance(pod, dict):
            raise ConfigError(f"{self._where('spec.template.spec')} is missing: the Job needs a pod template")
        return pod

    def _agent_container(self) -> int:
        containers = self._pod_spec(self.job).get("containers")
        if (
            not isinstance(containers, list)
            or not containers
            or not all(isinstance(c, dict) for c in containers)
        ):
            raise ConfigError(
                f"{self._where('spec.template.spec.containers')} must list at least one container"
            )
        names = [c.get("name") for c in containers]
        if self.container is not None:
            if self.container not in names:
                raise ConfigError(f"{self._where()}: no container named {self.container!r} (it has {names})")
            index = names.index(self.container)
        elif "agent" in names:
            index = names.index("agent")
        elif len(containers) == 1:
            index = 0
        else:
            raise ConfigError(
                f"{self._where()}: {len(containers)} containers {names} and none named 'agent': "
                "name the agent's container (--container)"
            )
        if not containers[index].get("image"):
            raise ConfigError(f"{self._where(f'container {names[index]!r}')} has no image")
        return index

    def _check_secrets(self) -> None:
        pod = self._pod_spec(self.job)
        for c in [*pod["containers"], *(pod.get("initContainers") or [])]:
            if not isinstance(c, dict):
                continue
            cname = c.get("name")
            for var in c.get("env") or []:
                if not isinstance(var, dict):
                    continue
                name, value = var.get("name"), var.get("value")
                if name in TOKEN_VARIABLES:
                    raise ConfigError(
                        f"{self._where(f'container {cname!r}')} sets {name}: "
                        "the runner's token never goes to an agent's pod"
                    )
                if isinstance(value, str) and any(s and s in value for s in self.secrets):
                    raise ConfigError(
                        f"{self._where(f'variable {name}')} holds the runner's token: "
                        "it never goes to an agent's pod"
                    )

    # ------------------------------------------------------------------ rendering

    def render(
        self,
        *,
        attempt_id: str,
        rollout_id: str,
        launcher: str,
        task: Mapping[str, Any],
        variables: Mapping[str, str],
        timeout: float | None,
        secret_env: Mapping[str, str] | None = None,
    ) -> dict[str, Any]:
        """The Job for one attempt. ``variables`` are the contract's (gateway, ids...);
        ``secret_env`` names those the container reads from the Job's Secret (:func:`job_secret`,
        named as the Job), ``{variable: key}``: their values never appear in the Job. The
        ``env`` and ``command`` templates are filled from ``task`` (a missing field fails the
        attempt: :class:`ProgramFailed`)."""
        env = dict(variables)
        task_json = json.dumps(dict(task), separators=(",", ":"))
        if len(task_json.encode()) > TASK_ENV_LIMIT:
            raise ProgramFailed(
                "TaskTooLarge",
                f"the task is {len(task_json.encode())} bytes of JSON, over the {TASK_ENV_LIMIT} a Job's "
                "AGENTBOLT_TASK variable may carry",
            )
        env["AGENTBOLT_TASK"] = task_json
        for name, template in self.env.items():
            env[name] = render(template, task, f"variable {name}")
        argv = [render(arg, task, "the command") for arg in self.command] if self.command else None
        labels = {
            MANAGED_BY[0]: MANAGED_BY[1],
            LAUNCHER_LABEL: label_value(launcher),
            ATTEMPT_LABEL: label_value(attempt_id),
            ROLLOUT_LABEL: label_value(rollout_id),
        }
        annotations = {ATTEMPT_ANNOTATION: attempt_id, ROLLOUT_ANNOTATION: rollout_id}
        secret_env = dict(secret_env or {})
        for name in secret_env:
            env.pop(name, None)
        injected = Injected(job_name(attempt_id), labels, annotations, env, timeout, secret_env)
        return self._build(injected, argv)

    def _build(self, injected: Injected, argv: list[str] | None) -> dict[str, Any]:
        job = copy.deepcopy(self.job)
        meta = job.setdefault("metadata", {})
        for key in ("generateName", "uid", "resourceVersion", "creationTimestamp", "selfLink"):
            meta.pop(key, None)
        meta["name"], meta["namespace"] = injected.name, self.namespace
        meta["labels"] = {**(meta.get("labels") or {}), **injected.labels}
        meta["annotations"] = {**(meta.get("annotations") or {}), **injected.annotations}
        job.pop("status", None)
        spec = job["spec"]
        spec["backoffLimit"] = 0  # one pod per attempt: retrying is the store's decision
        spec.pop("suspend", None)
        if injected.deadline is not None:
            spec["activeDeadlineSeconds"] = max(1, math.ceil(injected.deadline))
        spec.setdefault("ttlSecondsAfterFinished", self.ttl_seconds)
        for key in ("completions", "parallelism"):
            spec[key] = 1
        pod_meta = spec["template"].setdefault("metadata", {})
        pod_meta["labels"] = {**(pod_meta.get("labels") or {}), **injected.labels}
        pod = spec["template"]["spec"]
        pod["restartPolicy"] = "Never"
        pod.setdefault("automountServiceAccountToken", False)  # the agent gets no API access
        agent = pod["containers"][self.container_index]
        if argv is not None:
            agent["command"] = argv
            agent.pop("args", None)
        ours = {*injected.env, *injected.secret_env}
        kept = [v for v in agent.get("env") or [] if v.get("name") not in ours]
        from_secret = [
            {"name": k, "valueFrom": {"secretKeyRef": {"name": injected.name, "key": key}}}
            for k, key in injected.secret_env.items()
        ]
        agent["env"] = kept + [{"name": k, "value": v} for k, v in injected.env.items()] + from_secret
        return job

    @property
    def container_name(self) -> str | None:
        name = self._pod_spec(self.job)["containers"][self.container_index].get("name")
        return str(name) if name else None

    def sample(self) -> dict[str, Any]:
        """The Job as an attempt would get it (placeholder values): what :func:`schema_problem`
        checks at start."""
        fields: dict[str, Any] = _Anything()
        variables = {name: "x" for name in ("AGENTBOLT_ROLLOUT_ID", "AGENTBOLT_ATTEMPT_ID")}
        env = {name: "x" for name in self.env}
        argv = ["x" for _ in self.command] if self.command else None
        injected = Injected(
            job_name("at-0000000000000000"),
            {MANAGED_BY[0]: MANAGED_BY[1], LAUNCHER_LABEL: "x", ATTEMPT_LABEL: "x", ROLLOUT_LABEL: "x"},
            {ATTEMPT_ANNOTATION: "x", ROLLOUT_ANNOTATION: "x"},
            {**variables, "AGENTBOLT_TASK": json.dumps(fields), **env},
            60.0,
            {"OPENAI_API_KEY": SECRET_KEY},
        )
        return self._build(injected, argv)


def job_secret(job: Mapping[str, Any], data: Mapping[str, str]) -> dict[str, Any]:
    """The Secret of a created ``job`` (its uid known): named as the Job, holding ``data``, with
    the Job's labels and annotations, and the Job as its owner, so that Kubernetes' garbage
    collector deletes it with the Job (the launcher deletes it too). Not ``blockOwnerDeletion``:
    that would need ``update`` on ``jobs/finalizers`` where the OwnerReferencesPermission
    admission plugin runs, and nothing needs the Job's deletion to wait for its Secret's."""
    meta = job["metadata"]
    return {
        "apiVersion": "v1",
        "kind": "Secret",
        "type": "Opaque",
        "metadata": {
            "name": meta["name"],
            "namespace": meta["namespace"],
            "labels": dict(meta.get("labels") or {}),
            "annotations": dict(meta.get("annotations") or {}),
            "ownerReferences": [
                {"apiVersion": "batch/v1", "kind": "Job", "name": meta["name"], "uid": meta["uid"]}
            ],
        },
        "data": {key: base64.b64encode(value.encode()).decode() for key, value in data.items()},
    }


class _Anything(dict[str, Any]):
    """A task with every field (for the sample Job)."""

    def __missing__(self, key: str) -> str:
        return "x"


def schema_problem(job: Mapping[str, Any], version: str = SCHEMA_VERSION) -> str | None:
    """Where ``job`` breaks the Kubernetes OpenAPI schema of ``version`` (strict: unknown fields
    too), from the schemas the ``kubernetes-validate`` package bundles (offline); None when it
    fits, or when that package is not installed."""
    try:
        import kubernetes_validate
    except ImportError:
        return None
    try:
        kubernetes_validate.validate(dict(job), version, strict=True)
    except kubernetes_validate.ValidationError as exc:
        place = ".".join(str(p) for p in exc.path) or "(the Job)"
        return f"{place}: {exc.message}"
    return None
