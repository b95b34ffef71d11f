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
    try:
        import kubernetes  # noqa: F401
    except ImportError:
        raise missing_extra() from None
    from agentbolt.runner.worker import load_object

    variables = env_templates(options["env"], "--env")
    try:
        argv = shlex.split(command) if command else None
        scorer_argv = shlex.split(options["scorer_command"]) if options["scorer_command"] else None
    except ValueError as exc:
        raise ConfigError(f"a command cannot be split into arguments: {exc}") from None
    namespace = options["namespace"]
    template = JobTemplate(
        template_path,
        namespace,
        container=options["container"],
        command=argv,
        env=variables,
        secrets=(token or "",),
    )
    problem = schema_problem(template.sample())
    if problem is not None:
        raise ConfigError(
            f"Kubernetes template {template_path}: the Job does not fit the Kubernetes schema at {problem}"
        )
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s %(levelname)s %(message)s")
    launcher = JobLauncher(
        template,
        KubeApi(kube_api_client(), namespace),
        server_url,
        token=token,
        public_url=options["public_url"],
        name=options["name"],
        max_jobs=options["max_jobs"],
        timeout=options["timeout"],
        scorer=load_object(options["scorer"], "scorer") if options["scorer"] else None,
        scorer_command=scorer_argv,
        reward_later=options["reward_later"],
        output_limit=options["output_limit"],
        lease_seconds=options["lease_seconds"],
        max_rollouts=options["max_rollouts"],
    )
    launcher.run_sync()
    return launcher
