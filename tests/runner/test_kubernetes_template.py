"""The Jobs the Kubernetes launcher renders, checked offline against the Kubernetes OpenAPI
schema: the JSON schemas bundled in the kubernetes-validate wheel (strict: unknown fields are
errors too), not only by building the client's objects. No cluster runs here. Also: the example
template (deploy/k8s/job-template.yaml), a deliberately broken template, the recorded API
responses the launcher's tests replay (tests/runner/k8s/), and each bad template or option
ending in one clear line."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import kubernetes_validate
import pytest
import yaml

from agentbolt.errors import ConfigError
from agentbolt.runner.kube_template import (
    ATTEMPT_ANNOTATION,
    TASK_ENV_LIMIT,
    JobTemplate,
    job_name,
    label_value,
    schema_problem,
)
from agentbolt.runner.program_io import ProgramFailed

pytestmark = pytest.mark.timeout(60)

ROOT = Path(__file__).parents[2]
EXAMPLE = ROOT / "deploy" / "k8s" / "job-template.yaml"
RECORDED = Path(__file__).parent / "k8s"
VERSIONS = ["1.30", "1.33", kubernetes_validate.utils.latest_version()]
"""Kubernetes versions whose schemas the wheel bundles: an older supported one, the one the
launcher checks against at start, and the newest shipped."""

VARIABLES = {
    "OPENAI_BASE_URL": "http://agentbolt-server.agentbolt.svc:8765/gateway/ro-1/at-1/v1",
    "OPENAI_API_KEY": "ak_attempt_key",
    "AGENTBOLT_ROLLOUT_ID": "ro-1",
    "AGENTBOLT_ATTEMPT_ID": "at-0123456789abcdef",
    "AGENTBOLT_EVENTS_URL": "http://agentbolt-server.agentbolt.svc:8765/agent/ro-1/at-1/events",
}


def _render(template: JobTemplate, **kw):
    args = {
        "attempt_id": "at-0123456789abcdef",
        "rollout_id": "ro-1",
        "launcher": "default",
        "task": {"question": "2+2?", "meta": {"n": 1}},
        "variables": VARIABLES,
        "timeout": 90.5,
    } | kw
    return template.render(**args)


def _env(job) -> dict[str, str]:
    agent = next(c for c in job["spec"]["template"]["spec"]["containers"] if c["name"] == "agent")
    return {v["name"]: v.get("value") for v in agent["env"]}


def _write(tmp_path: Path, text: str, name: str = "job.yaml") -> Path:
    path = tmp_path / name
    path.write_text(text)
    return path


PLAIN = """\
apiVersion: batch/v1
kind: Job
metadata:
  labels: {team: research}
spec:
  template:
    spec:
      containers:
        - name: sidecar
          image: busybox:1.36
          command: [sleep, "3600"]
        - name: agent
          image: registry.example.com/agent:1
          args: [--verbose]
          env:
            - {name: OPENAI_API_KEY, value: stale}
            - {name: KEEP_ME, value: "yes"}
"""


@pytest.mark.parametrize("version", VERSIONS)
def test_the_example_and_a_plain_template_render_jobs_that_fit_the_schema(tmp_path, version):
    example = JobTemplate(
        EXAMPLE, "agentbolt", command=["python", "a.py", "{question}"], env={"Q": "{question}"}
    )
    plain = JobTemplate(_write(tmp_path, PLAIN), "agents")
    for template in (example, plain):
        job = _render(template)
        assert kubernetes_validate.validate(job, version, strict=True)
        assert schema_problem(job, version) is None
    # every document of the example (ConfigMap, RBAC, the launcher, NetworkPolicies) fits too
    for doc in yaml.safe_load_all(EXAMPLE.read_text()):
        assert kubernetes_validate.validate(doc, version, strict=True), doc["kind"]


def test_the_rendered_job_carries_the_attempt_and_the_launchers_settings(tmp_path):
    template = JobTemplate(
        _write(tmp_path, PLAIN),
        "agents",
        command=["python", "agent.py", "--q", "{question}"],
        env={"Q": "{question}"},
    )
    job = _render(template)
    meta, spec = job["metadata"], job["spec"]
    assert meta["name"] == "agentbolt-at-0123456789abcdef" == job_name("at-0123456789abcdef")
    assert meta["namespace"] == "agents"
    assert meta["labels"]["team"] == "research"  # the template's own labels are kept
    assert meta["labels"]["agentbolt.dev/launcher"] == "default"
    assert meta["labels"]["agentbolt.dev/attempt"] == "at-0123456789abcdef"
    assert meta["annotations"][ATTEMPT_ANNOTATION] == "at-0123456789abcdef"
    assert spec["backoffLimit"] == 0 and spec["activeDeadlineSeconds"] == 91
    assert spec["ttlSecondsAfterFinished"] == 3600 and spec["completions"] == 1
    pod = spec["template"]
    assert pod["metadata"]["labels"]["agentbolt.dev/attempt"] == "at-0123456789abcdef"
    assert pod["spec"]["restartPolicy"] == "Never" and pod["spec"]["automountServiceAccountToken"] is False
    sidecar, agent = pod["spec"]["containers"]
    assert "env" not in sidecar and sidecar["command"] == ["sleep", "3600"]  # only the agent is changed
    assert agent["command"] == ["python", "agent.py", "--q", "2+2?"] and "args" not in agent
    env = _env(job)
    assert env["OPENAI_API_KEY"] == "ak_attempt_key"  # the template's stale value is replaced
    assert env["KEEP_ME"] == "yes" and env["Q"] == "2+2?"
    assert json.loads(env["AGENTBOLT_TASK"]) == {"question": "2+2?", "meta": {"n": 1}}
    assert [v["name"] for v in agent["env"]].count("OPENAI_API_KEY") == 1
    # without --command the image's entrypoint and the template's args are kept
    kept = _render(JobTemplate(_write(tmp_path, PLAIN), "agents"))
    assert kept["spec"]["template"]["spec"]["containers"][1]["args"] == ["--verbose"]
    assert "command" not in kept["spec"]["template"]["spec"]["containers"][1]
    # the template itself is not changed by rendering
    assert template.job["spec"]["template"]["spec"]["containers"][1]["env"][0]["value"] == "stale"


def test_a_deliberately_broken_template_fails_the_schema_and_the_launcher_says_where(tmp_path):
    broken = PLAIN.replace('{name: KEEP_ME, value: "yes"}', '{name: KEEP_ME, valu: "yes"}')  # a typo
    template = JobTemplate(_write(tmp_path, broken), "agents")
    job = _render(template)
    with pytest.raises(kubernetes_validate.ValidationError) as caught:
        kubernetes_validate.validate(job, "1.33", strict=True)
    assert "valu" in caught.value.message
    problem = schema_problem(template.sample())
    assert problem is not None and problem.startswith("spec.template.spec.containers.1.env.")
    # the client's own objects take it and silently drop the misspelled field: no check at all
    from kubernetes.client import V1Job

    built = V1Job.from_dict(job)
    kept = {v.name: v.value for v in built.spec.template.spec.containers[1].env}
    assert "KEEP_ME" in kept and kept["KEEP_ME"] is None
    # and the command line refuses it before touching a cluster, in one line
    out = subprocess.run(
        [
            sys.executable,
            "-m",
            "agentbolt",
            "runner",
            "--kubernetes",
            str(tmp_path / "job.yaml"),
            "--namespace",
            "agents",
            "--public-url",
            "http://agentbolt:8765",
            "--server",
            "http://127.0.0.1:9",
        ],
        capture_output=True,
        text=True,
        timeout=60,
        env={**os.environ, "COLUMNS": "1000"},  # rich wraps the message to the terminal's width
    )
    assert out.returncode == 1, out.stderr
    lines = [line for line in out.stderr.splitlines() if line.strip()]
    assert (
        len(lines) == 1
        and "does not fit the Kubernetes schema at spec.template.spec.containers.1" in lines[0]
    )
    assert "Traceback" not in out.stderr


@pytest.mark.parametrize(
    ("text", "kw", "said"),
    [
        ("kind: Deployment\napiVersion: apps/v1\n", {}, "holds no Job documents"),
        ("apiVersion: batch/v1\nkind: Job\nspec: {template: {spec: {containers: []}}}\n", {}, "at least one"),
        ("apiVersion: batch/v2\nkind: Job\n", {}, "not 'batch/v1'"),
        ("apiVersion: batch/v1\nkind: Job\nspec: [\n", {}, "not YAML at line"),
        (PLAIN.replace("labels: {team: research}", "namespace: other"), {}, "is 'other', but the Jobs go to"),
        (PLAIN.replace("name: agent", "name: worker"), {}, "none named 'agent'"),
        (PLAIN, {"container": "nope"}, "no container named 'nope'"),
        (PLAIN.replace("image: registry.example.com/agent:1", "image: ''"), {}, "has no image"),
        (PLAIN.replace("KEEP_ME, value", "AGENTBOLT_TOKEN, value"), {}, "sets AGENTBOLT_TOKEN"),
        (
            PLAIN.replace('value: "yes"', "value: Bearer runner-token-0123456789"),
            {},
            "holds the runner's token",
        ),
        (
            PLAIN.replace("spec:\n  template:", "spec:\n  ttlSecondsAfterFinished: 0\n  template:"),
            {},
            "under 60 s",
        ),
        (PLAIN, {"command": ["python", "{0}"]}, "must name task fields"),
        (PLAIN, {"env": {"X": "{"}}, "bad template"),
    ],
)
def test_bad_templates_are_refused_in_one_line(tmp_path, text, kw, said):
    path = _write(tmp_path, text)
    with pytest.raises(ConfigError) as caught:
        JobTemplate(path, "agents", secrets=("runner-token-0123456789",), **kw)
    assert said in str(caught.value) and "\n" not in str(caught.value)


def test_a_missing_template_and_missing_task_fields(tmp_path):
    with pytest.raises(ConfigError, match="cannot read it"):
        JobTemplate(tmp_path / "nope.yaml", "agents")
    template = JobTemplate(_write(tmp_path, PLAIN), "agents", command=["run", "{missing}"])
    with pytest.raises(ProgramFailed, match="no field 'missing'") as caught:
        _render(template)
    assert caught.value.kind == "TaskField"
    big = JobTemplate(_write(tmp_path, PLAIN), "agents")
    with pytest.raises(ProgramFailed, match="over the") as caught:
        _render(big, task={"blob": "x" * TASK_ENV_LIMIT})
    assert caught.value.kind == "TaskTooLarge"


def test_job_names_and_labels_are_valid_and_the_same_for_the_same_attempt():
    for attempt in ["at-0123456789abcdef", "AT_Weird/Id:" + "x" * 200, "at-" + "f" * 80, "---"]:
        name = job_name(attempt)
        assert name == job_name(attempt) and len(name) <= 63
        assert kubernetes_validate.validate(
            {
                "apiVersion": "v1",
                "kind": "ConfigMap",
                "metadata": {"name": name, "labels": {"a": label_value(attempt)}},
            },
            "1.33",
            strict=True,
        )
        import re

        assert re.fullmatch(r"[a-z0-9]([-a-z0-9]*[a-z0-9])?", name)
        assert re.fullmatch(r"([A-Za-z0-9][-A-Za-z0-9_.]*)?[A-Za-z0-9]", label_value(attempt))
    assert job_name("AT-1") != job_name("at-1")  # ids differing in case get different Jobs


def _validate_status(body: dict) -> None:
    """A Status against meta/v1 Status from the same bundled schemas (kubernetes_validate
    files it under the meta group, so its own lookup by apiVersion does not find it)."""
    import jsonschema
    from referencing import Registry, Resource

    folder = "kubernetes-json-schema/v1.33.0-local-strict"
    schema = kubernetes_validate.utils.schema_contents(f"{folder}/status-meta-v1.json", "1.33")
    defs = kubernetes_validate.utils.schema_contents(f"{folder}/_definitions.json", "1.33")
    registry = Resource.from_contents(defs) @ (Resource.from_contents(schema) @ Registry())
    jsonschema.validators.Draft202012Validator(schema, registry=registry).validate(body)


@pytest.mark.parametrize("path", sorted(RECORDED.glob("*.json")), ids=lambda p: p.name)
def test_the_recorded_responses_fit_the_schema(path):
    """The files the API double serves are in the real API's shape (a watch event: its object;
    a bookmark's object is partial by design: only its resourceVersion counts)."""
    body = json.loads(path.read_text())
    if "type" in body and "object" in body:
        assert body["type"] in ("ADDED", "MODIFIED", "DELETED", "BOOKMARK", "ERROR") and len(body) == 2
        if body["type"] == "BOOKMARK":
            assert body["object"]["metadata"]["resourceVersion"].isdigit()
            return
        text = json.dumps(body["object"])
        body = body["object"]
    else:
        text = path.read_text()
    if body["kind"] == "Status":
        for hole in ("{name}", "{uid}", "{field}", "{detail}", "{version}", "{oldest}"):
            text = text.replace(hole, "x")
        _validate_status(json.loads(text))
        with pytest.raises(Exception, match="is not of type"):  # the check has teeth
            _validate_status({**json.loads(text), "code": "409"})
    else:
        assert kubernetes_validate.validate(body, "1.33", strict=True)


def _cli(tmp_path: Path, agent=None, command=None, **kw):
    from agentbolt.cli.kubernetes import launch_from_cli

    options = {"stdin": False, "env": [], "timeout": None, "scorer": None, "scorer_command": None}
    options |= {
        "reward_from": None,
        "reward_later": False,
        "output_limit": 1024,
        "namespace": "agents",
        "public_url": None,
    }
    options |= {"max_jobs": 1, "container": None, "name": "default", "lease_seconds": None, "max_rollouts": 1}
    return launch_from_cli(
        _write(tmp_path, PLAIN), agent, command, "http://127.0.0.1:9", None, **(options | kw)
    )


def test_the_command_lines_mistakes_are_one_line_each(tmp_path, monkeypatch):
    from agentbolt.errors import MissingExtra

    with pytest.raises(ConfigError, match="not an in-process --agent"):
        _cli(tmp_path, agent="my:agent")
    with pytest.raises(ConfigError, match="a pod has no stdin"):
        _cli(tmp_path, stdin=True)
    with pytest.raises(ConfigError, match="must look like NAME=TEMPLATE"):
        _cli(tmp_path, env=["NOPE"])
    with pytest.raises(ConfigError, match="cannot be split"):
        _cli(tmp_path, command="python 'unclosed")
    with pytest.raises(ConfigError, match="a pod cannot reach"):  # checked before any cluster call
        monkeypatch.setattr("agentbolt.cli.kubernetes.kube_api_client", lambda: None)
        monkeypatch.setattr(
            "agentbolt.cli.kubernetes.KubeApi", lambda client, ns: type("A", (), {"namespace": ns})
        )
        _cli(tmp_path)
    monkeypatch.undo()
    monkeypatch.setenv("KUBECONFIG", str(tmp_path / "no-kubeconfig"))
    monkeypatch.delenv("KUBERNETES_SERVICE_HOST", raising=False)
    with pytest.raises(ConfigError, match="cannot load the Kubernetes configuration"):
        _cli(tmp_path, public_url="http://agentbolt:8765")
    monkeypatch.setitem(sys.modules, "kubernetes", None)  # as if the extra were not installed
    with pytest.raises(MissingExtra, match=r"pip install 'agentbolt\[kubernetes\]'"):
        _cli(tmp_path)


def test_the_key_goes_in_the_jobs_secret_not_in_the_job(tmp_path):
    from agentbolt.runner.kube_template import SECRET_KEY, job_secret

    template = JobTemplate(_write(tmp_path, PLAIN), "agents")
    variables = {k: v for k, v in VARIABLES.items() if k != "OPENAI_API_KEY"}
    job = _render(template, variables=variables, secret_env={"OPENAI_API_KEY": SECRET_KEY})
    assert "ak_attempt_key" not in json.dumps(job)
    agent = job["spec"]["template"]["spec"]["containers"][1]
    refs = [v for v in agent["env"] if v["name"] == "OPENAI_API_KEY"]  # the template's stale one replaced
    assert refs == [
        {
            "name": "OPENAI_API_KEY",
            "valueFrom": {"secretKeyRef": {"name": job["metadata"]["name"], "key": SECRET_KEY}},
        }
    ]
    assert kubernetes_validate.validate(job, "1.33", strict=True)
    assert schema_problem(template.sample()) is None  # the sample the launcher checks at start reads it too
    created = {**job, "metadata": {**job["metadata"], "uid": "5f0c1a52-8a43-4c8e-9a51-2f6b3f0f7d11"}}
    secret = job_secret(created, {SECRET_KEY: "ak_attempt_key"})
    assert kubernetes_validate.validate(secret, "1.33", strict=True)
    assert secret["type"] == "Opaque" and secret["metadata"]["name"] == job["metadata"]["name"]
    assert secret["data"] == {SECRET_KEY: "YWtfYXR0ZW1wdF9rZXk="}  # base64 of the key
    assert secret["metadata"]["ownerReferences"] == [
        {
            "apiVersion": "batch/v1",
            "kind": "Job",
            "name": job["metadata"]["name"],
            "uid": "5f0c1a52-8a43-4c8e-9a51-2f6b3f0f7d11",
        }
    ]
