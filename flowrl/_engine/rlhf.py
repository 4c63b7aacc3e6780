"""The standard six-model PPO engine, in ChatLearn's argument order."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from .engine import Engine

if TYPE_CHECKING:
    from collections.abc import Mapping, Sequence

    from .._core.flow.model import Model
    from .._core.settings.run_config import RunConfig
    from .._pipeline.opening import Flow
    from .learning import CostFn
    from .tracking import Callback, Logger


class RLHFEngine(Engine):
    """policy -> reference, value; reward(policy, reference, value); PPO trainers for policy and
    value; weights synced ppo_policy -> policy and ppo_value -> value."""

    def __init__(
        self,
        policy: Model,
        reference: Model,
        reward: Model,
        value: Model,
        ppo_policy: Model,
        ppo_value: Model,
        config: RunConfig | Mapping[str, Any],
        *,
        eval_flow: Flow | None = None,
        callbacks: Sequence[Callback] = (),
        loggers: Sequence[Logger] = (),
        predict_cost: CostFn | None = None,
    ) -> None:
        # a flow calls steps on its nodes, not with the arguments a replica's step takes
        stages: list[Any] = [policy, reference, value, reward]

        def rollout(prompts: Any) -> Any:
            policy_, reference_, value_, reward_ = stages
            out = policy_.forward_step(prompts)
            ref = reference_.forward_step(out)
            val = value_.forward_step(out)
            return reward_.forward_step(out, ref, val)

        super().__init__(
            rollout=rollout,
            train=[ppo_policy, ppo_value],
            config=config,
            sync=[(ppo_policy, policy), (ppo_value, value)],
            eval_flow=eval_flow,
            callbacks=callbacks,
            loggers=loggers,
            predict_cost=predict_cost,
        )
