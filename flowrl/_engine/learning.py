"""Where learning stands: the dataset and its sampler, the relay buffer, episodes done
and their stats, the trainers' counters and results; ``snapshot``/``restore`` for checkpoints."""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from numbers import Real
from typing import TYPE_CHECKING, Any

from .._core.checks import item_source
from .._core.errors import ConfigError, FlowDefinitionError
from .._core.flow.batch import Sample
from .._core.scheduling.lengths import LengthMemory, length_of
from .._core.training.sampler import EpisodeBuffer, EpisodeSampler, RelayBuffer
from .checkpoint_files import sampling
from .checkpoint_state import EngineState
from .engine_stats import EngineStats, TrainCounters

if TYPE_CHECKING:
    from .._core.scheduling.autoscale import ScaleEvent
    from .._core.settings.run_config import RunConfig
    from .deployment import PipelineStatsPair
    from .engine_stats import EpisodeStats, Rebuild

RelayFn = Callable[[list[EpisodeBuffer]], Sequence[Sample]]
# ``Engine(predict_cost=...)``: an item and what the engine remembers of its prompt -> a cost
CostFn = Callable[[Mapping[str, Any], "float | None"], float]
GROUP_FIELDS = ("prompt_index", "copy_index")
TrainResults = dict[str, list[list[dict[str, Any]]]]  # trainer -> step -> rank -> its result


class LearningState:
    """Everything the driver knows of a run's progress; a checkpoint holds it (``EngineState``).

    ``episode``: episodes done. ``train_results``: per episode, per trainer, per step, per rank,
    what ``train_step`` returned; ``eval_results``: the samples of each evaluation.
    """

    def __init__(self, config: RunConfig, trainers: Sequence[str]) -> None:
        self.config = config
        self.dataset: list[Mapping[str, Any]] | None = None
        self.eval_dataset: list[Mapping[str, Any]] | None = None
        self.relay_fn: RelayFn | None = None
        self.sampler: EpisodeSampler | None = None
        self.relay = RelayBuffer(config.max_relay_episode)
        self.episode = 0
        self.episodes: list[EpisodeStats] = []
        self.rebuilds: list[Rebuild] = []  # not restored from a checkpoint: this process's
        self.counters = TrainCounters(trainers)
        self.train_results: list[TrainResults] = []
        self.eval_results: list[list[Sample]] = []
        # episode -> (sampler position, next sample id) at its rollout's start: a rollout
        # running ahead of training has drawn past the episode a checkpoint resumes from
        self._marks: dict[int, tuple[int, int]] = {}
        self.lengths = LengthMemory()  # per prompt, its responses' lengths (RunConfig.length_field)
        self.predict_cost: CostFn | None = None
        self._prompts: dict[int, list[int]] = {}  # episode -> each sample's prompt (dataset index)

    def set_dataset(self, items: Sequence[Mapping[str, Any]]) -> None:
        items = dataset_items(items, "dataset", "engine.set_dataset(items)")
        cfg = self.config
        if cfg.num_samples_per_prompt > 1 and any(f in item for item in items for f in GROUP_FIELDS):
            raise ConfigError(
                f"dataset items must not have fields {list(GROUP_FIELDS)}: the engine adds them for groups"
            )
        self.sampler = EpisodeSampler(
            len(items), cfg.sample_per_episode, cfg.num_samples_per_prompt, cfg.shuffle, cfg.seed
        )
        self.dataset = items

    def draw(self, episode: int, next_sample_id: int) -> list[dict[str, Any]]:
        """The items of ``episode``'s rollout, whose first sample will be ``next_sample_id``."""
        assert self.sampler is not None and self.dataset is not None, "draw() before set_dataset()"
        self._marks[episode] = (self.sampler.position, next_sample_id)
        grouped = self.config.num_samples_per_prompt > 1
        items = []
        drawn = self.sampler.next_episode()
        self._prompts[episode] = [prompt for prompt, _ in drawn]
        for prompt, copy in drawn:
            item = dict(self.dataset[prompt])
            if grouped:  # GRPO groups: which prompt, which copy
                item.update(prompt_index=prompt, copy_index=copy)
            items.append(item)
        return items

    def estimates(
        self, episode: int, items: Sequence[Mapping[str, Any]], rows: Sequence[int] | None = None
    ) -> list[float] | None:
        """A predicted cost per item of ``episode``'s rollout (``rows``: which of its items), from
        the remembered lengths and the ``predict_cost`` hook; None when neither is on."""
        if self.config.length_field is None and self.predict_cost is None:
            return None
        prompts = self._prompts[episode]
        keys = prompts if rows is None else [prompts[i] for i in rows]
        hook = self.predict_cost
        if hook is None:
            return self.lengths.costs(keys)
        out: list[float] = []
        for i, (item, key) in enumerate(zip(items, keys, strict=True)):
            value = hook(item, self.lengths.predict(key))
            if isinstance(value, bool) or not isinstance(value, Real) or not 0 <= float(value) < float("inf"):
                raise ConfigError(
                    f"Engine(predict_cost=...) returned {value!r} for item {i} of episode {episode}; expected a "
                    "finite number >= 0 (a predicted cost, e.g. a response length)"
                )
            out.append(float(value))
        return out

    def remember(self, episode: int, samples: Sequence[Sample], rows: Sequence[int]) -> None:
        """Record the lengths of ``episode``'s rollout (``RunConfig.length_field``), per prompt;
        ``rows``: the item each sample came from (a dropped one has none)."""
        field = self.config.length_field
        drawn = self._prompts.get(episode)
        if field is None or drawn is None:
            return
        prompts = [drawn[r] for r in rows]
        lengths = []
        for i, sample in enumerate(samples):
            if field not in sample:
                raise ConfigError(
                    f"RunConfig.length_field={field!r}: sample {i} of episode {episode}'s rollout has no such field; "
                    f"its fields are {sorted(sample)}"
                )
            where = f"RunConfig.length_field={field!r}, sample {i} of episode {episode}"
            lengths.append(length_of(sample[field], where))
        self.lengths.observe(prompts, lengths)

    def relay_samples(self, episode: int, samples: list[Sample]) -> list[Sample]:
        """Add ``episode``'s samples to the relay buffer; the samples to train on."""
        self.relay.add(EpisodeBuffer(episode, samples))
        # an episode whose samples were all dropped (on_stale="drop") trains nothing
        if self.relay_fn is None or not samples:
            return samples
        return relayed(self.relay_fn, list(self.relay.episodes))

    def eval_due(self, episode: int) -> bool:
        """Whether an evaluation runs after ``episode`` trained."""
        every = self.config.eval_every
        return bool(every and (episode + 1) % every == 0 and self.eval_dataset)

    def episode_done(self, stats: EpisodeStats, results: TrainResults) -> None:
        self.episodes.append(stats)
        # the prompts of episodes trained are needed no more (a rollout running ahead keeps its own)
        self._prompts = {e: p for e, p in self._prompts.items() if e >= len(self.episodes)}
        self.train_results.append(results)  # with the episode's end: a rebuild undoes whole episodes

    def undo(self, redone: range) -> None:
        """Forget the results of episodes ``redone``, which run again after a rebuild."""
        del self.train_results[len(self.train_results) - len(redone) :]
        every = self.config.eval_every
        evals = sum(1 for e in redone if every and (e + 1) % every == 0)
        del self.eval_results[len(self.eval_results) - evals :]

    def stats(self, pipelines: PipelineStatsPair, replaced: list[ScaleEvent]) -> EngineStats:
        rollout, evaluation = pipelines
        return EngineStats(
            rollout=rollout,
            evaluation=evaluation,
            trainers=self.counters.stats(),
            episodes=list(self.episodes),
            rebuilds=list(self.rebuilds),
            replaced=list(replaced),
        )

    def snapshot(
        self,
        *,
        next_sample_id: int,
        eval_numbering: tuple[int, int],
        trainer_ranks: dict[str, int],
        weight_versions: dict[str, int],
        synced: list[str],
    ) -> EngineState:
        """The state a checkpoint after the episodes done holds, with what the caller knows of
        the pipelines (their numbering now), the trainer groups and the synced weights."""
        assert self.sampler is not None and self.dataset is not None, "snapshot() before set_dataset()"
        position, next_id = self._marks.get(self.episode, (self.sampler.position, next_sample_id))
        # no later checkpoint resumes from an episode before this one
        self._marks = {e: m for e, m in self._marks.items() if e >= self.episode}
        return EngineState(
            episode=self.episode,
            next_sample_id=next_id,
            eval_next_id=eval_numbering[0],
            eval_runs=eval_numbering[1],
            sampler_position=position,
            weight_versions=weight_versions,
            trainer_ranks=trainer_ranks,
            trainer_counts=self.counters.snapshot(),
            synced=synced,
            episodes=list(self.episodes),
            prompt_lengths=self.lengths.state(),
            **sampling(self.config, len(self.dataset)),
        )

    def restore(self, state: EngineState, relay: list[EpisodeBuffer]) -> None:
        assert self.sampler is not None, "restore() before set_dataset()"
        self.episode, self.sampler.position = state.episode, state.sampler_position
        self.relay.episodes = relay
        self.counters.restore(state.trainer_counts)
        self.episodes = list(state.episodes)
        self._marks = {}
        self.lengths.restore(state.prompt_lengths)  # its rows were checked with the file (check_state)


def relayed(fn: RelayFn, episodes: list[EpisodeBuffer]) -> list[Sample]:
    """The relay function's training samples, checked: a list of samples, not empty."""
    name = getattr(fn, "__name__", "the relay function")
    out: Any = fn(episodes)
    if out is None or isinstance(out, (Mapping, str, bytes)) or not hasattr(out, "__iter__"):
        raise FlowDefinitionError(
            f"relay function {name} returned {type(out).__name__}; it must return the samples to train on "
            "(a list of flowrl.Sample, e.g. drawn from its episodes' .samples)"
        )
    items = list(out)
    if not items:
        raise FlowDefinitionError(f"relay function {name} returned no samples; it must return at least one to train on")
    samples = [x for x in items if isinstance(x, Sample)]
    if len(samples) < len(items):
        bad = next(x for x in items if not isinstance(x, Sample))
        raise FlowDefinitionError(
            f"relay function {name} returned a {type(bad).__name__} among its samples; every item must be a "
            "flowrl.Sample (from its episodes' .samples)"
        )
    return samples


def dataset_items(items: object, what: str, where: str) -> list[Mapping[str, Any]]:
    """``items`` as a list of mappings, or a ConfigError naming the first that is not one."""
    item_source(items, where)
    rows: list[Mapping[str, Any]] = list(items)  # type: ignore[call-overload]  # item_source refused the rest
    bad = next((i for i, item in enumerate(rows) if not isinstance(item, Mapping)), None)
    if bad is not None:
        raise ConfigError(
            f"{what} item {bad} is a {type(rows[bad]).__name__}; items must be mappings of field -> value, "
            "e.g. {'prompt': x}"
        )
    return rows
