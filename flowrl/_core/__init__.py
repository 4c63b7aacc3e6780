"""The core wing: flowrl's vocabulary and its pure logic.

Errors, configs and control messages, batches, flow tracing and the graph, the ``Model`` base,
the splitter and scheduler, stats, the staleness bound, the autoscaling policy, the episode
sampler, the simulator, timelines and the checkpoint encoding. No event loop, no Ray, no I/O
beyond files a caller names: everything here is tested with plain function calls. Imports
nothing from the other wings.
"""
