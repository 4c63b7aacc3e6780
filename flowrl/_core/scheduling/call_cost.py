"""What a call of a stage costs, learned from the runtime's own call timings (sans-IO).

A call of ``n`` samples keeps its replica ``fixed + n * per_sample`` seconds a step (a
micro-batch of at most ``batch_size``), plus its time around the steps (gathering the input,
the model's ``begin_shard``, joining the micro-batches: ``shard_s``), plus the runtime's
overhead (transport, dispatch, waiting for a CPU). ``CallCost`` fits the step's time
``busy = a + b * n`` over recent steps (moving averages of n, busy, n*n and n*busy, with
outliers clipped so that one stalled call does not move the fit), and keeps the call's time
around its steps and the measured overhead beside it. From that it answers the splitter's
questions:

- ``best_size``: the shard size that minimises the predicted finish of the stage's remaining
  work, ``U / R * (b + F / s) + s * b / 2`` for ``U`` samples left to hand out over ``R``
  replicas and ``F`` the fixed seconds of a call: each extra call costs ``F``, a bigger last
  call leaves the others idle for half of it on average. ``s = sqrt(2 U F / (R b))``.
- ``floor``: the smallest shard whose samples' work covers a call's overhead (the guided and
  factoring splitters' floor).
- ``queue_ahead``: whether a replica should get its next shard before its current one ends.
- ``drain_share`` (a function): at a stage's drain, when every sample left is pending and one
  call per replica covers them, how many the asking replica takes so that all replicas, each
  free at its own time, finish together.

Before two different sizes have been measured, the fixed time of a step cannot be told from
its per-sample time; the prior (``ModelConfig.call_cost``) stands in, and without one the whole
step is counted per sample (the shard size then follows the overhead alone).
"""

from __future__ import annotations

import math
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from collections.abc import Sequence

# After warm-up a call counts as at most its predicted time plus CLIP times the calls' mean
# deviation from the fit (at least SPREAD of the prediction): a stall (a garbage collection,
# a noisy neighbour) must not double the fixed cost, while a stage whose calls vary widely (a
# long tail) is clipped only far out.
CLIP = 3.0
SPREAD = 0.1
WARM = 4  # calls before clipping starts


class CallCost:
    def __init__(
        self,
        batch_size: int,
        weight: float = 0.2,
        prior: tuple[float, float] | None = None,
        most: int = 0,
        prefetch: int = 1,
    ) -> None:
        # batch_size: the most samples of one step; most: of one call (several steps);
        # prefetch: shards a replica holds at once (one runs while the next one's overhead passes)
        self.batch_size, self.weight, self.prior = batch_size, weight, prior
        self.most, self.prefetch = max(most, batch_size), prefetch
        self._avg: dict[str, float] = {}  # moving averages: n, busy, n*n, n*busy, overhead
        # the same without each replica's first step, which pays one-time costs (CUDA's first
        # kernels, the allocator's growth)
        self._warm: dict[str, float] = {}
        self._seen: set[int] = set()  # replicas whose first step was observed
        self.calls = 0
        # the fit of the calls so far: the splitter asks for it on every cut (the driver's
        # per-shard path), the calls change it only when one ends
        self._fitted: tuple[float, float] | None = prior

    def observe_shard(self, seconds: float) -> None:
        """A call's time on the replica outside its steps (gathering its input,
        ``Model.begin_shard``, joining its micro-batches' fields): paid once a call, however many
        steps it holds."""
        if math.isfinite(seconds) and seconds >= 0:
            self._mix(self._avg, "c", seconds)

    def _mix(self, averages: dict[str, float], key: str, value: float) -> None:
        """``value`` into the moving average ``averages[key]`` (the first value as it is)."""
        old = averages.get(key)
        averages[key] = value if old is None else old + self.weight * (value - old)

    def observe(self, rows: int, busy_s: float, overhead_s: float | None, replica: int | None = None) -> None:
        """One completed step; ``overhead_s`` None when it is not known (the call waited
        behind another shard on its replica, so its time outside the step says nothing);
        ``replica``: the replica that ran it, whose first step may be slow once."""
        if rows <= 0 or not math.isfinite(busy_s):
            return
        first = replica is not None and replica not in self._seen
        if replica is not None:
            self._seen.add(replica)
        if self.calls >= WARM:
            predicted = self.predict(rows)
            dev = self._avg.get("dev", predicted)
            busy_s = min(busy_s, predicted + CLIP * max(dev, SPREAD * predicted))
            self._mix(self._avg, "dev", abs(busy_s - predicted))
            if overhead_s is not None and "o" in self._avg:
                overhead_s = min(overhead_s, CLIP * max(self._avg["o"], 1e-6))
        self.calls += 1
        new = {"n": rows, "y": busy_s, "nn": rows * rows, "ny": rows * busy_s}
        if overhead_s is not None and math.isfinite(overhead_s):
            new["o"] = max(0.0, overhead_s)
        for averages in (self._avg,) if first else (self._avg, self._warm):
            for key, value in new.items():
                self._mix(averages, key, value)
        self._fitted = self._refit()

    def _fit(self) -> tuple[float, float] | None:
        """(fixed, per sample) seconds of the step, from the calls measured or the prior."""
        return self._fitted

    def _refit(self) -> tuple[float, float] | None:
        if not self._avg:
            return self.prior
        # Without the replicas' first steps where they give a line: a GPU replica's first call
        # of 64 as slow as its 960 after it would make the line fall, the fixed cost unseen
        for m in (self._warm, self._avg):
            line = _line(m)
            if line is not None:
                return line
        m = self._warm or self._avg
        if self.prior is not None:  # one size: split its time as the prior does
            fixed, per = self.prior
            scale = m["y"] / max(fixed + per * m["n"], 1e-12)
            return fixed * scale, per * scale
        return 0.0, m["y"] / m["n"]

    def predict(self, rows: int) -> float:
        fit = self._fit()
        return 0.0 if fit is None else fit[0] + fit[1] * rows

    def per_sample_s(self) -> float | None:
        """The step's marginal time per sample (None before any call or prior)."""
        fit = self._fit()
        return None if fit is None else fit[1]

    def overhead_s(self) -> float | None:
        return self._avg.get("o")

    def shard_s(self) -> float:
        """The replica's time a call costs beyond its steps (``observe_shard``)."""
        return self._avg.get("c") or 0.0

    def call_s(self, rows: int) -> float:
        """A call of ``rows`` samples on its replica: its time beyond the steps, and its steps."""
        steps = max(1, math.ceil(rows / self.batch_size))
        fit = self._fit()
        return self.shard_s() + (0.0 if fit is None else steps * fit[0] + fit[1] * rows)

    def fixed_s(self) -> float | None:
        """What a call costs whatever its size: the step's fixed time, the call's time beyond its
        step and the overhead."""
        fit = self._fit()
        if fit is None:
            return None
        return fit[0] + self.shard_s() + (self._avg.get("o") or 0.0)

    def best_size(self, unassigned: int, replicas: int, expected: int = 0) -> int | None:
        """The shard size that finishes ``unassigned`` samples over ``replicas`` soonest by the
        model above (None before anything is known: the splitter then spreads freely);
        ``expected``: the stage's samples in all (this run's), for the steps a call holds."""
        fixed, per = self.fixed_s(), self.per_sample_s()
        if fixed is None or per is None or unassigned <= 0:
            return None
        share = unassigned / max(1, replicas)
        size = self.batch_size  # a step costs the same whatever it holds: a full one
        if per > 0:
            best = math.sqrt(2.0 * share * fixed / per)

            def finish(s: int) -> float:
                return share * (per + fixed / s) + s * per / 2

            size = min((max(1, math.floor(best)), max(1, math.ceil(best))), key=finish)
        if size < self.batch_size or self.most == self.batch_size:
            return min(self.batch_size, size)
        # as many calls as the stage's whole share asks for: the remaining share alone would
        # shrink the calls as the stage drains, paying the fixed cost ever more often
        return self.batch_size * self._steps_per_call(max(share, expected / max(1, replicas)))

    def _steps_per_call(self, share: float) -> int:
        """Full steps a call should hold. Beyond one, a call saves its fixed costs but not a
        step's own: the replica's time around the steps (``shard_s``) and the runtime's
        overhead. Queued ahead (``prefetch``), the next shard's overhead passes while the running
        call works, so the overhead asks only for enough steps to cover it. The replica's own
        time is paid whatever is queued: over the stage's ``steps`` a replica runs, ``k`` steps a
        call pay it ``steps / k`` times, and the last call's samples reach the next stage ``k``
        steps late (a call's outputs leave together): ``k = sqrt(steps * fixed / step)``."""
        overhead, step = self._avg.get("o") or 0.0, self.predict(self.batch_size)
        if step <= 0:
            return 1
        fixed, cover = self.shard_s(), 1
        if self.prefetch > 1:
            if overhead > 0:
                cover = math.ceil(overhead / ((self.prefetch - 1) * step) - 1e-9)
        else:
            fixed += overhead
        steps = share / self.batch_size
        best = math.sqrt(steps * fixed / step)

        def finish(k: int) -> float:
            return steps * (step + fixed / k) + k * step

        k = min((max(1, math.floor(best)), max(1, math.ceil(best))), key=finish)
        # two calls a replica at least: a share in one call leaves nothing to even out the
        # replicas with (the seed's layout: 2 steps a replica, merged, left half of them idle)
        return max(1, min(self.most // self.batch_size, max(k, cover), math.floor(steps / 2)))

    def queue_ahead(self, remaining: int, replicas: int) -> bool:
        """Whether a replica should get its next shard before its current one ends (prefetch).

        Queued, a shard saves the replica the call's overhead of idling between calls; but
        one queued behind a long call (a heavy tail as the episode drains) can wait far longer,
        while another replica idles. So: while the overhead saved over the calls each replica
        has left (``remaining`` samples of the stage) exceeds one call's step time, which stops
        well before the drain; or, where calls last as long as predicted (their deviation from
        the fit is below the overhead, so a queued shard cannot wait much longer than on
        another replica), while each replica has two calls or more left. Never before a
        call's overhead is known.
        """
        m = self._avg
        if "o" not in m:
            return False
        calls_left = remaining / (replicas * m["n"])
        steady = "dev" in m and m["dev"] <= m["o"] and calls_left >= 2
        return steady or m["o"] * calls_left >= m["y"]

    def steady(self) -> bool:
        """Whether calls last as the fit says (their mean deviation from it within ``SPREAD`` of
        a mean call): a stage whose time is its longest sample's (a generation tail) is not."""
        m = self._avg
        return self.calls >= WARM and "dev" in m and m["dev"] <= SPREAD * m["y"]

    def floor(self) -> int:
        per_sample = self.per_sample_s()
        if per_sample is None or "o" not in self._avg:
            return 1
        if per_sample <= 0:
            return self.batch_size
        # within one micro-batch: beyond it, best_size weighs the overhead against whole steps
        return max(1, min(self.batch_size, math.ceil(self._avg["o"] / per_sample - 1e-9)))


def _line(m: dict[str, float]) -> tuple[float, float] | None:
    """(fixed, per sample) of the line through the averages ``m``; None for one size, or
    for a flat or falling line (noise, a tail: not "samples are free")."""
    if not m:
        return None
    var = m["nn"] - m["n"] ** 2
    if var <= 0.01 * m["nn"]:
        return None
    slope = (m["ny"] - m["n"] * m["y"]) / var
    return (max(0.0, m["y"] - slope * m["n"]), slope) if slope > 0 else None


def finish_together(frees: Sequence[float], samples: int, fixed: float, per: float, batch: int) -> float:
    """The soonest ``samples`` finish over replicas free at ``frees``, each running at most one
    more call of ``fixed + per * n`` seconds and ``n <= batch`` (split continuously): where the
    shares ``clip((T - free - fixed) / per, 0, batch)`` add up to ``samples``, walked over the
    breakpoints of that piecewise-linear sum. Infinite when one call each cannot hold them."""
    # the share of a replica rises from 0 at free + fixed, at a rate 1/per, to batch
    # ``batch * per`` later: breakpoints where the slope of the total changes
    points = sorted([(t + fixed, 1) for t in frees] + [(t + fixed + batch * per, -1) for t in frees])
    total, rising, at = 0.0, 0, points[0][0]
    for t, step in points:
        gained = rising * (t - at) / per
        if total + gained >= samples:
            return at + (samples - total) * per / rising
        total, at, rising = total + gained, t, rising + step
    return math.inf


def drain_share(mine: float, others: Sequence[float], samples: int, fixed: float, per: float, batch: int) -> int:
    """How many of the last ``samples`` the asking replica's call takes, so that they finish
    soonest (``finish_together``; the asking replica free at ``mine``, the others at
    ``others``: now, or when their calls in flight should end): its share at that finish,
    rounded up. 0 when the others finish them all before its call could: a busy replica then
    queues nothing.

    Guided self-scheduling spreads what is left over the replicas free *now*; where the others
    free up a moment later, that hands the free ones a shard longer than the wait for the rest.
    """
    if samples <= 0 or per <= 0:
        return 0
    finish = finish_together([mine, *others], samples, fixed, per, batch)
    if not math.isfinite(finish):  # more than one call each: not a drain
        return batch
    share = (finish - mine - fixed) / per
    return min(batch, samples, max(0, math.ceil(share - 1e-9)))
