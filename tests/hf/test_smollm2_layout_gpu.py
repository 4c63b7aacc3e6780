"""``examples/grpo_smollm2.py --gpu``'s layout on a real GPU (marked ``gpu``, skipped without
one): a Hugging Face Llama of SmolLM2-135M's shape with random weights, the policy, its
evaluation pool and the GRPO trainer on one GPU, weights by CUDA IPC; an episode and an
evaluation end to end, on a machine of one GPU or more.

    python -m pytest -q -m gpu tests/hf/test_smollm2_layout_gpu.py    # benchmarks/gpu/run.sh tests runs it

It starts its own Ray cluster with the machine's GPUs: run it in a pytest session of its own."""

from __future__ import annotations

from typing import TYPE_CHECKING

import pytest
import smollm2_layout

from flowrl.testing import flowrl_actor_names

if TYPE_CHECKING:
    from pathlib import Path

torch = pytest.importorskip("torch")
pytest.importorskip("transformers")
pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")]

# SmolLM2-135M's shape (the tests' tokenizer: a vocabulary of 300, not 49,152)
SMOLLM2 = {
    "hidden_size": 576,
    "intermediate_size": 1536,
    "num_hidden_layers": 30,
    "num_attention_heads": 9,
    "num_key_value_heads": 3,
    "max_position_embeddings": 2048,
}


def test_the_smollm2_example_layout_trains_and_evaluates_on_one_gpu(tmp_path: Path) -> None:
    import ray

    ray.init(num_cpus=16, num_gpus=torch.cuda.device_count(), include_dashboard=False, log_to_driver=False)
    try:
        model = smollm2_layout.random_model(tmp_path / "model", **SMOLLM2)
        engine = smollm2_layout.engine(model, tmp_path / "run")
        stats = engine.learn()
        assert flowrl_actor_names() == []
    finally:
        ray.shutdown()
    (episode,) = stats.episodes
    assert stats.trainers["grpo"].samples == 64 and episode.weight_versions == {"policy": 1}
    # one optimizer step, from the weights the rollout sampled with: the ratio is 1 iff the
    # trainer's log-probs on the GPU agree with the policy's (bf16 on both)
    assert episode.metrics["grpo"]["ratio_mean"] == pytest.approx(1.0, abs=0.1), episode.metrics
    (evaluated,) = engine.eval_results
    assert len(evaluated) == 64 and all("score" in s for s in evaluated)
