"""MLflow tracking: one MLflow run per flow run, driven through an explicit MlflowClient.

No global active-run state is used, so several Trackers in one process do not interfere.
System metrics (CPU, memory, disk, network; GPU when present) come from MLflow's
SystemMetricsMonitor bound to this run id and tracking URI (it needs psutil); its sampling
interval follows MLFLOW_SYSTEM_METRICS_SAMPLING_INTERVAL (default 10 s).
What a run logs as params and config.yaml has the passwords of URLs taken out (`redact`): a tracking URI or a study
storage URL may carry one.
"""

from __future__ import annotations

import contextlib
import fcntl
import json
import logging
import numbers
import os
import re
import subprocess
import tempfile
import time
import urllib.error
import urllib.request
from collections.abc import Sequence
from importlib.metadata import PackageNotFoundError, version
from pathlib import Path
from types import TracebackType
from typing import Any
from urllib.parse import unquote, urlparse

import yaml
from mlflow.entities import Metric, Param, RunTag
from mlflow.exceptions import MlflowException
from mlflow.tracking import MlflowClient

_URL_PASSWORD = re.compile(r"(?P<head>[A-Za-z][A-Za-z0-9+.\-]*://[^/\s:@]*:)(?P<password>[^@\s/]*)@")


def redact(value):
    """`value` with the password of every URL in it replaced by '***' (strings, and mappings/lists of them, at any
    depth): scheme://user:password@host -> scheme://user:***@host."""
    if isinstance(value, str):
        return _URL_PASSWORD.sub(lambda m: f"{m.group('head')}***@", value)
    if isinstance(value, dict):
        return {k: redact(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return type(value)(redact(v) for v in value)
    return value

PARAM_VALUE_LIMIT = 500  # the strictest MLflow servers refuse longer param values
_CUT = "...(truncated)"
_BATCH = 100
_STEP_EXEMPT = ("system/", "checkpoint/")  # metrics that do not count as training steps


class TrackingError(RuntimeError):
    """The tracking server cannot be used."""


def resolve_tracking_uri(uri: str | None, state_dir: Path) -> str:
    """Explicit uri > MLFLOW_TRACKING_URI > sqlite:///<state_dir>/mlflow.db."""
    if uri:
        return uri
    if os.environ.get("MLFLOW_TRACKING_URI"):
        return os.environ["MLFLOW_TRACKING_URI"]
    state_dir = Path(state_dir).expanduser().resolve()
    state_dir.mkdir(parents=True, exist_ok=True)
    return f"sqlite:///{state_dir / 'mlflow.db'}"


def check_reachable(uri: str, timeout: float = 5.0) -> None:
    """For http(s) URIs, GET /health (falling back to the REST API) and fail fast naming the URI."""
    if urlparse(uri).scheme not in ("http", "https"):
        return
    base = uri.rstrip("/")
    for path in ("/health", "/api/2.0/mlflow/experiments/search?max_results=1"):
        try:
            with urllib.request.urlopen(base + path, timeout=timeout) as response:
                if response.status < 500:
                    return
        except urllib.error.HTTPError as exc:
            if exc.code == 404:
                continue  # no /health route behind this proxy: try the API
            if exc.code < 500:
                return  # it answers (auth is checked by the client itself)
            raise TrackingError(f"MLflow tracking server {uri} answered {exc.code} on {path}") from exc
        except (OSError, ValueError) as exc:
            raise TrackingError(f"MLflow tracking server {uri} is unreachable: {exc}") from exc
    raise TrackingError(f"{uri} does not look like an MLflow tracking server (no /health, no REST API)")


def flatten(config: dict[str, Any], prefix: str = "") -> dict[str, str]:
    """{"a": {"b": 1}} -> {"a.b": "1"}; values stringified and cut to PARAM_VALUE_LIMIT."""
    flat: dict[str, str] = {}
    for key, value in config.items():
        name = f"{prefix}{key}"
        if isinstance(value, dict) and value:
            flat.update(flatten(value, f"{name}."))
            continue
        text = json.dumps(value) if isinstance(value, (list, tuple, dict)) else str(value)
        if len(text) > PARAM_VALUE_LIMIT:
            text = text[: PARAM_VALUE_LIMIT - len(_CUT)] + _CUT
        flat[name] = text
    return flat


def get_or_create_experiment(client: MlflowClient, name: str, tracking_uri: str) -> str:
    """Experiment id by name; a new one keeps a sqlite store's artifacts next to its database."""
    experiment = client.get_experiment_by_name(name)
    if experiment is None:
        location = None
        parsed = urlparse(tracking_uri)
        if parsed.scheme == "sqlite":
            db = Path(unquote(parsed.path[1:]))  # sqlite:////abs/x.db or sqlite:///relative/x.db
            location = (db.parent / "mlartifacts").resolve().as_uri()
        try:
            return client.create_experiment(name, artifact_location=location)
        except MlflowException:  # created concurrently by another process
            experiment = client.get_experiment_by_name(name)
            if experiment is None:
                raise
    if experiment.lifecycle_stage != "active":
        raise TrackingError(f"experiment '{name}' at {tracking_uri} is deleted; restore it or pick another name")
    return experiment.experiment_id


def _git_commit() -> str | None:
    try:
        out = subprocess.run(
            ["git", "rev-parse", "HEAD"],
            cwd=Path(__file__).resolve().parent,
            capture_output=True,
            text=True,
            timeout=5,
        )
    except (OSError, subprocess.SubprocessError):
        return None
    return out.stdout.strip() if out.returncode == 0 and out.stdout.strip() else None


def _as_number(value: Any) -> float | None:
    if hasattr(value, "item") and not isinstance(value, (str, bytes)):
        try:
            value = value.item()  # numpy / torch scalars
        except (ValueError, RuntimeError, TypeError):
            return None
    if isinstance(value, bool) or not isinstance(value, numbers.Real):
        return None
    return float(value)


def _model_requirements() -> list[str]:
    """What loading a logged model needs: the installed transformers, torch and safetensors (pinned as installed;
    given explicitly, so MLflow does not infer them by importing the model in a subprocess)."""
    out = []
    for package in ("transformers", "torch", "safetensors", "accelerate"):
        try:
            out.append(f"{package}=={version(package).split('+')[0]}")
        except PackageNotFoundError:
            continue
    return out


@contextlib.contextmanager
def sqlite_created(uri: str):
    """For a sqlite store (the state directory's): an exclusive lock on '<database>.lock' while the store is first
    used, so two runs starting together on a new store do not both create its tables (the second would fail with
    'table already exists'); any other store: nothing."""
    if not uri.startswith("sqlite:///"):
        yield
        return
    database = Path(uri[len("sqlite:///"):])
    database.parent.mkdir(parents=True, exist_ok=True)
    with open(f"{database}.lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        yield


class Tracker:
    """One MLflow run: params, metrics (strictly increasing steps), tables, checkpoint records."""

    def __init__(
        self,
        tracking_uri: str,
        experiment: str,
        run_name: str,
        *,
        run_id: str | None = None,
        tags: dict[str, str] | None = None,
        system_metrics: bool = True,
    ) -> None:
        self.tracking_uri = tracking_uri
        self.experiment = experiment
        self.run_name = run_name
        self.run_id: str | None = run_id
        self.tags = dict(tags or {})
        self.system_metrics = system_metrics
        self.last_step: int | None = None
        # (metric, step) pairs in the run: an earlier attempt's and side metrics'
        self.logged: set[tuple[str, int]] = set()
        self._client: MlflowClient | None = None
        self._monitor = None
        self._active = False

    @property
    def client(self) -> MlflowClient:
        if self._client is None:
            raise TrackingError("Tracker.start() has not been called")
        return self._client

    def start(self, config: dict) -> str:
        """Create the run (or resume `run_id`); a new run logs config as params and config.yaml."""
        check_reachable(self.tracking_uri)
        tags = dict(self.tags)
        try:
            with sqlite_created(self.tracking_uri):  # two runs starting on one new store create its tables once
                self._client = MlflowClient(tracking_uri=self.tracking_uri)
                get_or_create_experiment(self._client, self.experiment, self.tracking_uri)
            if self.run_id:
                self._resume()
            else:
                commit = _git_commit()  # a resumed run keeps the commit it started from
                if commit:
                    tags.setdefault("mlflow.source.git.commit", commit)
                experiment_id = get_or_create_experiment(self._client, self.experiment, self.tracking_uri)
                run = self._client.create_run(experiment_id, run_name=self.run_name,
                                              tags={"mlflow.runName": self.run_name})
                self.run_id = run.info.run_id
                self._log_config(config)
            self._log_batch(tags=[RunTag(k, str(v)) for k, v in tags.items()])
        except MlflowException as exc:
            raise TrackingError(f"MLflow at {self.tracking_uri}: {exc}") from exc
        self._active = True
        if self.system_metrics:
            self._start_system_metrics(resume=self.last_step is not None)
        return self.run_id

    def _resume(self) -> None:
        try:
            run = self.client.get_run(self.run_id)
        except MlflowException as exc:
            raise TrackingError(f"cannot resume run {self.run_id} at {self.tracking_uri}: {exc}") from exc
        if run.info.lifecycle_stage != "active":
            raise TrackingError(f"run {self.run_id} at {self.tracking_uri} is deleted")
        histories = {key: self.client.get_metric_history(self.run_id, key) for key in run.data.metrics}
        steps = [m.step for key, history in histories.items() if not key.startswith(_STEP_EXEMPT) for m in history]
        self.last_step = max(steps) if steps else None
        self.logged = {(key, m.step) for key, history in histories.items() for m in history}
        if run.info.status != "RUNNING":
            self.client.update_run(self.run_id, status="RUNNING")

    def _log_config(self, config: dict) -> None:
        plain = redact(json.loads(json.dumps(config, default=str)))
        self._log_batch(params=[Param(k, v) for k, v in flatten(plain).items()])
        self.client.log_text(self.run_id, yaml.safe_dump(plain, sort_keys=False), "config.yaml")

    def _log_batch(
        self, *, metrics: Sequence[Metric] = (), params: Sequence[Param] = (), tags: Sequence[RunTag] = ()
    ) -> None:
        metrics, params, tags = list(metrics), list(params), list(tags)
        for i in range(0, max(len(metrics), len(params), len(tags)), _BATCH):
            self.client.log_batch(
                self.run_id, metrics=metrics[i : i + _BATCH], params=params[i : i + _BATCH], tags=tags[i : i + _BATCH]
            )

    def _start_system_metrics(self, resume: bool) -> None:
        try:
            from mlflow.system_metrics.system_metrics_monitor import SystemMetricsMonitor  # optional: needs psutil

            self._monitor = SystemMetricsMonitor(self.run_id, resume_logging=resume, tracking_uri=self.tracking_uri)
            self._monitor.start()
        except Exception:  # noqa: BLE001 - optional: missing psutil or an unsupported platform must not stop training
            self._monitor = None

    def log_steps(self, steps: list[tuple[int, dict[str, float]]]) -> None:
        """Log the metrics of several steps in one batch (ascending steps, each after the last logged one)."""
        entries, timestamp = [], int(time.time() * 1000)
        for step, metrics in steps:
            if self.last_step is not None and step <= self.last_step:
                raise ValueError(f"step {step} is not after the last logged step {self.last_step} of run {self.run_id}")
            entries += [Metric(key, number, timestamp, step) for key, value in metrics.items()
                        if (number := _as_number(value)) is not None]
            self.last_step = step
        self._log_batch(metrics=entries)

    def log_side_metrics(self, metrics: dict[str, float], step: int) -> bool:
        """Log numeric values at `step` beside the iterations' (held-out eval, data counts): any step, not tracked by
        last_step. A metric already logged at that step (by an earlier attempt that got there before it stopped: the
        resumed run recomputes it) is not logged again. Returns whether anything was logged."""
        timestamp = int(time.time() * 1000)
        fresh = [Metric(key, number, timestamp, step) for key, value in metrics.items()
                 if (key, step) not in self.logged and (number := _as_number(value)) is not None]
        self._log_batch(metrics=fresh)
        self.logged.update((m.key, step) for m in fresh)
        return bool(fresh)

    def log_table(self, rows: list[dict], step: int, name: str = "samples") -> None:
        """Rows (e.g. prompt/response/reward) as an MLflow table artifact tables/<name>_<step>.json."""
        columns: dict[str, list] = {key: [] for row in rows for key in row}
        for row in rows:
            for key in columns:
                columns[key].append(row.get(key))
        self.client.log_table(self.run_id, data=columns, artifact_file=f"tables/{name}_{step:06d}.json")

    def log_checkpoint(self, uri: str, step: int) -> None:
        """Record a saved checkpoint: tag checkpoint.latest, metric checkpoint/iteration, checkpoints/<step>.txt."""
        self._log_batch(
            metrics=[Metric("checkpoint/iteration", float(step), int(time.time() * 1000), step)],
            tags=[RunTag("checkpoint.latest", uri)],
        )
        self.client.log_text(self.run_id, uri + "\n", f"checkpoints/{step:06d}.txt")

    def log_model(self, directory: str | Path, step: int, register_as: str | None = None,
                  name: str = "model") -> str:
        """Log a Hugging Face model directory (models/export.py) as this run's model: an MLflow 3 logged model in the
        transformers flavor (loadable with mlflow.transformers.load_model('models:/<id>'), its files under
        model/), linked to the run at `step`; with `register_as`, a new version of that registered model. Returns
        the logged model's id."""
        import mlflow.transformers  # heavy (~2 s): only logging a model needs it
        from mlflow.entities import LoggedModelOutput, LoggedModelStatus  # with mlflow.transformers: a model to log
        from mlflow.models import Model  # as above
        from transformers import AutoModelForCausalLM, AutoTokenizer  # heavy: the model MLflow's flavor saves

        run = self.client.get_run(self.run_id)
        with tempfile.TemporaryDirectory(prefix="mlflow-model-") as tmp:
            local = Path(tmp) / name
            # the model object, not the directory: MLflow 3.17's local-checkpoint path fails on transformers 5's
            # lazily registered pipelines
            components = {"model": AutoModelForCausalLM.from_pretrained(directory, dtype="auto"),
                          "tokenizer": AutoTokenizer.from_pretrained(directory)}
            quiet = logging.getLogger("mlflow.transformers")
            level = quiet.level
            quiet.setLevel(logging.ERROR)  # no hub here to fetch a model card or a license from: not worth a warning
            try:
                mlflow.transformers.save_model(components, str(local), task="text-generation",
                                               pip_requirements=_model_requirements())
            finally:
                quiet.setLevel(level)
            del components
            model = self.client.create_logged_model(run.info.experiment_id, name=name, source_run_id=self.run_id,
                                                    model_type="transformers", params={"step": str(step)})
            meta = Model.load(str(local))
            meta.model_id, meta.run_id, meta.artifact_path = model.model_id, self.run_id, name
            meta.save(str(local / "MLmodel"))
            try:
                self.client.log_model_artifacts(model.model_id, str(local))
            except Exception:
                self.client.finalize_logged_model(model.model_id, LoggedModelStatus.FAILED)
                raise
        self.client.finalize_logged_model(model.model_id, LoggedModelStatus.READY)
        self.client.log_outputs(self.run_id, models=[LoggedModelOutput(model.model_id, step=step)])
        if register_as:
            try:
                self.client.create_registered_model(register_as)
            except MlflowException as exc:  # it exists already: a new version of it
                if "RESOURCE_ALREADY_EXISTS" not in str(exc) and "already exists" not in str(exc):
                    raise
            # the source is the logged model's storage location: a sqlite store resolves 'models:/<id>' through
            # the process-global tracking URI, not this client's
            self.client.create_model_version(register_as, model.artifact_location, run_id=self.run_id,
                                             model_id=model.model_id)
        return model.model_id

    def end(self, status: str = "FINISHED") -> None:
        """Stop system metrics and mark the run terminated (FINISHED, FAILED or KILLED)."""
        if not self._active:
            return
        self._active = False
        if self._monitor is not None:
            self._monitor.finish()
            self._monitor = None
        self.client.set_terminated(self.run_id, status=status)

    def __enter__(self) -> Tracker:
        return self

    def __exit__(
        self, exc_type: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None
    ) -> None:
        self.end("FINISHED" if exc_type is None else "FAILED")
