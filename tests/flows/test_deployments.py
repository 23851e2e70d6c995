"""End to end through a real local stack: Prefect server, MLflow server and the served deployments (what `rlhf up`
starts), driven with `prefect deployment run` exactly as a user does, on an empty state directory (the embedded
default models ship with the package)."""

import json
import os
import re
import subprocess
import sys
import time
from pathlib import Path

import psutil
import pytest
from mlflow.tracking import MlflowClient

from components.launch import stack
from components.launch.flow_runs import flow_run_name
from tests.conftest import assert_learned
from tests.flows.conftest import created_run

pytestmark = pytest.mark.slow(16)
PREFECT = str(Path(sys.executable).parent / "prefect")


@pytest.fixture(scope="module")
def local_stack(flows_stack):
    """The package's local stack (tests/flows/conftest.py), as a new user whose Hugging Face cache holds their own
    models has it."""
    return flows_stack


def deployment_run(s, name: str, config: dict, deploy: dict | None = None,
                   check: bool = True) -> subprocess.CompletedProcess:
    """`prefect deployment run NAME --param config=... [--param deploy=...]`, as a user types it."""
    params = ["--param", f"config={json.dumps(config)}"]
    params += ["--param", f"deploy={json.dumps(deploy)}"] if deploy else []
    return subprocess.run([PREFECT, "deployment", "run", name, *params],
                          env=s["env"], capture_output=True, text=True, timeout=120, check=check)


def started(s, name: str, config: dict, deploy: dict | None = None) -> str:
    """The id of a new flow run of deployment `name` with `config` (and `deploy`), created through the API."""
    return created_run(s, name, {"config": config, **({"deploy": deploy} if deploy else {})})


def flow_run_id(proc: subprocess.CompletedProcess) -> str:
    return re.search(r"UUID: ([0-9a-f-]{36})", proc.stdout).group(1)


def read_flow_run(s, run_id: str) -> dict:
    return stack.prefect_get(s['api'], f"/flow_runs/{run_id}").json()


# How long a run may take to fail after one of its processes is killed. The death itself is what fails it (a peer's
# socket closes, a server's exit is seen), which takes seconds; the bound stays below every timeout that would also end
# the run (collectives and server requests: 300 s), so a run failed only by a timeout does not pass, and leaves room
# for a stalled 2-core machine (one fresh-clone run saw a killed rank's run fail 60-80 s after the kill).
DEAD_PROCESS_FAILS_RUN_S = 180


def wait_final(s, run_id: str, timeout: float = 300) -> dict:
    deadline = time.time() + timeout
    while time.time() < deadline:
        run = read_flow_run(s, run_id)
        if run["state"]["type"] in ("COMPLETED", "FAILED", "CANCELLED", "CRASHED"):
            return run
        time.sleep(1)
    raise TimeoutError(f"flow run {run_id} not final after {timeout}s: {run['state']}")


def task_names(s, run_id: str) -> list[str]:
    body = {"flow_runs": {"id": {"any_": [run_id]}}, "limit": 200}
    runs = stack.prefect_post(s['api'], "/task_runs/filter", body, timeout=10).json()
    return [r["name"] for r in sorted(runs, key=lambda r: r["expected_start_time"] or "")]


def stack_processes(s, marker: str) -> list[psutil.Process]:
    """Live processes of this module's stack (their environment names its state directory, or one inside it: a node
    group's, which every child of a flow run inherits, so tests running beside this module in another pytest worker
    never count) whose command line mentions `marker`. A process that outlived its parent still counts: it keeps its
    environment."""
    found = []
    for p in psutil.process_iter(["cmdline", "status"]):
        try:
            state = p.environ().get("RLHF_STATE_DIR", "") if marker in " ".join(p.info["cmdline"] or []) else ""
            if (state and p.info["status"] != psutil.STATUS_ZOMBIE
                    and (state == str(s["state_dir"]) or state.startswith(f"{s['state_dir']}{os.sep}"))):
                found.append(p)
        except psutil.Error:
            continue
    return found


def node_group_processes(s) -> list[psutil.Process]:
    """Live processes of this stack's node groups (each has a state directory of its own under the stack's)."""
    found = []
    for p in psutil.process_iter(["cmdline", "status"]):
        try:
            if (any(m in " ".join(p.info["cmdline"] or []) for m in ("components.runs", "components.launch.nodes"))
                    and p.info["status"] != psutil.STATUS_ZOMBIE
                    and p.environ().get("RLHF_STATE_DIR", "").startswith(str(s["state_dir"]))):
                found.append(p)
        except psutil.Error:
            continue
    return found


def server_processes(s, marker: str) -> list[psutil.Process]:
    """Live critic/reward server processes of this stack whose command line also mentions `marker` (e.g. the run's
    directory)."""
    return [p for p in stack_processes(s, "components.serving.triton.main") if marker in " ".join(p.cmdline())]


def mlflow_run(s, run_name: str):
    client = MlflowClient(s["urls"]["mlflow"])
    exp = client.get_experiment_by_name("rlhf-flows")
    runs = client.search_runs([exp.experiment_id], filter_string=f"attributes.run_name = '{run_name}'")
    assert len(runs) == 1, f"expected one MLflow run named {run_name}, got {len(runs)}"
    return client, runs[0]


def test_up_returns_once_every_deployment_is_registered(local_stack):
    """A run of any deployment may start the moment `rlhf up` returns (they register one after another)."""
    for name in stack.DEPLOYMENTS:
        assert stack.prefect_get(local_stack['api'], f"/deployments/name/{name}").status_code == 200, name


def test_a_users_model_data_and_reward_through_the_deployments_keeping_what_the_operator_set(local_stack):
    """The walk a new user takes (issue 31's acceptance): their model under an `org/name` hub id in the Hugging Face
    cache, `prefect deployment run reinforce/default` and `ppo/default` (at once) with a partial config naming preset
    none (their model's values, not the tiny demo's ppo/default shows), a parquet with question/answer columns and a
    reward file outside any package. The deployments' own parameters are
    kept; no gold reward is logged; the progress artifact reaches 100; MLflow holds each run's model (registered when
    asked); `rlhf export` gives a model plain transformers loads and generates from.

    Before, an operator sets reinforce/default's parameters as the UI's 'Edit deployment' does (PATCH
    /deployments/{id}): run settings (run_name, checkpoint.every, the batch) and where the run's parts run (the reward
    in the flow run's process, no server; the reward server loading a user's reward file is
    tests/components/serving/test_reward_functions_server.py's). The user's partial config names none of them (and
    another field of the same `reinforce` section): the run keeps every one of them, as Prefect replaces a parameter
    as a whole and the flow deep-merges what it is given over its deployment's. The UI's form shows both parameters,
    each field with its description."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    s, user = local_stack, local_stack["user"]
    deployment = stack.prefect_get(s['api'], "/deployments/name/reinforce/default").json()
    schema = deployment["parameter_openapi_schema"]
    assert set(schema["properties"]) == {"config", "deploy"}
    definitions = schema["definitions"]
    assert definitions["DeployConfig"]["properties"]["state_dir"]["description"]
    assert definitions["CheckpointConfig"]["properties"]["every"]["description"]
    operator = {"config": {"algorithm": "rloo", "run_name": "walk-rloo", "checkpoint": {"every": 1},
                           "reinforce": {"rollout_batch_size": 8}},
                "deploy": {"reward": {"launch": "in_process"}}}
    patch_path = f"/deployments/{deployment['id']}"
    stack.prefect_post(s["api"], patch_path, {"parameters": operator}, method="PATCH").raise_for_status()
    walk = {"preset": "none", "iterations": 2,
            "data": {"prompts": str(user / "math.parquet"), "prompt_key": "question"},
            "generation": {"max_new_tokens": 12}, "model": {"policy": "acme/tiny-qwen", "dtype": "float32"}}
    partials = {  # run name -> (deployment, the user's partial config); walk-rloo's name is the operator's
        "walk-rloo": ("reinforce/default",
                      {**walk, "reward": {"source": "function", "function": f"{user}/my_rewards.py:exact"},
                                            "reinforce": {"num_rollouts_per_prompt": 2},
                                            "tracking": {"register_as": "walk-model"}}),
        "walk-ppo": ("ppo/default", {**walk, "run_name": "walk-ppo", "ppo": {"rollout_batch_size": 8},
                                     "model": {**walk["model"], "reward": "acme/tiny-qwen-rm"}})}
    try:
        before = {d["id"]: d["parameters"] for d in stack.prefect_post(s["api"], "/deployments/filter", {}).json()}
        started = {name: flow_run_id(deployment_run(s, deployment, partial))
                   for name, (deployment, partial) in partials.items()}
        runs = {name: wait_final(s, run_id) for name, run_id in started.items()}
        for name, run in runs.items():
            assert run["state"]["type"] == "COMPLETED", (name, run["state"]["message"])
            after = stack.prefect_get(s['api'], f"/deployments/{run['deployment_id']}").json()
            assert after["parameters"] == before[run["deployment_id"]], name
    finally:
        stack.prefect_post(s["api"], patch_path, {"parameters": deployment["parameters"]},
                           method="PATCH").raise_for_status()

    # what the operator set on reinforce/default, kept
    assert runs["walk-rloo"]["name"] == "walk-rloo"  # the deployment's run_name
    ckpt = s["state_dir"] / "checkpoints" / "walk-rloo"
    assert [p.parent.name.split("-")[0] for p in sorted(ckpt.glob("iter_*/state.json"),
                                                        key=lambda p: p.stat().st_mtime)] \
        == ["iter_1", "iter_2"]  # every 1
    assert not (s["state_dir"] / "runs" / "walk-rloo" / "logs" / "reward-server.log").exists()  # in process
    client, mrun = mlflow_run(s, "walk-rloo")
    params = mrun.data.params
    # the operator's batch beside the user's
    assert (params["iterations"], params["checkpoint.every"], params["reinforce.rollout_batch_size"],
            params["reinforce.num_rollouts_per_prompt"]) == ("2", "1", "8", "2")
    assert params["deploy.reward.launch"] == "in_process"
    assert [m.value for m in client.get_metric_history(mrun.info.run_id, "episode")] == [16.0, 32.0]  # 8 prompts x 2

    for name, run in runs.items():
        artifacts = stack.prefect_post(s["api"], "/artifacts/filter",
                                       {"artifacts": {"flow_run_id": {"any_": [run["id"]]}}}).json()
        assert [a["data"] for a in artifacts if a["type"] == "progress"] == [100], name
        client, mrun = mlflow_run(s, name)
        assert "objective/gold_reward" not in mrun.data.metrics and "reward" in mrun.data.metrics, name
        models = client.search_logged_models(experiment_ids=[mrun.info.experiment_id],
                                             filter_string=f"source_run_id = '{mrun.info.run_id}'")
        assert [str(m.status) for m in models] == ["READY"], name
        if name == "walk-rloo":
            assert "rewards/exact/mean" in mrun.data.metrics
            assert [v.run_id for v in client.search_model_versions("name='walk-model'")] == [mrun.info.run_id]

        out = user / f"exported-{name}"
        subprocess.run([str(Path(sys.executable).parent / "rlhf"), "export", name, "--out", str(out)],
                       env=s["env"], check=True, capture_output=True, text=True, timeout=300)
        model, tokenizer = AutoModelForCausalLM.from_pretrained(out), AutoTokenizer.from_pretrained(out)
        prompt = tokenizer.apply_chat_template([{"role": "user", "content": "what is 1 plus 2?"}],
                                               add_generation_prompt=True, return_tensors="pt", return_dict=True)
        assert model.generate(**prompt, max_new_tokens=4, do_sample=False).shape[1] > prompt["input_ids"].shape[1], name


TARGETED = "models.tasks.sentiment:targeted_reward"


def test_reinforce_deployment_starts_no_critic_and_its_reward_server_scores_a_reward_that_reads_a_column(local_stack):
    """reinforce/default on builtin:sentiment_target: the reward function reads the rows' `target` column, which
    reaches it through the reward server (the optional `columns` input): every iteration's score from the server
    equals the gold reward, the same function run in the flow run's process on the rows themselves; and the held-out
    eval (16 prompts, 4 samples each at temperature 1) runs at 0 and 4 (MLflow metrics and tables, a Prefect table
    artifact). That RLOO learns this reward and the eval rises is tests/models/test_steps.py's (the same run in
    process)."""
    s = local_stack
    run_id = started(s, "reinforce/default", {
        "iterations": 4, "run_name": "e2e-rloo", "data": {"prompts": "builtin:sentiment_target"},
        "reward": {"source": "function", "function": TARGETED, "gold": TARGETED},
        "eval": {"prompts": "builtin:sentiment_target", "every": 4, "temperature": 1.0, "samples_per_prompt": 4,
                 "max_prompts": 16}})
    # the flow run is a fork of the deployment server's forkserver, named after the run, and what it starts (its
    # reward server) inherits the run's id
    server = _wait_for(lambda: server_processes(s, '"run_name":"e2e-rloo"'), 300, "the run's reward server")[0]
    flow_process = server.parent()
    assert server.environ()["PREFECT__FLOW_RUN_ID"] == run_id and flow_process.name() == flow_run_name(run_id)
    assert "multiprocessing.forkserver" in " ".join(flow_process.parent().cmdline())
    run = wait_final(s, run_id)
    assert run["state"]["type"] == "COMPLETED", run["state"]["message"]
    names = task_names(s, run["id"])
    assert not any("critic" in n for n in names), names
    assert any(n.startswith("deploy-reward-server") for n in names)
    logs = s["state_dir"] / "runs" / "e2e-rloo" / "logs"
    assert (logs / "reward-server.log").exists() and not (logs / "critic-server.log").exists()
    client, mrun = mlflow_run(s, "e2e-rloo")
    assert mrun.data.tags["algorithm"] == "rloo" and "objective/kl" in mrun.data.metrics
    assert mrun.data.tags["reward_transport"] == "tokens"  # a reward function decodes the policy's tokens

    def history(key):
        return [(m.step, m.value)
                for m in sorted(client.get_metric_history(mrun.info.run_id, key), key=lambda m: m.step)]

    gold, served = history("objective/gold_reward"), history("rewards/targeted_reward/mean")
    assert [step for step, _ in gold] == [step for step, _ in served] == [1, 2, 3, 4]
    # neither all 0 nor all 1
    assert [v for _, v in served] == pytest.approx([v for _, v in gold], abs=1e-6) and 0 < sum(v for _, v in gold) < 4
    evals = history("eval/gold_reward")
    assert [step for step, _ in evals] == [0, 4], evals
    assert [step for step, _ in history("eval/pass_at_4")] == [0, 4]
    assert history("data/rows") == [(0, 200.0)] and history("data/filtered_rows") == [(0, 0.0)]
    tables = {a.path for a in client.list_artifacts(mrun.info.run_id, "tables")}
    assert {"tables/eval_000000.json", "tables/eval_000004.json"} <= tables
    artifact = stack.prefect_post(s['api'], "/artifacts/latest/filter",
                                  {"artifacts": {"key": {"any_": ["eval-e2e-rloo"]}}},
                          timeout=10).json()
    assert artifact and artifact[0]["type"] == "table" and "iteration 4" in artifact[0]["description"], artifact
    assert server_processes(s, str(s["state_dir"])) == []
    # the run's logs hold what the run says, not what a library prints (datasets fingerprints the eval set with dill,
    # whose global-variable scan prints bytecode while capturing stdout)
    logs = [log["message"] for log in stack.prefect_post(s['api'], "/logs/filter", {
        "logs": {"flow_run_id": {"any_": [run["id"]]}}, "limit": 200}, timeout=10).json()]
    assert any(m.startswith("reward server ready at http://") for m in logs), logs
    assert any(m.startswith("eval at iteration 4: ") for m in logs) and any("data: 200 prompts" in m for m in logs)
    bytecode = re.compile(r"\b(RESUME|LOAD_GLOBAL|LOAD_ATTR|LOAD_CONST|RETURN_VALUE|CALL)\b")
    assert not [m for m in logs if bytecode.search(m)], [m for m in logs if bytecode.search(m)][:5]


def test_reinforce_with_a_reward_model_of_another_tokenizer_learns_through_text(local_stack, tiny_reward_chars):
    """model.reward=tiny/reward-chars (a character tokenizer): the flow picks the text transport by itself (the
    reward server's `reward_text`), the scores are reward-chars' own, and RLOO learns by the margin of the
    single-process learning test (tests/models/test_steps.py). (This is the one 12-iteration RLOO run through
    reward-chars: tests/models/test_steps.py runs its first 2 iterations in process.)"""
    s = local_stack
    run = wait_final(s, started(s, "reinforce/default", {
        "iterations": 12, "run_name": "e2e-rloo-text", "model": {"reward": "tiny/reward-chars"}}), timeout=900)
    assert run["state"]["type"] == "COMPLETED", run["state"]
    client, mrun = mlflow_run(s, "e2e-rloo-text")
    assert mrun.data.tags["reward_transport"] == "text"
    gold = [m.value for m in sorted(client.get_metric_history(mrun.info.run_id, "objective/gold_reward"),
                                    key=lambda m: m.step)]
    assert len(gold) == 12
    assert_learned(gold)
    scores = [m.value for m in sorted(client.get_metric_history(mrun.info.run_id, "reward"),
                                      key=lambda m: m.step)]
    assert len(scores) == 12 and max(abs(s - g) for s, g in zip(scores, gold)) < 0.1, (scores, gold)
    assert server_processes(s, str(s["state_dir"] / "runs" / "e2e-rloo-text")) == []


def test_invalid_parameter_is_refused_before_any_run(local_stack):
    s = local_stack
    before = stack.prefect_post(s['api'], "/flow_runs/count", {}, timeout=10).json()
    proc = deployment_run(s, "ppo/default", {"loss": {"epsilon": -1}}, check=False)
    assert proc.returncode != 0
    assert "epsilon" in proc.stdout + proc.stderr
    proc = deployment_run(s, "reinforce/default", {"reinforce": {"num_rollouts_per_prompt": "four"}}, check=False)
    assert proc.returncode != 0 and "num_rollouts_per_prompt" in proc.stdout + proc.stderr
    assert stack.prefect_post(s['api'], "/flow_runs/count", {}, timeout=10).json() == before


def _wait_for(predicate, timeout: float, what: str):
    deadline = time.time() + timeout
    while time.time() < deadline:
        value = predicate()
        if value:
            return value
        time.sleep(0.5)
    raise TimeoutError(what)


def test_a_critic_server_losing_a_rank_fails_the_run_naming_it_and_the_rerun_resumes_leaving_nothing(local_stack):
    """ppo/default with deploy.critic.nproc_per_node=2: the critic server's rank 0 serves, rank 1 follows. Rank 1 is
    killed after the first checkpoint (iteration 2): the run fails (DEAD_PROCESS_FAILS_RUN_S) naming the rank and the
    server that stopped because of it, and no process of the run is left. The same run name then resumes from the
    checkpoint (its 2-rank critic restored): the flow run shows its tasks (the critic server deployed and waited for,
    one task per iteration it ran, nothing before the checkpoint redone, a checkpoint at 4 and at the last), the same
    MLflow run continues to iteration 6 with every iteration's metrics once, and no server or rank is left. (That PPO
    learns across a kill and a resume is tests/components/test_controller_runs.py's; that a 2-rank critic answers and
    restores like one, tests/components/serving/test_critic_ranks.py's.)"""
    s = local_stack
    run_dir = s["state_dir"] / "runs" / "e2e-critic2"
    latest = s["state_dir"] / "checkpoints" / "e2e-critic2" / "latest.json"
    config, deploy = {"iterations": 6, "run_name": "e2e-critic2",
                      "checkpoint": {"every": 2}}, {"critic": {"nproc_per_node": 2}}
    first = started(s, "ppo/default", config, deploy)
    _wait_for(lambda: latest.exists() and (json.loads(latest.read_text())["iteration"] or 0) >= 2, 300,
              "first checkpoint")
    server = _wait_for(lambda: server_processes(s, str(run_dir)), 30, "critic server")[0]
    next(p for p in server.children() if "--follow" in " ".join(p.cmdline())).kill()
    run = wait_final(s, first, timeout=DEAD_PROCESS_FAILS_RUN_S)  # a dead rank fails the run
    assert run["state"]["type"] == "FAILED"
    message = run["state"]["message"] or ""
    assert re.search(r"critic server .*exited with code 1: .*critic rank 1 \(pid \d+\) exited with code -9",
                     message), message
    _wait_for(lambda: not critic_followers(s) and not server_processes(s, str(run_dir)), 60,
              "no process of the run left")
    checkpointed = json.loads(latest.read_text())["iteration"]
    assert checkpointed in (2, 4)

    second = wait_final(s, started(s, "ppo/default", config, deploy), timeout=900)
    assert second["state"]["type"] == "COMPLETED", second["state"]
    names = task_names(s, second["id"])
    assert any(n.startswith("deploy-critic-server") for n in names) and any(n.startswith("wait-until-ready")
                                                                            for n in names)
    assert sum(n.startswith("ppo-iteration") for n in names) == 6 - checkpointed  # nothing before the checkpoint redone
    assert sum(n.startswith("checkpoint") for n in names) == (2 if checkpointed == 2 else 1)  # at 4 and the last
    client, mrun = mlflow_run(s, "e2e-critic2")  # the same MLflow run continued
    steps = [m.step for m in client.get_metric_history(mrun.info.run_id, "objective/kl")]
    assert steps == sorted(set(steps)) and steps[-1] == 6
    assert mrun.info.status == "FINISHED"
    history = sorted(client.get_metric_history(mrun.info.run_id, "objective/gold_reward"), key=lambda m: m.step)
    assert [m.step for m in history] == list(range(1, 7))
    assert "loss/value_avg" in mrun.data.metrics and mrun.data.tags["algorithm"] == "ppo"
    assert mrun.data.tags["prefect.flow_run_id"] in (first, second["id"])
    assert "critic-rank1.log" in {p.name for p in (run_dir / "logs").iterdir()}
    assert server_processes(s, str(run_dir)) == [] and not critic_followers(s)


def test_asynchronous_rollouts_from_the_rollout_server_killed_fail_naming_it_and_resume_in_order(local_stack):
    """reinforce/default with rollout.engine=vllm (the rollout server a child of the flow run) and asynchronous rollouts
    (k=1: the next batch is generated while the actor trains). kill -9 of the rollout server mid-pipeline fails the
    run (DEAD_PROCESS_FAILS_RUN_S), naming it with its exit code, and leaves nothing. The rerun resumes from the
    checkpoint: its server samples with the checkpointed actor (the trainer's logprobs agree with the engine's on the
    first resumed batch, while the actor had moved away from the base checkpoint the server loads), staleness starts
    from 0 again (the rerun's log, every iteration it ran), and every iteration, before the kill and after it, trained
    on the prompt stream's batch of its own number: no prompt skipped, none trained twice (the sample tables, logged
    every iteration by whichever attempt logged it first, against the stream)."""
    from models.config import from_layers
    from models.data import PromptStream
    from models.loop import read_data
    from models.resolve import pin

    s = local_stack
    latest = s["state_dir"] / "checkpoints" / "e2e-vllm" / "latest.json"
    config = {"iterations": 200, "run_name": "e2e-vllm", "checkpoint": {"every": 2}, "tracking": {"table_every": 1},
              "rollout": {"engine": "vllm", "max_off_policy_steps": 1}}
    deploy = {"rollout": {"threads": 1}}  # 1 thread: the other worker shares the cores
    first = started(s, "reinforce/default", config, deploy)
    _wait_for(lambda: latest.exists() and (json.loads(latest.read_text())["iteration"] or 0) >= 2, 300,
              "first checkpoint")
    server = _wait_for(lambda: stack_processes(s, "components.serving.rollout.main"), 30, "rollout server")[0]
    server.kill()
    run = wait_final(s, first, timeout=DEAD_PROCESS_FAILS_RUN_S)  # a dead rollout server fails the run
    assert run["state"]["type"] == "FAILED"
    assert re.search(r"rollout server .*\(pid \d+, http://[^)]+\) exited with code -9", run["state"]["message"]
                     or ""), \
        run["state"]["message"]
    _wait_for(lambda: not stack_processes(s, "components.serving.rollout.main"), 30, "no rollout server left")
    checkpointed = json.loads(latest.read_text())["iteration"]
    client, mrun = mlflow_run(s, "e2e-vllm")
    logged = max(m.step for m in client.get_metric_history(mrun.info.run_id, "objective/kl"))  # >= checkpointed

    # the rerun redoes the iterations after the checkpoint (MLflow keeps the first attempt's steps) and two more
    rerun = wait_final(s, started(s, "reinforce/default", {**config, "iterations": logged + 2}, deploy))
    assert rerun["state"]["type"] == "COMPLETED", rerun["state"]
    # the training run stops its server at the end
    _wait_for(lambda: not stack_processes(s, "components.serving.rollout.main"), 60, "rollout server stopped")
    lines = [log["message"] for log in stack.prefect_post(s['api'], "/logs/filter", {
        "logs": {"flow_run_id": {"any_": [rerun["id"]]}}, "limit": 200}, timeout=10).json()]
    # the rerun's own iterations, as its log says them (MLflow keeps the steps the killed attempt logged first)
    ran = {int(m[1]): (float(m[2]), float(m[3])) for m in (
        re.match(r"iteration (\d+)/\d+: .* sampler logp diff (\S+) staleness (\S+)$", line) for line in lines) if m}
    assert {i: stale for i, (_, stale) in ran.items()} == {
        i: (0.0 if i == checkpointed + 1 else 1.0) for i in range(checkpointed + 1, logged + 3)}, lines
    assert ran[checkpointed + 1][0] < 1e-3, ran  # its first batch: sampled with the checkpointed actor
    history = {k: {m.step: m.value for m in client.get_metric_history(mrun.info.run_id, k)}
               for k in ("sampling/sampling_logp_difference/max", "rollout/staleness_max")}
    diff, stale = history.values()
    # ...which is not the base checkpoint the server loaded: one update alone moved the killed attempt's samplers
    # (its batches were one update behind) far more than that
    assert max(diff[i] for i in range(2, logged + 1)) > 1e-2, diff
    assert [stale[i] for i in range(1, logged + 1)] == [0.0] + [1.0] * (logged - 1), stale  # the killed attempt
    cfg = pin(from_layers({"preset": "tiny", **config, "deploy": {"state_dir": str(s["state_dir"])},
                           "algorithm": "rloo"}))
    stream = PromptStream(read_data(cfg)[0], cfg.reinforce.rollout_batch_size, cfg.seed)
    expected = [next(stream).prompts for _ in range(logged + 2)]
    for step in range(1, logged + 3):
        table = json.loads(Path(client.download_artifacts(mrun.info.run_id,
                                                          f"tables/samples_{step:06d}.json")).read_text())
        logged = [row[table["columns"].index("prompt")] for row in table["data"]]
        assert list(dict.fromkeys(logged)) == expected[step - 1][:len(dict.fromkeys(logged))], step


def test_a_failed_run_says_why_in_its_state_and_in_the_watch_output(local_stack):
    s = local_stack
    config = {"run_name": "e2e-fail", "model": {"policy": "/no/such/policy"}}
    proc = subprocess.run([PREFECT, "deployment", "run", "ppo/default", "--param", f"config={json.dumps(config)}",
                           "--watch"], env=s["env"], capture_output=True, text=True, timeout=300)
    assert proc.returncode != 0
    run = read_flow_run(s, flow_run_id(proc))
    message = run["state"]["message"]
    assert run["state"]["type"] == "FAILED" and "\n" not in message
    assert "RunFailed: FileNotFoundError: model.policy: model path '/no/such/policy' does not exist" in message
    watch = " ".join(proc.stdout.split())
    assert "model.policy: model path '/no/such/policy' does not exist" in watch  # the watch shows the reason


def actor_followers(s) -> list[psutil.Process]:
    """Live actor ranks > 0 of this stack's runs (started by a flow run's rank 0)."""
    return stack_processes(s, "components.launch.ranks")


def critic_followers(s) -> list[psutil.Process]:
    """Live critic server ranks > 0 of this stack's runs."""
    return stack_processes(s, "components.serving.triton.main --follow")


def test_ppo_on_two_node_groups_resumes_on_two_ranks_then_one_and_cancelled_leaves_no_critic_server(local_stack):
    """deploy.actor.nnodes=2: the PPO flow run is the run's controller; node group 0's rank 0 runs the run, starts its
    critic server beside it and stops it at the end, its log reaches the flow run's, and the checkpoint holds the
    critic of its own iteration. The same run name then
    resumes on 2 ranks of one node (the local critic restored from the checkpoint the node groups wrote), where rank
    1 (rank 0 is the flow run) is killed mid-run: the run fails naming it and leaves nothing. It resumes on 1 rank
    (with a local critic server), and is cancelled once it has trained there: the run ends CANCELLED and its critic
    server goes with it."""
    s = local_stack
    config, two = {"iterations": 2, "run_name": "e2e-dist",
                   "checkpoint": {"every": 1}}, {"actor": {"nproc_per_node": 2}}
    nodes = {"actor": {"nnodes": 2}}
    run = wait_final(s, started(s, "ppo/default", config, nodes))
    assert run["state"]["type"] == "COMPLETED", run["state"]
    said = [log["message"] for log in stack.prefect_post(s['api'], "/logs/filter", {
        "logs": {"flow_run_id": {"any_": [run["id"]]}}, "limit": 200}, timeout=10).json()]
    assert any("this process controls them, node group 0's rank 0 runs the run" in m for m in said), said
    assert [m.split(":")[0] for m in said if m.startswith("iteration ")] == ["iteration 1/2", "iteration 2/2"], said
    assert any(m.startswith("critic server ready at http://127.0.0.1:") for m in said), said  # beside node group 0
    assert not node_group_processes(s)
    client, mrun = mlflow_run(s, "e2e-dist")
    assert [m.value for m in client.get_metric_history(mrun.info.run_id, "dist/world_size")] == [2.0, 2.0]
    ckpt = s["state_dir"] / "checkpoints" / "e2e-dist"
    iter_2 = ckpt / json.loads((ckpt / "latest.json").read_text())["path"]  # iter_2-<id>: a fresh prefix per save
    manifest = json.loads((iter_2 / "state.json").read_text())
    assert manifest["state"]["world_size"] == 2 and "actor/optimizer.pt" in manifest["files"]
    assert not actor_followers(s) and server_processes(s, '"run_name":"e2e-dist"') == []  # its critic server went too
    # the critic of the checkpoint is the one of its iteration, inside iter_2 beside the actor
    assert manifest["parts"] == ["actor", "critic"]
    assert json.loads((iter_2 / "critic" / "critic.json").read_text())["step"] == manifest["state"]["critic_step"] > 0

    # the same run name resumes with the same world size, nothing redone (its first iteration is the 3rd), until its
    # rank 1 is killed: the run fails (DEAD_PROCESS_FAILS_RUN_S) naming the rank, and no process of it is left
    latest = ckpt / "latest.json"
    run_id = started(s, "ppo/default", {**config, "iterations": 200}, two)
    _wait_for(lambda: (json.loads(latest.read_text())["iteration"] or 0) >= 3, 240, "a checkpoint of the resumed run")
    follower = _wait_for(lambda: actor_followers(s), 30, "actor rank 1")[0]
    assert follower.environ()["RANK"] == "1"
    follower.kill()
    run = wait_final(s, run_id, timeout=DEAD_PROCESS_FAILS_RUN_S)  # a dead rank fails the run
    assert run["state"]["type"] == "FAILED"
    assert re.search(r"actor rank 1 \(pid \d+\) exited with code -9", run["state"]["message"]), run["state"]["message"]
    _wait_for(lambda: not actor_followers(s) and not critic_followers(s)
              and not server_processes(s, str(s["state_dir"] / "runs" / "e2e-dist")),
              60, "no process of the run left")
    said = [log["message"] for log in stack.prefect_post(s['api'], "/logs/filter", {
        "logs": {"flow_run_id": {"any_": [run_id]}}, "limit": 200}, timeout=10).json()]
    assert [m.split(":")[0] for m in said if m.startswith("iteration ")][0] == "iteration 3/200"
    # ... and on one rank from the 2-rank checkpoint: its weights and optimizer states, fresh sampling streams, a
    # warning; nothing before the checkpoint redone. Once it has trained an iteration of its own, it is cancelled (as
    # the UI's Cancel button does): the run ends CANCELLED and leaves no critic server.
    checkpointed = json.loads(latest.read_text())["iteration"]
    client, mrun = mlflow_run(s, "e2e-dist")
    logged = max(m.step for m in client.get_metric_history(mrun.info.run_id, "dist/world_size"))  # MLflow keeps these
    run_dir = s["state_dir"] / "runs" / "e2e-dist"
    run_id = started(s, "ppo/default", {**config, "iterations": 200}, {"actor": {"nproc_per_node": 1}})

    def sizes() -> list[float]:
        return [m.value
                for m in sorted(client.get_metric_history(mrun.info.run_id, "dist/world_size"), key=lambda m: m.step)]

    _wait_for(lambda: len(sizes()) > logged, 600, "an iteration of the run resumed on one rank")
    assert server_processes(s, str(run_dir)), "no critic server of the run resumed on one rank"
    subprocess.run([PREFECT, "flow-run", "cancel", run_id], env=s["env"], check=True, capture_output=True, timeout=60)
    run = wait_final(s, run_id, timeout=120)
    assert run["state"]["type"] == "CANCELLED", run["state"]
    _wait_for(lambda: not server_processes(s, str(run_dir)), 60, "critic server gone after cancel")
    said = [log["message"] for log in stack.prefect_post(s['api'], "/logs/filter", {
        "logs": {"flow_run_id": {"any_": [run_id]}}, "limit": 200}, timeout=10).json()]
    assert any("saved by 2 rank(s), resuming on 1" in m for m in said), said
    assert [m.split(":")[0] for m in said if m.startswith("iteration ")][0] == f"iteration {checkpointed + 1}/200", said
    assert sizes()[:logged + 1] == [2.0] * logged + [1.0]


def test_up_is_idempotent_and_down_frees_ports(local_stack, tmp_path):
    s = local_stack
    state = stack.stack_dir(s["state_dir"])
    pids = {n: (state / f"{n}.pid").read_text() for n in stack.SERVICES}
    lines = []
    stack.up(s["state_dir"], *s["ports"], set_profile=False, log=lines.append)
    assert any("already running" in line for line in lines)
    assert pids == {n: (state / f"{n}.pid").read_text() for n in stack.SERVICES}
    status = stack.status(s["state_dir"], log=lambda *_: None)
    assert all(v["running"] for v in status.values())
