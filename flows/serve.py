"""Serve every deployment from one process (what `rlhf up` starts): `python -m flows.serve`.

Each deployment is added with its flow (`Runner.add_flow`), so a flow run runs the flow this process holds, in a child
forked from a process that has imported the flows already (components/launch/flow_runs.py), instead of a new
interpreter that loads the flow from its file and imports everything again (`python -m prefect.engine`), when
RLHF_FORK_FLOW_RUNS=1 (what `rlhf up` sets); otherwise Prefect starts each flow run itself.
"""

from __future__ import annotations

import asyncio

from prefect.exceptions import TerminationSignal
from prefect.runner import Runner

from components.environment import quiet
from components.launch.flow_runs import by_reference, forking, preload
from flows.compare import compare
from flows.experiment import EXAMPLE_EXPERIMENT, experiment_flow
from flows.ppo import ppo
from flows.reinforce import reinforce
from flows.stages import STAGE_FLOWS, pipeline
from models.kinds import BY_JOB
from flows.sweep import EXAMPLE_CONFIG, EXAMPLE_SWEEP, sweep_flow
from models.config import RunConfig

DEMO_PRESET = "tiny"  # what the local training deployments run: the embedded tiny models' preset


def demo_parameters(algorithm: str) -> dict:
    """A local training deployment's parameters: the run the tiny preset makes, every field written out (so the
    Prefect form shows what a run of it trains), and the local placement."""
    return {"config": RunConfig(preset=DEMO_PRESET, algorithm=algorithm).model_dump(mode="json"),
            "deploy": {"placement": "local"}}


def deployments() -> list[tuple]:
    """(flow, its default deployment's parameters and description): each is served as `<flow name>/default`."""
    return [
        (ppo, dict(parameters=demo_parameters("ppo"),
                   description="PPO on the tiny preset (the embedded tiny models); --param config='{...}' changes "
                               "any run field, --param deploy='{...}' where its parts run (both merged over these; a "
                               "config naming preset none starts from the field defaults, for your own model)")),
        (reinforce, dict(parameters=demo_parameters("rloo"),
                         description="RLOO (any critic-free recipe) on the tiny preset, merged as ppo/default's")),
        (compare, dict(description="PPO vs RLOO curves and table")),
        # each kind of stage's (models/kinds.py) and the pipeline: no parameters of their own, so the form shows
        # the flow's defaults, which are what a run given nothing trains
        *((stage, dict(description=f"{BY_JOB[job].summary[0].upper()}{BY_JOB[job].summary[1:]}, on the embedded "
                                   f"default; --param config='{{...}}' merged over it"))
          for job, stage in STAGE_FLOWS.items()),
        (pipeline, dict(description="sft -> reward_model -> rl -> eval (sft -> dpo -> eval with a dpo section) on the "
                                    "embedded default, each stage reused when nothing it was made from changed "
                                    "(Cached)")),
        (sweep_flow, dict(parameters={"config": EXAMPLE_CONFIG.model_dump(mode="json", exclude_unset=True),
                                      "sweep": EXAMPLE_SWEEP.model_dump(mode="json")},
                          description="A hyperparameter sweep (Optuna): trials are runs of ppo/default or "
                                      "reinforce/default; the defaults are a 2 x 2 grid of RLOO runs")),
        (experiment_flow, dict(parameters={"experiment": EXAMPLE_EXPERIMENT.model_dump(mode="json")},
                               description="Arms x paired seeds compared with interval estimates (rliable) in a "
                                           "report; the defaults: RLOO vs GRPO, 3 seeds")),
    ]


def main() -> None:
    quiet()
    served = deployments()
    flows = [flow for flow, _ in served]
    if forking():  # RLHF_FORK_FLOW_RUNS=1 (`rlhf up`): each run a fork of a process that has imported them
        preload(flows)
    else:  # Prefect's own start: a new interpreter for each run
        by_reference(flows)
    runner = Runner(limit=4)
    for flow, deployment in served:
        runner.add_flow(flow, name="default", **deployment)
    try:
        asyncio.run(runner.start())  # until stopped (`rlhf down`), as prefect.serve runs it
    except (KeyboardInterrupt, TerminationSignal):
        pass


if __name__ == "__main__":
    main()
