"""`rlhf train`'s progress (components/cli/progress.py): a bar of the iterations with the time left, on its own
stream, the run's messages printed above it; a resumed run's bar starts at its checkpoint's iteration."""

from __future__ import annotations

import io
import re

from components.cli.progress import ProgressSteps


def test_the_bar_counts_iterations_with_the_time_left_and_messages_go_above_it():
    bar, out = io.StringIO(), io.StringIO()
    steps = ProgressSteps(file=bar, out=out)
    for i in range(4):
        steps.progress(i, 4, "iterations")
        steps.log(f"iteration {i + 1}/4: score +0.100")
    steps.progress(4, 4, "iterations")
    frames = bar.getvalue().replace("\r", "\n")
    assert re.search(r"iterations: +0%\|.*\| 0/4 \[\d\d:\d\d<\?", frames), frames
    assert re.search(r"iterations: +100%\|.*\| 4/4 \[\d\d:\d\d<\d\d:\d\d", frames), frames  # elapsed<left
    assert re.search(r"\| 2/4 \[\d\d:\d\d<\d\d:\d\d, +[\d.]+(it/s|s/it)\]", frames), frames  # a pace, a time left
    assert out.getvalue().splitlines() == [f"iteration {i}/4: score +0.100" for i in range(1, 5)]
    assert steps.bars == {}  # closed at the last iteration


def test_a_resumed_run_starts_its_bar_at_the_checkpoint():
    bar = io.StringIO()
    steps = ProgressSteps(file=bar, out=io.StringIO())
    steps.progress(6, 10, "iterations")
    steps.progress(7, 10, "iterations")
    steps.close()
    frames = bar.getvalue().replace("\r", "\n")
    assert "6/10" in frames and "7/10" in frames and "0/10" not in frames, frames
