"""The engine wing: RL training over pipelines, as components composed by ``Engine``.

Learning state, deployment, trainers, weight sync, checkpoints, asynchronous overlap,
elasticity, the episode loop and the run folder; ``RLHFEngine``. Imports ``_pipeline``,
``_backends`` and ``_core``; never ``ray``.
"""
