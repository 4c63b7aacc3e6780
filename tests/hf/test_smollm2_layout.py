"""``examples/grpo_smollm2.py --gpu``'s layout on Ray with one GPU free, as on a one-GPU machine:
the policy, its evaluation pool and the trainer share that GPU (an evaluation pool with a
placement group of its own would wait for a second GPU until ``setup_timeout_s``).
tests/hf/test_smollm2_layout_gpu.py runs the same on a real GPU."""

from __future__ import annotations

from typing import TYPE_CHECKING

import pytest
import smollm2_layout

from flowrl.testing import flowrl_actor_names

if TYPE_CHECKING:
    from pathlib import Path

pytest.importorskip("transformers")


@pytest.mark.slow  # in .ci/run's slow step: kept out of the default run for its time
def test_the_smollm2_example_layout_runs_an_episode_and_an_evaluation_on_one_free_gpu(
    ray_cluster, tmp_path: Path
) -> None:
    from ray.util.placement_group import placement_group, remove_placement_group

    # 7 of the session cluster's 8 logical GPUs held elsewhere: one GPU left, as on the H200
    others = placement_group([{"GPU": 7, "CPU": 0.1}])
    ray_cluster.get(others.ready(), timeout=60)
    try:
        model = smollm2_layout.random_model(tmp_path / "model")
        engine = smollm2_layout.engine(model, tmp_path / "run")
        stats = engine.learn()
    finally:
        remove_placement_group(others)
    assert stats.trainers["grpo"].samples == 64 and stats.episodes[0].weight_versions == {"policy": 1}
    (evaluated,) = engine.eval_results
    assert len(evaluated) == 64 and all("score" in s for s in evaluated)
    assert flowrl_actor_names() == []
