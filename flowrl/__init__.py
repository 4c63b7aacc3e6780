"""flowrl: an asynchronous actor-pool dataflow runtime on Ray for multi-model RL post-training."""

from __future__ import annotations

from ._batch import Batch, Sample
from ._autoscale import ScaleEvent
from ._config import Autoscale, ModelConfig, PipelineConfig
from ._engine import Engine
from ._engine_parts import EngineStats, EpisodeStats, RankStats, TrainerStats
from ._rlhf import RLHFEngine
from ._run_config import RunConfig
from ._sampler import EpisodeBuffer
from ._errors import (
    CheckpointError,
    ClusterError,
    ConfigError,
    FlowDefinitionError,
    FlowError,
    InputLostError,
    OutputError,
    PipelineClosedError,
    ReplicaDiedError,
    StageError,
)
from ._graph import FlowGraph
from ._model import Model, step
from ._pipeline import Pipeline, build_flow, open_pipeline, run_flow
from ._runtime import AsyncPipeline
from ._simulate import SimResult, SimStage, StageCost, Workload, simulate
from ._splitter import POLICIES as SPLITTERS
from ._stats import PipelineStats, ReplicaStats, StageStats

__version__ = "0.1.0"

__all__ = [
    "AsyncPipeline",
    "Batch",
    "Engine",
    "EngineStats",
    "EpisodeBuffer",
    "EpisodeStats",
    "RLHFEngine",
    "RankStats",
    "RunConfig",
    "TrainerStats",
    "CheckpointError",
    "ClusterError",
    "ConfigError",
    "FlowDefinitionError",
    "FlowError",
    "FlowGraph",
    "InputLostError",
    "Model",
    "ModelConfig",
    "Autoscale",
    "ScaleEvent",
    "OutputError",
    "Pipeline",
    "PipelineClosedError",
    "PipelineConfig",
    "PipelineStats",
    "ReplicaDiedError",
    "ReplicaStats",
    "SPLITTERS",
    "SimResult",
    "SimStage",
    "StageCost",
    "Workload",
    "simulate",
    "Sample",
    "StageError",
    "StageStats",
    "build_flow",
    "open_pipeline",
    "run_flow",
    "step",
]
