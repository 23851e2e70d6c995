"""Environments and reward functions for tests/models/test_environments.py, written as their authors would: TRL's
environment_factory protocol, TRL's reward-function convention; nothing imported from rlhf-flows."""

import os
import signal
import subprocess
import time
from pathlib import Path


class Echo:
    """One tool that answers with its argument; get_reward: 1 when the tool was called."""

    def __init__(self):
        self.calls = 0

    def reset(self, **row):
        self.calls = 0
        return row.get("observation")

    def echo(self, text: str) -> str:
        """Repeat a text.

        Args:
            text: What to repeat.
        """
        self.calls += 1
        if text == "fail":
            raise ValueError("refusing to echo 'fail'")
        return text

    def get_reward(self) -> float:
        return 1.0 if self.calls else 0.0


class Stall:
    """A tool that never returns (a hung environment), and one that kills its own process."""

    def reset(self, **row):
        return None

    def wait(self, seconds: int) -> str:
        """Wait.

        Args:
            seconds: How long.
        """
        while True:
            time.sleep(3600)

    def crash(self) -> str:
        """Crash the process."""
        os._exit(9)


class OneSession:
    """Serves one session at a time (OpenEnv's declaration); logs every call with its instance to a file."""

    SUPPORTS_CONCURRENT_SESSIONS = False

    def __init__(self):
        self.me = f"{os.getpid()}-{id(self)}"

    def reset(self, log, **row):
        self.log = Path(log)
        with self.log.open("a") as f:
            f.write(f"{self.me} reset\n")
        return None

    def echo(self, text: str) -> str:
        """Repeat a text.

        Args:
            text: What to repeat.
        """
        with self.log.open("a") as f:
            f.write(f"{self.me} echo\n")
        return text


def last_text(completions, **kwargs):
    """1 when the last assistant message says 'done'."""
    return [1.0 if c and c[-1].get("content") == "done" else 0.0 for c in completions]


def tool_calls_made(completions, environments, **kwargs):
    """The calls each episode's environment saw (TRL: reward functions get environments=)."""
    return [float(e.calls) for e in environments]


def answer_column(prompts, completions, answer, **kwargs):
    """Reads a data set column."""
    return [1.0 if a == "yes" else 0.0 for a in answer]


def raises_on_boom(completions, flag, **kwargs):
    """Raises when an episode's row says boom."""
    if "boom" in flag:
        raise RuntimeError("this reward function is broken")
    return [0.0 for _ in completions]


def hangs_on_hang(completions, flag, **kwargs):
    """Never returns when an episode's row says hang."""
    while "hang" in flag:
        time.sleep(3600)
    return [0.0 for _ in completions]


def with_alarm(completions, **kwargs):
    """Times itself out with signal.alarm, as math_verify does: only possible in a process's main thread."""
    def expired(signum, frame):
        raise TimeoutError("alarm")

    previous = signal.signal(signal.SIGALRM, expired)
    signal.alarm(5)
    try:
        return [0.5 for _ in completions]
    finally:
        signal.alarm(0)
        signal.signal(signal.SIGALRM, previous)


def plain_texts(prompts, responses):
    """Our convention: prompt and response texts."""
    return [1.0 if "done" in r else 0.0 for r in responses]


class StallingCalculator:
    """The shipped calculator's tool, except that it never returns for a subtraction (a hung environment)."""

    def reset(self, **row):
        return None

    def calculate(self, expression: str) -> str:
        """Evaluate an arithmetic expression.

        Args:
            expression: The expression, e.g. 12 * 34.
        """
        if "-" in expression:
            while True:
                time.sleep(3600)
        a, op, b = expression.split()
        return str(int(a) + int(b) if op == "+" else int(a) * int(b))


class SpawningStaller:
    """A tool that starts a process of its own (its pid to $SPAWNED_PID_FILE), then never returns."""

    def reset(self, **row):
        return None

    def run(self, command: str) -> str:
        """Run a command.

        Args:
            command: The command.
        """
        child = subprocess.Popen(["sleep", "600"])
        with open(os.environ["SPAWNED_PID_FILE"], "w") as out:
            out.write(str(child.pid))
        while True:
            time.sleep(3600)


def raises_on_products(prompts, completions, **kwargs):
    """Raises when a question asks for a product."""
    if any("*" in str(p[-1]["content"]) for p in prompts):
        raise ValueError("cannot score products")
    return [0.0 for _ in completions]
