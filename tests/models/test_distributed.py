"""The actor on 2 ranks (real gloo process groups over loopback, FSDP2) against one rank on the same data: the update
loop, one PPO and one RLOO update on fixed rollouts (2 ranks on one node, and 2 node groups of 1 rank each as the run's
controller starts them), and the pieces they rest on."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from components.launch.nodes import LocalNodes, NodeSpec
from components.launch.processes import wait_for
from components.serving.auth import new_secret
from models import distributed
from models.algorithms import ALGORITHMS
from models.config import Sampling, preset
from models.resolve import pin
from models.loop import build_actor, load_prompts
from models.prepare import prepare_run
from tests.conftest import free_port, free_port_block
from tests.models.dist_update import ranks_env, update

SCRIPT = Path(__file__).with_name("dist_update.py")
NON_DETERMINISTIC = ("time/", "throughput/", "step_time", "dist/")


def test_shards_cover_every_row_once_in_rank_order():
    for n in (1, 5, 8, 13):
        for world in (1, 2, 3):
            slices = [distributed.shard_slice(n, r, world) for r in range(world)]
            assert [i for s in slices for i in range(n)[s]] == list(range(n))
            assert max(s.stop - s.start for s in slices) - min(s.stop - s.start for s in slices) <= 1


def test_blocks_are_found_from_no_split_modules(tiny_models):
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(tiny_models["policy"])
    blocks = distributed.transformer_blocks(model)
    assert [type(b).__name__ for b in blocks] == ["GPT2Block"] * model.config.n_layer


DAPO = {"reward.source": "function", "reward.function": "tests.models.bad_rewards:half_constant_reward",
        "loss.dynamic_sampling_extra_rounds": 2}  # some groups' scores all equal, whatever the samples


@pytest.mark.parametrize("algorithm", ["ppo", "rloo", "dapo"])
def test_two_ranks_update_like_one(tiny_models, tmp_path, algorithm):
    """N ranks x B/N rollouts give the same update as 1 rank x B: actor weights to 1e-5 (float32), loss, KL and the
    grad norm (which would show gradients averaged instead of summed) to 1e-4 relative. The same 2 ranks as 2 node
    groups (deploy.actor.nnodes=2: two torchruns over loopback started by LocalNodes, each with a pod's environment
    and a state directory of its own) give the one-node update to 1e-5: checked on PPO's update (the launch is the
    same for every algorithm; PPO's update is the one with the most parts). DAPO (token-mean, clip-higher, dynamic
    sampling over the batch and the stream's next two, with a reward under which some prompts' groups always score
    alike): the groups it keeps, shared out over the ranks, give the one-rank update too."""
    cfg = prepare_run(preset("tiny", **{
        "deploy.state_dir": str(tmp_path), "model.policy": tiny_models["policy"], "algorithm": algorithm,
        "model.reward": tiny_models["reward"], "ppo.rollout_batch_size": 12, "ppo.minibatch_size": 6,
        "reinforce.rollout_batch_size": 6, "reinforce.minibatch_size": 8, "generation.max_new_tokens": 8,
        "generation.micro_batch_size": 4, "critic.micro_batch_size": 8, **(DAPO if algorithm == "dapo" else {})}))
    section = ALGORITHMS[algorithm].settings(cfg)
    k, n_prompts = ALGORITHMS[algorithm].samples_per_prompt(section), section.rollout_batch_size

    actor = build_actor(cfg)
    rounds = []
    for r in range(3 if algorithm == "dapo" else 1):  # dynamic sampling: this batch and the stream's next two
        prompts = load_prompts(cfg)[r * n_prompts:(r + 1) * n_prompts]
        rollout = actor.engine.generate(actor.policy.encode_prompts(prompts), k, Sampling.of(cfg.generation),
                                        torch.Generator().manual_seed(5 + r))
        rounds.append({"prompts": prompts, "tokens": rollout.tokens, "prompt_lengths": rollout.prompt_lengths,
                       "lengths": rollout.lengths, "is_end": rollout.is_end,
                       "sample_logprobs": rollout.sample_logprobs})
    fixture = {**rounds[0], "rounds": rounds}
    torch.save(fixture, tmp_path / "fixture.pt")
    (tmp_path / "cfg.json").write_text(cfg.model_dump_json())

    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        one_weights, one_metrics, one_engine = update(cfg, fixture, distributed.SINGLE)
    finally:
        torch.set_num_threads(threads)
    env = ranks_env()
    proc = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", "2", "--master_port",
                           str(free_port_block(2)), str(SCRIPT), str(tmp_path / "cfg.json"),
                           str(tmp_path / "fixture.pt"), str(tmp_path / "two.pt")],
                          capture_output=True, text=True, timeout=600, env=env)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    two = torch.load(tmp_path / "two.pt", weights_only=False)
    two_nodes = two_node_groups_update(tmp_path) if algorithm == "ppo" else None

    assert two["metrics"]["dist/world_size"] == 2 and one_metrics["dist/world_size"] == 1
    if algorithm == "dapo":  # groups were dropped and more were sampled
        assert one_metrics["dynamic_sampling/rounds"] >= 2 and one_metrics["dynamic_sampling/dropped_share"] > 0
    assert one_weights.keys() == two["weights"].keys()
    moved = 0.0
    initial = build_actor(cfg).policy.model.state_dict()
    steps = section.epochs * -(-n_prompts * k // section.minibatch_size)  # optimizer steps of the update
    pairs = [(one_weights, two["weights"])] + ([(two["weights"], two_nodes["weights"])] if two_nodes else [])
    for reference, result in pairs:
        assert result.keys() == reference.keys()
        for name, value in reference.items():
            other = result[name].clone()
            if name.endswith("attn.c_attn.bias"):
                # The key bias has a mathematically zero gradient (softmax is invariant to a constant added to every
                # key of a query's row), so its gradient is float noise (~1e-10) that depends on summation order, and
                # AdamW turns noise into steps of up to lr each. Bound it by that, and hold everything else to 1e-5.
                keys = slice(value.shape[0] // 3, 2 * value.shape[0] // 3)
                assert float((other[keys] - value[keys]).abs().max()) <= 2 * section.optim.lr * steps
                other[keys] = value[keys]
            torch.testing.assert_close(other, value, rtol=0, atol=1e-5, msg=name)
            moved = max(moved, float((value - initial[name]).abs().max()))
    assert moved > 1e-4  # the update moved the weights far beyond the tolerance
    if two_nodes:
        print(f"{algorithm}: 2 node groups vs 2 ranks on one node, largest weight difference "
              f"{max(float((two_nodes['weights'][n] - v).abs().max()) for n, v in two['weights'].items()):.1e}")
    keys = [k for k in one_metrics if not k.startswith(NON_DETERMINISTIC)]
    assert {"loss", "grad_norm", "policy/approxkl_avg",
            "dynamic_sampling/kept_groups" if algorithm == "dapo" else "objective/kl"} <= set(keys)
    for key in keys:
        assert two["metrics"][key] == pytest.approx(one_metrics[key], rel=1e-4, abs=1e-6), key
        if two_nodes:
            assert two_nodes["metrics"][key] == pytest.approx(two["metrics"][key], rel=1e-4, abs=1e-6), key
    # what a rollout engine receives after the update: every weight, gathered from the FSDP2 shards, the tied
    # lm_head included, equal to the full state dict the same ranks gather for a checkpoint
    for engine, weights in ((one_engine, one_weights), (two["engine_weights"], two["weights"])):
        assert "lm_head.weight" in engine and engine.keys() == weights.keys()
        for name in weights:
            assert torch.equal(engine[name], weights[name]), name
        assert torch.equal(engine["lm_head.weight"], engine["transformer.wte.weight"])  # tied


def two_node_groups_update(tmp_path: Path) -> dict:
    """dist_update.py's update on 2 node groups of 1 rank each (LocalNodes: two torchruns over loopback)."""
    nodes = LocalNodes(NodeSpec("rlhf-update-test", 2, 1, free_port_block(2), [str(SCRIPT), str(tmp_path / "cfg.json"),
                                str(tmp_path / "fixture.pt"), str(tmp_path / "nodes.pt")]), tmp_path / "logs",
                       tmp_path / "nodes", new_secret())
    try:
        nodes.start()
        status = wait_for(lambda: (s := nodes.status()).phase in ("succeeded", "failed") and s, 600, poll_s=0.5)
        assert status.phase == "succeeded", (status, nodes.logs(0, 40), nodes.logs(1, 40))
    finally:
        nodes.delete()
    return torch.load(tmp_path / "nodes.pt", weights_only=False)


def test_a_rollout_failure_on_rank_0_reaches_every_rank(tmp_path):
    """rollout.engine=vllm on 2 ranks: rank 0 alone talks to the rollout server. When its request fails (here: nothing
    listens at the URL), rank 0 raises the cause and rank 1 raises an error naming rank 0's, instead of waiting in
    the scatter until the process group times out."""
    env = ranks_env()
    proc = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", "2", "--master_port",
                           str(free_port_block(2)), str(SCRIPT.with_name("dist_engine_error.py")),
                           f"http://127.0.0.1:{free_port()}", str(tmp_path)],
                          capture_output=True, text=True, timeout=120, env=env)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    rank0, rank1 = (json.loads((tmp_path / f"rank{r}.json").read_text()) for r in (0, 1))
    assert rank0["type"] == "ConnectError", rank0
    assert rank1["type"] == "EngineRequestError", rank1
    assert rank1["message"].startswith("rank 0 could not sample from the rollout server: ConnectError"), rank1


def test_splitting_a_minibatch_into_micro_batches_does_not_change_the_step(tiny_models, tmp_path):
    """The shared update loop: one optimizer step over 12 rows, as 1 micro-batch or as 5, gives the same weights."""
    from models.update import minibatch_update

    cfg = pin(preset("tiny", **{"deploy.state_dir": str(tmp_path), "model.policy": tiny_models["policy"]}))
    tokens = torch.randint(4, 40, (12, 10), generator=torch.Generator().manual_seed(0))
    lengths = torch.randint(4, 11, (12,), generator=torch.Generator().manual_seed(1))
    results = []
    for micro in (12, 3):
        state = build_actor(cfg)
        policy = state.policy
        mask = (torch.arange(1, 10)[None, :] < lengths[:, None]).float()

        def micro_loss(idx):
            logp, _ = policy.logprobs(tokens[idx], lengths[idx])
            loss = -(logp * mask[idx]).sum() / mask[idx].sum()  # token mean of the rows idx
            return loss, {"loss": loss.detach()}

        stats = minibatch_update(policy.trainable_parameters(), state.optimizer, state.scheduler, micro_loss,
                                 mask.sum(1), torch.arange(12), 12, minibatch_size=12, epochs=1,
                                 micro_batch_size=micro, grad_clip=1e9, generator=torch.Generator().manual_seed(0))
        results.append((stats, {k: v.clone() for k, v in policy.model.state_dict().items()}))
    (one, w_one), (five, w_five) = results
    assert one["steps"] == five["steps"] == 1
    assert five["loss"] == pytest.approx(one["loss"], rel=1e-5)
    assert five["grad_norm"] == pytest.approx(one["grad_norm"], rel=1e-4)
    for name in w_one:
        if name.endswith("attn.c_attn.bias"):  # the key bias: zero gradient, see test_two_ranks_update_like_one
            continue
        torch.testing.assert_close(w_five[name], w_one[name], rtol=0, atol=1e-5, msg=name)


def test_episodes_played_on_rank_0_reach_each_rank_as_one_rank_plays_them(tiny_models, tmp_path):
    """A verifiers run's episodes (models/environments/remote.RemoteEpisodes): rank 0 gathers both ranks' rows, plays
    them (here a pure source: what it is handed decides every record) and scatters the records back; each rank's
    rollout (tokens, loss mask, the server's logprobs, the weights version) and scores are the single-process play's
    rows of its share, bit for bit, an errored episode's mask 0 and score 0 included."""
    from tests.models.dist_remote import play

    chat = str(Path(tiny_models["policy"]).parent / "chat")
    one = play(chat, distributed.SINGLE)
    env = ranks_env()
    proc = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", "2", "--master_port",
                           str(free_port_block(2)), str(Path(__file__).with_name("dist_remote.py")), chat,
                           str(tmp_path / "two.pt")], capture_output=True, text=True, timeout=600, env=env)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    assert one["errors"] == [""] * 6 + ["boom"] * 2 and one["scores"].tolist() == [0, 1, 0, 1, 0, 1, 0, 0]
    assert one["mask"][6:].sum() == 0 and one["mask"][:6].sum() > 0 and set(one["versions"].tolist()) == {7}
    for rank in (0, 1):
        two = torch.load(tmp_path / f"two.pt.{rank}", weights_only=False)
        share = slice(4 * rank, 4 * rank + 4)
        assert two["errors"] == one["errors"][share] and torch.equal(two["scores"], one["scores"][share])
        for key in ("lengths", "versions"):
            assert torch.equal(two[key], one[key][share]), key
        width = int(two["lengths"].max())  # each rank pads to its own longest row
        for key in ("tokens", "mask", "logprobs"):
            assert torch.equal(two[key], one[key][share][:, :two[key].shape[1]]), key
            assert two[key].shape[1] in (width, width - 1)
