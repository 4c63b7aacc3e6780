"""Multi-turn rollouts on a virtual clock (sans-IO): whole-sample batches, per-turn pull and
partial rollouts, for one workload, against its strict lower bound.

A sample is a list of turns; a turn is a generation of ``tokens`` tokens by the policy, then an
environment step of ``env_s`` seconds. A policy call decodes its shard in lock step, so it lasts
``fixed_s + token_s * (the most tokens any of its samples writes)``; an environment call runs its
samples' steps side by side, ``env_fixed_s + the longest env_s``. Three ways to run it:

- ``whole``: a policy replica takes the next ``batch`` samples and plays all their turns before it
  takes more (the loop inside one call, as a rollout worker with an agent loop does); it waits
  while the environment steps its samples, in calls of ``env_batch`` side by side (an agent
  loop calls its tools itself: no environment pool is shared between batches);
- ``turn``: every turn of every sample is pulled on its own (``flowrl.loop``): a free policy
  replica takes up to ``batch`` samples whose next turn is ready, whatever their turn, and an
  environment replica up to ``env_batch`` samples whose generation is done;
- ``partial``: as ``turn``, and a policy call writes at most ``budget`` tokens of each sample:
  a longer generation continues in a later call (segments). As in a ``flowrl.loop`` whose body
  is ``env.step(policy.generate(s))``, an unfinished segment passes through the environment,
  which skips it (a call of only such samples costs ``env_fixed_s``). Re-encoding the prefix
  at each continuation is not counted.

Queues are first come, first served.
"""

from __future__ import annotations

import heapq
import math
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

import numpy as np

from .bound import makespan_floor

if TYPE_CHECKING:
    from collections.abc import Sequence

MODES = ("whole", "turn", "partial")


@dataclass(frozen=True)
class Turn:
    tokens: int
    env_s: float


@dataclass(frozen=True)
class TurnWorkload:
    samples: tuple[tuple[Turn, ...], ...]
    policy_replicas: int
    batch: int
    env_replicas: int
    env_batch: int
    fixed_s: float  # a policy call's cost beyond its tokens
    token_s: float  # per token of the call's longest generation
    env_fixed_s: float
    budget: int = 0  # partial: the most tokens of one sample per call (0: no limit)

    def policy_s(self, tokens: Sequence[int]) -> float:
        return self.fixed_s + self.token_s * max(tokens)

    def env_call_s(self, steps: Sequence[float]) -> float:
        return self.env_fixed_s + max(steps)


@dataclass
class TurnResult:
    makespan_s: float
    policy_calls: int
    env_calls: int
    policy_busy_s: float
    segments: int  # policy calls times the samples in them: one per generation, more when partial
    turns: list[int] = field(default_factory=list)


def heavy_tailed(
    n: int,
    *,
    mean_turns: float,
    max_turns: int,
    mean_tokens: float,
    sigma: float,
    mean_env_s: float,
    env_sigma: float,
    seed: int,
) -> tuple[tuple[Turn, ...], ...]:
    """``n`` samples: turn counts geometric with mean ``mean_turns`` (at most ``max_turns``),
    tokens and environment seconds per turn log-normal with those means and sigmas."""
    rng = np.random.default_rng(seed)
    out = []
    for _ in range(n):
        k = min(max_turns, int(rng.geometric(1.0 / mean_turns)))
        toks = rng.lognormal(math.log(mean_tokens) - sigma**2 / 2, sigma, k)
        envs = rng.lognormal(math.log(mean_env_s) - env_sigma**2 / 2, env_sigma, k)
        out.append(tuple(Turn(max(1, round(t)), float(e)) for t, e in zip(toks, envs, strict=True)))
    return tuple(out)


def lower_bound(w: TurnWorkload) -> float:
    """No run is shorter (``makespan_floor``): the longest sample alone, or all the work on every
    replica at once, each call full (a call of ``batch`` samples costs at least the mean of
    their own costs)."""
    paths = (sum(w.policy_s([t.tokens]) + w.env_call_s([t.env_s]) for t in s) for s in w.samples)
    turns = [t for s in w.samples for t in s]
    policy = sum(w.policy_s([t.tokens]) for t in turns) / w.batch
    env = sum(w.env_call_s([t.env_s]) for t in turns) / w.env_batch
    return makespan_floor(paths, [(policy, w.policy_replicas), (env, w.env_replicas)])


def simulate_turns(w: TurnWorkload, mode: str) -> TurnResult:
    if mode not in MODES:
        raise ValueError(f"mode must be one of {list(MODES)}, got {mode!r}")
    if mode == "whole":
        return _whole(w)
    return _pull(w, partial=mode == "partial")


def _whole(w: TurnWorkload) -> TurnResult:
    """Static batches in arrival order; each policy replica plays its batch to the end."""
    batches = [list(range(i, min(i + w.batch, len(w.samples)))) for i in range(0, len(w.samples), w.batch)]
    replicas = [(0.0, r) for r in range(w.policy_replicas)]
    out = TurnResult(0.0, 0, 0, 0.0, 0, [len(s) for s in w.samples])
    for batch in batches:
        now, r = heapq.heappop(replicas)
        turn = 0
        live = batch
        while live:
            tokens = [w.samples[i][turn].tokens for i in live]
            took = w.policy_s(tokens)
            now += took
            out.policy_calls, out.policy_busy_s, out.segments = (
                out.policy_calls + 1,
                out.policy_busy_s + took,
                out.segments + len(live),
            )
            chunks = [live[k : k + w.env_batch] for k in range(0, len(live), w.env_batch)]
            now += max(w.env_call_s([w.samples[i][turn].env_s for i in c]) for c in chunks)
            out.env_calls += len(chunks)
            turn += 1
            live = [i for i in live if len(w.samples[i]) > turn]
        out.makespan_s = max(out.makespan_s, now)
        heapq.heappush(replicas, (now, r))
    return out


def _pull(w: TurnWorkload, *, partial: bool) -> TurnResult:
    """Per-turn pull on an event clock: replicas take ready work the moment they are free."""
    n = len(w.samples)
    turn = [0] * n
    left = [w.samples[i][0].tokens for i in range(n)]  # tokens of the current generation still to write
    policy_q: list[int] = list(range(n))
    env_q: list[int] = []
    free_p, free_e = list(range(w.policy_replicas)), list(range(w.env_replicas))
    events: list[tuple[float, int, str, int, list[int]]] = []  # (time, seq, pool, replica, samples)
    seq, now, done = 0, 0.0, 0
    out = TurnResult(0.0, 0, 0, 0.0, 0, [len(s) for s in w.samples])
    while done < n:
        while free_p and policy_q:
            ids, policy_q = policy_q[: w.batch], policy_q[w.batch :]
            write = [min(left[i], w.budget) if partial and w.budget else left[i] for i in ids]
            took = w.policy_s(write)
            for i, k in zip(ids, write, strict=True):
                left[i] -= k
            out.policy_calls, out.policy_busy_s, out.segments = (
                out.policy_calls + 1,
                out.policy_busy_s + took,
                out.segments + len(ids),
            )
            heapq.heappush(events, (now + took, seq, "p", free_p.pop(), ids))
            seq += 1
        while free_e and env_q:
            ids, env_q = env_q[: w.env_batch], env_q[w.env_batch :]
            took = w.env_call_s([0.0, *(w.samples[i][turn[i]].env_s for i in ids if left[i] == 0)])
            out.env_calls += 1
            heapq.heappush(events, (now + took, seq, "e", free_e.pop(), ids))
            seq += 1
        now, _, pool, r, ids = heapq.heappop(events)
        if pool == "p":
            free_p.append(r)
            env_q += ids
            continue
        free_e.append(r)
        for i in ids:
            if left[i] > 0:  # a segment: the rest of the generation in a later call
                policy_q.append(i)
                continue
            turn[i] += 1
            if turn[i] == len(w.samples[i]):
                done += 1
            else:
                left[i] = w.samples[i][turn[i]].tokens
                policy_q.append(i)
    out.makespan_s = now
    return out
