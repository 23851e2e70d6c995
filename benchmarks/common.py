"""What every benchmark shares: machine/version facts, min/median/max, result files, the tiny models and config
(the quiet offline environment is set by benchmarks/__init__.py).

Every result file (benchmarks/results/<name>.json) carries the machine (CPU model, cores, GPU), the library versions,
the settings, the repetitions and min/median/max of each measured series, so a number is never read without them.
"""

from __future__ import annotations

import json
import os
import platform
import statistics
import sys
import time
import argparse
from importlib import metadata
from pathlib import Path

import psutil
import torch
from torch.profiler import ProfilerActivity, profile

from models.config import preset
from models.prepare import prepare_run
from models.tiny_files import EMBEDDED_DIR

ROOT = Path(__file__).resolve().parent.parent
RESULTS = Path(__file__).resolve().parent / "results"


def log(message: str) -> None:
    print(f"[bench {time.strftime('%H:%M:%S')}] {message}", file=sys.stderr, flush=True)


def cpu_model() -> str:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()


def machine() -> dict:
    info = {"cpu": cpu_model(), "cores": os.cpu_count(), "torch_threads": torch.get_num_threads(),
            "platform": platform.platform(), "python": platform.python_version(),
            "memory_gib": round(psutil.virtual_memory().total / 2**30, 1)}
    info["gpu"] = torch.cuda.get_device_name(0) if torch.cuda.is_available() else None
    return info


def load_average() -> list[float] | None:
    try:
        return [round(x, 2) for x in os.getloadavg()]
    except OSError:
        return None


def versions() -> dict:
    out = {}
    for dist in ("torch", "transformers", "trl", "nvidia-pytriton", "tritonclient", "accelerate", "numpy"):
        try:
            out[dist] = metadata.version(dist)
        except metadata.PackageNotFoundError:
            out[dist] = None
    return out


def stats(values) -> dict:
    """n, min, median, max (and mean) of a series; None entries are not allowed."""
    values = [float(v) for v in values]
    if not values:
        return {"n": 0, "min": None, "median": None, "max": None, "mean": None}
    return {"n": len(values), "min": min(values), "median": statistics.median(values), "max": max(values),
            "mean": statistics.fmean(values)}


def results_dir(quick: bool = False) -> Path:
    """benchmarks/results/, or benchmarks/results/tmp/quick/ (git-ignored) for --quick runs."""
    return RESULTS / "tmp" / "quick" if quick else RESULTS


def write_result(name: str, data: dict) -> Path:
    """<results_dir>/<name>.json with machine, versions and the load average (other work on the machine) added."""
    directory = results_dir(bool(data.get("quick")))
    directory.mkdir(parents=True, exist_ok=True)
    payload = {"benchmark": name, "created": time.strftime("%Y-%m-%dT%H:%M:%S%z"), "machine": machine(),
               "versions": versions(), "load_average_1_5_15_min_at_end": load_average(), **data}
    path = directory / f"{name}.json"
    path.write_text(json.dumps(payload, indent=2, default=_jsonable) + "\n")
    log(f"wrote {path.relative_to(ROOT)}")
    return path


def _jsonable(value):
    if hasattr(value, "tolist"):
        return value.tolist()
    if isinstance(value, Path):
        return str(value)
    raise TypeError(f"not JSON serialisable: {type(value).__name__}")


def state_dir() -> Path:
    return Path(os.environ.get("RLHF_STATE_DIR", ROOT / ".rlhf")).absolute()


def ensure_tiny_models() -> Path:
    """The embedded tiny policy/reward/critic, as shipped with the package (models/assets/tiny)."""
    return EMBEDDED_DIR


def tiny_config(**overrides):
    """The embedded default config ('tiny' preset) pointing at this checkout's state dir, prepared for a run
    (models/prepare.py: the models checked, schedule lengths, reward transport)."""
    return prepare_run(preset("tiny", **{"deploy.state_dir": str(state_dir()), **overrides}))


def top_ops(fn, repeat: int = 5, top: int = 12) -> list[dict]:
    """torch.profiler: the ops with the most self CPU time over `repeat` calls of fn(), in ms per call."""
    with profile(activities=[ProfilerActivity.CPU]) as prof:
        for _ in range(repeat):
            fn()
    rows = sorted(prof.key_averages(), key=lambda e: e.self_cpu_time_total, reverse=True)[:top]
    return [{"op": e.key, "self_cpu_ms_per_call": e.self_cpu_time_total / 1e3 / repeat,
             "calls_per_call": e.count / repeat}
            for e in rows]


def quick_flag(argv=None) -> bool:
    parser = argparse.ArgumentParser()
    parser.add_argument("--quick", action="store_true", help="fewer repetitions (a ~3 minute check, not for reporting)")
    return parser.parse_args(argv).quick


def side_by_side(trainer_class, ours):
    """What a benchmark against one of TRL's trainers runs TRL with, unchanged but for two hooks: a subclass of
    `trainer_class` that keeps the batch each `training_step` received, and a `TrainerCallback` that at each of TRL's
    step ends takes TRL's time (from the end of our previous step to the end of its own) and runs `ours(batch)` on
    that very batch, outside TRL's clock, so the sides alternate step by step and see the same background load.
    Returns (the subclass, the callback, {"trl": seconds per step, "ours": ..., "tokens": per step})."""
    from transformers import TrainerCallback  # heavy: only a benchmark against TRL needs it

    batches: list[dict] = []
    timings: dict[str, list] = {"trl": [], "ours": [], "tokens": []}

    class KeepBatch(trainer_class):
        def training_step(self, model, inputs, *args, **kwargs):
            batches.append(inputs)
            return super().training_step(model, inputs, *args, **kwargs)

    class Interleave(TrainerCallback):
        def __init__(self):
            self.start = None

        def on_step_begin(self, args, state, control, **kwargs):
            if self.start is None:
                self.start = time.perf_counter()

        def on_step_end(self, args, state, control, **kwargs):
            timings["trl"].append(time.perf_counter() - self.start)
            timings["tokens"].append(int(batches[-1]["attention_mask"].sum()))
            started = time.perf_counter()
            ours(batches[-1])
            timings["ours"].append(time.perf_counter() - started)
            self.start = time.perf_counter()

    return KeepBatch, Interleave(), timings
