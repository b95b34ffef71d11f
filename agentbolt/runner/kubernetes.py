"""One Kubernetes Job per rollout: program agents isolated in pods of their own.

:class:`JobLauncher` claims attempts from the store like a runner and runs each as a Job made
from the user's template (:mod:`agentbolt.runner.kube_template`), its agent container given
the attempt's variables: the program runner's contract (docs/agents.md), with the task in
``AGENTBOLT_TASK`` (there is no shared file system) and every URL on the server's
cluster-reachable address (``public_url``). It talks to the cluster through
:mod:`agentbolt.runner.kube_api`: it lists its Jobs and pods once, then follows them with the
client's watch (:mod:`agentbolt.runner.kube_watch`: resumed from the last resourceVersion when
a stream drops, listed again on 410 Gone), and acts on each change; the store stays the source
of truth. What it tells the server of each attempt (lease, events, finish) is the runner's own
cycle (:mod:`agentbolt.runner.attempt`):

* a claimed attempt gets one Job, named after the attempt (so a second create for it is
  answered 409 by the API server, and taken as the Job it already has), labelled with the
  launcher, rollout and attempt; ``backoffLimit: 0`` (one pod: retrying is the store's
  decision), ``activeDeadlineSeconds`` from the timeout, ``ttlSecondsAfterFinished``; the
  attempt's key is not in the Job but in a Secret owned by it
  (:mod:`agentbolt.runner.kube_launch` says why, and in which order);
* while the Job runs, the launcher heartbeats the attempt's lease;
* a Job that ends is reported with its outcome (:mod:`agentbolt.runner.kube_outcome`): the
  reward the program posted, else the scorer's; or a failure with its reason;
* a Job whose attempt is no longer running in the store (cancelled, lease lost, finished) is
  deleted, and so is each Job once its attempt is reported, its Secret with it;
* after a restart the launcher lists its Jobs by label and adopts those whose attempts it
  still holds (it acts under a stable worker id, ``worker_id``, for that reason).

Stopping the launcher (SIGTERM, Ctrl-C) stops claiming and leaves the running Jobs alone: the
next launcher of the same name adopts them; if none comes within the lease, the store retries
their rollouts and the next launcher deletes the stale Jobs.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import signal
import time
from collections.abc import Callable, Sequence
from typing import Any

from agentbolt.client import AsyncClient, Client, RetryPolicy
from agentbolt.errors import (
    AgentboltError,
    ConfigError,
    LeaseLost,
    NotFound,
    WorkerRevoked,
    WorkerTokenExpired,
)
from agentbolt.runner import kube_state
from agentbolt.runner.agent import RolloutContext
from agentbolt.runner.attempt import AttemptCycle, claim
from agentbolt.runner.kube_api import KubeApi, KubeError
from agentbolt.runner.kube_launch import (
    SECRET_ENV,
    SecretFailed,
    Tracked,
    check_public_url,
    create_job,
    create_secret,
    variables,
)
from agentbolt.runner.kube_outcome import JobOutcomes, failed
from agentbolt.runner.kube_template import (
    ATTEMPT_ANNOTATION,
    LAUNCHER_LABEL,
    ROLLOUT_ANNOTATION,
    JobTemplate,
    label_value,
)
from agentbolt.runner.kube_watch import Follower, Watched
from agentbolt.runner.program_io import OUTPUT_LIMIT, ProgramFailed
from agentbolt.runner.program_reward import AttemptAccess, ProgramRun, Scorer, reward_sources
from agentbolt.schemas import AttemptStatus, Claim

__all__ = ["JobLauncher"]

log = logging.getLogger("agentbolt.kubernetes")


# ---------------------------------------------------------------------------- the launcher


class JobLauncher:
    """Run each claimed attempt as a Kubernetes Job (see the module's text).

    * ``template``: the :class:`JobTemplate` (its namespace is where the Jobs go);
    * ``api``: a :class:`KubeApi`;
    * ``public_url``: the server's address as pods reach it (default: ``server_url``);
    * ``name``: this launcher (the label its Jobs carry; one launcher per name at a time);
    * ``worker_id``: the identity it holds attempts under (default ``k8s-<namespace>-<name>``),
      the same after a restart so that it can adopt its Jobs;
    * ``max_jobs``: Jobs at a time; ``timeout``: each Job's ``activeDeadlineSeconds`` (default
      the rollout's own timeout, if it has one);
    * ``scorer`` / ``scorer_command`` / ``reward_from`` / ``reward_later``: as :class:`~agentbolt.runner.Program`;
    * ``resync``: seconds between passes over the watched Jobs (no API call: the watch keeps
      them current); they adopt a Job of this launcher's it does not track, and retry a delete
      that failed;
    * ``watch_timeout``: seconds each watch request lasts (the API server's ``timeoutSeconds``)
      before it is resumed from its last resourceVersion.
    """

    def __init__(
        self,
        template: JobTemplate,
        api: KubeApi,
        server_url: str,
        *,
        token: str | None = None,
        public_url: str | None = None,
        name: str = "default",
        worker_id: str | None = None,
        max_jobs: int = 10,
        timeout: float | None = None,
        scorer: Callable[[ProgramRun], Any] | None = None,
        scorer_command: Sequence[str] | None = None,
        reward_from: str | Sequence[str] | None = None,
        reward_later: bool = False,
        output_limit: int = OUTPUT_LIMIT,
        llm: str | None = None,
        lease_seconds: float | None = None,
        poll_wait: float = 5.0,
        resync: float = 10.0,
        max_rollouts: int | None = None,
        watch_timeout: int = 300,
    ) -> None:
        if max_jobs < 1:
            raise ConfigError(f"max_jobs must be at least 1, not {max_jobs}")
        if timeout is not None and timeout <= 0:
            raise ConfigError(f"timeout must be positive, not {timeout}")
        self.template, self.api = template, api
        self.namespace = api.namespace
        self.public_url = (public_url or server_url).rstrip("/")
        check_public_url(self.public_url, public_url is None)
        self.name = name
        self.label = label_value(name)
        self.selector = f"{LAUNCHER_LABEL}={self.label}"
        self.worker_id = worker_id or f"k8s-{self.namespace}-{name}"
        self.max_jobs, self.timeout, self.max_rollouts = max_jobs, timeout, max_rollouts
        self.llm, self.lease_seconds, self.poll_wait, self.resync = llm, lease_seconds, poll_wait, resync
        self.watch_timeout = watch_timeout
        # Retry forever while the server is down (as a runner does): the Jobs go on meanwhile.
        self.client = AsyncClient(
            server_url, token, retry=RetryPolicy(attempts=0, base_delay=0.2, max_delay=5.0)
        )
        access = AttemptAccess(None, self.public_url, self.client, (token,) if token else ())
        scoring = Scorer(scorer, scorer_command, timeout)
        outcomes = (scoring, reward_later, output_limit, reward_sources(reward_from, scoring.present))
        self.outcomes = JobOutcomes(api, template.container_name, access, *outcomes)
        self._sync = Client(server_url, token, retry=RetryPolicy(attempts=5, base_delay=0.2, max_delay=5.0))
        self.tracked: dict[str, Tracked] = {}
        self.completed = self.failed = self.lost = self.adopted = self.deleted = 0
        self._stopping: asyncio.Event | None = None
        self._room: asyncio.Event | None = None
        self._tasks: set[asyncio.Task[Any]] = set()
        self.watched = Watched()
        self.followers: list[Follower] = []
        self._adopting: set[str] = set()

    # ------------------------------------------------------------------ lifecycle

    def run_sync(self, install_signals: bool = True) -> None:
        asyncio.run(self.run(install_signals))

    async def run(self, install_signals: bool = False) -> None:
        """Reconcile and claim until stopped; the Jobs still running are left to run."""
        self._stopping, self._room = asyncio.Event(), asyncio.Event()
        self._loop = asyncio.get_running_loop()
        if install_signals:
            for sig in (signal.SIGINT, signal.SIGTERM):
                self._loop.add_signal_handler(sig, self.stop)
        log.info(
            "launcher %s: up to %d Jobs in namespace %s, as worker %s; pods reach the server at %s",
            *(self.name, self.max_jobs, self.namespace, self.worker_id, self.public_url),
        )
        try:
            await self._follow()  # adopt first: what runs counts against max_jobs
            claimer = asyncio.create_task(self._claim_loop())
            while not self._done:
                await self._sleep(self.resync)
                if self._stopping.is_set():
                    break
                try:
                    await self._sweep(None)
                except Exception:
                    log.exception("a pass over the Jobs failed; trying again in %.0f s", self.resync)
            await asyncio.wait({claimer}, timeout=30)  # a launch in flight ends: its Job gets its Secret
            claimer.cancel()
            await asyncio.gather(claimer, return_exceptions=True)
            await self._wind_down()
        finally:
            for follower in self.followers:
                follower.stop()
            await self.client.aclose()
            self._sync.close()

    def stop(self) -> None:
        """Stop claiming and return; running Jobs are left to the next launcher."""
        if self._stopping is not None:
            self._loop.call_soon_threadsafe(self._stopping.set)

    def identity_lost(self, exc: WorkerRevoked | WorkerTokenExpired) -> None:
        """The server no longer takes this launcher's token: stop; the Jobs still running are
        left to a launcher the server takes."""
        log.error("launcher %s: %s; stopping", self.name, exc)
        if self._stopping is not None:
            self._stopping.set()

    @property
    def _done(self) -> bool:
        assert self._stopping is not None
        if self.max_rollouts is not None and self.completed + self.failed >= self.max_rollouts:
            return True
        return self._stopping.is_set()

    async def _sleep(self, seconds: float) -> None:
        assert self._stopping is not None
        with contextlib.suppress(asyncio.TimeoutError):
            await asyncio.wait_for(self._stopping.wait(), seconds)

    async def _wind_down(self) -> None:
        """Let reports in flight end (briefly); stop the heartbeats."""
        reports = [t for t in self._tasks if not t.done()]
        if reports:
            await asyncio.wait(reports, timeout=10)
        for tracked in self.tracked.values():
            if tracked.keeper is not None:
                tracked.keeper.cancel()
        for task in [*self._tasks, *(t.keeper for t in self.tracked.values() if t.keeper)]:
            task.cancel()
        await asyncio.gather(*self._tasks, return_exceptions=True)

    def _spawn(self, coro: Any) -> None:
        task = asyncio.create_task(coro)
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)

    def _untrack(self, tracked: Tracked) -> None:
        self.tracked.pop(tracked.attempt_id, None)
        if tracked.keeper is not None and tracked.keeper is not asyncio.current_task():
            tracked.keeper.cancel()
        assert self._room is not None
        self._room.set()

    # ------------------------------------------------------------------ claiming

    async def _claim_loop(self) -> None:
        assert self._stopping is not None and self._room is not None
        while not self._done:
            if len(self.tracked) >= self.max_jobs:
                self._room.clear()
                waits = [
                    asyncio.ensure_future(self._room.wait()),
                    asyncio.ensure_future(self._stopping.wait()),
                ]
                await asyncio.wait(waits, return_when=asyncio.FIRST_COMPLETED)
                for wait in waits:
                    wait.cancel()
                continue
            try:
                claimed = await claim(self, self.poll_wait, self._stopping)
            except AgentboltError as exc:
                log.error("dequeue failed: %s", exc)
                await self._sleep(1.0)
                continue
            if claimed is None:
                continue
            try:
                await self._launch(claimed)
            except Exception:  # the attempt's lease runs out and the store retries it
                log.exception("launching attempt %s failed", claimed.attempt.id)
                dropped = self.tracked.get(claimed.attempt.id)
                if dropped is not None:
                    self._untrack(dropped)
                await self._sleep(1.0)

    async def _launch(self, claim: Claim) -> None:
        attempt_id = claim.attempt.id
        cycle = AttemptCycle(self, RolloutContext(claim.rollout, claim.attempt, claim.resources))
        tracked = Tracked(attempt_id, claim.rollout.id, "", cycle, claim.lease_seconds)
        self.tracked[attempt_id] = tracked
        env, secret = variables(claim, self.public_url, self.llm)
        try:
            body = self.template.render(
                attempt_id=attempt_id,
                rollout_id=claim.rollout.id,
                launcher=self.label,
                task=claim.rollout.task.data,
                variables=env,
                timeout=self.timeout or claim.rollout.timeout_seconds,
                secret_env=SECRET_ENV,
            )
        except ProgramFailed as exc:
            self.tracked.pop(attempt_id, None)
            await self._report_failure(tracked, exc.kind, str(exc))
            return
        tracked.job = body["metadata"]["name"]
        tracked.keeper = asyncio.create_task(self._keep(tracked))  # the lease, while creating too
        try:
            job = await create_job(self.api, body, attempt_id)
            await create_secret(self.api, job, secret)  # after the Job: see kube_launch
            tracked.secret = True
        except KubeError as exc:
            self._untrack(tracked)
            what = "Secret" if isinstance(exc, SecretFailed) else "Job"
            if tracked.ending:  # no longer ours meanwhile: nothing to report
                return
            if exc.transient:  # not this attempt's fault: hand it back, try again later
                log.warning(
                    "could not create %s %s (%s); attempt %s released", what, tracked.job, exc, attempt_id
                )
                with contextlib.suppress(LeaseLost, NotFound):
                    await cycle.finish(AttemptStatus.RELEASED, None, f"Kubernetes API: {exc}")
                await self._sleep(2.0)
            else:
                said = f"Kubernetes refused the {what} {tracked.job}: {exc}"
                await self._report_failure(tracked, "JobRejected", said)
            return
        if tracked.ending:  # the store took the attempt back while the Job was being created
            await self._delete(tracked)
            return
        tracked.created = time.monotonic()
        log.info("attempt %s: Job %s created", attempt_id, tracked.job)
        self._consider(tracked.job)  # the watch may have shown it ending meanwhile

    # ------------------------------------------------------------------ keeping the lease

    async def _keep(self, tracked: Tracked) -> None:
        """Heartbeat the attempt while its Job runs; once the store says it is no longer ours
        (cancelled, lease lost, finished elsewhere), delete the Job."""
        cycle = tracked.cycle
        assert cycle is not None
        await cycle.heartbeats((tracked.lease_seconds or self.lease_seconds or 30.0) / 3)
        if tracked.ending:
            return
        tracked.ending = True
        log.warning(
            "attempt %s is no longer ours (%s): deleting Job %s", tracked.attempt_id, cycle.why, tracked.job
        )
        self.lost += 1
        if tracked.created is not None:  # else the launch deletes it once created
            await self._delete(tracked)

    async def _delete(self, tracked: Tracked) -> None:
        """Delete the Job, then its Secret (which the garbage collector would delete too)."""
        try:
            if await asyncio.to_thread(self.api.delete_job, tracked.job):
                self.deleted += 1
            self.watched.deleted(tracked.job)
        except KubeError as exc:  # the next pass finds it again (not ours any more) and retries
            log.warning("could not delete Job %s: %s", tracked.job, exc)
        try:
            await asyncio.to_thread(self.api.delete_secret, tracked.job)
        except KubeError as exc:  # owned by the Job: the garbage collector deletes it
            log.warning(
                "could not delete Secret %s (its Job's garbage collection will): %s", tracked.job, exc
            )
        self._untrack(tracked)

    # ------------------------------------------------------------------ following the Jobs

    async def _follow(self) -> None:
        """List the Jobs and pods, act on them, then follow them with watches from there."""
        listed = time.monotonic()
        jobs, jobs_version = await asyncio.to_thread(self.api.listing, "jobs", self.selector)
        pods, pods_version = await asyncio.to_thread(self.api.listing, "pods", self.selector)
        self.watched.apply("pods", "SYNC", (pods, listed))
        self.watched.apply("jobs", "SYNC", (jobs, listed))
        await self._sweep(listed)
        for kind, version in (("jobs", jobs_version), ("pods", pods_version)):
            follower = Follower(
                self.api, kind, self.selector, version, self._deliver, timeout=self.watch_timeout
            )
            self.followers.append(follower)
            follower.start()

    def _deliver(self, kind: str, change: str, payload: Any) -> None:
        """From a watch's thread: hand the change to the event loop."""
        with contextlib.suppress(RuntimeError):  # the loop is closed: the launcher has ended
            self._loop.call_soon_threadsafe(self._on_change, kind, change, payload)

    def _on_change(self, kind: str, change: str, payload: Any) -> None:
        """A change a watch saw, or ``SYNC``: the whole list again (after 410 Gone)."""
        concerned = self.watched.apply(kind, change, payload)
        if change == "SYNC" and kind == "jobs":
            self._spawn(self._sweep(payload[1]))
            return
        for name, what in concerned:
            self._consider(name, adopt=what == "ADDED", gone=what == "DELETED")

    def _consider(self, name: str, *, adopt: bool = False, gone: bool = False) -> None:
        """Act on what the watch shows of Job ``name``: report it once it ended, or vanished
        (``gone``); adopt it (``adopt``) if it is this launcher's but not tracked."""
        tracked = next((t for t in self.tracked.values() if t.job == name), None)
        job = self.watched.jobs.get(name)
        if tracked is None:
            if adopt and job is not None and name not in self._adopting:
                self._spawn(self._adopt(job))
            return
        if tracked.ending or tracked.created is None or (job is None and not gone):
            return
        if job is None:
            tracked.ending = True
            self._spawn(self._end(tracked, None, None))
            return
        pod, container = self.watched.pod_of(name), self.template.container_name
        stuck = kube_state.image_error(pod, container)
        if stuck and tracked.secret and kube_state.waiting_for_secret(pod, container, name):
            stuck = False  # the pod started before its Secret existed: the kubelet retries it
        if kube_state.finished(job) or stuck:
            tracked.ending = True
            self._spawn(self._end(tracked, job, pod))

    async def _sweep(self, listed: float | None) -> None:
        """A pass over the watched Jobs: adopt this launcher's that it does not track, act on
        the tracked. After a list begun at ``listed``, a tracked Job created before it and not
        in it is gone."""
        for name, job in list(self.watched.jobs.items()):
            attempt_id = (job["metadata"].get("annotations") or {}).get(ATTEMPT_ANNOTATION)
            if not attempt_id:
                log.warning("Job %s carries this launcher's label but no attempt: left alone", name)
            elif attempt_id not in self.tracked and name not in self._adopting | self.watched.gone:
                await self._adopt(job)
        for tracked in list(self.tracked.values()):
            vanished = tracked.job not in self.watched.jobs
            created_before = listed is not None and tracked.created is not None and tracked.created < listed
            self._consider(tracked.job, gone=vanished and created_before)

    async def _adopt(self, job: dict[str, Any]) -> None:
        """A Job of this launcher's that it does not track (it restarted): keep it if the store
        says the attempt is still running and held by this worker, else delete it."""
        meta = job["metadata"]
        notes = meta.get("annotations") or {}
        attempt_id, rollout_id = notes[ATTEMPT_ANNOTATION], notes.get(ROLLOUT_ANNOTATION, "")
        tracked = Tracked(attempt_id, rollout_id, meta["name"], adopted=True)
        self._adopting.add(meta["name"])
        try:
            await self._take(tracked)
        finally:
            self._adopting.discard(meta["name"])

    async def _take(self, tracked: Tracked) -> None:
        attempt_id = tracked.attempt_id
        try:
            attempt = await self.client.heartbeat(attempt_id, self.worker_id, self.lease_seconds)
        except (LeaseLost, NotFound) as exc:
            log.info("Job %s: its attempt is not ours (%s): deleted", tracked.job, exc)
            await self._delete(tracked)
            return
        rollout = await asyncio.to_thread(self._sync.get_rollout, attempt.rollout_id)
        tracked.rollout_id = rollout.id
        tracked.cycle = AttemptCycle(self, RolloutContext(rollout, attempt, None))
        lease = attempt.lease_expires_at - attempt.heartbeat_at if attempt.lease_expires_at else None
        tracked.lease_seconds = lease if lease and lease > 0 else None
        # a Job whose launcher stopped before creating its Secret never starts: not waited for
        with contextlib.suppress(KubeError):
            tracked.secret = await asyncio.to_thread(self.api.read_secret, tracked.job) is not None
        tracked.created = time.monotonic()
        self.tracked[attempt_id] = tracked
        tracked.keeper = asyncio.create_task(self._keep(tracked))
        self.adopted += 1
        log.info("adopted Job %s (attempt %s)", tracked.job, attempt_id)
        self._consider(tracked.job)

    # ------------------------------------------------------------------ reporting

    async def _end(self, tracked: Tracked, job: dict[str, Any] | None, pod: dict[str, Any] | None) -> None:
        """Report a Job that ended (or vanished), then delete it. The lease is kept meanwhile
        (a scorer may take a while)."""
        try:
            if job is None:  # its Secret is deleted below (its garbage collector may be slower)
                said = f"Job {tracked.job} was deleted before it finished (not by this launcher)"
                await self._report_failure(tracked, "JobDeleted", said)
            else:
                await self._report(tracked, job, pod)
        except Exception:
            log.exception("reporting attempt %s failed", tracked.attempt_id)
        await self._delete(tracked)

    async def _report(self, tracked: Tracked, job: dict[str, Any], pod: dict[str, Any] | None) -> None:
        assert tracked.cycle is not None
        status, reward, error = await self.outcomes.read(tracked.cycle.ctx, tracked.job, job, pod)
        await self._send(tracked, status, reward, error)

    async def _report_failure(self, tracked: Tracked, kind: str, message: str) -> None:
        assert tracked.cycle is not None
        await self._send(tracked, *failed(tracked.cycle.ctx, kind, message))

    async def _send(
        self, tracked: Tracked, status: AttemptStatus, reward: float | None, error: str | None
    ) -> None:
        """Upload the events (those the server refuses are dropped, and fail the attempt with
        the reason), then finish the attempt."""
        assert tracked.cycle is not None
        ended = await tracked.cycle.report(status, reward, error)
        if ended is not None:
            said = f": {error}" if error and ended == status else ""
            log.info("attempt %s %s%s", tracked.attempt_id, ended.value, said)
