"""The pull matchmaker of one pool (sans-IO: no Ray, no event loop).

Replicas ask for work one *slot* at a time (a slot is one shard in flight; ``prefetch`` slots
per replica). Samples become ready per stage. ``poll`` pairs waiting slots with shards cut by
the splitter at that moment, never ahead of a request. Among waiting replicas, those with
fewer shards in flight go first, then the least recently served, so a second slot is served
only when every replica already has work, and work rotates over the whole pool. A second
slot is served at all only while queueing a shard ahead pays (``CallCost.queue_ahead``), or
always where a replica merges its shards into one running batch (``merges``).

Pending samples leave in order of their cost estimate, costliest first, then oldest first
(without estimates: oldest first). Starting the long samples first keeps them off the end of
the episode, and a shard then holds samples of similar cost, so a call that lasts as long as
its longest sample wastes little.

Deterministic mode (``PipelineConfig.deterministic``): shards are fixed blocks, cut whole in
the order they filled (``fixed_blocks``); no splitter, no cost order.
"""

from __future__ import annotations

import heapq
import itertools
from typing import TYPE_CHECKING

from .call_cost import drain_share
from .fixed_blocks import FixedBlocks
from .splitter import policy as check_policy
from .splitter import shard_size
from .stage_queue import Assignment as Assignment
from .stage_queue import StageQueue

if TYPE_CHECKING:
    from collections.abc import Callable, Sequence


class PoolScheduler:
    """Ready samples per stage, waiting slots per replica, and the splitter between them.

    Every operation costs O(log replicas) (a heap of waiting replicas, lazy deletion); only a
    cut at a stage's drain (``_drain``, with a clock) reads every replica's predicted free time.
    """

    def __init__(
        self,
        *,
        replicas: int,
        policy: str,
        prefetch: int = 1,
        deterministic: bool = False,
        clock: Callable[[], float] | None = None,
        merges: bool = False,
    ) -> None:
        self.replicas = replicas
        check_policy(policy)
        self.policy = policy
        self.prefetch = prefetch
        self.merges = merges  # a replica runs its shards at once (Model.merges_shards): one never waits
        self.deterministic = deterministic
        self._blocks = FixedBlocks() if deterministic else None
        self.in_flight = [0] * replicas
        self._last_served = list(range(-replicas, 0))  # never served: in replica order
        self._stages: dict[str, StageQueue] = {}
        self._waiting = [0] * replicas  # slots of each replica waiting for a shard
        self._version = [0] * replicas  # bumped when a replica's priority changes
        self._queue: list[tuple[int, int, int, int]] = []  # (in flight, last served, replica, version)
        self._held: dict[tuple[int, str], int] = {}  # (replica, stage) -> samples running there
        self._seq = itertools.count()
        self.retired: set[int] = set()  # replicas that serve no more (their process died)
        self.joining: set[int] = set()  # replicas whose ids are taken while they start
        self._isolating: set[int] = set()  # replicas running a suspect: nothing is queued behind it
        # ``clock`` (the simulator's or the runtime's seconds): the drain predicts when calls end
        self._clock = clock
        self._free_at = [0.0] * replicas  # predicted end of each replica's last call in flight

    def add_stage(
        self, name: str, batch_size: int, prior: tuple[float, float] | None = None, micro_batches: int = 1
    ) -> None:
        """Register a stage served by this pool; later stages in a flow are added later.
        ``prior``: a call's (fixed, per-sample) seconds until calls are measured;
        ``micro_batches``: the most of ``batch_size`` samples a ``cost`` shard holds."""
        most = batch_size * (micro_batches if self.policy == "cost" else 1)
        self._stages[name] = StageQueue(name, batch_size, most=most, prior=prior, prefetch=self.prefetch)

    def expect(self, stage: str, count: int) -> None:
        """``count`` more samples will reach ``stage`` (it sizes shards by what remains)."""
        q = self._stages[stage]
        q.wave = count if q.remaining <= 0 else q.wave + count
        q.expected += count

    def admit(self, stage: str, count: int) -> None:
        """``count`` samples entered the pipeline and will reach ``stage``: the ``cost``
        splitter may wait for them. Samples only expected (not admitted) are never waited for."""
        self._stages[stage].admitted += count

    def measure(
        self,
        stage: str,
        rows: int,
        busy_s: float,
        overhead_s: float | None,
        steps: Sequence[tuple[int, float]] = (),
        shard_s: float = 0.0,
        replica: int | None = None,
    ) -> None:
        """A finished call of ``stage``: its busy time and its overhead (None when unknown),
        from which the smallest shard worth a call is refitted (``CallCost``). ``steps``: a
        call of several micro-batches, each one's (samples, seconds): the fit is of one step,
        the overhead of the call. ``shard_s``: the part of ``busy_s`` outside the steps, paid
        once a call (``CallMeta.shard_s``). ``replica``: the replica that ran it."""
        q = self._stages[stage]
        for i, (n, seconds) in enumerate(steps if len(steps) > 1 else [(rows, max(0.0, busy_s - shard_s))]):
            q.fit.observe(n, seconds, overhead_s if i == 0 else None, replica)
        q.fit.observe_shard(shard_s)
        q.floor = q.fit.floor()

    def ready(
        self,
        stage: str,
        ids: list[int],
        costs: Sequence[float] | None = None,
        places: Sequence[tuple[int, int]] | None = None,
    ) -> None:
        """Samples ``ids`` can run on ``stage``; ``costs``: an estimate of each one's cost;
        ``places`` (deterministic mode): each one's (run, position in it), else blocks of one."""
        q = self._stages[stage]
        if q.dispatched + len(q.heap) + q.parked_n + len(ids) > q.expected:
            raise ValueError(f"stage {stage!r}: more samples ready than expected ({q.expected})")
        if self._blocks is None:
            q.push(ids, costs)
        else:
            self._blocks.ready(q, ids, places)

    def seal(self, run: int, count: int) -> None:
        """Run ``run`` holds ``count`` samples (admission done): its last, short block may go."""
        if self._blocks is not None:
            self._blocks.seal(run, count, self._stages.values())

    def request(self, replica: int) -> None:
        """One slot of ``replica`` is idle and asks for a shard."""
        if replica in self.retired or replica in self.joining:
            raise ValueError(f"replica {replica} is retired or not joined yet and asks for no shards")
        if self._waiting[replica] + self.in_flight[replica] >= self.prefetch:
            raise ValueError(f"replica {replica} asked for more than prefetch={self.prefetch} shards")
        self._waiting[replica] += 1
        if self._waiting[replica] == 1:
            self._enqueue(replica)

    def add_replica(self, joining: bool = False) -> int:
        """A new replica joins the pool (ids are never reused); it is served first. ``joining``:
        its id is taken now, while it starts, and it serves from ``join`` (or is retired)."""
        r = self.replicas
        self.replicas += 1
        for per_replica in (self.in_flight, self._waiting, self._version):
            per_replica.append(0)
        self._last_served.append(min(self._last_served, default=0) - 1)
        self._free_at.append(0.0)
        if joining:
            self.joining.add(r)
        return r

    def join(self, replica: int) -> None:  # ``replica``, added ``joining``, is ready for shards
        self.joining.remove(replica)

    def serving_ids(self) -> list[int]:
        """The replicas serving now: joined, and neither removed nor dead."""
        return [r for r in range(self.replicas) if r not in self.retired and r not in self.joining]

    def withdraw(self, replica: int) -> None:
        """Forget the waiting slots of ``replica`` (it stopped pulling)."""
        self._waiting[replica] = 0
        self._version[replica] += 1

    def retire(self, replica: int) -> None:
        """``replica`` serves no more (its process died, or it was removed): its waiting slots
        are forgotten, its shards are not cut for, and shard sizes count the replicas left. The
        shards it holds still finish (or are given back)."""
        self.withdraw(replica)
        self.joining.discard(replica)  # one that never joined: its start failed
        self.retired.add(replica)

    def give_back(
        self, assignment: Assignment, costs: Sequence[float] | None = None, dropped: Sequence[int] = ()
    ) -> None:
        """The shard ``assignment`` did not complete (its replica died or hung): its samples are
        pending again, except ``dropped``, which the stage no longer expects; ``costs``: the
        estimates of those given back, in shard order. Each is cut alone from now on until a
        call of it completes, so that a sample that makes calls hang does not spend the
        retries of the others."""
        r, q = assignment.replica, self._stages[assignment.stage]
        self.in_flight[r] -= 1
        self._isolating.discard(r)
        self._held_add(r, q, -len(assignment.ids))
        q.dispatched -= len(assignment.ids)
        q.suspects.difference_update(dropped)
        q.expected -= len(dropped)
        q.admitted -= len(dropped)
        back = [i for i in assignment.ids if i not in dropped] if dropped else assignment.ids
        if self._blocks is not None:
            self._blocks.give_back(q, back)
        else:
            q.push(back, costs)
            q.suspects.update(back)
        self._changed(r)

    @property
    def serving(self) -> int:
        return self.replicas - len(self.retired) - len(self.joining)

    def finish(self, assignment: Assignment) -> None:
        """The shard ``assignment`` completed."""
        r, n, q = assignment.replica, len(assignment.ids), self._stages[assignment.stage]
        self.in_flight[r] -= 1
        self._isolating.discard(r)
        self._held_add(r, q, -n)
        q.finished += n
        if q.suspects:
            q.suspects.difference_update(assignment.ids)
        if q.returned:
            q.returned.difference_update(assignment.ids)
        self._changed(r)

    @property
    def pending(self) -> int:
        return sum(len(q.heap) for q in self._stages.values())

    def poll(self) -> list[Assignment]:
        out: list[Assignment] = []
        passed: list[int] = []  # busy replicas left only suspects (or running one): they wait
        while self._queue:
            if not any(q.heap for q in self._stages.values()):
                break
            replica = self._pop_waiting()
            if replica is None:
                break
            cut = self._next_cut(replica)
            if cut is None:
                self._enqueue(replica)  # still waiting: the stages wait for more samples, or
                break  # every replica still waiting has work; each asks again when a shard ends
            stage, n = cut
            taken = self._take(stage, replica, n)
            if not taken:
                passed.append(replica)
                continue
            self._waiting[replica] -= 1
            if self._clock is not None:
                self._free_at[replica] = self._ends(replica, stage, len(taken))
            out.append(Assignment(replica, stage.name, taken))
            self.in_flight[replica] += 1
            self._last_served[replica] = next(self._seq)
            self._changed(replica)
        for replica in passed:
            self._enqueue(replica)
        for q in self._stages.values():
            q.peak = max(q.peak, len(q.heap))
        return out

    def queues(self) -> dict[str, tuple[int, int]]:
        """Per stage: (samples waiting now, the most that ever waited after a poll)."""
        return {name: (len(q.heap), q.peak) for name, q in self._stages.items()}

    def _enqueue(self, r: int) -> None:
        heapq.heappush(self._queue, (self.in_flight[r], self._last_served[r], r, self._version[r]))

    def _changed(self, r: int) -> None:
        self._version[r] += 1
        if self._waiting[r]:
            self._enqueue(r)

    def _pop_waiting(self) -> int | None:
        """The waiting replica with the fewest shards in flight, then the least recently served."""
        while self._queue:
            _, _, r, version = heapq.heappop(self._queue)
            if version == self._version[r] and self._waiting[r]:
                return r
        return None

    def _next_cut(self, replica: int) -> tuple[StageQueue, int] | None:
        """The stage ``replica`` serves next and the shard's size; None when none should be cut
        now. The deepest stage first (stages are added in flow order): it drains the pipeline."""
        for q in reversed(self._stages.values()):
            if not q.heap:
                continue
            if self.in_flight[replica] and not self.merges and not q.fit.queue_ahead(q.remaining, self.serving):
                return None
            n = self._size(q, replica)
            if n:
                return q, n
        return None

    def _held_add(self, replica: int, q: StageQueue, n: int) -> None:
        key = (replica, q.name)
        before = self._held.get(key, 0)
        self._held[key] = before + n
        q.holders += (before + n > 0) - (before > 0)

    def _ends(self, r: int, q: StageQueue, n: int) -> float:
        """When a call of ``n`` samples of ``q`` cut for ``r`` now should end (after its calls in flight)."""
        assert self._clock is not None
        now = self._clock()
        start = max(self._free_at[r], now) if self.in_flight[r] else now + (q.fit.overhead_s() or 0.0)
        return start + q.fit.call_s(n)

    def _drain(self, q: StageQueue, replica: int) -> int | None:
        """The ``cost`` splitter's size at the stage's drain (``drain_share``): every sample
        left is pending and one call per serving replica covers them; None otherwise."""
        pending, most = len(q.heap), q.batch_size  # one step a call: at the drain more keep the others waiting
        if self._clock is None or most == 1 or q.expected - q.dispatched != pending or not q.fit.steady():
            return None
        fixed, per = q.fit.fixed_s(), q.fit.per_sample_s()
        if fixed is None or per is None or per <= 0 or pending > self.serving * most:
            return None
        now = self._clock()

        def free(r: int) -> float:
            return max(now, self._free_at[r]) if self.in_flight[r] else now

        others = [free(r) for r in self.serving_ids() if r != replica]
        return drain_share(free(replica), heapq.nsmallest(pending - 1, others), pending, fixed, per, most)

    @staticmethod
    def _most(q: StageQueue) -> int:
        """The most samples of a call now: several micro-batches only while calls last as the
        fit predicts; where they vary (a generation's tail), one, so that the work still
        spreads over the replicas as it runs out."""
        return q.most if q.fit.steady() else q.batch_size

    def _size(self, q: StageQueue, replica: int) -> int:
        if self.deterministic:  # the block at the head of the queue, whole
            return q.lengths[q.heap[0][0]]
        most = self._most(q)
        if most == 1:  # one sample a call (the driver's hottest path with one-sample shards)
            return 1
        if self.policy == "cost" and (n := self._drain(q, replica)) is not None:
            return n
        held = self._held.get((replica, q.name), 0)
        busy = q.holders - (held > 0)  # other replicas running samples of this stage
        unassigned = q.expected - q.dispatched
        return shard_size(
            self.policy,
            pending=len(q.heap),
            remaining=q.remaining,
            replicas=self.serving,
            batch_size=q.batch_size,
            most=most,
            held=held,
            unassigned=unassigned,
            free_replicas=self.serving - busy,
            floor=q.floor,
            target=q.fit.best_size(unassigned, self.serving, q.wave) if self.policy == "cost" else None,
            coming=q.coming,
        )

    def _take(self, q: StageQueue, replica: int, n: int) -> list[int]:
        """Up to ``n`` samples of ``q`` for ``replica``, costliest first. A suspect goes alone,
        to a replica with nothing in flight (a call queued behind one that hangs fails with it);
        none when only suspects are left for a busy replica."""
        if replica in self._isolating:
            return []
        if self.deterministic:
            return self._take_block(q, replica)
        entries = [heapq.heappop(q.heap) for _ in range(n)]
        if q.suspects:
            suspects = [e for e in entries if e[1] in q.suspects]
            keep = suspects[:1] if suspects and not self.in_flight[replica] else []
            keep = keep or [e for e in entries if e[1] not in q.suspects]
            for e in entries:
                if e not in keep:
                    heapq.heappush(q.heap, e)
            entries = keep
            if suspects and entries == suspects[:1]:
                self._isolating.add(replica)
        self._held_add(replica, q, len(entries))
        q.dispatched += len(entries)
        return [e[1] for e in entries]

    def _take_block(self, q: StageQueue, replica: int) -> list[int]:
        """The block at the head of ``q``; a suspect only for a replica with nothing in flight."""
        key, first = q.heap[0]
        if first in q.suspects:
            if self.in_flight[replica]:
                return []
            self._isolating.add(replica)
        ids = []
        while q.heap and q.heap[0][0] == key:
            ids.append(heapq.heappop(q.heap)[1])
        del q.lengths[key]
        self._held_add(replica, q, len(ids))
        q.dispatched += len(ids)
        return ids

    def forget_suspects(self) -> None:
        """Sample ids and run numbers start again (a resume): no suspect, no run's size known."""
        if self._blocks is not None:
            self._blocks.forget()
        for q in self._stages.values():
            q.suspects.clear()
            q.returned.clear()
