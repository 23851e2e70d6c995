"""A rank of a node group for tests/components/launch/test_local_nodes.py (run by torchrun through
components/launch/nodes.py): it writes what it was given, then does what its mode says.

    python node_job.py OUT MODE    MODE: no-restart (rank 1 exits with NO_RESTART_EXIT_CODE once rank 0 runs, rank 0
                                   sleeps until stopped), sleep (every rank sleeps until stopped)
"""

import json
import os
import sys
import time

GIVEN = ("JOBSET_NAME", "REPLICATED_JOB_NAME", "JOB_INDEX", "JOB_COMPLETION_INDEX", "RANK", "WORLD_SIZE", "LOCAL_RANK",
         "MASTER_ADDR", "MASTER_PORT", "RLHF_STATE_DIR", "RLHF_PARENT_PID", "NODE_JOB_TOKEN", "RLHF_RUN_SECRET")

out, mode = sys.argv[1], sys.argv[2]
rank = int(os.environ["RANK"])
seen = {name: os.environ.get(name) for name in GIVEN}
seen.update(cores=sorted(os.sched_getaffinity(0)), pid=os.getpid(), parent=os.getppid())
with open(os.path.join(out, f"rank{rank}.jsonl"), "a") as f:
    f.write(json.dumps(seen) + "\n")
if mode == "no-restart" and rank == 1:
    deadline = time.monotonic() + 120
    while not os.path.exists(os.path.join(out, "rank0.jsonl")) and time.monotonic() < deadline:
        time.sleep(0.1)  # rank 0 has said what it was given before the set is stopped
    sys.exit(78)
time.sleep(600)  # until the set is stopped
