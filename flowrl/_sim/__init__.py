"""The simulators: flowrl's scheduling and static push on a virtual clock (sans-IO).

``simulate`` runs a workload through the same ``PoolScheduler`` and splitters the runtime uses,
``push`` runs ChatLearn's static push, ``epochs`` several epochs with a length memory and
``turns`` multi-turn and partial rollouts. The load test, the benchmarks and ``flowrl.simulate``
use them; the runtime does not.
"""
