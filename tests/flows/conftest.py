"""One real local stack for tests/flows/ (what `rlhf up` starts: Prefect server, MLflow server, the served
deployments): test_deployments.py and test_sweeps.py run on it one after the other, in one pytest worker (tests/
conftest.py's scheduler keeps this package together), so the suite starts one stack for both, not one each."""

import os

import psutil
import pytest

from components.launch import stack
from components.launch.processes import wait_for
from tests.conftest import free_port_block
from tests.hub_cache import build_qwen2, put_in_cache

REWARDS = '''import re

def exact(prompts, responses, answer):
    out = []
    for response, solution in zip(responses, answer):
        numbers = re.findall(r"-?\\d+", response)
        out.append(1.0 if numbers and numbers[-1] == solution.split("####")[-1].strip() else 0.0)
    return out
'''


@pytest.fixture(scope="package")
def flows_stack(tmp_path_factory):
    """The local stack on an empty state directory, as `rlhf up` starts it for a new user whose Hugging Face cache
    holds their own models: a small Qwen2 with its own BPE tokenizer and chat template as `acme/tiny-qwen`, a reward
    model of its family as `acme/tiny-qwen-rm` (tests/hub_cache.py); beside it their data (a parquet with question /
    answer columns) and a reward file outside any package."""
    import datasets

    state_dir = tmp_path_factory.mktemp("state")
    user = tmp_path_factory.mktemp("user")
    cache = user / "hf-cache"
    put_in_cache(build_qwen2(user / "build" / "policy"), cache, "acme/tiny-qwen")
    put_in_cache(build_qwen2(user / "build" / "reward", reward=True), cache, "acme/tiny-qwen-rm")
    rows = [{"question": f"what is {a} plus {b}?", "answer": f"{a} + {b} = {a + b}. #### {a + b}"}
            for a in range(8) for b in range(8)]
    datasets.Dataset.from_list(rows).to_parquet(str(user / "math.parquet"))
    (user / "my_rewards.py").write_text(REWARDS)
    prefect_port, mlflow_port = free_port_block(1), free_port_block(1)
    with pytest.MonkeyPatch.context() as mp:
        # The served deployments look for new runs and for cancellations every second instead of Prefect's default
        # 10 s: ~40 runs here, each of which would otherwise wait 5 s on average before it starts.
        mp.setenv("PREFECT_RUNNER_POLL_FREQUENCY", "1")
        mp.setenv("HF_HUB_CACHE", str(cache))  # the stack's processes (and their children) read this cache
        urls = stack.up(state_dir, prefect_port, mlflow_port, set_profile=False, log=lambda *_: None)
    # the prefect CLI prints through Rich, which wraps lines at $COLUMNS (80 without a terminal), e.g. a watched run's
    # log line after a prefix holding the flow run's random name: text the tests look for could break anywhere
    env = {**stack.base_env(state_dir, prefect_port, mlflow_port), "COLUMNS": "1000", "HF_HUB_CACHE": str(cache)}
    # the stack's credentials, as a process that runs on it has them: prefect_post/prefect_get and MLflow's client
    credentials = stack.client_env(stack.credentials(stack.stack_dir(state_dir)))
    os.environ.update(credentials)
    yield {"state_dir": state_dir, "urls": urls, "env": env, "api": env["PREFECT_API_URL"],
           "ports": (prefect_port, mlflow_port), "user": user}
    for name in credentials:
        os.environ.pop(name, None)
    stack.down(state_dir, log=lambda *_: None)  # nothing left to stop where test_sweeps.py's last test stopped it
    # a run's server follows its killed parent within its stop's grace
    assert wait_for(lambda: not stack_processes(state_dir), 30), "a process of the stack or its runs outlived `down`"


def created_run(s, name: str, parameters: dict) -> str:
    """The id of a new flow run of deployment `name` (flow/deployment) with `parameters`, created through the API as
    the UI's Run button does (POST /deployments/{id}/create_flow_run): what `prefect deployment run` sends, without a
    CLI process (~1.3 CPU-s each). `prefect deployment run` itself, as a user types it, is the walk's, the bad-input
    checks' and the watch's (test_deployments.py), the sweeps' bad input and the experiment's (test_sweeps.py)."""
    deployment = stack.prefect_get(s["api"], f"/deployments/name/{name}").json()
    response = stack.prefect_post(s["api"], f"/deployments/{deployment['id']}/create_flow_run",
                                  {"parameters": parameters})
    response.raise_for_status()
    return response.json()["id"]


def stack_processes(state_dir) -> list[psutil.Process]:
    """Live processes whose environment names the stack's state directory, or one inside it (a node group's)."""
    found = []
    for p in psutil.process_iter(["status"]):
        try:
            state = p.environ().get("RLHF_STATE_DIR", "")
            if p.info["status"] != psutil.STATUS_ZOMBIE and (state == str(state_dir)
                                                             or state.startswith(f"{state_dir}{os.sep}")):
                found.append(p)
        except psutil.Error:
            continue
    return found
