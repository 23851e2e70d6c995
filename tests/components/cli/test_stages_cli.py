"""`rlhf sft`, `rlhf reward-model`, `rlhf dpo` and `rlhf pipeline` as a user runs them: the shipped examples are valid
pipelines; two `rlhf sft` of one run name started together on one state directory: one trains and writes its
summary, the other is refused naming the run; bad input is refused naming the field."""

import json
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

from components.cli.files import load_tree
from components.cli.main import main
from components.pipeline.config import PipelineFile

ROOT = Path(__file__).resolve().parents[3]
RLHF = str(Path(sys.executable).parent / "rlhf")


def test_the_shipped_examples_are_pipelines():
    given = load_tree(PipelineFile, str(ROOT / "examples" / "pipeline.yaml"), ["rl.iterations=3"])
    assert given.name == "sentiment-demo" and given.rl.algorithm == "rloo" and given.rl.iterations == 3
    assert given.rl.reward.normalize and given.reward_model.data == "builtin:sentiment_preference"
    dpo = load_tree(PipelineFile, str(ROOT / "examples" / "pipeline_dpo.yaml"), [])
    assert dpo.pipeline.stages == ("sft", "dpo", "eval") and dpo.dpo.beta == 0.5 and dpo.sft == given.sft
    kto = load_tree(PipelineFile, str(ROOT / "examples" / "pipeline_kto.yaml"), [])
    assert kto.pipeline.stages == ("sft", "kto", "eval") and kto.kto.loss_type == "kto" and kto.sft == given.sft


def test_two_rlhf_sft_of_one_run_name_started_together_one_trains_the_other_is_refused(tmp_path):
    """Two `rlhf sft --set run_name=twice` started at once on one state directory: the one that takes the run's lease
    trains and writes its summary; the other is refused before it touches anything, naming the run and its holder."""
    args = ["sft", "--set", f"deploy.state_dir={tmp_path}", "--set", "sft.max_steps=6", "--set", "sft.max_eval_rows=8",
            "--set", "run_name=twice", "--set", "deploy.tracking.system_metrics=false"]
    procs = [subprocess.Popen([RLHF, *args, "--summary-out", str(tmp_path / f"summary{i}.json")],
                              stdout=subprocess.PIPE,
                              stderr=subprocess.PIPE, text=True, env=dict(os.environ, HF_HUB_OFFLINE="1"))
             for i in range(2)]
    outs = [proc.communicate(timeout=600) for proc in procs]
    codes = sorted(proc.returncode for proc in procs)
    assert codes == [0, 1], [err[-3000:] for _, err in outs]
    winner, loser = (0, 1) if procs[0].returncode == 0 else (1, 0)
    refusal = r"rlhf sft failed: RunLocked: run_name='twice' is being written by pid \d+ on "
    assert re.search(refusal, outs[loser][1]), outs[loser][1][-2000:]
    result = json.loads((tmp_path / f"summary{winner}.json").read_text())
    assert result["steps"] == 6 and result["model"].endswith("/checkpoints/twice/model") and result["job"] == "sft"
    assert [e["step"] for e in result["evals"]] == [0, 6] and "eval/loss" in result["metrics"]
    assert result["provenance"]["models"]["model"]["source"] == "tiny"
    assert not (tmp_path / f"summary{loser}.json").exists()


@pytest.mark.parametrize("args, expected", [
    (["reward-model", "--set", "reward_model.center_rewards_coefficient=-1"], "center_rewards_coefficient"),
    (["sft", "--set", "sft.batch_sise=8"], "batch_sise"),
    (["pipeline", "--set", "rl.algorithm=dpo"], "rl.algorithm"),
    (["dpo", "--set", "dpo.loss_type=hinge"], "loss_type"),
    (["eval", "--set", "eval.samples_per_prompt=0"], "samples_per_prompt"),
])
def test_bad_input_is_refused_naming_the_field(args, expected):
    with pytest.raises(SystemExit) as err:
        main(args)
    assert str(err.value).startswith("invalid config: ") and expected in str(err.value)
