"""The Kubernetes launcher's reconcile loop, against recorded API responses.

No cluster runs here: the Kubernetes API is a TEST DOUBLE (tests/runner/k8s/kube_api_double.py)
serving JSON in the real API's shape from the files under tests/runner/k8s/, over real HTTP on
127.0.0.1, to the real `kubernetes` client (its watches too: chunked JSON-line streams). The agentbolt server, its SQLite store and the
attempts' credentials are real. The test plays the pod: it reads the variables the launcher
put in the Job (the key from the Job's Secret, as the kubelet would), posts the reward to the events URL with the attempt's key (the URL is the
server's public address, which the test maps to 127.0.0.1), and moves the Job to the state
chosen (complete; failed by deadline, by the backoff limit; an image that cannot be pulled).
"""

from __future__ import annotations

import base64
import json
import re
import threading
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import httpx
import kubernetes_validate
import pytest
from k8s.kube_api_double import KubeDouble
from kubernetes import client as kube

from agentbolt.client import Client
from agentbolt.errors import ConfigError
from agentbolt.runner.kube_api import KubeApi
from agentbolt.runner.kube_template import JobTemplate, job_name, schema_problem
from agentbolt.runner.kubernetes import JobLauncher
from agentbolt.schemas import LLM, AttemptStatus, PromptTemplate, RolloutCreate, RolloutStatus, Task
from agentbolt.server import Role, ServerConfig, ServerThread

pytestmark = pytest.mark.timeout(90)

ADMIN, RUNNER = "admin-token-0123456789", "runner-token-0123456789"
PUBLIC = "http://agentbolt-server.agents.svc:8765"
NS = "agents"
TEMPLATE = """\
apiVersion: batch/v1
kind: Job
spec:
  template:
    spec:
      containers:
        - name: agent
          image: registry.example.com/my-agent:1
"""
LEASE = 4.0  # seconds; 1.5 lapsed now and then on a loaded 2-core machine


@pytest.fixture
def server(tmp_path) -> Iterator[tuple[ServerThread, Client]]:
    config = ServerConfig(
        db=str(tmp_path / "s.db"), tokens={ADMIN: Role.ADMIN, RUNNER: Role.RUNNER}, sweep_interval=0.1
    )
    with ServerThread(config) as srv, Client(srv.url, ADMIN) as admin:
        prompt = PromptTemplate(template="Answer {{briefly}}.\nOne line.", engine="plain")
        admin.publish_resources(
            {"llm": LLM(base_url="http://127.0.0.1:9/v1", model="tiny"), "system_prompt": prompt}
        )
        yield srv, admin


@pytest.fixture
def double() -> Iterator[KubeDouble]:
    with KubeDouble(validate=lambda job: schema_problem(job)) as d:
        yield d


def _launcher(srv: ServerThread, double: KubeDouble, tmp_path: Path, **kw) -> JobLauncher:
    path = tmp_path / "job.yaml"
    path.write_text(TEMPLATE)
    template = JobTemplate(
        path,
        NS,
        command=["python", "agent.py", "{question}"],
        env={"QUESTION": "{question}"},
        secrets=(RUNNER,),
    )
    api = KubeApi(kube.ApiClient(kube.Configuration(host=double.url)), NS)
    options = {"public_url": PUBLIC, "lease_seconds": LEASE, "poll_wait": 0.2, "timeout": 300}
    return JobLauncher(template, api, srv.url, token=RUNNER, **(options | kw))


@contextmanager
def running(launcher: JobLauncher) -> Iterator[JobLauncher]:
    thread = threading.Thread(target=launcher.run_sync, args=(False,), daemon=True)
    thread.start()
    try:
        yield launcher
    finally:
        deadline = time.monotonic() + 10
        while not hasattr(launcher, "_loop") and time.monotonic() < deadline:
            time.sleep(0.01)
        launcher.stop()
        thread.join(timeout=15)
        assert not thread.is_alive(), "the launcher did not stop"


def wait_until(what: Callable[[], object], timeout: float = 20.0, said: str = "") -> object:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if value := what():
            return value
        time.sleep(0.05)
    raise AssertionError(f"timed out waiting: {said or what}")


def _enqueue(admin: Client, questions: list[str]) -> list[str]:
    rollouts = admin.enqueue(
        [RolloutCreate(task=Task(data={"question": q}), max_attempts=1) for q in questions]
    )
    return [r.id for r in rollouts]


def _attempt(admin: Client, rollout_id: str):
    attempts = wait_until(lambda: admin.list_attempts(rollout_id), said=f"an attempt of {rollout_id}")
    return attempts[-1]  # type: ignore[index]


def _env(job: dict, double: KubeDouble | None = None) -> dict[str, Any]:
    """The agent container's variables; with ``double``, those from a Secret resolved as the
    kubelet does (else left out)."""
    agent = job["spec"]["template"]["spec"]["containers"][0]
    env = {v["name"]: v["value"] for v in agent["env"] if "value" in v}
    for var in agent["env"]:
        ref = (var.get("valueFrom") or {}).get("secretKeyRef")
        if ref and double is not None:
            # as the kubelet does, wait for it (the launcher creates it right after the Job)
            name = ref["name"]
            secret = wait_until(lambda name=name: double.secret(name), said=f"the Secret {name}")
            env[var["name"]] = base64.b64decode(secret["data"][ref["key"]]).decode()
    return env


def _as_pod(srv: ServerThread, job: dict, reward: float, double: KubeDouble) -> None:
    """What the agent in the pod does: report its reward with the attempt's own key."""
    env = _env(job, double)
    url = env["AGENTBOLT_EVENTS_URL"].replace(PUBLIC, srv.url)
    answer = httpx.post(
        url, json={"reward": reward}, headers={"authorization": f"Bearer {env['OPENAI_API_KEY']}"}, timeout=10
    )
    assert answer.status_code == 200, answer.text


def _final(admin: Client, rollout_id: str, timeout: float = 20.0):
    def done():
        rollout = admin.get_rollout(rollout_id)
        return rollout if rollout.status in (RolloutStatus.SUCCEEDED, RolloutStatus.FAILED) else None

    return wait_until(done, timeout, f"rollout {rollout_id} to end")


def test_one_job_per_attempt_with_the_contract_and_each_outcome(server, double, tmp_path):
    srv, admin = server
    ok, deadline, exits, pull = _enqueue(admin, ["2+2?", "slow", "crash", "no image"])
    with running(_launcher(srv, double, tmp_path, max_jobs=4)) as launcher:
        attempts = {rid: _attempt(admin, rid) for rid in (ok, deadline, exits, pull)}
        names = {rid: job_name(a.id) for rid, a in attempts.items()}
        wait_until(lambda: len(double.job_names()) == 4, said="four Jobs")
        assert sorted(names.values()) == double.job_names()
        job = double.job(names[ok])
        assert job is not None
        env = _env(job)
        a = attempts[ok]
        # the program runner's contract, on the server's public address
        assert env["OPENAI_BASE_URL"] == f"{PUBLIC}/gateway/{ok}/{a.id}/v1"
        assert env["AGENTBOLT_EVENTS_URL"] == f"{PUBLIC}/agent/{ok}/{a.id}/events"
        assert env["OPENAI_MODEL"] == env["AGENTBOLT_MODEL"] == "tiny"
        # its one LLM resource as a role's variables too (one resource: the plain URL)
        llm_vars = {k: v for k, v in env.items() if k.startswith("AGENTBOLT_LLM_")}
        assert (
            len(llm_vars) == 2
            and env[next(k for k in llm_vars if k.endswith("_BASE_URL"))] == env["OPENAI_BASE_URL"]
        )
        assert "OPENAI_API_KEY" not in env  # not in the Job: in its Secret
        assert _env(job, double)["OPENAI_API_KEY"].startswith("ak_")
        assert env["AGENTBOLT_ROLLOUT_ID"] == ok and env["AGENTBOLT_ATTEMPT_ID"] == a.id
        assert json.loads(env["AGENTBOLT_TASK"]) == {"question": "2+2?"} and env["QUESTION"] == "2+2?"
        assert env["AGENTBOLT_TASK_ID"] == admin.get_rollout(ok).task.id
        # the prompt resource's text (a pod shares no file with the runner: no _FILE variable)
        assert env["AGENTBOLT_PROMPT_SYSTEM_PROMPT"] == "Answer {{briefly}}.\nOne line."
        assert "AGENTBOLT_PROMPT_SYSTEM_PROMPT_FILE" not in env
        assert job["spec"]["template"]["spec"]["containers"][0]["command"] == ["python", "agent.py", "2+2?"]
        assert RUNNER not in json.dumps(double.created)  # never the runner's token
        spec = job["spec"]
        assert spec["backoffLimit"] == 0 and spec["activeDeadlineSeconds"] == 300
        assert spec["ttlSecondsAfterFinished"] > 0 and spec["template"]["spec"]["restartPolicy"] == "Never"
        assert job["metadata"]["labels"]["agentbolt.dev/attempt"] == a.id
        assert job["metadata"]["labels"]["agentbolt.dev/launcher"] == "default"
        for body in double.created:  # each Job as sent fits the API's schema
            assert kubernetes_validate.validate(body, "1.33", strict=True)
        # leases are kept while the Jobs run: well past the lease, every attempt still runs
        time.sleep(LEASE * 2)
        for rid in attempts:
            assert admin.list_attempts(rid)[-1].status == AttemptStatus.RUNNING
        # the pods: one succeeds with a posted reward, the others fail their ways
        _as_pod(srv, job, 0.75, double)
        double.set_state(names[ok], "complete", log="thinking\nanswer: 4\n")
        double.set_state(names[deadline], "deadline")
        double.set_state(names[exits], "backoff", log="Traceback: boom\n")
        double.set_state(names[pull], "image-pull")
        done = {rid: _final(admin, rid) for rid in attempts}
        assert done[ok].status == RolloutStatus.SUCCEEDED and done[ok].reward == 0.75
        assert done[deadline].status == RolloutStatus.FAILED and "DeadlineExceeded" in done[deadline].error
        assert "activeDeadlineSeconds (300 s)" in done[deadline].error
        assert "BackoffLimitExceeded" in done[exits].error and "exited with code 3" in done[exits].error
        assert "ImagePullBackOff" in done[pull].error and "not found" in done[pull].error
        # the pod's log is recorded; each reported Job is deleted
        logs = [e.data for e in admin.all_events(ok) if e.type == "message" and e.data.get("role") == "log"]
        assert logs and "answer: 4" in logs[0]["content"]
        crash = [e.data for e in admin.all_events(exits) if e.type == "exception"]
        assert crash and crash[-1]["type"] == "ProgramExit"
        wait_until(lambda: not double.job_names(), said="the reported Jobs deleted")
        assert double.count("POST", r"/jobs$") == 4
        assert launcher.completed == 1 and launcher.failed == 3


def test_without_a_posted_reward_the_scorer_sees_the_pods_log_or_the_attempt_fails(server, double, tmp_path):
    srv, admin = server
    seen = []

    def scorer(run):
        seen.append(run)
        return 1.0 if "answer: 4" in run.stdout else 0.0

    right, wrong = _enqueue(admin, ["2+2?", "2+3?"])
    with running(_launcher(srv, double, tmp_path, scorer=scorer)):
        names = {rid: job_name(_attempt(admin, rid).id) for rid in (right, wrong)}
        wait_until(lambda: len(double.job_names()) == 2, said="two Jobs")
        double.set_state(names[right], "complete", log="answer: 4\n")
        double.set_state(names[wrong], "complete", log="answer: 6\n")
        assert _final(admin, right).reward == 1.0 and _final(admin, wrong).reward == 0.0
    assert sorted(r.task.data["question"] for r in seen) == ["2+2?", "2+3?"]
    assert all(r.exit_code == 0 for r in seen)
    # no scorer and nothing posted: the attempt fails, saying so
    (silent,) = _enqueue(admin, ["quiet"])
    with running(_launcher(srv, double, tmp_path)):
        name = job_name(_attempt(admin, silent).id)
        wait_until(lambda: double.job(name), said="the Job")
        double.set_state(name, "complete")
        rollout = _final(admin, silent)
    assert rollout.status == RolloutStatus.FAILED and "no reward" in rollout.error


def test_an_event_the_server_refuses_is_dropped_alone_and_fails_the_attempt_with_the_reason(tmp_path, double):
    """The pod's log (150 kB) is over the server's body limit (64 KiB); the Job's other events
    (its exit, its reward) are sent with it. Only the log is dropped, found by halving the
    refused batch as a runner does, and the attempt fails naming it; before, the whole upload
    was refused and the attempt's record held none of the Job's events."""
    config = ServerConfig(
        db=str(tmp_path / "s.db"),
        tokens={ADMIN: Role.ADMIN, RUNNER: Role.RUNNER},
        sweep_interval=0.1,
        max_body_bytes=64 * 1024,
    )
    with ServerThread(config) as srv, Client(srv.url, ADMIN) as admin:
        (rid,) = _enqueue(admin, ["2+2?"])
        with running(_launcher(srv, double, tmp_path, output_limit=1_000_000)) as launcher:
            name = job_name(_attempt(admin, rid).id)
            wait_until(lambda: double.job(name), said="the Job")
            job = double.job(name)
            assert job is not None
            _as_pod(srv, job, 0.75, double)
            double.set_state(name, "complete", log="answer: 4\n" * 15_000)
            rollout = _final(admin, rid)
        assert launcher.failed == 1 and launcher.completed == 0
        refused = r"the server refused event \d+ \(message\): HTTP 413"
        assert rollout.status == RolloutStatus.FAILED and re.search(refused, rollout.error), rollout.error
        [attempt] = admin.list_attempts(rid)
        assert attempt.status == AttemptStatus.FAILED and re.search(refused, attempt.error or "")
        events = admin.all_events(rid)
        assert not [e for e in events if e.type == "message" and e.data.get("role") == "log"]
        [exit_] = [e.data for e in events if e.type == "job_exit"]
        assert exit_["job"] == name and exit_["condition"] == "Complete"
        assert [e.data["value"] for e in events if e.type == "reward" and e.data.get("final")] == [0.75]
        [record] = [e.data for e in events if e.type == "exception"]
        assert record["type"] == "EventRefused" and re.search(refused, record["message"])


def test_a_cancelled_rollout_has_its_job_deleted(server, double, tmp_path):
    srv, admin = server
    (rid,) = _enqueue(admin, ["cancel me"])
    with running(_launcher(srv, double, tmp_path)) as launcher:
        name = job_name(_attempt(admin, rid).id)
        wait_until(lambda: double.job(name), said="the Job")
        double.set_state(name, "running")
        admin.cancel(rid)
        wait_until(lambda: double.job(name) is None, timeout=LEASE * 4, said="the Job deleted")
        assert double.count("DELETE", rf"/jobs/{name}") == 1
        assert admin.get_rollout(rid).status == RolloutStatus.CANCELLED
        wait_until(lambda: not launcher.tracked, said="the attempt untracked")
        assert launcher.lost == 1


def test_a_restarted_launcher_adopts_its_jobs_and_deletes_stale_ones(server, double, tmp_path):
    srv, admin = server
    first, second = _enqueue(admin, ["one", "two"])
    with running(_launcher(srv, double, tmp_path)):
        names = {rid: job_name(_attempt(admin, rid).id) for rid in (first, second)}
        wait_until(lambda: len(double.job_names()) == 2, said="two Jobs")
    # the launcher is gone; its Jobs run on. A Job of an attempt that no longer runs is stale.
    stale = json.loads(json.dumps(double.job(names[second])))
    for key in ("uid", "resourceVersion", "generation", "creationTimestamp"):
        stale["metadata"].pop(key)
    stale["metadata"]["name"] = "agentbolt-at-stale"
    stale["metadata"]["annotations"]["agentbolt.dev/attempt-id"] = "at-stale"
    stale.pop("status")
    double.add_job(stale)
    double.set_state(names[first], "running")
    with running(_launcher(srv, double, tmp_path)) as again:
        wait_until(lambda: again.adopted == 2, said="two Jobs adopted")
        wait_until(lambda: double.job("agentbolt-at-stale") is None, said="the stale Job deleted")
        time.sleep(LEASE * 2)  # the adopted attempts' leases are kept
        for rid in (first, second):
            assert admin.list_attempts(rid)[-1].status == AttemptStatus.RUNNING
            assert len(admin.list_attempts(rid)) == 1
        for rid, reward in ((first, 1.0), (second, 0.5)):
            job = double.job(names[rid])
            assert job is not None
            _as_pod(srv, job, reward, double)
            double.set_state(names[rid], "complete")
        assert _final(admin, first).reward == 1.0 and _final(admin, second).reward == 0.5
    assert double.count("POST", r"/jobs$") == 2  # no second Job for any attempt


def test_a_create_whose_answer_was_lost_is_adopted_on_409_not_duplicated(server, double, tmp_path):
    srv, admin = server
    double.lose_create_answers = 1  # stored, but answered 504 Timeout: the launcher tries again
    (rid,) = _enqueue(admin, ["once"])
    with running(_launcher(srv, double, tmp_path)):
        name = job_name(_attempt(admin, rid).id)
        wait_until(lambda: double.count("POST", r"/jobs$") == 2, said="the create tried twice")
        wait_until(lambda: double.count("GET", rf"/jobs/{name}$") >= 1, said="the 409 looked into")
        assert double.job_names() == [name] and len(double.created) == 1
        job = double.job(name)
        assert job is not None
        _as_pod(srv, job, 0.25, double)
        double.set_state(name, "complete")
        assert _final(admin, rid).reward == 0.25
    assert admin.list_attempts(rid)[-1].status == AttemptStatus.SUCCEEDED


def test_an_api_server_in_trouble_releases_the_attempt_to_be_tried_again(server, double, tmp_path):
    srv, admin = server
    double.refuse_creates = 3  # every try of the first create: 504, nothing stored
    (rid,) = _enqueue(admin, ["later"])
    with running(_launcher(srv, double, tmp_path)):
        wait_until(lambda: double.job_names(), said="a Job once the API answers again")
        attempts = admin.list_attempts(rid)
        assert [a.status for a in attempts] == [AttemptStatus.RELEASED, AttemptStatus.RUNNING]
        assert "Timeout" in (attempts[0].error or "")
        assert double.job_names() == [job_name(attempts[1].id)]
        assert double.count("POST", r"/jobs$") == 4


def test_a_job_the_api_or_the_client_refuses_fails_its_attempt_with_the_reason(server, double, tmp_path):
    srv, admin = server
    # a field of the wrong type: the client's models refuse it before it is sent
    launcher = _launcher(srv, double, tmp_path)
    launcher.template.job["spec"]["template"]["spec"]["containers"][0]["ports"] = [{"containerPort": "http"}]
    (typed,) = _enqueue(admin, ["x"])
    with running(launcher):
        rollout = _final(admin, typed)
    assert rollout.status == RolloutStatus.FAILED
    assert "ClientValidation" in rollout.error and "containerPort" in rollout.error
    # the API server's own refusal (here: an admission policy's 422 Invalid, served by the double)
    double.validate = lambda job: "spec.template.spec.containers[0].image: registry not allowed by policy"
    (refused,) = _enqueue(admin, ["y"])
    with running(_launcher(srv, double, tmp_path)):
        rollout = _final(admin, refused)
    assert rollout.status == RolloutStatus.FAILED
    assert "422 Invalid" in rollout.error and "registry not allowed by policy" in rollout.error
    assert not double.job_names() and not double.created


def test_loopback_public_url_is_refused(server, double, tmp_path):
    srv, _ = server
    with pytest.raises(ConfigError, match="a pod cannot reach"):
        _launcher(srv, double, tmp_path, public_url=None)
    with pytest.raises(ConfigError, match="loopback"):
        _launcher(srv, double, tmp_path, public_url="http://localhost:8765")


def _versions(job: dict) -> str:
    return str(job["metadata"]["resourceVersion"])


def test_jobs_are_followed_through_the_watch_and_the_key_is_in_a_secret_owned_by_the_job(
    server, double, tmp_path
):
    srv, admin = server
    ok, crash = _enqueue(admin, ["2+2?", "crash"])
    with running(_launcher(srv, double, tmp_path, max_jobs=2)):
        names = {rid: job_name(_attempt(admin, rid).id) for rid in (ok, crash)}
        for name in names.values():
            wait_until(lambda name=name: double.secret(name), said=f"the Secret of {name}")
        job, secret = double.job(names[ok]), double.secret(names[ok])
        assert job is not None and secret is not None
        # the Job holds no key: its container reads it from the Secret of the same name
        key = base64.b64decode(secret["data"]["agent-key"]).decode()
        assert key.startswith("ak_") and key not in json.dumps(double.created)
        [ref] = [v for v in job["spec"]["template"]["spec"]["containers"][0]["env"] if "valueFrom" in v]
        assert ref == {
            "name": "OPENAI_API_KEY",
            "valueFrom": {"secretKeyRef": {"name": names[ok], "key": "agent-key"}},
        }
        # the Secret: Opaque, labelled as its Job, owned by it (the garbage collector deletes it)
        assert secret["type"] == "Opaque"
        assert secret["metadata"]["labels"]["agentbolt.dev/launcher"] == "default"
        owner = {"apiVersion": "batch/v1", "kind": "Job", "name": names[ok], "uid": job["metadata"]["uid"]}
        assert secret["metadata"]["ownerReferences"] == [owner]
        for body in double.created_secrets:  # as sent, it fits the API's schema
            assert kubernetes_validate.validate(body, "1.33", strict=True)
        # a pod that reached the kubelet before its Secret existed waits; it is not failed
        double.set_state(names[ok], "secret-pending")
        time.sleep(1.0)
        assert admin.list_attempts(ok)[-1].status == AttemptStatus.RUNNING
        _as_pod(srv, job, 0.5, double)
        double.set_state(names[ok], "complete")
        double.set_state(names[crash], "backoff", log="Traceback: boom\n")
        assert _final(admin, ok).reward == 0.5
        assert "BackoffLimitExceeded" in _final(admin, crash).error
        for name in names.values():  # each reported Job is deleted, its Secret with it
            wait_until(lambda name=name: double.job(name) is None and double.secret(name) is None)
            assert double.count("DELETE", rf"/jobs/{name}(\?|$)") == 1
            assert double.count("DELETE", rf"/secrets/{name}(\?|$)") == 1
    # followed, not polled: one list of each kind, then watches from its version; no Job read
    assert double.lists("jobs") == 1 and double.lists("pods") == 1 + 2  # + each ended Job's pod
    assert double.watches("jobs") and double.watches("pods")
    assert double.count("GET", r"/jobs/agentbolt-") == 0


def test_a_dropped_watch_resumes_from_the_last_version_and_410_lists_again(server, double, tmp_path):
    srv, admin = server
    (rid,) = _enqueue(admin, ["2+2?"])
    with running(_launcher(srv, double, tmp_path)) as launcher:
        name = job_name(_attempt(admin, rid).id)
        wait_until(lambda: double.secret(name), said="the Secret")
        wait_until(lambda: name in launcher.watched.jobs, said="the Job seen through the watch")
        jobs, pods = launcher.followers
        # the stream breaks off (no chunked end) right after it sends the Job running
        double.drop_after_next_event("jobs")
        double.set_state(name, "running")
        running_version = _versions(double.job(name) or {})
        wait_until(lambda: jobs.resumed == 1, said="the watch resumed")
        wait_until(lambda: running_version in double.watches("jobs"), said="a watch from the last version")
        assert double.watches("jobs")[-1] == running_version and jobs.relisted == 0
        # the API server no longer has that version: 410 Expired, then a list and a watch from it
        double.expire()
        wait_until(lambda: jobs.relisted == 1 and pods.relisted == 1, said="both listed again")
        assert double.lists("jobs") == 2
        wait_until(lambda: int(double.watches("jobs")[-1]) >= double.oldest, said="watching again")
        job = double.job(name)
        assert job is not None
        _as_pod(srv, job, 1.0, double)
        double.set_state(name, "complete")
        assert _final(admin, rid).reward == 1.0
        wait_until(lambda: double.job(name) is None, said="the Job deleted")
    assert launcher.completed == 1 and double.count("GET", r"/jobs/agentbolt-") == 0


def test_a_secret_that_cannot_be_created_deletes_its_job_and_fails_the_attempt(server, double, tmp_path):
    srv, admin = server
    double.refuse_secrets = 1  # 403: the launcher's Role may not create secrets
    (rid,) = _enqueue(admin, ["no secret"])
    with running(_launcher(srv, double, tmp_path)) as launcher:
        rollout = _final(admin, rid)
        name = job_name(admin.list_attempts(rid)[-1].id)
        assert rollout.status == RolloutStatus.FAILED
        assert "403 Forbidden" in rollout.error and "cannot create resource" in rollout.error
        assert f"Secret {name}" in rollout.error and "the Job was deleted" in rollout.error
        assert double.count("POST", r"/jobs$") == 1 and double.count("DELETE", rf"/jobs/{name}(\?|$)") == 1
        assert not double.job_names() and double.secret(name) is None
        assert not launcher.tracked
