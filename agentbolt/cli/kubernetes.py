"""``agentbolt runner --kubernetes``: the command line's options checked (each problem one
line), then a :class:`~agentbolt.runner.kubernetes.JobLauncher` run until stopped."""

from __future__ import annotations

import logging
import shlex
from pathlib import Path
from typing import Any

from agentbolt.cli.assignments import env_templates
from agentbolt.errors import ConfigError
from agentbolt.runner.kube_api import KubeApi, kube_api_client, missing_extra
from agentbolt.runner.kube_template import JobTemplate, schema_problem
from agentbolt.runner.kubernetes import JobLauncher

__all__ = ["launch_from_cli"]


def launch_from_cli(
    template_path: Path,
    agent: str | None,
    command: str | None,
    server_url: str,
    token: str | None,
    **options: Any,
) -> JobLauncher:
    """What ``agentbolt runner --kubernetes`` runs: check everything (each problem one line),
    then launch Jobs until stopped."""
    _refuse_what_a_job_cannot_do(agent, options)
    try:
        import kubernetes  # noqa: F401
    except ImportError:
        raise missing_extra() from None
    template = _template(template_path, command, token, options)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s %(levelname)s %(message)s")
    launcher = JobLauncher(
        template,
        KubeApi(kube_api_client(), options["namespace"]),
        server_url,
        token=token,
        **_launcher_options(options),
    )
    launcher.run_sync()
    return launcher


def _refuse_what_a_job_cannot_do(agent: str | None, options: dict[str, Any]) -> None:
    if agent is not None:
        raise ConfigError(
            "--kubernetes runs a program in each Job (--command, or the image's own entrypoint), "
            "not an in-process --agent"
        )
    if options["stdin"]:
        raise ConfigError(
            "--stdin has no meaning in a Job (a pod has no stdin): the task is in AGENTBOLT_TASK"
        )
    if options["scorer"] and options["scorer_command"]:
        raise ConfigError("give one of --scorer module:fn and --scorer-command '...', not both")


def _template(path: Path, command: str | None, token: str | None, options: dict[str, Any]) -> JobTemplate:
    """The Job template, checked against the Kubernetes schema before any Job is made of it."""
    variables = env_templates(options["env"], "--env")
    template = JobTemplate(
        path,
        options["namespace"],
        container=options["container"],
        command=_split(command),
        env=variables,
        secrets=(token or "",),
    )
    problem = schema_problem(template.sample())
    if problem is not None:
        raise ConfigError(
            f"Kubernetes template {path}: the Job does not fit the Kubernetes schema at {problem}"
        )
    return template


def _launcher_options(options: dict[str, Any]) -> dict[str, Any]:
    """The :class:`JobLauncher` settings the command line gives."""
    from agentbolt.runner.worker import load_object

    given = {
        key: options[key]
        for key in ("public_url", "name", "max_jobs", "timeout", "reward_from", "reward_later")
    }
    given |= {key: options[key] for key in ("output_limit", "lease_seconds", "max_rollouts")}
    scorer = options["scorer"]
    given["scorer"] = load_object(scorer, "scorer") if scorer else None
    given["scorer_command"] = _split(options["scorer_command"])
    return given


def _split(command: str | None) -> list[str] | None:
    try:
        return shlex.split(command) if command else None
    except ValueError as exc:
        raise ConfigError(f"a command cannot be split into arguments: {exc}") from None
