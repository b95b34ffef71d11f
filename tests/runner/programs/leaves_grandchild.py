"""Starts a grandchild that sleeps, writes its pid to the path in argv[1], then either hangs
(argv[2] == "hang") or exits 0 with a reward, leaving the grandchild behind."""

import json
import os
import subprocess
import sys
import time

grandchild = subprocess.Popen(["sleep", "300"])
with open(sys.argv[1], "w") as f:
    f.write(str(grandchild.pid))
if sys.argv[2] == "hang":
    time.sleep(300)
with open(os.environ["AGENTBOLT_RESULT_FILE"], "w") as f:
    json.dump({"reward": 0.5}, f)
