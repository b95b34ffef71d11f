"""A scorer for ``agentbolt runner --scorer``: the length of the program's first line."""

from agentbolt.runner.program import ProgramRun


def first_line_length(run: ProgramRun) -> float:
    return float(len(run.stdout.splitlines()[0]))
