"""The critic server on 1 vs 2 ranks, and rewards as text vs tokens, through a raw tritonclient.

1. Round-trip time of critic_infer (64 x 32 tokens) and critic_train (the same batch, 2 epochs) against a critic
   server with deploy.critic.nproc_per_node = 1 and 2 (the tiny critic, one torch thread per rank), alternated. On 2
   cores a tiny critic gains nothing from 2 ranks: the figure shows the cost of the broadcast and the collectives.
2. Text transport overhead: reward_text (64 prompt/response strings, tokenized by the server) against reward_model
   (the same rollouts as token ids) on one reward server, alternated.
"""

from __future__ import annotations

import time
from pathlib import Path

import numpy as np
import torch
import tritonclient.http as http

from benchmarks.common import RESULTS, log, quick_flag, stats, tiny_config, write_result
from components.launch.processes import find_free_ports
from components.serving.auth import read_secret
from components.serving.launcher import launch
from components.serving.triton.clients import RunToken
from components.serving.triton.contract import ServerSpec
from models.config import Sampling
from models.loop import build_actor, load_prompts


def _client(url):
    """A raw tritonclient with the run's token on every request (the servers hold this process's run secret)."""
    client = http.InferenceServerClient(url.split("://")[1], network_timeout=300)
    client.register_plugin(RunToken(read_secret()))
    return client


def _call(client, model, **arrays) -> float:
    items = []
    for name, array in arrays.items():
        dtype = "BYTES" if array.dtype == np.object_ else {np.dtype(np.int64): "INT64",
                                                           np.dtype(np.float32): "FP32"}[array.dtype]
        item = http.InferInput(name, list(array.shape), dtype)
        item.set_data_from_numpy(array)
        items.append(item)
    start = time.perf_counter()
    client.infer(model, items)
    return time.perf_counter() - start


def rollouts(cfg, n: int = 64):
    """n real rollouts of the tiny policy: token ids (right-padded) and their prompt/response texts."""
    actor = build_actor(cfg)
    policy = actor.policy
    prompts = load_prompts(cfg)[:n]
    rollout = actor.engine.generate(policy.encode_prompts(prompts), 1, Sampling.of(cfg.generation),
                                    torch.Generator().manual_seed(0))
    return rollout, prompts, policy.decode_responses(rollout)


def main(argv=None) -> dict:
    quick = quick_flag(argv)
    reps = 5 if quick else 30
    (RESULTS / "tmp").mkdir(parents=True, exist_ok=True)
    cfg = tiny_config()
    rollout, prompts, responses = rollouts(cfg)
    tokens, lengths = rollout.tokens.numpy(), rollout.lengths.numpy().reshape(-1, 1)
    mask = (np.arange(tokens.shape[1])[None, :] < lengths).astype(np.float32)
    servers = {}
    try:
        for ranks in (1, 2):
            c = cfg.model_copy(update={"critic": cfg.critic.model_copy(update={"nproc_per_node": ranks})})
            spec = ServerSpec(kind="critic", config=c, port=find_free_ports(count=4), torch_threads=1)
            servers[ranks] = launch(spec, Path(RESULTS / "tmp" / f"critic-{ranks}-ranks.log"))
        times = {r: {"infer": [], "train": []} for r in servers}
        clients = {r: _client(s.url) for r, s in servers.items()}
        for i in range(reps + 1):
            for ranks in ((1, 2) if i % 2 == 0 else (2, 1)):
                infer = _call(clients[ranks], "critic_infer", tokens=tokens, sequence_lengths=lengths)
                train = _call(clients[ranks], "critic_train", tokens=tokens, returns=mask * 0.1, prev_values=mask * 0,
                              mask=mask)
                if i:  # the first round warms up
                    times[ranks]["infer"].append(infer)
                    times[ranks]["train"].append(train)
        critic = {f"{r}_ranks": {k: stats(v) for k, v in t.items()} for r, t in times.items()}
        for op in ("infer", "train"):
            critic[f"{op}_ratio_2_over_1"] = critic["2_ranks"][op]["median"] / critic["1_ranks"][op]["median"]
        log(f"critic_ranks: infer {critic['1_ranks']['infer']['median'] * 1e3:.1f} ms (1) vs "
            f"{critic['2_ranks']['infer']['median'] * 1e3:.1f} ms (2); train "
            f"{critic['1_ranks']['train']['median']:.3f} s vs {critic['2_ranks']['train']['median']:.3f} s")
    finally:
        for server in servers.values():
            server.stop()
    spec = ServerSpec(kind="reward", config=cfg, port=find_free_ports(), torch_threads=1)
    text = {"tokens": [], "text": []}
    strings = {n: np.array([[t.encode()] for t in texts], dtype=np.object_)
               for n, texts in (("prompts", prompts), ("responses", responses))}
    with launch(spec, Path(RESULTS / "tmp" / "reward-server.log")) as server:
        client = _client(server.url)
        for i in range(reps + 1):
            for kind in (("tokens", "text") if i % 2 == 0 else ("text", "tokens")):
                seconds = (_call(client, "reward_model", tokens=tokens, sequence_lengths=lengths) if kind == "tokens"
                           else _call(client, "reward_text", **strings))
                if i:
                    text[kind].append(seconds)
    transport = {k: stats(v) for k, v in text.items()}
    transport["text_over_tokens"] = transport["text"]["median"] / transport["tokens"]["median"]
    log(f"critic_ranks: reward as text {transport['text']['median'] * 1e3:.1f} ms vs tokens "
        f"{transport['tokens']['median'] * 1e3:.1f} ms")
    result = {"quick": quick,
              "settings": {"batch": list(tokens.shape), "repetitions": reps,
                           "critic": "tiny critic (GPT-2, 108k parameters) + combined tiny reward model",
                           "torch_threads_per_rank": 1},
              "critic_round_trip_seconds": critic, "reward_transport_seconds": transport}
    write_result("critic_ranks", result)
    return result


if __name__ == "__main__":
    main()
