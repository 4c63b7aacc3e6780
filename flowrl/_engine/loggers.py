"""The experiment trackers flowrl writes to: TensorBoard, Weights & Biases and MLflow.

Each imports its package only when it is used (none is a dependency of flowrl), and opens its
run at the first call, so that a logger made with an engine that never runs writes nothing.
"""

from __future__ import annotations

import importlib
import importlib.util
import json
import netrc
import os
import re
import time
from pathlib import Path
from typing import TYPE_CHECKING, Any, Literal
from urllib.parse import urlparse

from .._core.errors import ConfigError

if TYPE_CHECKING:
    from collections.abc import Iterator, Mapping

    from .._core.settings.run_config import LoggerConfig

# kind -> (the module it imports, what pip installs)
PACKAGES = {
    "tensorboard": ("tensorboard", "tensorboard"),
    "wandb": ("wandb", "wandb"),
    "mlflow": ("mlflow", "mlflow-skinny"),
}
DEFAULT_ROOT = "runs"  # where loggers write when neither their dir nor RunConfig.run_dir is set
# how a run ended, for the trackers that record it: MLflow's run status, W&B's exit code
Outcome = Literal["finished", "failed", "killed"]
MLFLOW_STATUS = {"finished": "FINISHED", "failed": "FAILED", "killed": "KILLED"}


def check_installed(spec: LoggerConfig, where: str) -> None:
    """ConfigError, with the pip command, when ``spec``'s package is not installed."""
    module, pip = PACKAGES[spec.kind]
    if importlib.util.find_spec(module) is None:
        raise ConfigError(
            f"{where}: kind={spec.kind!r} needs the package {module!r}, which is not installed: "
            f"pip install {pip} (or pip install 'flowrl[track]' for TensorBoard, W&B and MLflow)"
        )


def check_wandb_login(mode: str | None, where: str) -> None:
    """ConfigError when W&B would run online without an API key: it would ask for one on stdin,
    hidden behind the live view, and the run would wait forever."""
    if mode is not None or os.environ.get("WANDB_MODE"):
        return
    if os.environ.get("WANDB_API_KEY") or _netrc_has(_wandb_host()):
        return
    raise ConfigError(
        f"{where}: kind='wandb' without mode logs online, and no W&B API key was found (WANDB_API_KEY "
        f"unset, no {_wandb_host()} entry in {_netrc_path()}): run `wandb login` first, or set mode: offline "
        "(wandb sync uploads the run later) or mode: disabled"
    )


def _wandb_host() -> str:
    return urlparse(os.environ.get("WANDB_BASE_URL") or "https://api.wandb.ai").netloc or "api.wandb.ai"


def _netrc_path() -> Path:
    """The netrc file W&B reads its key from: $NETRC, else ~/.netrc, else ~/_netrc."""
    if os.environ.get("NETRC"):
        return Path(os.environ["NETRC"]).expanduser()
    unix = Path("~/.netrc").expanduser()
    windows = Path("~/_netrc").expanduser()
    return windows if not unix.exists() and windows.exists() else unix


def _netrc_has(host: str) -> bool:
    try:
        return netrc.netrc(str(_netrc_path())).authenticators(host) is not None
    except (OSError, netrc.NetrcParseError):  # none, unreadable or malformed: W&B finds no key there either
        return False


def build(spec: LoggerConfig, run_dir: str | None) -> TensorBoardLogger | WandbLogger | MLflowLogger:
    """The logger ``spec`` describes; its folder defaults to one inside ``run_dir`` (else ``runs/``)."""
    root = Path(run_dir) if run_dir else None
    if spec.kind == "tensorboard":
        stamp = time.strftime("%Y%m%d-%H%M%S")  # runs without a run folder do not share one
        default = root / "tensorboard" if root else Path(DEFAULT_ROOT) / "tensorboard" / f"{stamp}-{os.getpid()}"
        return TensorBoardLogger(spec.dir or default)
    if spec.kind == "wandb":
        return WandbLogger(project=spec.project or "flowrl", name=spec.name, mode=spec.mode, dir=spec.dir or root)
    if spec.tracking_uri is not None:
        return MLflowLogger(tracking_uri=spec.tracking_uri, experiment=spec.experiment or "flowrl", name=spec.name)
    folder = spec.dir or (root or Path(DEFAULT_ROOT)) / "mlruns"
    return MLflowLogger(dir=folder, experiment=spec.experiment or "flowrl", name=spec.name)


class TensorBoardLogger:
    """Scalars as TensorBoard event files in ``log_dir`` (``torch.utils.tensorboard``), the run's
    config as a text entry. The first step each writer logs hides the folder's events at that step
    and later from TensorBoard (``purge_step``): a run resumed from a checkpoint, or run again
    into the same folder, replaces what the earlier one logged there instead of doubling it."""

    def __init__(self, log_dir: str | Path) -> None:
        self.log_dir = Path(log_dir)
        self._writer: Any = None
        self._last: int | None = None
        self._config: str | None = None

    def log_config(self, config: Mapping[str, Any]) -> None:
        # four spaces: a code block in TensorBoard's markdown
        self._config = "    " + json.dumps(config, indent=2, default=str).replace("\n", "\n    ")

    def log_scalars(self, step: int, scalars: Mapping[str, float]) -> None:
        if self._writer is None or (self._last is not None and step <= self._last):
            self._open(step)  # again when a rebuilt trainer redoes episodes: they replace the first tries
        for key, value in scalars.items():
            self._writer.add_scalar(key, value, step)
        self._writer.flush()  # an episode takes seconds: show it now, not after flush_secs
        self._last = step

    def close(self, outcome: Outcome = "finished") -> None:
        """Flush and close the event file (TensorBoard keeps no run status: ``outcome`` is unused)."""
        if self._writer is not None:
            self._writer.close()
            self._writer = None

    def _open(self, step: int) -> None:
        self.close()  # the writer of the earlier steps, if any
        tensorboard = importlib.import_module("torch.utils.tensorboard")
        self._writer = tensorboard.SummaryWriter(str(self.log_dir), purge_step=step)
        if self._config is not None:
            self._writer.add_text("config", self._config, step)
            self._config = None  # once


class WandbLogger:
    """Scalars as a Weights & Biases run (``wandb``) of ``project``; ``mode="offline"`` keeps it
    in ``dir``/wandb and never touches the network (``wandb sync`` uploads it later). The run's
    config is the run's W&B config. W&B neither captures the console (flowrl's view owns it) nor
    prints its summary when the run ends (``quiet``)."""

    def __init__(
        self,
        *,
        project: str = "flowrl",
        name: str | None = None,
        mode: str | None = None,
        dir: str | Path | None = None,
    ) -> None:
        self.project, self.name, self.mode = project, name, mode
        self.dir = Path(dir) if dir is not None else Path(DEFAULT_ROOT)
        self._run: Any = None

    def log_config(self, config: Mapping[str, Any]) -> None:
        if self._run is None:
            self._open(dict(config))
        else:
            self._run.config.update(dict(config), allow_val_change=True)

    def log_scalars(self, step: int, scalars: Mapping[str, float]) -> None:
        if self._run is None:
            self._open({})
        self._run.log(dict(scalars), step=step)

    def _open(self, config: dict[str, Any]) -> None:
        check_wandb_login(self.mode, "WandbLogger")  # again: the environment may have changed since
        wandb = importlib.import_module("wandb")
        self.dir.mkdir(parents=True, exist_ok=True)
        settings = wandb.Settings(console="off", quiet=True)
        self._run = wandb.init(
            project=self.project,
            name=self.name,
            mode=self.mode,
            dir=str(self.dir),
            config=config,
            reinit="create_new",  # one run per logger, beside any the user's code holds
            settings=settings,
        )

    def close(self, outcome: Outcome = "finished") -> None:
        """Finish the run; a failed or cancelled one with exit code 1, so that W&B shows it failed."""
        if self._run is not None:
            self._run.finish(exit_code=0 if outcome == "finished" else 1)
            self._run = None


class MLflowLogger:
    """Scalars as metrics of an MLflow run (``mlflow.tracking.MlflowClient``, no global state) in
    ``experiment``; the run's config as its params (flattened: ``models.policy.batch_size``).
    ``tracking_uri``: a server or store; else ``dir``, a local folder, as a file store. Recent
    MLflow refuses file stores unless ``MLFLOW_ALLOW_FILE_STORE=true``: set for the process when
    a local folder is asked for (unless the variable is set already)."""

    MAX_PARAM = 6000  # MLflow's limit on a param's value
    BATCH = 100  # params per log_batch call (MLflow's limit; metrics may be 1000)

    def __init__(
        self,
        *,
        tracking_uri: str | None = None,
        dir: str | Path | None = None,
        experiment: str = "flowrl",
        name: str | None = None,
    ) -> None:
        if tracking_uri is not None and dir is not None:
            raise ConfigError(f"MLflowLogger: give dir or tracking_uri, not both (got {dir!r} and {tracking_uri!r})")
        self.uri = tracking_uri or Path(dir if dir is not None else Path(DEFAULT_ROOT) / "mlruns").resolve().as_uri()
        self.experiment, self.name = experiment, name
        self._client: Any = None
        self.run_id: str | None = None

    def log_config(self, config: Mapping[str, Any]) -> None:
        entities = self._open()
        params = [entities.Param(k, v[: self.MAX_PARAM]) for k, v in flatten(config)]
        for i in range(0, len(params), self.BATCH):
            self._client.log_batch(self.run_id, params=params[i : i + self.BATCH])

    def log_scalars(self, step: int, scalars: Mapping[str, float]) -> None:
        entities = self._open()
        stamp = int(time.time() * 1000)
        metrics = [entities.Metric(metric_key(k), float(v), stamp, step) for k, v in scalars.items()]
        for i in range(0, len(metrics), 10 * self.BATCH):
            self._client.log_batch(self.run_id, metrics=metrics[i : i + 10 * self.BATCH])

    def _open(self) -> Any:
        entities = importlib.import_module("mlflow.entities")
        if self._client is not None:
            return entities
        if urlparse(self.uri).scheme in ("", "file"):
            os.environ.setdefault("MLFLOW_ALLOW_FILE_STORE", "true")
        tracking = importlib.import_module("mlflow.tracking")
        client = tracking.MlflowClient(tracking_uri=self.uri)
        found = client.get_experiment_by_name(self.experiment)
        experiment_id = found.experiment_id if found is not None else client.create_experiment(self.experiment)
        self.run_id = client.create_run(experiment_id, run_name=self.name).info.run_id
        self._client = client
        return entities

    def close(self, outcome: Outcome = "finished") -> None:
        """End the run with the status ``outcome`` names: FINISHED, FAILED, or KILLED (cancelled, Ctrl-C)."""
        if self._client is not None:
            self._client.set_terminated(self.run_id, status=MLFLOW_STATUS[outcome])
            self._client = None


def flatten(config: Mapping[str, Any], prefix: str = "") -> Iterator[tuple[str, str]]:
    """``config``'s leaves as (dotted key, value as text); a list is one leaf."""
    for key, value in config.items():
        if isinstance(value, dict) and value:
            yield from flatten(value, f"{prefix}{key}.")
        else:
            yield f"{prefix}{key}", value if isinstance(value, str) else json.dumps(value, default=str)


def metric_key(key: str) -> str:
    """``key`` with the characters MLflow refuses in a metric name (it takes ``[\\w./ -]``) as ``_``."""
    return re.sub(r"[^\w./ -]", "_", key)
