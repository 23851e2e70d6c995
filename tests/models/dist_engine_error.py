"""Two ranks sample through one VLLMEngine whose rollout server cannot be reached (run under torchrun by
tests/models/test_distributed.py): each rank writes what it raised, so the test sees that rank 0's failure reached
every rank instead of leaving rank 1 waiting in the scatter.

    python -m torch.distributed.run --nproc_per_node 2 tests/models/dist_engine_error.py URL OUT_DIR
"""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

from models import distributed
from components.serving.rollout.client import RolloutClient
from models.config import Sampling
from models.engines.vllm import VLLMEngine

if __name__ == "__main__":
    url, out = sys.argv[1], Path(sys.argv[2])
    me = distributed.init(distributed.from_env(), "gloo", 60, torch.device("cpu"), os.environ["RLHF_RUN_SECRET"])
    engine = VLLMEngine(pad_id=0, stop_ids=torch.tensor([1]), me=me)
    if me.is_leader:
        engine.servers = [RolloutClient(url, "test/1", timeout_s=10)]  # nothing listens there: no version to ask
    try:
        engine.generate([[5, 6, 7]] * (me.rank + 1), 2, Sampling(), torch.Generator().manual_seed(0))
        raised = None
    except Exception as exc:  # noqa: BLE001 - recorded for the test
        raised = {"type": type(exc).__name__, "message": str(exc)}
    (out / f"rank{me.rank}.json").write_text(json.dumps(raised))
    distributed.shutdown(me, graceful=True)
