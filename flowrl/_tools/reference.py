"""The configuration reference, generated from the config Structs themselves.

``python -m flowrl._tools.reference > docs/config.md`` writes it; a test fails when the page and the
Structs differ, or when a field has no description here, so the page cannot drift.
"""

from __future__ import annotations

import inspect
import sys
import types
from typing import Literal, get_args, get_origin

import msgspec

from .._core.settings.config import Autoscale, CallCostPrior, ModelConfig, PipelineConfig
from .._core.settings.healing import Healing
from .._core.settings.run_config import (
    CheckpointConfig,
    LoggerConfig,
    ReproducibilityConfig,
    RunConfig,
    StalenessConfig,
)

MEANING: dict[type[msgspec.Struct], dict[str, str]] = {
    ModelConfig: {
        "num_replicas": "number of replicas; 1 when neither this nor `num_gpu` is given",
        "num_gpu": "ChatLearn style: total GPUs of the model; replicas = `num_gpu / (tensor_parallel_size * "
        "pipeline_parallel_size)`",
        "tensor_parallel_size": "GPUs of one replica, with `pipeline_parallel_size` (for the derivation above)",
        "pipeline_parallel_size": "see `tensor_parallel_size`",
        "batch_size": "the most samples one step takes (a micro-batch)",
        "shard_micro_batches": "the most micro-batches of `batch_size` a `cost` shard holds; the replica runs them in "
        "order in one call, paying its fixed cost once (1: one micro-batch a shard)",
        "gpus_per_replica": "GPUs each replica asks Ray for (may be fractional); overrides the derived value",
        "cpus_per_replica": "CPUs each replica asks Ray for",
        "splitter": "how shards are cut: `cost` (learns a call's fixed and per-sample cost and sizes shards to "
        "finish soonest), `guided`, `factoring` or `greedy` (concepts.md, splitter policies)",
        "call_cost": "a `CallCostPrior`: what a call costs before any is measured (the `cost` splitter's start)",
        "prefetch": "shards in flight per replica: one running, one waiting (queued only while that pays)",
        "call_timeout_s": "the longest one call may take, seen from the driver (a shard sent while others are in "
        "flight on its replica gets as long again for each); a call still running then fails the run with a "
        "`StageError` naming it and every replica is stopped (Ray; an in-process call cannot be cut short)",
        "on_timeout": "`fail`: a call past `call_timeout_s` fails the run; `retry`: its replica is stopped and "
        "replaced, and its samples go to another replica, at most `PipelineConfig.max_retries` times each "
        "(a stuck environment or tool; multiturn.md)",
        "on_spent": "what a sample does whose call hung (or lost its replica) once more after "
        "`PipelineConfig.max_retries` retries: `fail` the run, or `drop` that sample alone (the run goes on; "
        "`PipelineStats.dropped` records the stage, turn and reason)",
        "autoscale": "an `Autoscale`: grow and shrink this model's pool while runs go on (below)",
        "healing": "a `Healing`: replace a replica that dies, so that the pool keeps its size (below); "
        "`null`: the pool runs smaller",
        "weight_transport": "trainers: `host` (numpy through the object store), `cuda_ipc` (handles to a GPU "
        "snapshot, copied on the GPU by replicas on the same GPU: colocated models) or `nccl` "
        "(a broadcast from rank 0 in a process group with the replicas: replicas on other GPUs; "
        "gloo for CPU weights)",
    },
    PipelineConfig: {
        "backend": "`ray`: one Ray actor per replica; `inprocess`: every replica in this process (tests, "
        "debugging; `FLOWRL_DEBUG=1` forces it)",
        "ray_address": "cluster to join; unset: `RAY_ADDRESS`, else an embedded local cluster",
        "ray_namespace": "Ray namespace of the replica actors (named `flowrl-<tag>-<model>-<replica>`)",
        "ray_init_cpus": "CPUs of the embedded cluster; default: the machine's, or the replicas' total if larger",
        "ray_init_gpus": "GPUs of the embedded cluster; default: what Ray detects (a number gives logical GPUs)",
        "max_inflight": "samples admitted and not yet handed back; bounds every queue",
        "input_chunk": "input items admitted together (kept by the driver and sent sliced per shard when they "
        "hold at most about 1 MiB, else stored as one object)",
        "ordered": "default of `ordered=` for `run` and `stream`: deliver in input order",
        "setup_timeout_s": "time for all replicas to start and finish `setup` before `ClusterError`",
        "startup_report_s": "Ray: while actors start, every this many seconds a warning per actor not ready: "
        "not scheduled (and what it waits for), in `setup()` for how long, or connecting its channel; "
        "0: none",
        "inprocess_threads": "in-process: run calls in worker threads so replicas overlap",
        "cost_field": "an input field with a number estimating each sample's cost: costliest pending first",
        "local_channels": "Ray: replicas on the driver's node get shards over a Unix socket, not actor calls",
        "max_retries": "times a sample may be sent to a stage again after its replica died (or its input was "
        "lost with a node); 0 fails the run at once",
        "seed": "what each sample's random streams derive from (`Batch.seeds`, `Batch.generators`); "
        "default: an engine's `RunConfig.seed`, else 0 (reproducibility.md)",
        "deterministic": "shards are fixed blocks of `batch_size` sample ids of each run (the splitter is not "
        "used) and replicas run torch's deterministic algorithms (in process: the whole process); an engine's "
        "`RunConfig.reproducibility.deterministic` sets it (reproducibility.md)",
        "trace_spans": "how many of the latest shard spans the pipeline keeps for its timeline; 0: none",
        "progress": "`auto` (a live table while a stream runs, on a terminal; else a log line per run), "
        "`live`, `log` or `off` (YAML's bare `off`/`on` read as false/true mean `off`/`live`); an "
        "engine's own pools stay quiet",
    },
    RunConfig: {
        "sample_per_episode": "samples per episode (prompts x `num_samples_per_prompt`)",
        "num_episode": "episodes per `learn()` call (the n-th call runs up to episode n x this)",
        "train_global_batch_size": "samples per optimizer step over all ranks of a trainer; default "
        "`sample_per_episode`",
        "train_micro_batch_size": "samples per micro-batch (`self.micro_batches`); default: the global batch",
        "num_training_epoch": "passes over the training samples per episode",
        "max_relay_episode": "episodes the relay buffer keeps: 0 the current one, k the last k, -1 all",
        "sync_every": "sync trainer weights to their inference models after every k-th episode",
        "eval_every": "run `eval_flow` after every k-th episode; 0: never",
        "seed": "seed of the shuffle",
        "collective_timeout_s": "timeout of the trainers' process groups: a collective waiting longer fails",
        "shuffle": "permute the dataset on each pass over it",
        "num_samples_per_prompt": "copies of each prompt (a GRPO group), kept together",
        "checkpoint": "when checkpoints are written, where, and what a run resumes from (`CheckpointConfig`, below)",
        "staleness": "asynchronous training: how far rollouts may run ahead of training (`StalenessConfig`, below)",
        "reproducibility": "deterministic mode, and the record and replay of an asynchronous schedule "
        "(`ReproducibilityConfig`, below)",
        "length_field": "an output field of the rollout with each sample's response length (a number or a "
        "sequence, e.g. `response_ids`): remembered per prompt, the next rollouts start the longest first",
        "run_dir": "where `metrics.jsonl` (a line per episode) and `trace.json` (the timeline) go",
        "progress": "`auto` (a live table on a terminal, else log lines), `live`, `log` or `off` (false: `off`, "
        "true: `live`)",
        "loggers": "experiment trackers that get each episode's scalars: `tensorboard`, `wandb`, `mlflow` or a "
        "`LoggerConfig` (below; tracking.md)",
        "colocation": "groups of model names that share GPUs, e.g. `[[policy, reference]]`",
        "models": "a `ModelConfig` per model name, applied when the engine is built",
        "pipeline": "the `PipelineConfig` of every pool and trainer",
    },
}

MEANING[CheckpointConfig] = {
    "dir": "the folder checkpoints go to (and are resumed from)",
    "every": "write a checkpoint after every k-th episode (and one at the start); 0: never",
    "keep": "how many of the latest checkpoints to keep; 0: all",
    "resume": "`auto`: from the latest checkpoint in `dir`, if any; `never`: afresh; or the path of one "
    "checkpoint folder",
    "max_trainer_restarts": "times a trainer whose rank died may be rebuilt (from a survivor or the last checkpoint)",
    "rebuild_from_survivor": "a dead rank's group rebuilt from a surviving rank's state where it can continue",
}

MEANING[StalenessConfig] = {
    "max": "0: synchronous; k > 0: rollouts run ahead of training, every trained sample generated by weights at "
    "most k versions old (engine.md, asynchronous training)",
    "on_stale": "`wait`: admit an episode's prompts only once the bound can be met; `drop` / `regenerate`: start "
    "rollouts one version earlier and drop, or generate again, samples more than k versions behind",
    "segment": "which segment of a sample generated in a loop (a partial rollout) its staleness counts by: "
    "`oldest` (every token within the bound) or `newest` (multiturn.md)",
}

MEANING[ReproducibilityConfig] = {
    "deterministic": "a sample's numbers do not depend on the layout: fixed shards of `batch_size` sample ids "
    "in every pool, torch's deterministic algorithms in every replica and trainer rank (reproducibility.md)",
    "record_schedule": "a file the engine writes, per episode, the weight version each rollout sample was "
    "generated with (what timing decides in asynchronous training)",
    "replay_schedule": "a `record_schedule` file read back: every sample is generated with the version it had "
    "in the recorded run",
}

MEANING[CallCostPrior] = {
    "fixed_s": "seconds a call costs whatever its size (a kernel launch, padding, a micro-batch)",
    "per_sample_s": "seconds each sample adds to a call",
}

MEANING[Autoscale] = {
    "min_replicas": "the fewest replicas the autoscaler leaves serving",
    "max_replicas": "the most replicas it grows to (and only while the cluster has free resources for one more)",
    "grow_queue": "grow when the samples waiting for the model's stages are at least this many batches per serving "
    "replica; it grows by as many replicas as would bring the queue down to that",
    "shrink_starved": "shrink when the replicas spent at least this fraction of the time with no shard (and "
    "nothing waits); it removes half the replicas that starvation says are spare, at least one",
    "patience": "readings in a row that must agree before the pool is resized",
    "every_s": "seconds between readings, while a run is active",
}

MEANING[Healing] = {
    "max_restarts": "replacements in a row of one replica (a replacement that completes a shard ends the row); "
    "past it the replica is left out and reported",
    "per_minute": "the most replacements a pool starts within any 60 s",
    "backoff_s": "seconds before a replica's second replacement in a row, doubled for each further one",
    "max_backoff_s": "the longest wait before a replacement",
}

MEANING[LoggerConfig] = {
    "kind": "`tensorboard`, `wandb` or `mlflow`",
    "dir": "the logger's folder; default: `<run_dir>/tensorboard`, `<run_dir>/wandb`, `<run_dir>/mlruns` (without "
    "`run_dir`: `runs/tensorboard/<time>-<pid>`, `runs/wandb`, `runs/mlruns`)",
    "project": "wandb: the project (default `flowrl`)",
    "name": "wandb, mlflow: the run's name",
    "mode": "wandb: `online`, `offline` (no network; `wandb sync` uploads later) or `disabled`",
    "tracking_uri": "mlflow: a tracking server or store, instead of the local file store in `dir`",
    "experiment": "mlflow: the experiment (default `flowrl`)",
}

WHERE: dict[type[msgspec.Struct], str] = {
    ModelConfig: "`Model(name, config)`, `RunConfig.models.<name>`, a run file's `models.<name>`",
    PipelineConfig: "`open_pipeline(flow, config)`, `Pipeline`, `RunConfig.pipeline`",
    RunConfig: "`Engine(config=...)`, `RunConfig.load(path)`, a run file's `run`",
    Autoscale: '`ModelConfig.autoscale`, e.g. `{"max_replicas": 8}`',
    CallCostPrior: '`ModelConfig.call_cost`, e.g. `{"fixed_s": 0.05, "per_sample_s": 0.002}`',
    Healing: '`ModelConfig.healing`, e.g. `{"max_restarts": 5}`',
    LoggerConfig: "`RunConfig.loggers`, e.g. `[tensorboard, {kind: wandb, mode: offline}]`",
    CheckpointConfig: "`RunConfig.checkpoint`, e.g. `{dir: runs/ckpt, every: 2}`",
    StalenessConfig: "`RunConfig.staleness`, e.g. `{max: 1, on_stale: drop}`",
    ReproducibilityConfig: "`RunConfig.reproducibility`, e.g. `{deterministic: true}`",
}


def _type(t: object) -> str:
    """Markdown for a field's type (no ``|``: it would split a table cell)."""
    if get_origin(t) is Literal:
        return "one of " + ", ".join(f'`"{a}"`' for a in get_args(t))
    if isinstance(t, types.UnionType):
        return " or ".join(_type(a) for a in get_args(t))
    if get_origin(t) is list and isinstance(get_args(t)[0], types.UnionType):
        return "list of " + _type(get_args(t)[0])
    if t is type(None):
        return "`None`"
    if isinstance(t, type) and not get_args(t):
        return f"`{t.__name__}`"
    return "`" + str(t).replace("flowrl._core.settings.config.", "").replace("flowrl.", "") + "`"


def _default(field: msgspec.structs.FieldInfo) -> str:
    if field.default is not msgspec.NODEFAULT:
        value = field.default
        return "`" + ('"' + value + '"' if isinstance(value, str) else repr(value)) + "`"
    if field.default_factory is not msgspec.NODEFAULT:
        value = field.default_factory()
        return f"`{type(value).__name__}()`" if isinstance(value, msgspec.Struct) else f"`{value!r}`"
    return "required"


def section(cls: type[msgspec.Struct]) -> str:
    fields = msgspec.structs.fields(cls)
    meanings = MEANING[cls]
    missing = [f.name for f in fields if f.name not in meanings]
    stale = sorted(set(meanings) - {f.name for f in fields})
    if missing or stale:
        raise KeyError(f"{cls.__name__}: no description for {missing}; descriptions of no field: {stale}")
    doc = inspect.cleandoc(cls.__doc__ or "").split("\n\n")[0].replace("\n", " ")
    rows = [f"| `{f.name}` | {_type(f.type)} | {_default(f)} | {meanings[f.name]} |" for f in fields]
    return "\n".join(
        [
            f"## {cls.__name__}",
            "",
            doc,
            "",
            f"Used by: {WHERE[cls]}.",
            "",
            "| key | type | default | meaning |",
            "| --- | --- | --- | --- |",
            *rows,
            "",
        ]
    )


def config_reference() -> str:
    head = (
        "# Configuration reference\n\nGenerated from the config Structs by `python -m flowrl._tools.reference > "
        "docs/config.md` (a test keeps it current). A config is a Struct or a mapping (YAML, TOML, "
        "`--set key=value`); unknown keys and wrong types are errors naming the key.\n"
    )
    return "\n".join([head, *(section(c) for c in MEANING)])


if __name__ == "__main__":
    sys.stdout.write(config_reference())
