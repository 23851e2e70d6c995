"""How `rlhf train` shows a run: its steps run directly (models/loop.Steps), its messages printed, and a progress
bar of the iterations with the rate and the time left (tqdm, on stderr), kept below the messages. A resumed run's
bar starts at the checkpoint's iteration and estimates from this attempt's pace."""

from __future__ import annotations

import sys
from typing import TextIO

from tqdm.auto import tqdm

from models.loop import Steps


class ProgressSteps(Steps):
    """The CLI's steps: `progress` drives one bar per `what` (its ETA from the pace so far), `log` prints above it."""

    def __init__(self, file: TextIO | None = None, out: TextIO | None = None):
        self.file, self.out = file, out  # the bar's stream (stderr) and the messages' (stdout); None: the current ones
        self.bars: dict[str, tqdm] = {}
        quiet_weight_bars()

    def progress(self, done: int, total: int, what: str) -> None:
        bar = self.bars.get(what)
        if bar is None:
            bar = self.bars[what] = tqdm(total=total, initial=done, desc=what, unit="it", dynamic_ncols=True,
                                         file=self.file or sys.stderr, smoothing=0.3, mininterval=0, miniters=1)
            # every iteration redrawn: they take seconds, never too many to draw
        bar.update(done - bar.n)
        if done >= total:
            self.close(what)

    def log(self, message: str) -> None:
        tqdm.write(message, file=self.out or sys.stdout)

    def close(self, what: str | None = None) -> None:
        """End the bar of `what` (every bar by default), leaving its last state on the screen."""
        for name in [what] if what else list(self.bars):
            if (bar := self.bars.pop(name, None)) is not None:
                bar.close()


def quiet_weight_bars() -> None:
    """transformers' own bars (loading and writing weights, once per model a run loads) off in this process: the
    iterations' bar is the one to read. The hub's download bars (a model fetched into the cache) stay."""
    from transformers.utils import logging as transformers_logging  # the CLI's run loads transformers anyway

    transformers_logging.set_tqdm_hook(lambda factory, args, kwargs: transformers_logging.EmptyTqdm(*args, **kwargs))
