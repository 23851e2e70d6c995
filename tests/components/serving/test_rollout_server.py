"""The vLLM rollout server (components/serving/rollout_server.py) as a real child process in .venv-vllm, on the tiny
policy: the generation contract, logprob agreement with the trainer before and after refits, a skipped refit caught
by the mismatch metric, LoRA merged weights, bad input refused while it keeps serving, and a kill -9 named."""

import os
import signal

import httpx
import pytest
import torch

from components.serving.rollout import RolloutServer, RolloutServerNotReady, server_env, server_python
from models.config import GenerationConfig, LoraConfig, RLHFConfig
from models.policy import Policy
from models.rollout.vllm import EngineRequestError, RolloutClient, VLLMEngine, safetensors_bytes
from models.step import engine_mismatch
from models.losses import tis_weights
from models.tasks import sentiment


def config(tiny_models, tmp_path, **vllm) -> RLHFConfig:
    """Any free port; 1 thread: the suite's other worker shares the cores (a run's default is every core)."""
    return RLHFConfig.model_validate({"state_dir": str(tmp_path), "model": {"policy": tiny_models["policy"]},
                                      "rollout": {"engine": "vllm", "vllm": {"port": 0, "threads": 1, **vllm}}})


def test_the_server_gets_every_core_of_a_cpu_host_unless_told(tiny_models, tmp_path):
    default = RLHFConfig.model_validate({"model": {"policy": tiny_models["policy"]}})
    assert server_env(default)["OMP_NUM_THREADS"] == str(os.cpu_count())
    assert server_env(config(tiny_models, tmp_path))["OMP_NUM_THREADS"] == "1"
    assert server_env(default)["VLLM_ENABLE_V1_MULTIPROCESSING"] == "0"


@pytest.fixture(scope="module")
def server(tiny_models, tmp_path_factory):
    cfg = config(tiny_models, tmp_path_factory.mktemp("rollout"))
    server_python(cfg)  # a missing .venv-vllm fails here, naming `make vllm-venv`
    with RolloutServer(cfg, tmp_path_factory.mktemp("logs") / "rollout-server.log") as proc:
        proc.wait_until_ready(300)
        yield proc
    assert proc.poll() is not None and not proc.group_members()  # stopped, nothing of it left


@pytest.fixture(scope="module")
def policy(tiny_models):
    return Policy.load(tiny_models["policy"])


@pytest.fixture
def engine(server, policy):
    """An engine on the module's server holding the policy's weights as they are now."""
    engine = VLLMEngine(policy.pad_id, policy.stop_ids)
    engine.connect(RolloutClient(server.url))
    engine.update_weights(policy.engine_weights())
    yield engine
    engine.close()


def trainer_logprobs(policy, rollout, temperature):
    with torch.no_grad():
        return policy.logprobs(rollout.tokens, rollout.lengths, temperature)[0] * rollout.response_mask


def test_generation_contract_shapes_eos_and_n_samples(server, policy):
    client = RolloutClient(server.url)
    prompts = policy.encode_prompts(sentiment.prompts(3))
    eos = policy.eos_id
    answer = client.generate({"prompt_token_ids": prompts, "n": 4, "max_new_tokens": 6, "stop_token_ids": [eos],
                              "seed": 1})
    assert len(answer["samples"]) == 3 and all(len(s) == 4 for s in answer["samples"])
    assert isinstance(answer["weights_version"], int)
    for per_prompt in answer["samples"]:
        assert len({tuple(s["token_ids"]) for s in per_prompt}) > 1  # n samples, not n copies
        for s in per_prompt:
            ids, logprobs = s["token_ids"], s["logprobs"]
            assert 1 <= len(ids) <= 6 and len(logprobs) == len(ids) and all(lp <= 0 for lp in logprobs)
            assert eos not in ids[:-1]  # a response ends at its first stop token, which it keeps
            assert s["is_end"] == (ids[-1] == eos)
            if not s["is_end"]:
                assert len(ids) == 6
    # a stop id we know comes first (the greedy token) ends every sample at once, kept, is_end
    greedy = client.generate({"prompt_token_ids": prompts, "top_k": 1, "max_new_tokens": 1})["samples"]
    first = [s[0]["token_ids"][0] for s in greedy]
    stopped = client.generate({"prompt_token_ids": prompts[:1], "n": 2, "top_k": 1, "max_new_tokens": 5,
                               "stop_token_ids": [first[0]]})["samples"][0]
    assert all(s["token_ids"] == [first[0]] and s["is_end"] for s in stopped)
    # the same seed samples the same tokens
    again = client.generate({"prompt_token_ids": prompts, "n": 4, "max_new_tokens": 6, "stop_token_ids": [eos],
                             "seed": 1})
    assert [[s["token_ids"] for s in p] for p in again["samples"]] == [[s["token_ids"] for s in p] for p in answer["samples"]]
    client.close()


def test_engine_rollout_has_the_native_layout(engine, policy):
    prompts = policy.encode_prompts([p for p in sentiment.prompts(4) for _ in range(2)])  # k=2 per prompt
    rollout = engine.generate(prompts, GenerationConfig(max_new_tokens=8), torch.Generator().manual_seed(0))
    assert rollout.tokens.shape[0] == 8 and rollout.sample_logprobs.shape == (8, rollout.tokens.shape[1] - 1)
    for i, ids in enumerate(prompts):
        p, n = int(rollout.prompt_lengths[i]), int(rollout.lengths[i])
        assert rollout.tokens[i, :p].tolist() == ids
        assert (rollout.tokens[i, n:] == policy.pad_id).all()
        assert bool(rollout.is_end[i]) == (int(rollout.tokens[i, n - 1]) in policy.stop_ids.tolist())
    assert torch.equal(rollout.response_mask.sum(1).long(), rollout.response_lengths)
    assert (rollout.sample_logprobs * (1 - rollout.response_mask) == 0).all()


@pytest.mark.parametrize("temperature", [1.0, 0.7])
def test_logprobs_match_the_trainer_before_and_after_refits(engine, tiny_models, temperature):
    """Engine logprobs (processed: the tempered distribution actually sampled) against the trainer's recomputation on
    the same tokens, on the initial weights and after three refits with perturbed weights; each refit moves the
    engine's logprobs by far more than the agreement tolerance, so a refit that did not land would fail."""
    policy = Policy.load(tiny_models["policy"])
    prompts = policy.encode_prompts(sentiment.prompts(8))
    gen = GenerationConfig(max_new_tokens=10, temperature=temperature)
    generator = torch.Generator().manual_seed(0)
    torch.manual_seed(0)
    for refit in range(4):
        if refit:
            with torch.no_grad():
                for param in policy.model.parameters():
                    param.add_(torch.randn_like(param) * 0.02)
            engine.update_weights(policy.engine_weights())
        rollout = engine.generate(prompts, gen, generator)
        mine = trainer_logprobs(policy, rollout, temperature)
        diff = (mine - rollout.sample_logprobs).abs().max().item()
        assert diff < 1e-3, (refit, diff)
    assert engine.version == 4


def test_a_skipped_refit_is_caught_by_the_mismatch_metric(engine, tiny_models):
    policy = Policy.load(tiny_models["policy"])
    prompts = policy.encode_prompts(sentiment.prompts(8))
    gen = GenerationConfig(max_new_tokens=10)
    torch.manual_seed(1)
    with torch.no_grad():
        for param in policy.model.parameters():
            param.add_(torch.randn_like(param) * 0.05)
    stale = engine.generate(prompts, gen, torch.Generator().manual_seed(1))  # refit skipped on purpose
    engine.update_weights(policy.engine_weights())
    fresh = engine.generate(prompts, gen, torch.Generator().manual_seed(1))
    metrics = {}
    for name, ro in (("stale", stale), ("fresh", fresh)):
        old = trainer_logprobs(policy, ro, 1.0)
        tis = tis_weights(old, ro.sample_logprobs, ro.response_mask, 2.0)
        metrics[name] = engine_mismatch(policy.me, old, ro.sample_logprobs, ro.response_mask, tis, 2.0)
    assert metrics["fresh"]["rollout/logprob_diff_max"] < 1e-3
    assert metrics["stale"]["rollout/logprob_diff_mean"] > 0.05, metrics
    assert metrics["stale"]["rollout/logprob_diff_max"] > 20 * metrics["fresh"]["rollout/logprob_diff_max"]


def test_lora_weights_reach_the_engine_merged(server, tiny_models):
    policy = Policy.load(tiny_models["policy"], lora=LoraConfig(enabled=True, r=4))
    with torch.no_grad():
        for name, param in policy.model.named_parameters():
            if "lora_B" in name:
                param.normal_(0, 0.05)  # adapters that change the outputs
    engine = VLLMEngine(policy.pad_id, policy.stop_ids)
    engine.connect(RolloutClient(server.url))
    engine.update_weights(policy.engine_weights())
    rollout = engine.generate(policy.encode_prompts(sentiment.prompts(6)), GenerationConfig(max_new_tokens=8),
                              torch.Generator().manual_seed(2))
    policy.model.eval()
    mine = trainer_logprobs(policy, rollout, 1.0)
    with torch.no_grad():
        base = policy.logprobs(rollout.tokens, rollout.lengths, reference=True)[0] * rollout.response_mask
    assert (mine - rollout.sample_logprobs).abs().max() < 1e-3
    assert (base - rollout.sample_logprobs).abs().max() > 1e-2  # the adapters made a difference the engine has
    engine.close()


def test_bad_input_is_refused_naming_the_field_and_the_server_keeps_serving(server, policy):
    http = httpx.Client(base_url=server.url, timeout=60)
    good = {"prompt_token_ids": policy.encode_prompts(sentiment.prompts(1)), "max_new_tokens": 4}
    version = http.get("/health").json()["weights_version"]
    vocab, limit = http.get("/health").json()["vocab_size"], http.get("/health").json()["max_model_len"]
    cases = [
        ({**good, "prompt_token_ids": [[1, vocab + 5]]}, 400, "prompt_token_ids[0]: token id"),
        ({**good, "prompt_token_ids": [[]]}, 400, "prompt_token_ids[0]: a prompt needs at least one token"),
        ({**good, "prompt_token_ids": []}, 422, "prompt_token_ids"),
        ({**good, "n": 0}, 422, "n"),
        ({**good, "temperature": -1}, 422, "temperature"),  # 0 is greedy (the held-out eval)
        ({**good, "max_new_tokens": 1000}, 400, f"exceed max_model_len {limit}"),
        ({**good, "stop_token_ids": [-1]}, 400, "stop_token_ids: token id -1"),
        ({**good, "expected_version": version + 7}, 409, f"the engine holds weights version {version}"),
        ({**good, "temprature": 0.5}, 422, "temprature"),
    ]
    for body, status, fragment in cases:
        response = http.post("/generate", json=body)
        assert response.status_code == status, (body, response.text)
        assert fragment in str(response.json()["detail"]), response.text
    state = {name: t.clone() for name, t in policy.engine_weights()}
    no_head = safetensors_bytes((n, t) for n, t in state.items() if n != "lm_head.weight")
    response = http.post("/update_weights", params={"version": 99}, content=no_head)
    assert response.status_code == 400 and "missing ['lm_head.weight']" in response.json()["detail"]
    response = http.post("/update_weights", params={"version": 99}, content=b"not safetensors")
    assert response.status_code == 400 and response.json()["detail"].startswith("body: not a safetensors file")
    assert http.get("/health").json()["weights_version"] == version  # nothing half-applied
    assert http.post("/generate", json=good).status_code == 200
    with pytest.raises(EngineRequestError, match="answered 400: prompt_token_ids"):
        RolloutClient(server.url).generate({**good, "prompt_token_ids": [[vocab]]})
    http.close()


def test_a_killed_server_is_named_with_its_exit_code(tiny_models, tmp_path, policy):
    cfg = config(tiny_models, tmp_path)
    with RolloutServer(cfg, tmp_path / "rollout-server.log") as proc:
        proc.wait_until_ready(300)
        engine = VLLMEngine(policy.pad_id, policy.stop_ids)
        engine.connect(RolloutClient(proc.url, timeout_s=30))
        os.kill(proc.pid, signal.SIGKILL)
        with pytest.raises(httpx.HTTPError):
            engine.generate(policy.encode_prompts(sentiment.prompts(2)), GenerationConfig(), torch.Generator())
        message = proc.death(settle_s=30)
        assert message.startswith(f"rollout server (pid {proc.pid}, {proc.url}) exited with code -9")
        assert "engine loaded" in message  # the log tail
        engine.close()
    assert not proc.group_members()


def test_a_server_that_cannot_load_fails_readiness_with_its_log(tiny_models, tmp_path):
    cfg = config(tiny_models, tmp_path, max_model_len=10**7)  # more than the model's positions
    with RolloutServer(cfg, tmp_path / "rollout-server.log") as proc:
        with pytest.raises(RolloutServerNotReady, match=r"rollout server exited with code \d+ before it was ready"):
            proc.wait_until_ready(300)
