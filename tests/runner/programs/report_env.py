"""Writes what it was given (argv, environment, working directory, task file, stdin) as JSON
to the path in its first argument, and its reward to the result file."""

import json
import os
import sys

given = {
    "argv": sys.argv[1:],
    "env": dict(os.environ),
    "cwd": os.getcwd(),
    "cwd_files": sorted(os.listdir(".")),
    "task": json.load(open(os.environ["AGENTBOLT_TASK_FILE"])),
    "stdin": sys.stdin.read(),
}
with open(sys.argv[1], "w") as f:
    json.dump(given, f)
with open(os.environ["AGENTBOLT_RESULT_FILE"], "w") as f:
    json.dump({"reward": 1.0, "note": "all given"}, f)
print("reported")
