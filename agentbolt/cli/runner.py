"""``agentbolt runner``: a runner of an agent (``--agent``) or of a program (``--command``)
per rollout, here, on Ray (``--ray``) or as Kubernetes Jobs (``--kubernetes``)."""

from __future__ import annotations

import logging
import os
import sys
from pathlib import Path
from typing import Annotated, Any

import typer

from agentbolt.cli.common import DEFAULT_SERVER, ServerOpt, TokenOpt, err_console
from agentbolt.errors import ConfigError


def _program(
    command: str,
    stdin: bool,
    env: list[str],
    timeout: float | None,
    scorer: str | None,
    scorer_command: str | None,
    reward_from: str | None,
    reward_later: bool,
    output_limit: int,
    run_as: str | None,
    sandboxing: dict[str, Any],
) -> Any:
    """The Program that ``agentbolt runner --command`` runs; ``sandboxing``: its sandbox and
    limits (Program's keyword arguments)."""
    from agentbolt.cli.assignments import env_templates
    from agentbolt.runner.program import Program
    from agentbolt.runner.worker import load_object

    variables = env_templates(env, "--env")
    if scorer is not None and scorer_command is not None:
        raise ConfigError("give one of --scorer module:fn and --scorer-command '...', not both")
    return Program(
        command,
        stdin=stdin,
        env=variables,
        timeout=timeout,
        scorer=load_object(scorer, "scorer") if scorer else None,
        scorer_command=scorer_command,
        reward_from=reward_from,
        reward_later=reward_later,
        output_limit=output_limit,
        run_as=run_as,
        **sandboxing,
    )


def runner_command(
    agent: Annotated[
        str | None, typer.Option("--agent", "-a", help="module:object or file.py:object.")
    ] = None,
    command: Annotated[
        str | None,
        typer.Option(
            "--command",
            "-c",
            help="Run this program per rollout instead: an argv template, {field} from the task.",
        ),
    ] = None,
    stdin: Annotated[bool, typer.Option("--stdin", help="Also write the task as JSON to its stdin.")] = False,
    env: Annotated[
        list[str] | None,
        typer.Option("--env", help="NAME=TEMPLATE: a variable from task fields (repeatable)."),
    ] = None,
    timeout: Annotated[
        float | None, typer.Option(min=0.001, help="Seconds before the program's process group is killed.")
    ] = None,
    scorer: Annotated[
        str | None, typer.Option(help="module:fn scoring a program's run (sees task, output, model calls).")
    ] = None,
    scorer_command: Annotated[
        str | None, typer.Option(help="A command that reads the run as JSON on stdin and prints a reward.")
    ] = None,
    reward_from: Annotated[
        str | None,
        typer.Option(
            help="Sources of a program's reward, first present wins: scorer, program, result_file "
            "(comma-separated; default: the scorer if given, else program,result_file).",
        ),
    ] = None,
    reward_later: Annotated[
        bool, typer.Option("--reward-later", help="A program run without a reward succeeds.")
    ] = False,
    output_limit: Annotated[
        int, typer.Option(min=1, help="Bytes of a program's stdout and of its stderr recorded.")
    ] = 64 * 1024,
    run_as: Annotated[
        str | None,
        typer.Option(
            help="Run each program as this unprivileged user (name or uid[:gid]; the runner is root)."
        ),
    ] = None,
    sandbox: Annotated[
        bool, typer.Option("--sandbox", help="Run each program in a bubblewrap sandbox (docs/agents.md).")
    ] = False,
    sandbox_read: Annotated[
        list[str] | None,
        typer.Option(help="An absolute path a sandboxed program also sees, read-only (repeatable)."),
    ] = None,
    limit_memory: Annotated[
        str | None, typer.Option(help="Memory of a program's run, e.g. 2G (sandboxed: 4G; 0: none).")
    ] = None,
    limit_processes: Annotated[
        int | None, typer.Option(min=0, help="Processes and threads of a run (sandboxed: 512; 0: none).")
    ] = None,
    limit_cpu_s: Annotated[
        float | None, typer.Option(min=0, help="CPU seconds of each process of a run (sandboxed: 3600).")
    ] = None,
    limit_file_size: Annotated[
        str | None, typer.Option(help="Largest file a run writes, e.g. 100M (sandboxed: 1G; 0: none).")
    ] = None,
    limit_open_files: Annotated[
        int | None, typer.Option(min=0, help="Open files per process of a run (sandboxed: 4096).")
    ] = None,
    server: ServerOpt = DEFAULT_SERVER,
    token: TokenOpt = None,
    concurrency: Annotated[int, typer.Option("--concurrency", "-n", min=1, help="Rollouts at a time.")] = 1,
    lease_seconds: Annotated[float | None, typer.Option(help="Lease per attempt.")] = None,
    max_rollouts: Annotated[int | None, typer.Option(help="Exit after this many rollouts.")] = None,
    tracing: Annotated[
        bool, typer.Option(help="Export OpenTelemetry spans of each rollout to the server.")
    ] = False,
    kubernetes: Annotated[
        Path | None, typer.Option(help="Run each rollout as a Kubernetes Job from this template (YAML).")
    ] = None,
    namespace: Annotated[str, typer.Option(help="Namespace of the Jobs (--kubernetes).")] = "default",
    public_url: Annotated[
        str | None, typer.Option(help="The server's address as pods reach it (--kubernetes).")
    ] = None,
    max_jobs: Annotated[int, typer.Option(min=1, help="Jobs at a time (--kubernetes).")] = 10,
    container: Annotated[
        str | None, typer.Option(help="The agent's container in the template (default: 'agent').")
    ] = None,
    launcher_name: Annotated[
        str, typer.Option(help="This launcher's name: it adopts its Jobs after a restart (--kubernetes).")
    ] = "default",
    ray: Annotated[
        str | None,
        typer.Option(help="Run the runners as Ray actors: host:port, ray://host:port, auto, or local."),
    ] = None,
    replicas: Annotated[int | None, typer.Option(min=1, help="Runner actors to start (--ray).")] = None,
    ray_cpus: Annotated[float | None, typer.Option(min=0, help="CPUs per actor (--ray; 1).")] = None,
    ray_memory: Annotated[str | None, typer.Option(help="Memory per actor, e.g. 2GiB (--ray).")] = None,
    ray_resource: Annotated[
        list[str] | None, typer.Option(help="NAME=AMOUNT per actor, e.g. sandbox=1 (--ray; repeatable).")
    ] = None,
    ray_ready_timeout: Annotated[
        float, typer.Option(min=0.001, help="Seconds for every actor to start and register (--ray).")
    ] = 120.0,
) -> None:
    """Run an agent (--agent) or a program (--command) on queued rollouts until stopped
    (Ctrl-C finishes or releases running ones); with --kubernetes, each rollout is a Job."""
    from agentbolt.runner.worker import Runner, load_agent

    if kubernetes is not None and (ray is not None or replicas is not None):
        raise ConfigError(
            "--kubernetes runs each rollout as a Job; it cannot be combined with --ray/--replicas"
        )
    if run_as is not None and (kubernetes is not None or agent is not None):
        raise ConfigError(
            "--run-as is for programs this runner starts (--command): an --agent runs inside the "
            "runner, and a Job's user is its template's securityContext (runAsUser)"
        )
    sandboxing: dict[str, Any] = {"sandbox": sandbox, "sandbox_read": sandbox_read or []}
    sandboxing |= {"limit_memory": limit_memory, "limit_processes": limit_processes}
    sandboxing |= {"limit_cpu_s": limit_cpu_s, "limit_file_size": limit_file_size}
    sandboxing["limit_open_files"] = limit_open_files
    if kubernetes is not None and any(sandboxing.values()):
        raise ConfigError(
            "--sandbox, --sandbox-read and --limit-* apply to programs this runner starts; with "
            "--kubernetes each rollout's pod is its sandbox: set limits in the Job template"
        )
    if kubernetes is not None:
        from agentbolt.cli.kubernetes import launch_from_cli

        program: dict[str, Any] = {"stdin": stdin, "env": env or [], "timeout": timeout, "scorer": scorer}
        program |= {
            "scorer_command": scorer_command,
            "reward_from": reward_from,
            "reward_later": reward_later,
            "output_limit": output_limit,
        }
        kube: dict[str, Any] = {
            "namespace": namespace,
            "public_url": public_url,
            "max_jobs": max_jobs,
            "container": container,
        }
        kube |= {"name": launcher_name, "lease_seconds": lease_seconds, "max_rollouts": max_rollouts}
        launch_from_cli(kubernetes, agent, command, server, token, **program, **kube)
        return
    if (agent is None) == (command is None):
        raise ConfigError(
            "give the agent as exactly one of --agent module:object or --command '<argv template>'"
        )
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s %(levelname)s %(message)s")
    sys.path.insert(0, os.getcwd())
    options = (
        stdin,
        env or [],
        timeout,
        scorer,
        scorer_command,
        reward_from,
        reward_later,
        output_limit,
        run_as,
    )
    if agent is not None and any(sandboxing.values()):
        raise ConfigError("--sandbox and --limit-* apply to a program (--command), not to --agent")
    loaded = load_agent(agent) if agent is not None else _program(command or "", *options, sandboxing)
    ray_options = (replicas, ray_cpus, ray_memory, ray_resource)
    if ray is not None or any(o is not None for o in ray_options):
        from agentbolt.cli.ray import run_cli

        run_on = agent if agent is not None else loaded  # a spec: each actor loads it itself
        run_cli(
            ray,
            run_on,
            server,
            token,
            *ray_options,
            ray_ready_timeout,
            concurrency,
            lease_seconds,
            max_rollouts,
            tracing or None,
        )
        return
    worker = Runner(
        loaded,
        server,
        token=token,
        concurrency=concurrency,
        lease_seconds=lease_seconds,
        max_rollouts=max_rollouts,
        tracing=tracing or None,
    )
    worker.run_sync()
    if worker.abandoned:
        # Released attempts whose agent threads still run: they cannot be interrupted, and
        # waiting for them would defeat the stop. Their work is already handed back.
        err_console.print(f"stopped; {worker.abandoned} released agent thread(s) abandoned")
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(0)
