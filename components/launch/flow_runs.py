"""Served flow runs start as forks of a process that has imported the flows already.

Prefect's runner runs a served flow (`Runner.add_flow`) in a child made by `multiprocessing.get_context("spawn")`
(prefect.flow_engine.run_flow_in_subprocess; a deployment added without its flow runs `python -m prefect.engine`
instead): a fresh interpreter that imports torch, transformers, MLflow, Prefect and the flows again, ~11 CPU-s before
the run does anything. `preload(modules)` gives Prefect multiprocessing's forkserver in its place: one clean,
single-threaded process, started here once, imports `modules`, and each flow run is a fork of it. What Prefect does
with the child is unchanged (the same target and environment, joined through its sentinel, killed by pid; a child
killed by a signal reports the signal as its exit code).

Prefect hands the child its flow pickled (cloudpickle): a flow's function is not its module's attribute (the Flow is),
so it would go by value, with a copy of only the globals its code names, and a flow whose annotations are strings
(`from __future__ import annotations`) could not validate its parameters there. The flows served here go by
reference instead (`by_reference`: their module and attribute, already imported by the forkserver), forked or not:
the child runs the module's own flow, as `python -m prefect.engine` does.

Two things a forked child would otherwise lose, which it gets here: PREFECT__FLOW_RUN_ID in its environment (so the
processes it starts inherit it, as they do from `python -m prefect.engine`), and a name of its own: a fork keeps the
forkserver's command line and its initial environment (/proc/<pid>/environ), so the child names itself
`flow_run_name(id)` (its comm, what `ps -o comm`, `top` and psutil's `name()` show).

This patches Prefect where it has no public hook (`prefect.runner._starter_direct`, prefect.flow_engine's
`multiprocessing`), so it is a switch: RLHF_FORK_FLOW_RUNS=1 (`forking()`), which `rlhf up` sets for its deployment
server and the test suite for everything it starts; off anywhere else (the cluster: a pod runs one flow run).
"""

from __future__ import annotations

import copyreg
import importlib
import multiprocessing
import multiprocessing.forkserver
import os
import pickle
from multiprocessing.context import ForkServerProcess
from typing import Optional


SWITCH = "RLHF_FORK_FLOW_RUNS"  # 1: the deployment server's flow runs are forks (`preload`); 0 or unset: Prefect's own
WARM = "components.launch.warm"  # imported by the forkserver after the flows' modules


def forking() -> bool:
    """Whether this process's served flow runs start as forks of a preloaded forkserver: RLHF_FORK_FLOW_RUNS=1."""
    value = os.environ.get(SWITCH, "0")
    if value not in ("0", "1"):
        raise ValueError(f"{SWITCH}={value!r}: expected 0 (Prefect starts each flow run) or 1 (forks, `rlhf up`)")
    return value == "1"


def flow_run_name(flow_run_id: str) -> str:
    """The name a forked flow run's process takes: `fr-` and its id's first 12 hex digits (comm holds 15 bytes)."""
    return "fr-" + str(flow_run_id).replace("-", "")[:12]


class FlowRunProcess(ForkServerProcess):
    """A forkserver child that sets the flow run's id in its environment and takes its name before Prefect's target
    runs."""

    def __init__(self, flow_run_id: Optional[str], **kwargs):
        super().__init__(**kwargs)
        self.flow_run_id = flow_run_id

    def run(self):
        if self.flow_run_id:
            os.environ["PREFECT__FLOW_RUN_ID"] = self.flow_run_id
            try:
                with open("/proc/self/comm", "w") as comm:
                    comm.write(flow_run_name(self.flow_run_id))
            except OSError:  # not Linux: the name is only a convenience
                pass
        super().run()


class _ForkServer:
    """`multiprocessing` as prefect.flow_engine uses it: `get_context(method).Process(target=..., args=...)`."""

    def __init__(self):
        self.flow_run_id: Optional[str] = None  # of the run being started (the runner starts them one at a time)

    def get_context(self, method=None):
        return self

    def Process(self, **kwargs):
        return FlowRunProcess(self.flow_run_id, **kwargs)

    def __getattr__(self, name):
        return getattr(multiprocessing, name)


def served_flow(module: str, name: str):
    """A served flow, as a flow run's process unpickles it: its module's attribute."""
    return getattr(importlib.import_module(module), name)


def by_reference(flows: list) -> list[str]:
    """From now on `flows` pickle (for the child that runs a flow run, forked or spawned) as their module and
    attribute, not by value; returns their modules."""
    from prefect import Flow  # here: `rlhf up` reads SWITCH from this module without importing Prefect

    where = {}
    for flow in flows:
        module = importlib.import_module(flow.fn.__module__)
        where[id(flow)] = (module.__name__, next(k for k, v in vars(module).items() if v is flow))

    def reduce_flow(flow):
        return (served_flow, where[id(flow)]) if id(flow) in where else flow.__reduce_ex__(pickle.DEFAULT_PROTOCOL)

    copyreg.pickle(Flow, reduce_flow)
    return sorted({module for module, _ in where.values()})


def preload(flows: list) -> None:
    """From now on this process's Prefect runner starts runs of `flows` as forks of a forkserver that has imported
    their modules and components/launch/warm.py (what a run would import on first use), each flow passed by
    reference; the forkserver starts now (its imports overlap the deployments' registration). Only where `forking()`:
    it patches Prefect's private module."""
    from prefect import flow_engine  # here, as above: only the deployment server with the switch on patches it
    from prefect.runner import _starter_direct  # the module Prefect's runner calls to start a served flow run

    multiprocessing.set_forkserver_preload(by_reference(flows) + [WARM])
    forkserver = _ForkServer()
    start = flow_engine.run_flow_in_subprocess

    def run_flow_in_subprocess(flow, flow_run=None, **kwargs):
        forkserver.flow_run_id = str(flow_run.id) if flow_run is not None else None
        return start(flow, flow_run=flow_run, **kwargs)

    flow_engine.multiprocessing = forkserver
    _starter_direct.run_flow_in_subprocess = run_flow_in_subprocess
    multiprocessing.forkserver.ensure_running()
