"""Serving a critic or reward server (PyTriton): start the front and Triton, load the weights (components/serving/
triton/critic.py, reward.py), bind the models, serve until SIGTERM/SIGINT; a rank or Triton that exits stops the
server.

The server's address is its front (components/serving/triton/front.py, in this process); Triton listens on a Unix
socket in the server's private workspace, with no token on its command line, and PyTriton reaches it through the
front with a token that exists in this process only.

One Triton instance serves all models of a server; `CriticTrainer.lock` serialises infer/train/save. Serving order:
Triton starts first, then the weights load, then the models are bound. If the weights fail to load, each model name is
registered in Triton's repository as a model whose load fails with the error, so readiness checks report
"model critic_infer UNAVAILABLE: <why>" while the server keeps answering (like Triton with a broken model).

PyTriton notes (0.7.0):
- Tensors travel base64-encoded (PYTRITON_NO_TENSORSTORE=1): PyTriton's shared-memory tensor store crashes on
  zero-size arrays (e.g. tokens [2, 0]) before our validation could name the tensor.
- The python-backend stub must find this interpreter's libpython first (pyenv vs Debian's): `prepare_environment`
  prepends sysconfig LIBDIR to LD_LIBRARY_PATH before Triton starts (the one place that sets it: every server
  process, launched or started by hand, goes through `serve`).
"""

from __future__ import annotations

import logging
import os
import secrets
import signal
import sys
import sysconfig
import threading
import time
from pathlib import Path
from typing import Callable, Optional

import psutil
import torch

from components.launch.processes import can_bind, exit_with_parent, remove_own_dir_if_orphaned, wait_for
from components.serving.auth import MissingSecret
from components.serving.triton.contract import ModelSpec, ServerSpec
from components.serving.triton.front import INTERNAL_HEADER, Front
from components.serving.triton.critic import load_critic
from components.serving.triton.reward import load_reward
from models import distributed

LOG = logging.getLogger("rlhf.server")


def prepare_environment() -> None:
    """Environment the Triton child processes inherit: this interpreter's libpython first, base64 tensor transport."""
    libdir = sysconfig.get_config_var("LIBDIR")
    current = os.environ.get("LD_LIBRARY_PATH", "")
    if libdir and libdir not in current.split(":"):
        os.environ["LD_LIBRARY_PATH"] = f"{libdir}:{current}" if current else libdir
    os.environ["PYTRITON_NO_TENSORSTORE"] = "1"


class _Stop(BaseException):
    """Raised in the main thread by SIGTERM/SIGINT."""


_FAILING_MODEL_PY = '''
import os


class TritonPythonModel:
    def initialize(self, args):
        with open(os.path.join(args["model_repository"], "load_error.txt")) as f:
            raise RuntimeError(f.read())
'''


def behind_front(triton, socket_path: Path) -> None:
    """Make tritonserver bind HTTP to `socket_path` only (no gRPC, no metrics port), while PyTriton keeps the address
    it was configured with (the front's) for its own calls: the arguments tritonserver is started with are the only
    place the socket appears (PyTriton 0.7 builds them from this config in `TritonServer.start`)."""
    from pytriton.server.triton_server_config import TritonServerConfig  # heavy: only a server process starts Triton

    class Arguments(TritonServerConfig):
        def to_args_list(self) -> list:
            args = super().to_args_list()
            args[args.index("--http-address") + 1] = f"unix:{socket_path}"
            return args

    arguments = Arguments()
    arguments.update_config(params=triton._triton_server_config.server_args())
    triton._triton_server_config = arguments


def triton_client(url: str, timeout_s: float = 2.0):
    """A tritonclient HTTP client of `url` (http://host:port or host:port) with bounded timeouts."""
    import tritonclient.http as http  # heavy: a flow imports this module for the spec, not for a client

    return http.InferenceServerClient(url.split("://", 1)[-1].rstrip("/"), connection_timeout=timeout_s,
                                      network_timeout=timeout_s)


def _register_failed_model(workspace, url: str, token: str, name: str, reason: str) -> None:
    """Put `name` into Triton's repository as a model whose load fails with `reason` (state UNAVAILABLE + reason)."""
    from tritonclient.utils import InferenceServerException  # heavy: see triton_client

    model_dir = Path(workspace.model_store_path) / name
    (model_dir / "1").mkdir(parents=True, exist_ok=True)
    (model_dir / "config.pbtxt").write_text(
        f'name: "{name}"\nbackend: "python"\nmax_batch_size: 0\n'
        'input [ { name: "unavailable" data_type: TYPE_INT64 dims: [ 1 ] } ]\n'
        'output [ { name: "unavailable_out" data_type: TYPE_INT64 dims: [ 1 ] } ]\n')
    (model_dir / "load_error.txt").write_text(reason)
    (model_dir / "1" / "model.py").write_text(_FAILING_MODEL_PY)
    client = triton_client(url, timeout_s=60)
    try:
        client.load_model(name, headers={INTERNAL_HEADER.decode(): token})
    except InferenceServerException:
        pass  # expected: the load fails with `reason`
    finally:
        client.close()


def serve(spec: ServerSpec, load: Callable[[], tuple[list, object]] | None = None) -> int:
    """Start Triton, load the weights (`load` returns (model spec, callable) pairs and the group of the server's other
    ranks, or None), bind, serve until SIGTERM/SIGINT. Models are bound, so the server is ready, only once every rank
    is up; a rank that exits stops the server (not ready any more) with an error that names it.

    Returns the process exit code: 0 after a requested stop, 1 when the weights failed to load, a rank or Triton died.
    """
    prepare_environment()
    kind = spec.kind
    load = load or (lambda: load_callables(spec))
    if not can_bind(spec.host, spec.port):
        LOG.error("%s server: port %d on %s already in use; choose another --port", kind, spec.port, spec.host)
        return 1
    from pytriton.triton import Triton, TritonLifecyclePolicy, TritonSecurityConfig  # heavy: only a server starts it
    from pytriton.utils.workspace import Workspace  # heavy: as above

    def on_signal(signum, _frame):
        signal.signal(signal.SIGTERM, signal.SIG_IGN)
        signal.signal(signal.SIGINT, signal.SIG_IGN)
        raise _Stop(signum)

    signal.signal(signal.SIGTERM, on_signal)
    signal.signal(signal.SIGINT, on_signal)
    exit_with_parent()  # a run killed without stopping us (SIGKILL): stop as a stop request would, within seconds
    if spec.torch_threads:
        torch.set_num_threads(spec.torch_threads)
    try:
        secret = spec.run_secret()
    except MissingSecret as exc:
        LOG.error("%s server: %s", kind, exc)
        return 2
    workspace = Workspace()  # a fresh 0700 directory under $PYTRITON_HOME: servers on one machine never share one
    token = secrets.token_urlsafe(32)  # PyTriton's own, to the front: never on a command line, never sent elsewhere
    front = Front(spec.host, spec.port, Path(workspace.path) / "triton.sock", secret, spec.section.auth == "none",
                  token, kind=kind)
    # PyTriton's address for Triton is the front's; Triton itself binds the Unix socket, with no token
    # the models' files written into the workspace's repository, loaded from there by name (with PyTriton's default,
    # each load uploads them and Triton copies them into a /tmp/folderXXXXXX of its own, left there when a load is cut)
    in_workspace = TritonLifecyclePolicy(launch_triton_on_startup=True, local_model_store=True)
    triton = Triton(config=spec.triton_config(), workspace=workspace, triton_lifecycle_policy=in_workspace,
                    security_config=TritonSecurityConfig(access_token=token, restricted_endpoints=[]))
    behind_front(triton, front.triton_socket)
    url = f"http://{spec.host}:{spec.port}"
    code = 0
    group = None
    try:
        front.start()
    except OSError as exc:
        LOG.error("%s server: %s", kind, exc)
        return 1
    try:
        started = time.monotonic()
        triton.run()
        LOG.info("%s server: Triton up behind %s in %.1fs; loading weights", kind, url, time.monotonic() - started)
        try:
            bindings, group = load()
        except Exception as exc:
            LOG.exception("%s server: weights failed to load", kind)
            reason = f"{kind} server failed to load: {type(exc).__name__}: {exc}"
            for name in spec.models:
                _register_failed_model(workspace, url, token, name, reason)
            code = 1
            wait_for(lambda: not triton.is_alive(), None, poll_s=0.5)  # answer readiness checks with the reason
            return code
        for model, infer in bindings:
            triton.bind(model_name=model.name, infer_func=infer, inputs=model.inputs,
                        outputs=model.outputs, config=model.config(), strict=True)
        LOG.info("%s server: ready at %s with models %s (%.1fs)", kind, url, [m.name for m, _ in bindings],
                 time.monotonic() - started)

        def ended() -> Optional[str]:
            """Why serving stopped by itself: a rank exited, or Triton (or a model backend) did."""
            if group is not None and (reason := group.exited()):
                return reason
            return None if triton.is_alive() else "Triton or a model backend exited"

        LOG.error("%s server: %s", kind, wait_for(ended, None, poll_s=0.5))
        code = 1
    except _Stop:
        LOG.info("%s server: stop requested", kind)
    finally:
        # serving that ended by itself (a rank or Triton died) stops within a bound; a requested stop as it takes
        _stop_triton(triton, kind, spec.exit_timeout_s + STOP_SLACK_S if code else None)
        front.stop()
        if group is not None:
            _stop_ranks(group)
        LOG.info("%s server: stopped", kind)
        remove_own_dir_if_orphaned()  # its home (the workspace, the models' repository) when the run died first
    return code


STOP_SLACK_S = 10  # past Triton's own exit timeout, for PyTriton's unloading on a loaded machine


def _stop_triton(triton, kind: str, deadline_s: Optional[float]) -> None:
    """PyTriton's stop, within `deadline_s` (None: as long as it takes). A stop can wait on a request that never ends
    (one waiting in a collective on a rank that died): past the deadline the server's own processes (tritonserver,
    its backend stubs, its ranks) are killed and this process exits at once with code 1, so that whoever started it
    sees it gone, and why (its log's last ERROR line), within a bound: not a server that stays up, answering ready,
    for the collective's timeout."""
    if deadline_s is None:
        triton.stop()
        return
    stopping = threading.Thread(target=triton.stop, name="triton-stop", daemon=True)
    stopping.start()
    stopping.join(deadline_s)
    if stopping.is_alive():
        # a warning: the cause (the ERROR line before it) stays the log's last ERROR line, which names the exit
        LOG.warning("%s server: Triton did not stop within %.0fs (a request still waits): its processes killed, "
                    "exiting", kind, deadline_s)
        for child in psutil.Process().children(recursive=True):
            try:
                child.kill()
            except psutil.Error:
                pass
        logging.shutdown()
        os._exit(1)


def _stop_ranks(group) -> None:
    """Tell the server's other ranks to stop (when they can still hear it), then make sure they are gone."""
    if group.exited() is None:
        me = distributed.Dist(0, group.world, 0, group.world)
        try:
            me.broadcast_object(("stop", ()))
            distributed.shutdown(me, graceful=True)
        except Exception:  # noqa: BLE001 - a rank already gone: stopped below either way
            pass
    group.stop()
    distributed.shutdown()


def configure_logging() -> None:
    logging.basicConfig(level=logging.INFO, stream=sys.stderr,
                        format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    for noisy in ("pytriton", "tritonclient", "urllib3", "httpx"):
        logging.getLogger(noisy).setLevel(logging.WARNING)


def load_callables(spec: ServerSpec) -> tuple[list[tuple[ModelSpec, Callable]], object]:
    """Load the weights a spec names (building the embedded default if it is named and missing) and bind callables."""
    return (load_critic if spec.kind == "critic" else load_reward)(spec)


def model_state_summary(index: list[dict], name: str) -> str | None:
    """'STATE: reason' of `name` in a repository index (POST /v2/repository/index), None if absent."""
    for entry in index:
        if entry.get("name") == name:
            state, reason = entry.get("state") or "UNKNOWN", (entry.get("reason") or "").strip()
            return f"{state}: {reason}" if reason else state
    return None
