"""An experiment's report: its runs read back from MLflow (the trials nested under its parent run, each tagged with
its arm and seed), the statistics (components/sweep/statistics.py) over the seeds every arm completed, and what a
reader needs to trust them: what differs between the arms (the config diff), the compute each arm used, the
provenance (code version, library versions, machine) and a link to every run.

    summary(...)          the experiment as JSON: each run (arm, seed, mlflow_run_id, final metrics) and the
                          statistics per arm and metric, keyed by arm name (`rlhf experiment --summary-out`)
    markdown(...)         the table, the plain reading of the intervals, the figures' names (a Prefect artifact and
                          report.md on the parent run)
    html(...)             one self-contained HTML file: the same, with the figures inline (`rlhf experiment report`)
    figures(...)          performance profiles and sample-efficiency curves (rliable's plot_utils), per metric
"""

from __future__ import annotations

import base64
import html as html_escape
import io
import json
import platform
import re
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Optional

import matplotlib.pyplot as plt
import numpy as np
import yaml
from mlflow.entities import Metric
from matplotlib.patches import Patch
from mlflow.tracking import MlflowClient
from rliable import plot_utils

from components.sweep import statistics
from components.sweep.config import ARM
from components.sweep.experiment import AGGREGATES, ExperimentConfig
from components.sweep.space import valid_config
from components.sweep.tracking import find_parent
from components.tracking.tracker import flatten
from models.config import RLHFConfig

PROVENANCE_TAGS = ("provenance.code.modules", "mlflow.source.git.commit", "machine", "reproducible",
                   "reproducible.why")


@dataclass
class RunRecord:
    """One arm x seed run as MLflow has it."""

    arm: str
    seed: int
    run_id: str
    run_name: str
    wall_s: Optional[float]
    ranks: int
    tags: dict
    curves: dict[str, list[tuple[int, float]]] = field(default_factory=dict)  # metric -> [(step, value)] by step


def read_runs(client: MlflowClient, experiment_id: str, parent_run_id: str, metrics: list[str]) -> list[RunRecord]:
    """The experiment's complete runs (nested under its parent run, tagged sweep.state=complete), with their curves
    of `metrics` (a step logged twice: its latest value)."""
    runs = client.search_runs([experiment_id], f"tags.`mlflow.parentRunId` = '{parent_run_id}' and "
                              f"tags.`sweep.state` = 'complete'", max_results=5000)
    runs = [run for run in runs if f"sweep.param.{ARM}" in run.data.tags]
    return sorted(read_records(client, runs, metrics, lambda run: (run.data.tags[f"sweep.param.{ARM}"],
                                                                   int(run.data.tags["sweep.param.seed"]))),
                  key=lambda r: (r.seed, r.arm))


def read_records(client: MlflowClient, runs: list, metrics: list[str], arm_and_seed) -> list[RunRecord]:
    """A RunRecord of each MLflow run: its arm and seed (`arm_and_seed(run)`), wall-clock, ranks, tags and curves."""
    records = []
    for run in runs:
        curves = {}
        for metric in metrics:
            latest: dict[int, float] = {}
            for m in sorted(client.get_metric_history(run.info.run_id, metric), key=lambda m: (m.step, m.timestamp)):
                latest[m.step] = m.value
            curves[metric] = sorted(latest.items())
        wall = (run.info.end_time - run.info.start_time) / 1000 if run.info.end_time else None
        params = run.data.params
        ranks = int(params.get("deploy.actor.nproc_per_node", 1)) * int(params.get("deploy.actor.nnodes", 1))
        arm, seed = arm_and_seed(run)
        records.append(RunRecord(arm, seed, run.info.run_id, run.info.run_name, wall, ranks, run.data.tags, curves))
    return records


def summary(experiment: ExperimentConfig, config: RLHFConfig, records: list[RunRecord], metrics: list[str],
            run_url=lambda run_id: None) -> dict:
    """The experiment as JSON (see the module's docstring). Only seeds that every arm completed are compared (the
    scores stay paired); the others are listed as `unpaired`."""
    arms = list(experiment.arms)
    result = compared(records, arms, experiment.seed_list(), metrics, experiment.direction, experiment.reps,
                      experiment.confidence, experiment.bootstrap_seed, run_url)
    return {"experiment": experiment.name, **result, "config_diff": config_diff(experiment, config)}


def compared(records: list[RunRecord], arms: list[str], seed_list: list[int], metrics: list[str], direction: str,
             reps: int, confidence: float, bootstrap_seed: int, run_url=lambda run_id: None) -> dict:
    """Runs of arms x seeds compared (an experiment's; `rlhf compare`'s, one seed per arm): each run's final
    metrics, and per metric and aggregate the statistics over the seeds every arm has."""
    by = {(r.arm, r.seed): r for r in records}
    seeds = [s for s in seed_list if all((arm, s) in by for arm in arms)]
    unpaired = sorted({r.seed for r in records} - set(seeds))
    runs = [{"arm": r.arm, "seed": r.seed, "mlflow_run_id": r.run_id, "run_name": r.run_name, "url": run_url(r.run_id),
             "wall_s": r.wall_s, "final": {m: (r.curves[m][-1][1] if r.curves.get(m) else None) for m in metrics}}
            for r in records]
    stats: dict = {}
    kw = {"reps": reps, "confidence": confidence, "seed": bootstrap_seed}
    for metric in metrics if seeds else []:
        stats[metric] = {}
        for aggregate in AGGREGATES:
            scores = {arm: np.array([statistics.run_scores(by[arm, s].curves[metric])[aggregate] for s in seeds])
                      for arm in arms}
            stats[metric][aggregate] = {
                "scores": {arm: v.tolist() for arm, v in scores.items()},
                "aggregates": statistics.aggregates(scores, **kw),
                "improvement": statistics.improvement(scores, direction=direction, **kw),
                "profiles": statistics.profiles(scores, **kw)}
        curve = {(arm, s): dict(by[arm, s].curves[metric]) for arm in arms for s in seeds}  # step -> value
        steps = sorted(set.intersection(*(set(c) for c in curve.values())))
        if steps:
            values = {arm: np.array([[curve[arm, s][t] for t in steps] for s in seeds]) for arm in arms}
            stats[metric]["curve"] = statistics.curves(values, steps, **kw)
    return {"arms": arms, "seeds": seeds, "unpaired_seeds": unpaired, "metrics": metrics, "direction": direction,
            "reps": reps, "confidence": confidence, "bootstrap_seed": bootstrap_seed, "runs": runs,
            "statistics": stats, "compute": compute(records, arms), "provenance": provenance(records)}


def config_diff(experiment: ExperimentConfig, config: RLHFConfig) -> dict[str, dict[str, list]]:
    """arm -> {dotted field: [the base's value, the arm's]} for every field where the arm's run config differs from
    the base (the fields an arm sets, and the ones its recipe changes with them)."""
    sweep = experiment.as_sweep(config)
    base = flatten(config.run.model_dump(mode="json"))
    out = {}
    for arm in experiment.arms:
        mine = flatten(valid_config(config, sweep, {ARM: arm}).run.model_dump(mode="json"))
        out[arm] = {k: [base.get(k), v] for k, v in mine.items() if base.get(k) != v}
    return out


def compute(records: list[RunRecord], arms: list[str]) -> dict[str, dict]:
    """arm -> runs, wall-clock hours summed over them and per run, and process-hours (wall-clock x actor ranks)."""
    out = {}
    for arm in arms:
        mine = [r for r in records if r.arm == arm and r.wall_s is not None]
        hours = sum(r.wall_s for r in mine) / 3600
        out[arm] = {"runs": len(mine), "wall_hours": hours,
                    "wall_s_per_run": hours * 3600 / len(mine) if mine else None,
                    "process_hours": sum(r.wall_s * r.ranks for r in mine) / 3600}
    return out


def provenance(records: list[RunRecord]) -> dict:
    """What the runs were made with: each provenance tag's values over the runs (one value: they agree), the
    libraries' versions of the first run, and the machine that made the report."""
    tags = {}
    for name in PROVENANCE_TAGS:
        values = sorted({r.tags[name] for r in records if name in r.tags})
        if values:
            tags[name] = values[0] if len(values) == 1 else values
    libraries = {k.removeprefix("provenance.code.libraries."): v
                 for k, v in (records[0].tags if records else {}).items()
                 if k.startswith("provenance.code.libraries.")}
    return {"tags": tags, "libraries": libraries,
            "report_made_on":
                f"{platform.node()} ({platform.platform()}, {platform.processor() or platform.machine()})",
            "report_made_at": time.strftime("%Y-%m-%d %H:%M:%S %Z")}


# ------------------------------------------------------------------------------------------------ words and tables
def _ci(x: dict) -> str:
    return f"{x['value']:.4g} [{x['low']:.4g}, {x['high']:.4g}]"


def readings(result: dict) -> list[str]:
    """The intervals in plain words: per metric and pair, whether the arms separate and, if not, how many seeds
    would at the observed spread."""
    lines = []
    n, size = len(result["seeds"]), round(100 * result["confidence"])
    for metric, by_aggregate in result["statistics"].items():
        for aggregate in AGGREGATES:
            stats = by_aggregate[aggregate]
            for key, pair in stats["improvement"].items():
                x, y = key.split(",")
                if result["arms"].index(x) > result["arms"].index(y):
                    continue  # each pair once
                d = pair["mean_difference"]
                what = f"{metric} ({aggregate}), {x} - {y}: mean paired difference {_ci(d)}"
                if pair["separated"]:
                    lines.append(f"{what}: the {size}% interval excludes 0, so over {n} seed(s) "
                                 f"{x if d['value'] > 0 else y} scores higher.")
                elif n < 2:
                    lines.append(f"{what}: {n} seed(s) do not separate {x} and {y}; one seed gives no spread to judge "
                                 f"from: run more seeds.")
                else:
                    need = pair["seeds_needed"]
                    more = (f"about {need} paired seeds would separate them at the observed spread" if need else
                            "no difference was observed, so no number of seeds at this spread would separate them")
                    lines.append(f"{what}: the {size}% interval includes 0: {n} seed(s) do not separate {x} and "
                                 f"{y}; {more}.")
    return lines


def statistics_markdown(result: dict) -> list[str]:
    """The statistics' tables per metric and aggregate, and what the intervals say."""
    out = []
    for metric, by_aggregate in result["statistics"].items():
        for aggregate in AGGREGATES:
            stats = by_aggregate[aggregate]
            out += ["", f"## {metric} ({aggregate})", "", "| arm | IQM | mean | median | runs |",
                    "|---|---|---|---|---|"]
            for arm in result["arms"]:
                a = stats["aggregates"][arm]
                runs = ", ".join(f"{v:.4g}" for v in stats["scores"][arm])
                out.append(f"| {arm} | {_ci(a['iqm'])} | {_ci(a['mean'])} | {_ci(a['median'])} | {runs} |")
            if stats["improvement"]:
                out += ["", "| x over y | P(x > y) | paired x - y per seed | mean x - y | separated |",
                        "|---|---|---|---|---|"]
                for key, pair in stats["improvement"].items():
                    diffs = ", ".join(f"{v:+.4g}" for v in pair["differences"])
                    out.append(f"| {key.replace(',', ' over ')} | {_ci(pair['probability'])} | {diffs} | "
                               f"{_ci(pair['mean_difference'])} | {'yes' if pair['separated'] else 'no'} |")
    if lines := readings(result):
        out += ["", "## What the intervals say", "", *[f"- {line}" for line in lines]]
    return out


def markdown(result: dict, figure_names: list[str] = ()) -> str:
    out = [f"# Experiment {result['experiment']}", "",
           f"{len(result['arms'])} arms x {len(result['seeds'])} paired seeds "
           f"({', '.join(map(str, result['seeds']))}); {round(100 * result['confidence'])}% stratified bootstrap "
           f"intervals (rliable, {result['reps']} resamples, seed {result['bootstrap_seed']}); {result['direction']} "
           "is better."]
    if result["unpaired_seeds"]:
        out.append(f"Seeds left out (not every arm completed them): {result['unpaired_seeds']}.")
    out += statistics_markdown(result)
    out += ["", "## What differs between the arms", ""]
    for arm, diff in result["config_diff"].items():
        out.append(f"- **{arm}**: " + ("the base config" if not diff else
                                        "; ".join(f"`{k}` {base} -> {mine}" for k, (base, mine) in diff.items())))
    out += ["", "## Compute", "", "| arm | runs | wall-clock hours | per run (s) | process-hours |",
            "|---|---|---|---|---|"]
    for arm, c in result["compute"].items():
        per = "n/a" if c["wall_s_per_run"] is None else f"{c['wall_s_per_run']:.0f}"
        out.append(f"| {arm} | {c['runs']} | {c['wall_hours']:.3g} | {per} | {c['process_hours']:.3g} |")
    prov = result["provenance"]
    out += ["", "## Provenance", "", *[f"- {k}: {v}" for k, v in prov["tags"].items()],
            f"- libraries: {', '.join(f'{k} {v}' for k, v in prov['libraries'].items())}",
            f"- report made on {prov['report_made_on']} at {prov['report_made_at']}", "", "## Runs", "",
            "| arm | seed | run | " + " | ".join(f"final {m}" for m in result["metrics"]) + " |",
            "|---|---|---|" + "---|" * len(result["metrics"])]
    for r in result["runs"]:
        name = f"[{r['run_name']}]({r['url']})" if r["url"] else r["run_name"]
        finals = " | ".join("absent" if v is None else f"{v:.4g}" for v in r["final"].values())
        out.append(f"| {r['arm']} | {r['seed']} | {name} (`{r['mlflow_run_id']}`) | {finals} |")
    if figure_names:
        out += ["", "## Figures", "", *[f"- {name}" for name in figure_names]]
    return "\n".join(out) + "\n"


def one_seed_per_arm(client: MlflowClient, run_ids: list[str],
                     candidates: tuple[str, ...] = ("eval/gold_reward", "eval/reward", "objective/gold_reward",
                                                    "reward")) -> str:
    """`rlhf compare`'s statistics: each run an arm of one seed, compared as an experiment's arms are (the same
    code), on the first of `candidates` every run logged. Markdown; with one seed there is no interval and the
    reading says so: an experiment (docs/experiments.md) gives the seeds that separate arms."""
    runs = [client.get_run(run_id) for run_id in run_ids]
    metric = next((m for m in candidates if all(client.get_metric_history(r.info.run_id, m) for r in runs)), None)
    if metric is None or len(runs) < 2:
        return ""
    records = read_records(client, runs, [metric], lambda run: (run.info.run_name, 0))
    result = compared(records, [r.arm for r in records], [0], [metric], "maximize", 1000, 0.95, 0)
    return "\n".join(["", "One run per arm: the statistics of an experiment (docs/experiments.md) with one seed; its "
                            "intervals are points and say nothing of the spread between seeds.",
                            *statistics_markdown(result)]) + "\n"


# ------------------------------------------------------------------------------------------------ figures
def figures(result: dict) -> dict[str, bytes]:
    """name -> PNG: per metric, the performance profiles of its final value and the sample-efficiency curve (the
    IQM by step with its interval band), drawn by rliable's plot_utils."""
    out = {}
    colors = dict(zip(result["arms"], plt.get_cmap("tab10").colors))
    for metric, by_aggregate in result["statistics"].items():
        slug = metric.replace("/", "_")
        profile = by_aggregate["final"]["profiles"]
        tau = np.array(profile["tau"])
        fig, ax = plt.subplots(figsize=(7, 4))
        plot_utils.plot_performance_profiles(
            {a: np.array(p["value"]) for a, p in profile["arms"].items()}, tau,
            performance_profile_cis={a: np.array([p["low"], p["high"]]) for a, p in profile["arms"].items()},
            colors=colors, xlabel=f"final {metric} (tau)", ylabel="share of runs scoring > tau", ax=ax,
            labelsize="medium", ticklabelsize="small")
        _legend(ax, colors)
        out[f"profile_{slug}.png"] = _png(fig)
        if "curve" in by_aggregate:
            curve = by_aggregate["curve"]
            fig, ax = plt.subplots(figsize=(7, 4))
            plot_utils.plot_sample_efficiency_curve(
                np.array(curve["steps"]), {a: np.array(c["value"]) for a, c in curve["arms"].items()},
                {a: np.array([c["low"], c["high"]]) for a, c in curve["arms"].items()}, algorithms=list(curve["arms"]),
                colors=colors, xlabel="iteration", ylabel=f"IQM of {metric}", ax=ax, labelsize="medium",
                ticklabelsize="small")
            _legend(ax, colors)
            out[f"curve_{slug}.png"] = _png(fig)
    return out


def _legend(ax, colors: dict) -> None:
    """One entry per arm in its colour (the plots draw a line and a band per arm)."""
    ax.legend(handles=[Patch(color=color, label=arm) for arm, color in colors.items()], loc="best", fontsize="small")


def _png(fig) -> bytes:
    buffer = io.BytesIO()
    fig.savefig(buffer, format="png", dpi=90, bbox_inches="tight")
    plt.close(fig)
    return buffer.getvalue()


def html(result: dict, images: dict[str, bytes]) -> str:
    """One self-contained HTML page: the markdown's sections as HTML (tables, lists), the figures inline."""
    body, table = [], []

    def flush() -> None:
        if table:
            head, *rows = [row for i, row in enumerate(table) if i != 1]  # the markdown's |---| line dropped
            body.append("<table><tr>" + "".join(f"<th>{_inline(c)}</th>" for c in head) + "</tr>" +
                        "".join("<tr>" + "".join(f"<td>{_inline(c)}</td>" for c in row) + "</tr>" for row in rows) +
                        "</table>")
            table.clear()

    for line in markdown(result).splitlines():
        if line.startswith("|"):
            table.append([c.strip() for c in line.strip("|").split("|")])
            continue
        flush()
        if line.startswith("#"):
            level = len(line) - len(line.lstrip("#"))
            body.append(f"<h{level}>{_inline(line.lstrip('#').strip())}</h{level}>")
        elif line.startswith("- "):
            body.append(f"<li>{_inline(line[2:])}</li>")
        elif line:
            body.append(f"<p>{_inline(line)}</p>")
    flush()
    for name, png in images.items():
        body.append(f"<figure><img alt='{name}' src='data:image/png;base64,{base64.b64encode(png).decode()}'>"
                    f"<figcaption>{html_escape.escape(name)}</figcaption></figure>")
    style = ("body{font-family:system-ui,sans-serif;max-width:1100px;margin:2em auto;padding:0 1em}"
             "table{border-collapse:collapse;margin:.5em 0}td,th{border:1px solid #ccc;padding:3px 8px;"
             "font-size:90%}th{background:#f3f3f3}img{max-width:100%}")
    return ("<!doctype html><html><head><meta charset='utf-8'><title>Experiment "
            f"{html_escape.escape(result['experiment'])}</title><style>{style}</style></head><body>{''.join(body)}</body></html>\n")


def _inline(text: str) -> str:
    """Markdown's inline `code`, **bold** and [text](url) as HTML, the rest escaped."""
    out = html_escape.escape(text)
    out = re.sub(r"`([^`]+)`", r"<code>\1</code>", out)
    out = re.sub(r"\*\*([^*]+)\*\*", r"<b>\1</b>", out)
    return re.sub(r"\[([^\]]+)\]\(([^)]+)\)", r"<a href='\2'>\1</a>", out)


# ------------------------------------------------------------------------------------------------ on the parent run
def run_link(uri: str, experiment_id: str):
    """A run's page in the MLflow UI when the tracking store is a server; None for a local store."""
    if not uri.startswith(("http://", "https://")):
        return lambda run_id: None
    return lambda run_id: f"{uri.rstrip('/')}/#/experiments/{experiment_id}/runs/{run_id}"


def build(client: MlflowClient, uri: str, experiment_id: str, parent_run_id: str, experiment: ExperimentConfig,
          config: RLHFConfig) -> tuple[dict, str, str, dict[str, bytes]]:
    """(summary, markdown, html, figures) of the experiment from what MLflow holds now."""
    metrics = experiment.metric_names(config)
    records = read_runs(client, experiment_id, parent_run_id, metrics)
    result = summary(experiment, config, records, metrics, run_link(uri, experiment_id))
    images = figures(result)
    return result, markdown(result, list(images)), html(result, images), images


def log_report(client: MlflowClient, parent_run_id: str, experiment: ExperimentConfig, result: dict, md: str,
               page: str, images: dict[str, bytes]) -> None:
    """experiment.yaml (what `rlhf experiment report` rebuilds it from), experiment.json, report.md, report.html and
    the figures under report/ on the parent run; the IQM of each arm's final metric as metrics
    (experiment/<metric>/<arm>/iqm)."""
    client.log_text(parent_run_id, yaml.safe_dump(experiment.model_dump(mode="json"), sort_keys=False),
                    "experiment.yaml")
    client.log_text(parent_run_id, json.dumps(result, indent=1), "report/experiment.json")
    client.log_text(parent_run_id, md, "report/report.md")
    client.log_text(parent_run_id, page, "report/report.html")
    with tempfile.TemporaryDirectory() as tmp:
        for name, png in images.items():
            (Path(tmp) / name).write_bytes(png)
            client.log_artifact(parent_run_id, str(Path(tmp) / name), "report")
    now = int(time.time() * 1000)
    client.log_batch(parent_run_id, metrics=[
        Metric(f"experiment/{metric}/{arm}/iqm", a["iqm"]["value"], now, len(result["seeds"]))
        for metric, by_aggregate in result["statistics"].items()
        for arm, a in by_aggregate["final"]["aggregates"].items()])


def find_experiment(client: MlflowClient, tracking_experiment: str, name: str,
                    uri: str) -> tuple[str, str, ExperimentConfig]:
    """(MLflow experiment id, parent run id, the experiment's definition) of the experiment named `name`."""
    experiment_id, run_id, definition = find_parent(client, tracking_experiment, "experiment", name, uri,
                                                    "experiment.yaml")
    return experiment_id, run_id, ExperimentConfig.model_validate(definition)
