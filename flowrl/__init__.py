"""flowrl: an asynchronous actor-pool dataflow runtime on Ray for multi-model RL post-training."""

from __future__ import annotations

import inspect as _inspect
from types import FunctionType as _FunctionType

from ._core.errors import (
    CheckpointError,
    ClusterError,
    ConfigError,
    FlowDefinitionError,
    FlowError,
    InputLostError,
    MissingFieldError,
    OutputError,
    PipelineClosedError,
    RankDivergenceError,
    ReplicaDiedError,
    StageError,
)
from ._core.flow.batch import Batch, Sample
from ._core.flow.graph import FlowGraph
from ._core.flow.loops import loop
from ._core.flow.model import Model, step
from ._core.observe.pipeline_stats import LoopStats, PipelineStats, ReplicaStats, StageStats
from ._core.scheduling.autoscale import ScaleEvent
from ._core.scheduling.lengths import LengthMemory
from ._core.scheduling.splitter import POLICIES as SPLITTERS
from ._core.settings.config import Autoscale, CallCostPrior, ModelConfig, PipelineConfig
from ._core.settings.healing import Healing
from ._core.settings.run_config import CheckpointConfig, LoggerConfig, ReproducibilityConfig, RunConfig, StalenessConfig
from ._core.training.sampler import EpisodeBuffer
from ._engine.engine import Engine
from ._engine.engine_stats import EngineStats, EpisodeStats, RankStats, Rebuild, TrainerStats
from ._engine.loggers import MLflowLogger, TensorBoardLogger, WandbLogger
from ._engine.rlhf import RLHFEngine
from ._engine.tracking import EpisodeReport, Logger
from ._pipeline.opening import Pipeline, build_flow, open_pipeline, run_flow
from ._pipeline.pipeline import AsyncPipeline
from ._sim.simulate import SimResult, SimStage, StageCost, Workload, simulate

__version__ = "0.1.0"

__all__ = [
    "AsyncPipeline",
    "Autoscale",
    "Batch",
    "CallCostPrior",
    "CheckpointConfig",
    "CheckpointError",
    "ClusterError",
    "ConfigError",
    "Engine",
    "EngineStats",
    "EpisodeBuffer",
    "EpisodeReport",
    "EpisodeStats",
    "FlowDefinitionError",
    "FlowError",
    "FlowGraph",
    "Healing",
    "InputLostError",
    "LengthMemory",
    "Logger",
    "LoggerConfig",
    "LoopStats",
    "MLflowLogger",
    "MissingFieldError",
    "Model",
    "ModelConfig",
    "OutputError",
    "Pipeline",
    "PipelineClosedError",
    "PipelineConfig",
    "PipelineStats",
    "RLHFEngine",
    "RankDivergenceError",
    "RankStats",
    "Rebuild",
    "ReplicaDiedError",
    "ReplicaStats",
    "ReproducibilityConfig",
    "RunConfig",
    "SPLITTERS",
    "Sample",
    "ScaleEvent",
    "SimResult",
    "SimStage",
    "StageCost",
    "StageError",
    "StageStats",
    "StalenessConfig",
    "TensorBoardLogger",
    "TrainerStats",
    "WandbLogger",
    "Workload",
    "build_flow",
    "loop",
    "open_pipeline",
    "run_flow",
    "simulate",
    "step",
]


def _rehome(namespace: dict[str, object]) -> None:
    """Every exported class and function says ``flowrl`` is its module, as trio's are: reprs,
    tracebacks, pickles and docs name ``flowrl.Batch``, not the private module that defines it
    (pickles stay loadable: ``flowrl.<name>`` is the object itself).

    msgspec (and ``typing.get_type_hints``) resolve a class's string annotations lazily, in the
    globals of ``sys.modules[cls.__module__]``; a class's own annotations (Structs, dataclasses)
    are resolved here first, while the defining module is still the one named, so decoding,
    converting and type hints see the same types after the move.
    """
    for name in __all__:
        obj = namespace[name]
        if not isinstance(obj, type) and not isinstance(obj, _FunctionType):
            continue  # SPLITTERS, a dict
        if isinstance(obj, type) and "__annotations__" in vars(obj):
            obj.__annotations__ = _inspect.get_annotations(obj, eval_str=True)
        obj.__module__ = __name__


_rehome(globals())
del _rehome
