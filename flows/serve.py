"""Serve every deployment from one process (what `rlhf up` starts): `python -m flows.serve`.

Each deployment is added with its flow (`Runner.add_flow`), so a flow run runs the flow this process holds, in a child
forked from a process that has imported the flows already (components/launch/flow_runs.py), instead of a new
interpreter that loads the flow from its file and imports everything again (`python -m prefect.engine`).
"""

from __future__ import annotations

import asyncio

from prefect.exceptions import TerminationSignal
from prefect.runner import Runner

from components.environment import quiet
from components.launch.flow_runs import preload
from flows.compare import compare
from flows.experiment import EXAMPLE_EXPERIMENT, experiment_flow
from flows.ppo import ppo
from flows.reinforce import reinforce
from flows.stages import STAGE_FLOWS, pipeline
from models.kinds import BY_JOB
from flows.sweep import EXAMPLE_CONFIG, EXAMPLE_SWEEP, sweep_flow


def deployments() -> list[tuple]:
    """(flow, its default deployment's parameters and description): each is served as `<flow name>/default`."""
    return [
        (ppo, dict(parameters={"config": {"algorithm": "ppo"}, "deploy": {}},
                   description="PPO on the embedded default (tiny local models); --param config='{...}' sets any run "
                               "field, --param deploy='{...}' where its parts run (both merged over these)")),
        (reinforce, dict(parameters={"config": {"algorithm": "rloo"}, "deploy": {}},
                         description="REINFORCE/RLOO on the embedded default (merged as ppo/default's)")),
        (compare, dict(description="PPO vs RLOO curves and table")),
        *((stage, dict(parameters={"config": {}, "deploy": {}},  # each kind of stage's (models/kinds.py)
                       description=f"{BY_JOB[job].summary[0].upper()}{BY_JOB[job].summary[1:]}, on the embedded "
                                   f"default; --param config='{{...}}' merged over it")) for job, stage in STAGE_FLOWS.items()),
        (pipeline, dict(parameters={"config": {}, "deploy": {}},
                        description="sft -> reward_model -> rl -> eval (sft -> dpo -> eval with a dpo section) on the "
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
    preload([flow for flow, _ in served])
    runner = Runner(limit=4)
    for flow, deployment in served:
        runner.add_flow(flow, name="default", **deployment)
    try:
        asyncio.run(runner.start())  # until stopped (`rlhf down`), as prefect.serve runs it
    except (KeyboardInterrupt, TerminationSignal):
        pass


if __name__ == "__main__":
    main()
