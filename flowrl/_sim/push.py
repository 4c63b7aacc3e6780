"""ChatLearn-style static push on the simulator's virtual clock (sans-IO).

The baseline the load test runs for real (``flowrl/_tools/baselines.run_push``), predicted with
the same workload, per-call overhead and dispatcher capacity as ``simulate``: the first stage's
batches are cut in input order; each batch keeps its identity through the flow and goes whole,
round-robin over the replicas, to every stage once the stages it reads have finished it; a
replica runs it in one call, a step per micro-batch of its own batch size, one call after
another.
"""

from __future__ import annotations

import heapq

import numpy as np

from .simulate import INPUT, SimResult, Workload, lower_bound, tails


def push_batches(samples: int, batch_size: int) -> list[range]:
    """Static push's batches: the first stage's batch size of samples each, in input order. Each
    keeps its identity through the flow. The one rule of the simulator, the load test's push
    (``_tools/baselines.run_push``) and the GPU baselines (``benchmarks/gpu/pull_push.py``)."""
    return [range(lo, min(lo + batch_size, samples)) for lo in range(0, samples, batch_size)]


def push_replica(turn: int, replicas: int) -> int:
    """The replica a stage's ``turn``-th call goes to: round robin over its replicas."""
    return turn % replicas


def simulate_push(workload: Workload) -> SimResult:
    w, tail = workload, tails(workload)
    batches = [np.arange(b.start, b.stop) for b in push_batches(w.samples, w.stages[0].batch_size)]
    free_at = {st.name: [0.0] * st.replicas for st in w.stages}
    busy = {st.name: [0.0] * st.replicas for st in w.stages}
    sizes: dict[str, dict[int, int]] = {st.name: {} for st in w.stages}
    turn = dict.fromkeys(free_at, 0)
    done: dict[tuple[int, str], float] = {}
    dispatcher = 0.0
    # Calls go out in the order their batch becomes ready (a shared dispatcher serves them in
    # that order): events are (ready time, batch, stage index).
    events = [(0.0, b, 0) for b in range(len(batches)) if w.stages[0].inputs == [INPUT]]
    heapq.heapify(events)
    pending = {(b, k) for b in range(len(batches)) for k in range(len(w.stages))}
    while events:
        ready, b, k = heapq.heappop(events)
        if (b, k) not in pending:
            continue
        st = w.stages[k]
        if any(i != INPUT and (b, i) not in done for i in st.inputs):
            continue
        pending.discard((b, k))
        r = push_replica(turn[st.name], st.replicas)
        turn[st.name] += 1
        ids = batches[b]
        # an input's call is entered when it is sent, with its end: the batch waits for it
        sent = max([ready, *(done[(b, i)] for i in st.inputs if i != INPUT)])
        if w.dispatch_s:
            sent = dispatcher = max(sent, dispatcher) + w.dispatch_s
        # one call a batch, as the load test's push worker: the call's cost once, then a step
        # per micro-batch of at most the stage's batch size
        steps = [ids[lo : lo + st.batch_size] for lo in range(0, len(ids), st.batch_size)]
        took = st.cost.shard_s + sum(
            st.cost.call_s + len(part) * st.cost.per_sample_s + float(tail[st.name][part].max()) for part in steps
        )
        end = max(sent + w.overhead_s, free_at[st.name][r]) + took
        busy[st.name][r] += took
        sizes[st.name][len(ids)] = sizes[st.name].get(len(ids), 0) + 1
        free_at[st.name][r] = end
        done[(b, st.name)] = end
        for j, later in enumerate(w.stages):
            if st.name in later.inputs:
                heapq.heappush(events, (max(done.get((b, i), end) for i in later.inputs if i != INPUT), b, j))
    makespan = max(done.values(), default=0.0)
    return SimResult(
        makespan_s=makespan,
        lower_bound_s=lower_bound(w, tail),
        busy_s=busy,
        replicas_used={k: sum(1 for x in v if x > 0) for k, v in busy.items()},
        calls={k: sum(v.values()) for k, v in sizes.items()},
        shard_sizes={k: dict(sorted(v.items())) for k, v in sizes.items()},
    )
