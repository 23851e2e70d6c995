"""Imported once, by the served flow runs' forkserver (components/launch/flow_runs.preload, only where
RLHF_FORK_FLOW_RUNS=1), never by a run: what every flow run would otherwise do again on first use (~3-4 CPU-s of a
short run), done once before the forks.

- the rest of transformers' model loading, which its first `from_pretrained` imports (accelerate, its kernels'
  integration and with it torch._dynamo; torch.distributed.tensor);
- datasets (reading a data set);
- the model publish: MLflow's transformers flavor (and peft, which it checks for), and MLflow's map from modules to
  installed distributions, which it builds (reading every distribution's file list) to check a logged model's
  requirements against this environment (mlflow.utils.requirements_utils: not MLflow's documented API, one reason
  the forks are a switch).
"""

import importlib

from mlflow.utils.requirements_utils import warn_dependency_requirement_mismatches

WARMED = ("datasets", "mlflow.transformers", "peft", "torch._dynamo", "torch.distributed.tensor",
          "transformers.generation", "transformers.integrations.accelerate", "transformers.integrations.hub_kernels",
          "transformers.modeling_utils")

for module in WARMED:
    importlib.import_module(module)

warn_dependency_requirement_mismatches(["mlflow"])  # builds the map; mlflow is installed, so nothing is logged
