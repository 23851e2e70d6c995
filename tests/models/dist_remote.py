"""Episodes played on rank 0 for every rank (models/environments/remote.RemoteEpisodes, a verifiers run's), on however
many ranks this process group has (run by tests/models/test_distributed.py: in the test process for 1 rank, under
torchrun for 2): each rank's rows in, its own episodes out.

    python -m torch.distributed.run --nproc_per_node 2 tests/models/dist_remote.py TOKENIZER OUT
"""

from __future__ import annotations

import os
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

from components.verifiers.worker import merge_steps
from models import distributed
from models.config import Sampling
from models.environments.remote import RemoteEpisodes
from models.policy import load_policy_tokenizer

ROWS = [{"prompt": [{"role": "user", "content": f"question {i}"}], "example_id": i // 2, "split": "train"}
        for i in range(8)]  # 4 prompts x 2 rollouts


class Engine:
    version = 7


def source(rows: list[dict], sampling: dict) -> list[dict]:
    """One record per row, from the row alone (what rank 0 is handed decides everything): a model turn, the
    environment's two tokens, a second model turn whose length depends on the row; the last example's errors."""
    records = []
    for j, row in enumerate(rows):
        i = row["example_id"]
        steps = [{"prompt_ids": [1, 2 + i], "completion_ids": [10 + i, 11], "completion_mask": [1, 1],
                  "completion_logprobs": [-0.1 * (j + 1), -0.2], "is_truncated": False},
                 {"prompt_ids": [1, 2 + i, 10 + i, 11, 90, 91], "completion_ids": [20 + j] * (1 + j % 3),
                  "completion_mask": [1] * (1 + j % 3), "completion_logprobs": [-0.3] * (1 + j % 3),
                  "is_truncated": False}]
        error = "boom" if i == 3 else None
        records.append({"example_id": i, "reward": float(j % 2), "turns": 2, "steps": steps,
                        "samples": merge_steps(steps, error is not None), "messages": row["prompt"], "error": error,
                        "is_truncated": False, "stop_condition": "no_tools", "temperature": sampling["temperature"]})
    return records


def play(tokenizer_path: str, me: distributed.Dist) -> dict:
    episodes = RemoteEpisodes("env", load_policy_tokenizer(tokenizer_path), me)
    if me.is_leader:
        episodes.source = source
    rows = ROWS[me.shard(len(ROWS))]
    played = episodes.play(Engine(), rows, Sampling(temperature=0.7, max_new_tokens=8), None, 8, 0)
    r = played.rollout
    return {"tokens": r.tokens, "lengths": r.lengths, "mask": r.loss_mask, "logprobs": r.sample_logprobs,
            "versions": r.versions, "scores": played.scores, "errors": [e.error for e in played.episodes]}


if __name__ == "__main__":
    me = distributed.init(distributed.from_env(), "gloo", 120, torch.device("cpu"), os.environ["RLHF_RUN_SECRET"])
    out = play(sys.argv[1], me)
    torch.save(out, f"{sys.argv[2]}.{me.rank}")
    distributed.dist.destroy_process_group()
