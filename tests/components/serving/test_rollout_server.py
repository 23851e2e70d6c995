"""The vLLM rollout server (components/serving/rollout/) as a real child process in .venv-vllm, on the tiny
policy: the generation contract, k samples per prompt as asked (equal neighbouring prompts too), logprob agreement
with the trainer before and after refits over both weight transports (and between them), the version the server
issues and the run it serves (409s naming both), /health while the weights are broken, a skipped refit caught by
the mismatch metric, LoRA merged weights, bad input refused while it keeps serving, and a kill -9 named."""

import os
import re
import signal
import socket
import subprocess
import sys
from collections import Counter
from pathlib import Path

import httpx
import psutil
import pytest
import torch

from components.launch.processes import ServerNotReady, alive, group_members, wait_for
from components.serving.auth import new_secret, request_headers
from components.serving.launcher import launch_rollout, rollout_env, rollout_python
from components.serving.rollout.client import HTTPWeights, RolloutClient, safetensors_header, safetensors_stream
from components.handshake import run_client
from models.config import LoraConfig, RLHFConfig, Sampling, from_layers, preset
from models.resolve import pin
from models.engines import Weights
from models.engines.vllm import EngineRequestError, VLLMEngine
from models.algorithms import StepData, resolve
from models.losses import mismatch_weights
from models.policy import Policy
from models.step import engine_mismatch
from models.tasks import sentiment

pytestmark = pytest.mark.slow(4)

RUN = "test-rollout-server/1"  # the run every test of this module speaks as (the server serves one run)


def config(tiny_models, tmp_path, **placement) -> RLHFConfig:
    """Any free port; 1 thread: the suite's other worker shares the cores (a run's default is every core)."""
    return pin(from_layers({"preset": "tiny", "model": {"policy": tiny_models["policy"]}, "rollout": {"engine": "vllm"},
                            "deploy": {"state_dir": str(tmp_path), "rollout": {"port": 0, "threads": 1, **placement}}}))


def test_the_server_gets_every_core_of_a_cpu_host_unless_told(tiny_models, tmp_path):
    default = RLHFConfig.model_validate({"model": {"policy": tiny_models["policy"]}})
    assert rollout_env(default)["OMP_NUM_THREADS"] == str(os.cpu_count())
    assert rollout_env(config(tiny_models, tmp_path))["OMP_NUM_THREADS"] == "1"
    assert rollout_env(default)["VLLM_ENABLE_V1_MULTIPROCESSING"] == "0"


# the module's server runs on one core (deploy.rollout.cpu_cores), as in a pod
SERVER_CORE = max(os.sched_getaffinity(0))


def threads_cores(pid: int) -> dict[str, str]:
    """Each thread of process `pid` (its name and id) -> the cores it may run on (a Linux core list)."""
    cores = {}
    for tid in os.listdir(f"/proc/{pid}/task"):
        status = dict(line.split(":\t", 1) for line in open(f"/proc/{pid}/task/{tid}/status").read().splitlines()
                      if ":\t" in line)
        cores[f"{status['Name']} {tid}"] = status["Cpus_allowed_list"].strip()
    return cores


@pytest.fixture(scope="module")
def inductor_cache(tmp_path_factory) -> Path:
    """Where torch's inductor would keep what the module's server compiles (it inherits TORCHINDUCTOR_CACHE_DIR)."""
    return tmp_path_factory.mktemp("inductor")


@pytest.fixture(scope="module")
def server(tiny_models, tmp_path_factory, inductor_cache):
    cfg = config(tiny_models, tmp_path_factory.mktemp("rollout"), cpu_cores=str(SERVER_CORE))
    rollout_python(cfg)  # a missing .venv-vllm fails here, naming `make vllm-venv`
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("TORCHINDUCTOR_CACHE_DIR", str(inductor_cache))
        launched = launch_rollout(cfg, tmp_path_factory.mktemp("logs") / "rollout-server.log")
    with launched as proc:
        proc.wait_until_ready(300)
        yield proc
    assert proc.poll() is not None and not proc.group_members()  # stopped, nothing of it left


@pytest.fixture(scope="module")
def policy(tiny_models):
    return Policy.load(tiny_models["policy"])


def connected(server, policy, transport: str = "http") -> VLLMEngine:
    """An engine of this module's run on the server, over `transport`, holding the policy's weights as they are now."""
    engine = VLLMEngine(policy.pad_id, policy.stop_ids)
    client = RolloutClient(server.url, RUN, timeout_s=60)
    if transport == "dist":
        client.use_dist("127.0.0.1", timeout_s=60)
    engine.connect(client)
    engine.update_weights(policy.engine_weights())
    return engine


@pytest.fixture
def engine(server, policy):
    engine = connected(server, policy)
    yield engine
    engine.close()


def trainer_logprobs(policy, rollout, temperature):
    with torch.no_grad():
        return policy.logprobs(rollout.tokens, rollout.lengths, temperature)[0] * rollout.response_mask


def perturb(policy, scale: float, seed: int) -> None:
    torch.manual_seed(seed)
    with torch.no_grad():
        for param in policy.model.parameters():
            param.add_(torch.randn_like(param) * scale)


def test_generation_contract_shapes_eos_and_n_samples(server, policy):
    client = RolloutClient(server.url, RUN)
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
    greedy = client.generate({"prompt_token_ids": prompts, "temperature": 0, "max_new_tokens": 1})["samples"]
    first = [s[0]["token_ids"][0] for s in greedy]
    stopped = client.generate({"prompt_token_ids": prompts[:1], "n": 2, "top_k": 1, "max_new_tokens": 5,
                               "stop_token_ids": [first[0]]})["samples"][0]
    assert all(s["token_ids"] == [first[0]] and s["is_end"] for s in stopped)
    # the same seed samples the same tokens
    again = client.generate({"prompt_token_ids": prompts, "n": 4, "max_new_tokens": 6, "stop_token_ids": [eos],
                             "seed": 1})
    assert [[s["token_ids"] for s in p] for p in again["samples"]] == [[s["token_ids"] for s in p]
                                                                       for p in answer["samples"]]
    client.close()


def test_every_thread_of_the_server_runs_on_its_cores(server):
    """deploy.rollout.cpu_cores binds the whole process, the web server's worker threads that generate included (vLLM's
    own binding reaches only the thread that built the engine; on a shared host the server then competes with the
    actor for its cores). The module's first test has generated, so those threads exist."""
    cores = threads_cores(server.pid)
    assert len(cores) > 1 and set(cores.values()) == {str(SERVER_CORE)}, cores


def test_equal_neighbouring_prompts_keep_k_samples_each(engine, policy, server):
    """The step passes k: prompts that repeat (common in real data) are asked for k samples each, exactly the request
    a client makes with n=k for those prompts (nothing guessed from prompt equality)."""
    ids = policy.encode_prompts(["review the cat :", "review the cat :", "review the dog :"])
    rollout = engine.generate(ids, 3, Sampling(max_new_tokens=8), torch.Generator().manual_seed(4))
    seed = int(torch.randint(0, 2**31 - 1, (1,), generator=torch.Generator().manual_seed(4)))
    stop_ids = [int(t) for t in policy.stop_ids]
    direct = RolloutClient(server.url, RUN).generate({"prompt_token_ids": ids, "n": 3, "max_new_tokens": 8,
                                                      "seed": seed, "stop_token_ids": stop_ids})
    expected = [s["token_ids"] for per_prompt in direct["samples"] for s in per_prompt]
    got = [rollout.tokens[i, rollout.prompt_lengths[i]:rollout.lengths[i]].tolist() for i in range(len(rollout))]
    assert len(got) == 9 and got == expected
    assert len({tuple(r) for r in got[:3]}) > 1  # the first prompt's 3 samples are 3 draws, not copies
    assert rollout.versions.tolist() == [engine.version] * 9  # stamped by the server


def test_engine_rollout_has_the_native_layout(engine, policy):
    prompts = policy.encode_prompts(sentiment.prompts(4))
    rollout = engine.generate(prompts, 2, Sampling(max_new_tokens=8), torch.Generator().manual_seed(0))
    assert rollout.tokens.shape[0] == 8 and rollout.sample_logprobs.shape == (8, rollout.tokens.shape[1] - 1)
    for i in range(8):
        ids = prompts[i // 2]
        p, n = int(rollout.prompt_lengths[i]), int(rollout.lengths[i])
        assert rollout.tokens[i, :p].tolist() == ids
        assert (rollout.tokens[i, n:] == policy.pad_id).all()
        assert bool(rollout.is_end[i]) == (int(rollout.tokens[i, n - 1]) in policy.stop_ids.tolist())
    assert torch.equal(rollout.response_mask.sum(1).long(), rollout.response_lengths)
    assert (rollout.sample_logprobs * (1 - rollout.response_mask) == 0).all()


@pytest.mark.parametrize("temperature", [1.0, 0.7])
def test_logprobs_match_the_trainer_before_and_after_refits_over_both_transports(server, tiny_models, temperature):
    """Engine logprobs (processed: the tempered distribution actually sampled) against the trainer's recomputation on
    the same tokens, on the initial weights and after refits with perturbed weights, alternating the transports; each
    refit moves the engine's logprobs by far more than the agreement tolerance, so a refit that did not land would
    fail. The versions are the server's: one more per refit."""
    policy = Policy.load(tiny_models["policy"])
    prompts = policy.encode_prompts(sentiment.prompts(8))
    sampling = Sampling(max_new_tokens=10, temperature=temperature)
    generator = torch.Generator().manual_seed(0)
    engines = {transport: connected(server, policy, transport) for transport in ("http", "dist")}
    start = engines["dist"].version
    for refit in range(4):
        engine = engines["http" if refit % 2 else "dist"]  # dist connected last: it holds the newest version
        if refit:
            perturb(policy, 0.02, refit)
            engine.version = RolloutClient(server.url, RUN).version()  # the other engine moved the server on
            engine.update_weights(policy.engine_weights())
        rollout = engine.generate(prompts, 1, sampling, generator)
        diff = (trainer_logprobs(policy, rollout, temperature) - rollout.sample_logprobs).abs().max().item()
        assert diff < 1e-3, (refit, diff)
    assert engine.version == start + 3
    for e in engines.values():
        e.close()


def test_a_refit_over_dist_and_over_http_gives_the_same_logprobs(server, tiny_models):
    """The same weights sent over each transport: the same sampled tokens, logprobs within 1e-5 (float32)."""
    policy = Policy.load(tiny_models["policy"])
    perturb(policy, 0.03, 11)
    prompts = policy.encode_prompts(sentiment.prompts(8))
    answers = {}
    for transport in ("http", "dist"):
        engine = connected(server, policy, transport)  # a full refit of the same weights
        answers[transport] = engine.generate(prompts, 2, Sampling(max_new_tokens=10), torch.Generator().manual_seed(9))
        assert engine.last_refit["transport"] == transport and engine.last_refit["bytes"] > 0
        engine.close()
    http, dist = answers["http"], answers["dist"]
    assert torch.equal(http.tokens, dist.tokens)
    assert (http.sample_logprobs - dist.sample_logprobs).abs().max().item() < 1e-5
    assert dist.versions[0] == http.versions[0] + 1


def test_the_server_serves_one_run_and_issues_the_versions(engine, server, policy):
    """The server is bound to the run that first sent it weights: another run's generate, update or transfer set-up is
    refused with 409 naming both runs, as is an update whose version is not the next one; the engine refuses to
    sample from weights it did not apply (another trainer of the same run moved the server on)."""
    ids = policy.encode_prompts(sentiment.prompts(2))
    other = RolloutClient(server.url, "another-run/7")
    with pytest.raises(EngineRequestError, match=r"409: run: this rollout server serves run 'test-rollout-server/1', "
                                                 r"not 'another-run/7'"):
        other.generate({"prompt_token_ids": ids, "max_new_tokens": 2})
    with pytest.raises(EngineRequestError, match="409: run: this rollout server serves run"):
        other.load_weights(policy.engine_weights(), engine.version + 1)
    with pytest.raises(EngineRequestError, match="409: run: this rollout server serves run"):
        other.use_dist("127.0.0.1", timeout_s=30)
    same_run = RolloutClient(server.url, RUN)
    with pytest.raises(EngineRequestError, match=rf"409: version: the server holds weights version {engine.version}; "
                                                 rf"an update makes version {engine.version + 1}, not "
                                                 rf"{engine.version + 2}"):
        same_run.load_weights(policy.engine_weights(), engine.version + 2)
    assert same_run.version() == engine.version  # nothing applied
    same_run.load_weights(policy.engine_weights(), engine.version + 1)  # a second trainer of this run
    with pytest.raises(EngineRequestError, match=rf"holds weights version {engine.version + 1}, not {engine.version}"):
        engine.generate(ids, 1, Sampling(max_new_tokens=2), torch.Generator())
    for client in (other, same_run):
        client.close()


def test_prompts_spread_over_two_replicas_sample_what_one_replica_samples(engine, server, policy):
    """Two replicas (here the module's server reached twice, so both hold the same weights) each sample a contiguous
    share of whole prompts, seeded by the prompts' places in the batch: every prompt keeps its k samples, and they are
    the samples one replica draws for the whole batch (same tokens; logprobs within float noise)."""
    prompts = policy.encode_prompts(sentiment.prompts(5))
    sampling = Sampling(max_new_tokens=6, temperature=1.0)
    two = VLLMEngine(policy.pad_id, policy.stop_ids)
    two.connect([RolloutClient(server.url, RUN, timeout_s=60) for _ in range(2)])
    try:
        one_rollout = engine.generate(prompts, 3, sampling, torch.Generator().manual_seed(11))
        two_rollout = two.generate(prompts, 3, sampling, torch.Generator().manual_seed(11))
    finally:
        two.close()
    assert torch.equal(two_rollout.tokens, one_rollout.tokens)
    # each prompt's 3 rows together, in order
    assert torch.equal(two_rollout.prompt_lengths, one_rollout.prompt_lengths)
    torch.testing.assert_close(two_rollout.sample_logprobs, one_rollout.sample_logprobs, rtol=0, atol=1e-4)
    assert two_rollout.versions.tolist() == [engine.version] * 15


def test_every_replica_must_apply_the_version_the_trainer_made(engine, server, policy):
    """After a refit every replica holds the trainer's version, or the refit fails naming the replica that does not:
    here both "replicas" are the module's server, so the second update of one version is refused (409) and the
    engine names that replica instead of sampling from weights that may differ."""
    two = VLLMEngine(policy.pad_id, policy.stop_ids)
    two.connect([RolloutClient(server.url, RUN, timeout_s=60) for _ in range(2)])
    try:
        with pytest.raises(EngineRequestError, match=r"rollout server replica [01] \(http://127\.0\.0\.1:\d+\): the "
                                                     r"weight update failed: .*409: version: the server holds weights "
                                                     rf"version {engine.version + 1}; an update makes version "
                                                     rf"{engine.version + 2}, not {engine.version + 1}"):
            two.update_weights(policy.engine_weights())
        assert two.version == engine.version  # the engine did not move on
    finally:
        two.close()


def test_tensor_parallelism_is_refused_on_a_cpu_host_and_with_http_weights(tiny_models, tmp_path):
    """deploy.rollout.tensor_parallel_size > 1 needs GPUs on the server's host: refused here before anything starts,
    naming the field; and an HTTP body cannot reach the GPU workers that hold the shards: refused in the config."""
    with pytest.raises(ValueError, match=r"^deploy\.rollout\.tensor_parallel_size=2: the rollout server shards the "
                                         r"model over 2 GPUs, and this host has 0 \(a CPU host runs tensor_parallel_"
                                         r"size=1\)"):
        launch_rollout(config(tiny_models, tmp_path, tensor_parallel_size=2), tmp_path / "never.log")
    assert not (tmp_path / "never.log").exists()
    with pytest.raises(ValueError, match=r"deploy\.rollout\.tensor_parallel_size=2 needs "
                                         r"deploy\.rollout\.weight_transfer='dist'"):
        config(tiny_models, tmp_path, tensor_parallel_size=2, weight_transfer="http")


def test_a_failed_update_breaks_health_until_a_full_update_and_never_advances_the_version(server, policy):
    """A weight update that fails half way (here: the trainer announces a dist update and never sends a tensor, so
    the server's receive times out) leaves some weights new and some old: /health answers 503 naming why, the
    server's death check says it is not healthy, generation is refused, the version stays; a full update mends it."""
    client = RolloutClient(server.url, RUN, timeout_s=60)
    client.use_dist("127.0.0.1", timeout_s=2)
    version = client.version()
    weights = policy.engine_weights()
    response = client.http.post("/weights/update", params={"ready_key": "never-sent"}, json={
        "run": RUN, "version": version + 1, "names": [n for n, _, _ in weights.specs],
        "dtype_names": [str(d).removeprefix("torch.") for _, d, _ in weights.specs],
        "shapes": [list(s) for _, _, s in weights.specs]})
    assert response.status_code == 500 and "update to version" in response.json()["detail"]
    health = httpx.get(f"{server.url}/health", timeout=10)
    assert health.status_code == 503 and health.json()["weights_version"] == version
    assert "failed" in health.json()["broken"]
    assert server.death(settle_s=1).startswith(f"rollout server (pid {server.pid}, {server.url}) is not healthy: "
                                               f"/health answered 503")
    with pytest.raises(EngineRequestError, match="503: weights: inconsistent after a failed update"):
        client.generate({"prompt_token_ids": policy.encode_prompts(sentiment.prompts(1)), "max_new_tokens": 2})
    client.transport = HTTPWeights(client)
    assert client.load_weights(policy.engine_weights(), version + 1)["weights_version"] == version + 1
    assert httpx.get(f"{server.url}/health", timeout=10).status_code == 200 and server.death() is None
    client.close()


def test_a_skipped_refit_is_caught_by_the_mismatch_metric(engine, tiny_models):
    policy = Policy.load(tiny_models["policy"])
    prompts = policy.encode_prompts(sentiment.prompts(8))
    sampling = Sampling(max_new_tokens=10)
    perturb(policy, 0.05, 1)
    stale = engine.generate(prompts, 1, sampling, torch.Generator().manual_seed(1))  # refit skipped on purpose
    engine.update_weights(policy.engine_weights())
    fresh = engine.generate(prompts, 1, sampling, torch.Generator().manual_seed(1))
    metrics = {}
    settings = resolve(preset("tiny", algorithm="rloo"))
    for name, ro in (("stale", stale), ("fresh", fresh)):
        old, mask = trainer_logprobs(policy, ro, 1.0), ro.response_mask
        data = StepData(ro.tokens, mask, ro.is_end, old, {}, torch.zeros_like(mask), 0.0, 1, policy.pad_id, settings,
                        engine_logp=ro.sample_logprobs * mask,
                        is_weights=mismatch_weights(old, ro.sample_logprobs, mask, "token_truncate", None, 2.0))
        metrics[name] = engine_mismatch(data, settings)
    assert metrics["fresh"]["sampling/sampling_logp_difference/max"] < 1e-3
    assert metrics["stale"]["sampling/sampling_logp_difference/mean"] > 0.05, metrics
    assert (metrics["stale"]["sampling/sampling_logp_difference/max"]
            > 20 * metrics["fresh"]["sampling/sampling_logp_difference/max"])


def test_lora_weights_reach_the_engine_merged(server, tiny_models):
    policy = Policy.load(tiny_models["policy"], lora=LoraConfig(enabled=True, r=4))
    with torch.no_grad():
        for name, param in policy.model.named_parameters():
            if "lora_B" in name:
                param.normal_(0, 0.05)  # adapters that change the outputs
    engine = connected(server, policy, "dist")
    rollout = engine.generate(policy.encode_prompts(sentiment.prompts(6)), 1, Sampling(max_new_tokens=8),
                              torch.Generator().manual_seed(2))
    policy.model.eval()
    mine = trainer_logprobs(policy, rollout, 1.0)
    with torch.no_grad():
        base = policy.logprobs(rollout.tokens, rollout.lengths, reference=True)[0] * rollout.response_mask
    assert (mine - rollout.sample_logprobs).abs().max() < 1e-3
    assert (base - rollout.sample_logprobs).abs().max() > 1e-2  # the adapters made a difference the engine has
    engine.close()


def test_bad_input_is_refused_naming_the_field_and_the_server_keeps_serving(server, policy):
    http = run_client(server.secret, "rollout", base_url=server.url, timeout=60)
    good = {"prompt_token_ids": policy.encode_prompts(sentiment.prompts(1)), "max_new_tokens": 4, "run": RUN}
    health = http.get("/health").json()
    version, vocab, limit = health["weights_version"], health["vocab_size"], health["max_model_len"]
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
        ({**good, "temperature": 3.0}, 400, "temperature: temperature must be in [0, 2]"),  # vLLM's own checks
        ({**good, "temperature": 0, "n": 2}, 400, "n: n must be 1 when using greedy sampling"),
    ]
    for body, status, fragment in cases:
        response = http.post("/generate", json=body)
        assert response.status_code == status, (body, response.text)
        assert fragment in str(response.json()["detail"]), response.text
    weights = policy.engine_weights()
    state = dict(weights)
    no_head = Weights([s for s in weights.specs if s[0] != "lm_head.weight"],
                      [t for n, t in state.items() if n != "lm_head.weight"])
    response = http.post("/update_weights", params={"version": version + 1, "run": RUN},
                         content=b"".join(safetensors_stream(no_head)))
    assert response.status_code == 400 and "missing ['lm_head.weight']" in response.json()["detail"]
    response = http.post("/update_weights", params={"version": version + 1, "run": RUN}, content=b"not safetensors")
    assert response.status_code == 400 and response.json()["detail"].startswith("body: not a safetensors file")
    wrong = Weights([(n, d, (1,) + tuple(s)) if n == "lm_head.weight" else (n, d, s) for n, d, s in weights.specs],
                    [t.unsqueeze(0) if n == "lm_head.weight" else t for n, t in state.items()])
    response = http.post("/update_weights", params={"version": version + 1, "run": RUN},
                         content=b"".join(safetensors_stream(wrong)))
    assert response.status_code == 400 and response.json()["detail"].startswith("shapes: lm_head.weight has shape")
    response = http.post("/update_weights", params={"version": version + 1})
    assert response.status_code == 422 and "run" in response.text
    assert http.get("/health").json()["weights_version"] == version  # nothing half-applied
    assert http.post("/generate", json=good).status_code == 200
    with pytest.raises(EngineRequestError, match="answered 400: prompt_token_ids"):
        RolloutClient(server.url, RUN).generate({**good, "prompt_token_ids": [[vocab]]})
    http.close()


# ------------------------------------------------------------------------------------------------ its own run only
def test_a_stranger_is_refused_and_health_shows_no_run_token(server, policy):
    """Every endpoint but GET /health and the proof needs a request signed with the run's key: 401 unsigned (naming
    the header; the run's secret itself as a bearer token too: it is never sent), 403 signed with another run's,
    before any body is read; /health says whether a run is bound, never which."""
    connected(server, policy).close()  # bound to this module's run
    body = {"prompt_token_ids": [[1, 2]], "max_new_tokens": 2, "run": RUN}
    requests = [("POST", "/generate", {"json": body}), ("POST", "/weights/init", {"json": {
                    "run": RUN, "master_address": "127.0.0.1", "master_port": 1}}),
                ("POST", "/weights/update", {"params": {"ready_key": "k"}, "json": {"run": RUN, "version": 1,
                                                                                   "names": [], "dtype_names": [],
                                                                                   "shapes": []}}),
                ("POST", "/weights/digests", {"json": {"run": RUN, "version": 1, "ready_key": "k", "digests": []}}),
                ("POST", "/update_weights", {"params": {"version": 1, "run": RUN}, "content": b"x" * 100}),
                ("GET", "/openapi.json", {}), ("GET", "/docs", {})]
    stranger = new_secret()
    for who, status in ((lambda m, p: {}, 401), (lambda m, p: request_headers(stranger, m, p), 403),
                        (lambda m, p: {"authorization": f"Bearer {server.secret}"}, 401)):
        for method, path, kwargs in requests:
            response = httpx.request(method, f"{server.url}{path}", headers=who(method, path), timeout=30, **kwargs)
            assert response.status_code == status, (path, status, response.text)
            assert response.json()["detail"].startswith("authorization:")
    health = httpx.get(f"{server.url}/health", timeout=30)
    assert health.status_code == 200 and health.json()["bound"] is True
    assert RUN not in health.text and "run" not in health.json()
    assert RolloutClient(server.url, RUN, secret=server.secret).generate(body)["samples"]


def test_idle_and_slow_connections_of_a_stranger_keep_nothing_from_the_run(server, policy):
    """The issue's probe: 64 idle TCP connections, with no secret, made the server answer 503 to every request,
    /health included (uvicorn's limit counted connections). A stranger now holds more connections than the server
    keeps open (--max-connections, 1024), some idle, some sending a request head that never ends: /health and the
    run's own requests are answered all the while (the longest idle connections are closed to make room)."""
    host, port = server.url.split("//")[1].split(":")
    held = []
    try:
        for i in range(1100):
            sock = socket.create_connection((host, int(port)), timeout=30)
            if i % 3 == 0:  # a request head sent in part: it never ends
                sock.sendall(b"POST /generate HTTP/1.1\r\nHost: x\r\nX-Slow: a")
            held.append(sock)
        health = httpx.get(f"{server.url}/health", timeout=30)
        assert health.status_code == 200, health.text
        client = RolloutClient(server.url, RUN, timeout_s=60, secret=server.secret)
        connected(server, policy).close()  # bound to this module's run
        answer = client.generate({"prompt_token_ids": policy.encode_prompts(sentiment.prompts(1)), "max_new_tokens": 2})
        assert answer["samples"] and httpx.get(f"{server.url}/health", timeout=30).status_code == 200
        client.close()
        closed = sum(1 for sock in held if _closed_by_peer(sock))
        assert closed >= 1100 - 1024, closed  # the server kept at most its bound, the stranger's oldest went first
    finally:
        for sock in held:
            sock.close()


def _closed_by_peer(sock: socket.socket) -> bool:
    sock.setblocking(False)
    try:
        return sock.recv(1) == b""
    except BlockingIOError:
        return False
    except OSError:
        return True


def whole_answer(sock: socket.socket) -> str:
    """An HTTP answer read off a raw socket to its end (its head and `content-length` bytes of body; the peer closing
    ends it too): one recv may hold only the head."""
    data = b""
    while chunk := sock.recv(4096):
        data += chunk
        head, ended, body = data.partition(b"\r\n\r\n")
        length = re.search(rb"content-length: (\d+)", head, re.I)
        if ended and len(body) >= (int(length[1]) if length else 0):
            break
    return data.decode(errors="replace")


def signed(server, method: str, path: str) -> str:
    """An `Authorization` line signed with the run's key, for a request written by hand."""
    return f"Authorization: {request_headers(server.secret, method, path.split('?')[0])['authorization']}\r\n"


def test_bodies_and_requests_are_bounded(server, policy):
    http = run_client(server.secret, "rollout", base_url=server.url, timeout=60)
    version = http.get("/health").json()["weights_version"]
    # refused from the Content-Length alone: nothing of the body is read (none is sent here)
    host, port = server.url.split("//")[1].split(":")
    for path, size in (("/generate", (32 << 20) + 1), (f"/update_weights?version={version + 1}&run={RUN}", 1 << 40)):
        with socket.create_connection((host, int(port)), timeout=30) as sock:
            sock.sendall(f"POST {path} HTTP/1.1\r\nHost: x\r\n{signed(server, 'POST', path)}"
                         f"Content-Type: application/json\r\nContent-Length: {size}\r\n\r\n".encode())
            answer = whole_answer(sock)
        assert answer.startswith("HTTP/1.1 413") and "content-length:" in answer, answer
    with socket.create_connection((host, int(port)), timeout=30) as sock:  # a body of unknown size: chunked
        sock.sendall(f"POST /generate HTTP/1.1\r\nHost: x\r\n{signed(server, 'POST', '/generate')}"
                     f"Transfer-Encoding: chunked\r\n\r\n2\r\n{{}}\r\n0\r\n\r\n".encode())
        answer = whole_answer(sock)
    assert answer.startswith("HTTP/1.1 411") and "content-length: required" in answer, answer
    ids = policy.encode_prompts(sentiment.prompts(1))
    for body, fields in (({"prompt_token_ids": ids * 100, "n": 41}, "prompt_token_ids, n: 100 prompts x n=41 = 4100"),
                         ({"prompt_token_ids": ids * 64, "n": 64, "max_new_tokens": 2049},
                          "prompt_token_ids, n, max_new_tokens: 4096 sequences x 2049")):
        response = http.post("/generate", json={**body, "run": RUN})
        assert response.status_code == 400 and response.json()["detail"].startswith(fields), response.text
    init = {"run": RUN, "master_address": "10.1.2.3", "master_port": 29500}
    response = http.post("/weights/init", json=init)
    assert response.status_code == 403 and "master_address: this server sets up weight transfers with its trainer " \
                                           "at '127.0.0.1' only, not '10.1.2.3'" in response.json()["detail"]
    response = http.post("/weights/init", json={**init, "master_address": "127.0.0.1", "timeout_s": 10**6})
    assert response.status_code == 422 and "timeout_s" in response.text
    assert http.get("/health").json()["weights_version"] == version
    assert http.post("/generate", json={"prompt_token_ids": ids, "max_new_tokens": 2, "run": RUN}).status_code == 200
    http.close()


def test_45_aborted_uploads_end_their_readers_and_the_server_keeps_serving(server, policy):
    """Uploads that stop half way (the client goes away): each reader ends at once instead of waiting for the rest
    forever; the server's worker threads (40 in uvicorn's pool) are not used up, the lock is free, a full update by
    the run mends the weights the aborted ones left half-loaded, and generation goes on."""
    client = RolloutClient(server.url, RUN, timeout_s=60, secret=server.secret)
    version = client.version()
    weights = policy.engine_weights()
    header = safetensors_header(weights)
    length = len(header) + sum(torch.Size(shape).numel() * 4 for _, _, shape in weights.specs)
    host, port = server.url.split("//")[1].split(":")
    baseline = len(os.listdir(f"/proc/{server.pid}/task"))
    for i in range(45):
        with socket.create_connection((host, int(port)), timeout=30) as sock:
            sock.sendall(f"POST /update_weights?version={version + 1}&run={RUN} HTTP/1.1\r\nHost: x\r\n"
                         f"{signed(server, 'POST', '/update_weights')}Content-Type: application/octet-stream\r\n"
                         f"Content-Length: {length}\r\n\r\n".encode() + (header + b"\0" * 4096)[:64 + 97 * i])
    health = wait_for(lambda: httpx.get(f"{server.url}/health", timeout=30).json(), 30)
    assert health["weights_version"] == version  # no aborted upload became a version
    # every reader has ended: the pool's threads go idle and retire, none waits on a body that never comes
    assert wait_for(lambda: len(os.listdir(f"/proc/{server.pid}/task")) <= baseline + 4, 60, poll_s=0.5), \
        (baseline, len(os.listdir(f"/proc/{server.pid}/task")))
    assert client.load_weights(weights, version + 1)["weights_version"] == version + 1  # the lock is free
    answer = client.generate({"prompt_token_ids": policy.encode_prompts(sentiment.prompts(2)), "max_new_tokens": 3})
    assert answer["weights_version"] == version + 1 and len(answer["samples"]) == 2
    client.close()


def test_the_weight_transfer_store_listens_on_the_trainers_address_only(server, policy):
    client = RolloutClient(server.url, RUN, timeout_s=60, secret=server.secret)
    engine = VLLMEngine(policy.pad_id, policy.stop_ids)
    client.use_dist("127.0.0.1", timeout_s=60)
    port = client.transport.port
    listening = [c for c in psutil.Process().net_connections("tcp") if c.status == psutil.CONN_LISTEN
                 and c.laddr.port == port]
    assert listening and {c.laddr.ip for c in listening} == {"127.0.0.1"}, listening  # never every interface
    engine.connect(client)
    engine.update_weights(policy.engine_weights())  # the group works over loopback
    engine.close()


OPENAI_ROUTES = ("/v1/", "/tokenize", "/inference/")  # vLLM's shapes (components/serving/rollout/openai.py)


def at_most_4_sequences(case):
    """A fuzzed request that the server would accept with n sequences (1 to its cap of 4096) asks for at most 4: a
    generation's length is bounded by the tiny model's context (64 tokens), its width by this; every refusal (n < 1,
    over the cap, not an integer) stays as generated."""
    body = case.body if isinstance(case.body, dict) else {}
    for holder in (body, body.get("sampling_params")):
        if isinstance(holder, dict) and type(holder.get("n")) is int and 4 < holder["n"] <= 4096:
            holder["n"] = 4
    return case


def test_schemathesis_drives_every_endpoint_from_the_servers_own_schema(server, policy):
    """Schemathesis builds requests from the server's own OpenAPI schema, valid and invalid (wrong types, missing and
    extra fields, out-of-range numbers, random strings for the run and the trainer's address): none gets a server
    error, each refusal names its field (FastAPI's `detail` on the trainer's routes; vLLM's `error` with its `param`
    on the OpenAI-compatible ones), and the run's own requests are served afterwards. The OpenAI-compatible routes
    get 10 examples each (at 60 they would double the test's time: building a case from vLLM's large request models
    is slow); 10 were enough to find the 5xx that vLLM's own checks used to cause."""
    import schemathesis
    from hypothesis import HealthCheck, given, settings
    from hypothesis import strategies as st
    from schemathesis import GenerationMode

    connected(server, policy).close()  # bound to this module's run: a stranger's random `run` is another run
    raw = httpx.get(f"{server.url}/openapi.json", headers=request_headers(server.secret, "GET", "/openapi.json"),
                    timeout=30).json()
    schema = schemathesis.openapi.from_dict(raw)
    counts: Counter = Counter()
    for result in schema.get_all_operations():
        operation = result.ok()
        openai = operation.path.startswith(OPENAI_ROUTES)
        cases = st.one_of(operation.as_strategy(GenerationMode.POSITIVE),
                          operation.as_strategy(GenerationMode.NEGATIVE)).map(at_most_4_sequences)

        @settings(max_examples=10 if openai else 60, deadline=None, derandomize=True, database=None,
                  suppress_health_check=list(HealthCheck))
        @given(cases)
        def one(case):
            auth = request_headers(server.secret, case.method, case.formatted_path)  # each request signed once
            response = case.call(base_url=server.url, headers=auth, timeout=60)
            counts[operation.label, response.status_code] += 1
            assert response.status_code < 500, (case.as_curl_command(), response.text)
            if response.status_code < 400:
                return
            body = response.json()
            assert ("error" in body) == openai, (operation.label, body)
            if openai:
                error = body["error"]
                assert error["param"] and error["message"] and error["code"] == response.status_code, error
            elif isinstance(body["detail"], list):  # pydantic's: each error locates its field
                assert all(error["loc"] for error in body["detail"]), body
            else:
                assert re.match(r"^[a-z_]+(\[\d+\])?(, [a-z_]+)*:|^weights/|^body:", body["detail"]), body

        one()
    sent = sum(counts.values())
    refused = sum(n for (_, status), n in counts.items() if status >= 400)
    print(f"schemathesis: {sent} requests, {refused} refused (4xx), none 5xx: {sorted(counts.items())}")
    assert sent >= 200 and refused >= sent // 2
    engine = connected(server, policy)  # the run's own requests are served
    rollout = engine.generate(policy.encode_prompts(sentiment.prompts(2)), 2, Sampling(max_new_tokens=4),
                              torch.Generator().manual_seed(0))
    assert len(rollout) == 4
    engine.close()


PARENT = """
import sys
from components.serving.launcher import launch_rollout
from models.config import RLHFConfig
server = launch_rollout(RLHFConfig.model_validate_json(sys.argv[1]), sys.argv[2])
server.wait_until_ready(300)
print(server.pid, flush=True)
sys.stdin.read()  # until killed
"""


def test_an_eager_server_on_a_cpu_host_compiles_nothing(server, policy, inductor_cache):
    """enforce_eager (the module's server) on a host without a GPU: sampling at temperature 1 with the sampled tokens'
    logprobs and ranks (what vLLM otherwise compiles with inductor: its random sample and its rank count), after every
    test above has generated, leaves the inductor cache empty."""
    engine = connected(server, policy)
    try:
        rollout = engine.generate(policy.encode_prompts(sentiment.prompts(4)), 2, Sampling(max_new_tokens=6),
                                  torch.Generator().manual_seed(0))
    finally:
        engine.close()
    assert rollout.tokens.shape[0] == 8 and bool((rollout.sample_logprobs <= 0).all())
    assert [p.name for p in inductor_cache.rglob("*") if p.is_file()] == []


def test_a_rollout_server_whose_run_is_killed_stops(tiny_models, tmp_path):
    cfg = config(tiny_models, tmp_path)
    repo = Path(__file__).resolve().parents[3]
    parent = subprocess.Popen([sys.executable, "-c", PARENT, cfg.model_dump_json(), str(tmp_path / "server.log")],
                              cwd=repo, env={**os.environ, "PYTHONPATH": str(repo)}, stdin=subprocess.PIPE,
                              stdout=subprocess.PIPE, text=True)
    try:
        pid = int(parent.stdout.readline())
        os.kill(parent.pid, signal.SIGKILL)  # the run dies without a chance to stop its server
        parent.wait()
        assert wait_for(lambda: not alive(pid) and not group_members(pid), 60, poll_s=0.2)
        assert "is gone: stopping" in (tmp_path / "server.log").read_text()
    finally:
        parent.kill()
        parent.wait()


def test_a_killed_server_is_named_with_its_exit_code(tiny_models, tmp_path, policy):
    cfg = config(tiny_models, tmp_path)
    with launch_rollout(cfg, tmp_path / "rollout-server.log") as proc:
        proc.wait_until_ready(300)
        engine = VLLMEngine(policy.pad_id, policy.stop_ids)
        engine.connect(RolloutClient(proc.url, RUN, timeout_s=30))
        os.kill(proc.pid, signal.SIGKILL)
        with pytest.raises(httpx.HTTPError):
            engine.generate(policy.encode_prompts(sentiment.prompts(2)), 1, Sampling(), torch.Generator())
        message = proc.death(settle_s=30)
        assert message.startswith(f"rollout server (pid {proc.pid}, {proc.url}) exited with code -9")
        assert "engine loaded" in message  # the log tail
        engine.close()
    assert not proc.group_members()


@pytest.mark.parametrize("vllm, words", [({"max_model_len": 10**7}, "max_model_len"),  # more than the model's positions
                                          ({"cpu_cores": "4096"}, "--cpu-cores: cannot run on cores [4096]")])
def test_a_server_that_cannot_load_fails_readiness_with_its_log(tiny_models, tmp_path, vllm, words):
    cfg = config(tiny_models, tmp_path, **vllm)
    with launch_rollout(cfg, tmp_path / "rollout-server.log") as proc:
        with pytest.raises(ServerNotReady, match=r"rollout server exited with code \d+ before .* was ready") as err:
            proc.wait_until_ready(300)
        assert err.value.reason == "process_exited" and words in str(err.value)
