"""flowrl: an asynchronous actor-pool dataflow runtime on Ray for multi-model RL post-training."""

from __future__ import annotations

from ._core.autoscale import ScaleEvent
from ._core.batch import Batch, Sample
from ._core.config import Autoscale, ModelConfig, PipelineConfig
from ._core.errors import (
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
from ._core.graph import FlowGraph
from ._core.model import Model, step
from ._core.run_config import RunConfig
from ._core.sampler import EpisodeBuffer
from ._core.simulate import SimResult, SimStage, StageCost, Workload, simulate
from ._core.splitter import POLICIES as SPLITTERS
from ._core.stats import PipelineStats, ReplicaStats, StageStats
from ._engine.engine import Engine
from ._engine.stats import EngineStats, EpisodeStats, RankStats, TrainerStats
from ._engine.rlhf import RLHFEngine
from ._pipeline.opening import Pipeline, build_flow, open_pipeline, run_flow
from ._pipeline.pipeline import AsyncPipeline

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
