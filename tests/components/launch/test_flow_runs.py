"""The deployment server's flow-run start (components/launch/flow_runs.py): the switch that turns the forks on, and
the flows pickled by reference whichever way a run starts. A served run started both ways: tests/flows."""

import subprocess
import sys

import pytest

from components.launch import flow_runs


@pytest.mark.parametrize("value, expected", [(None, False), ("0", False), ("1", True)])
def test_forking_is_on_only_where_the_switch_says_1(monkeypatch, value, expected):
    if value is None:
        monkeypatch.delenv(flow_runs.SWITCH, raising=False)
    else:
        monkeypatch.setenv(flow_runs.SWITCH, value)
    assert flow_runs.forking() is expected


def test_a_switch_value_other_than_0_or_1_is_refused_naming_the_variable(monkeypatch):
    monkeypatch.setenv(flow_runs.SWITCH, "yes")
    with pytest.raises(ValueError, match="RLHF_FORK_FLOW_RUNS='yes': expected 0 .* or 1"):
        flow_runs.forking()


def test_a_served_flow_pickles_as_its_module_attribute_and_a_new_interpreter_loads_that_flow():
    """What a spawned flow run's process gets (the switch off): a pickle naming flows.ppo's `ppo`, which a fresh
    interpreter turns into the module's own flow, not a by-value copy of its function."""
    code = (
        "import pickle, sys, cloudpickle\n"
        "from components.launch.flow_runs import by_reference\n"
        "from flows.ppo import ppo\n"
        "assert by_reference([ppo]) == ['flows.ppo']\n"
        "sys.stdout.buffer.write(cloudpickle.dumps(ppo))\n"
    )
    pickled = subprocess.run([sys.executable, "-c", code], capture_output=True, check=True).stdout
    assert b"served_flow" in pickled and b"flows.ppo" in pickled and len(pickled) < 1000
    check = "import pickle, sys\nfrom flows.ppo import ppo\nassert pickle.loads(sys.stdin.buffer.read()) is ppo\n"
    subprocess.run([sys.executable, "-c", check], input=pickled, check=True)
