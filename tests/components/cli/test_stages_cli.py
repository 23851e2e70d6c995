"""`rlhf sft`, `rlhf reward-model` and `rlhf pipeline` as a user runs them: the shipped example is a valid pipeline, a
stage run from the console script writes its summary, bad input is refused naming the field."""

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from components.cli.files import load_tree
from components.cli.main import main
from components.pipeline.config import PipelineFile

ROOT = Path(__file__).resolve().parents[3]
RLHF = str(Path(sys.executable).parent / "rlhf")


def test_the_shipped_example_is_a_pipeline():
    given = load_tree(PipelineFile, str(ROOT / "examples" / "pipeline.yaml"), ["rl.iterations=3"])
    assert given.name == "sentiment-demo" and given.rl.algorithm == "rloo" and given.rl.iterations == 3
    assert given.rl.reward.normalize and given.reward_model.data == "builtin:sentiment_preference"


def test_rlhf_sft_trains_and_writes_its_summary(tmp_path):
    summary = tmp_path / "summary.json"
    proc = subprocess.run([RLHF, "sft", "--set", f"deploy.state_dir={tmp_path}", "--set", "sft.max_steps=2",
                           "--set", "sft.max_eval_rows=8", "--set", "run_name=cli-sft",
                           "--set", "deploy.tracking.system_metrics=false", "--summary-out", str(summary)],
                          capture_output=True, text=True, timeout=600, env=dict(os.environ, HF_HUB_OFFLINE="1"))
    assert proc.returncode == 0, proc.stderr[-3000:]
    result = json.loads(summary.read_text())
    assert result["steps"] == 2 and result["model"].endswith("/checkpoints/cli-sft/model")
    assert [e["step"] for e in result["evals"]] == [0, 2] and "eval/loss" in result["metrics"]


@pytest.mark.parametrize("args, expected", [
    (["reward-model", "--set", "reward_model.center_rewards_coefficient=-1"], "center_rewards_coefficient"),
    (["sft", "--set", "sft.batch_sise=8"], "batch_sise"),
    (["pipeline", "--set", "rl.algorithm=dpo"], "rl.algorithm"),
])
def test_bad_input_is_refused_naming_the_field(args, expected):
    with pytest.raises(SystemExit) as err:
        main(args)
    assert str(err.value).startswith("invalid config: ") and expected in str(err.value)
