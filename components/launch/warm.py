"""Imported once, by the served flow runs' forkserver (components/launch/flow_runs.preload), never by a run: what every
flow run would otherwise do again on first use (~3-4 CPU-s of a short run), done once before the forks.

- the rest of transformers' model loading, which its first `from_pretrained` imports (accelerate, its kernels'
  integration and with it torch._dynamo; torch.distributed.tensor);
- datasets (reading a data set);
- the model publish: MLflow's transformers flavor (and peft, which it checks for), and MLflow's map from modules to
  installed distributions, which it builds (reading every distribution's file list) to check a logged model's
  requirements against this environment.
"""

import datasets  # noqa: F401
import mlflow.transformers  # noqa: F401
import peft  # noqa: F401
import torch._dynamo
import torch.distributed.tensor  # noqa: F401
import transformers.generation
import transformers.integrations.accelerate
import transformers.integrations.hub_kernels
import transformers.modeling_utils  # noqa: F401
from mlflow.utils.requirements_utils import warn_dependency_requirement_mismatches

warn_dependency_requirement_mismatches(["mlflow"])  # builds the map; mlflow is installed, so nothing is logged
