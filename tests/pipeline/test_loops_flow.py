"""Loops in a running flow (flowrl.loop), in process and on Ray: every turn of every sample runs
exactly once, whatever the timing; samples take different numbers of turns; a loop ends on its
field, on max_turns or on its deadline, with the reason recorded; the state a body updates is
what the next turn and the stages after the loop read."""

from __future__ import annotations

import os
import random
import threading
import time
from pathlib import Path
from typing import Any

import pytest

import flowrl
from flowrl.testing import flowrl_actor_names

CPU = {"cpus_per_replica": 0.25}


def _jitter(seed: int, batch: flowrl.Batch, iteration: int, batch_size: int) -> None:
    """A few milliseconds that depend on the shard: shards finish in a shuffled order. A step
    never holds more than the model's ``batch_size``."""
    if len(batch) > batch_size:
        raise AssertionError(f"a step of {len(batch)} samples, above batch_size={batch_size}")
    rng = random.Random(hash((seed, iteration, tuple(batch.ids.tolist()), len(batch))))
    time.sleep(rng.random() * 0.004)


class Player(flowrl.Model):
    """Moves: its move is the turn number, read from the transcript (two entries a turn)."""

    def __init__(self, name: str, config: dict[str, Any], seed: int = 0) -> None:
        super().__init__(name, config)
        self.seed = seed

    @flowrl.step
    def act(self, batch: flowrl.Batch, iteration: int) -> dict[str, Any]:
        _jitter(self.seed, batch, iteration, self.config.batch_size)
        return {"move": [len(t) // 2 + 1 for t in batch["text"]]}


class Game(flowrl.Model):
    """Appends the move and its answer to the transcript; done once the move reaches the goal."""

    def __init__(self, name: str, config: dict[str, Any], seed: int = 0) -> None:
        super().__init__(name, config)
        self.seed = seed

    @flowrl.step
    def play(self, batch: flowrl.Batch, iteration: int) -> dict[str, Any]:
        _jitter(self.seed, batch, iteration, self.config.batch_size)
        moves = batch["move"]
        text = [list(t) + [m, -m] for t, m in zip(batch["text"], moves, strict=True)]
        return {"text": text, "done": [m >= g for m, g in zip(moves, batch["goal"], strict=True)]}


class Judge(flowrl.Model):
    def score(self, batch: flowrl.Batch, iteration: int) -> dict[str, Any]:
        return {"length": [len(t) for t in batch["text"]]}

    forward_step = score


def goal(i: int) -> int:
    return 1 + (i * 7) % 6  # 1 to 6 turns, mixed along the input


def game_flow(seed: int, max_turns: int = 10, replicas: tuple[int, int] = (2, 3)):
    player = Player("player", {"num_replicas": replicas[0], "batch_size": 3, **CPU}, seed)
    game = Game("game", {"num_replicas": replicas[1], "batch_size": 2, **CPU}, seed + 1)
    judge = Judge("judge", {"num_replicas": 1, "batch_size": 4, **CPU})

    def flow(games):
        final = flowrl.loop(lambda s: game.play(player.act(s)), games, until="done", max_turns=max_turns)
        return judge.forward_step(final)

    return flow


def games(n: int) -> list[dict[str, Any]]:
    return [{"text": [], "goal": goal(i)} for i in range(n)]


def transcript(turns: int) -> list[int]:
    return [v for t in range(1, turns + 1) for v in (t, -t)]


@pytest.mark.parametrize("backend, seed", [("inprocess", 1), ("inprocess", 2), ("ray", 3)])
async def test_each_turn_runs_once_and_samples_take_their_own_number_of_turns(ray_cluster, backend, seed):
    n = 23
    config = {"backend": backend, "inprocess_threads": True}
    async with flowrl.open_pipeline(game_flow(seed), config) as pipe:
        out = await pipe.run(games(n))
        stats = pipe.stats()
    assert [s.id for s in out] == list(range(n))
    for s in out:
        g = goal(s.id)
        assert s["text"] == transcript(g)  # every turn once, in order: none lost, none twice
        assert (s["loop_turns"], s["loop_stop"], bool(s["done"])) == (g, "done", True)
        assert s["length"] == 2 * g  # the stage after the loop reads the last turn's state
        assert s["move"] == g  # a turn's own field: the last turn's
    total = sum(goal(i) for i in range(n))
    assert stats["player.act"].samples == total and stats["game.play"].samples == total
    loop = stats.loops["loop"]
    assert (loop.samples, loop.turns, loop.stops) == (n, total, {"done": n})
    assert loop.turn_counts == {g: sum(goal(i) == g for i in range(n)) for g in range(1, 7)}
    assert stats["judge.forward_step"].samples == n
    # a shard may hold several micro-batches (each step checks its own against batch_size)
    assert stats["player.act"].max_shard <= 3 * 8 and stats["game.play"].max_shard <= 2 * 8
    if backend == "ray":
        assert flowrl_actor_names() == []


async def test_max_turns_ends_a_sample_with_its_reason_and_the_trace_shows_turns():
    async with flowrl.open_pipeline(game_flow(4, max_turns=3), {"backend": "inprocess"}) as pipe:
        out = await pipe.run(games(12))
        stats, spans = pipe.stats(), pipe.timeline.spans
    assert stats.loops["loop"].stops == {
        "done": sum(goal(i) <= 3 for i in range(12)),
        "max_turns": sum(goal(i) > 3 for i in range(12)),
    }
    seen = sorted(
        (sid, turn)
        for s in spans
        if s.name == "game.play"
        for sid, turn in zip(s.args["ids"], s.args["turns"], strict=True)
    )
    assert seen == sorted((i, t) for i in range(12) for t in range(1, min(goal(i), 3) + 1))  # each turn once
    assert all("turns" not in s.args for s in spans if s.name == "judge.forward_step")
    for s in out:
        g = goal(s.id)
        turns = min(g, 3)
        assert s["text"] == transcript(turns)
        assert s["loop_turns"] == turns
        assert s["loop_stop"] == ("done" if g <= 3 else "max_turns")


async def test_a_deadline_ends_a_sample_after_its_turn():
    player = Player("player", {"batch_size": 2})
    game = Game("game", {"batch_size": 2})

    def flow(x):
        return flowrl.loop(lambda s: game.play(player.act(s)), x, until="done", max_turns=5, deadline_s=1e-9)

    async with flowrl.open_pipeline(flow, {"backend": "inprocess"}) as pipe:
        out = await pipe.run([{"text": [], "goal": 4} for _ in range(5)])
    # the deadline has passed when the first turn ends: one turn each, none cut mid-turn
    assert [(s["loop_turns"], s["loop_stop"], s["text"]) for s in out] == [(1, "deadline", [1, -1])] * 5


class Writer(flowrl.Model):
    """Writes ``tokens`` tokens a call until ``length`` are written: a partial rollout."""

    @flowrl.step
    def generate(self, batch: flowrl.Batch, iteration: int) -> dict[str, Any]:
        response, segments = [], []
        for text, length, seg in zip(batch["response"], batch["length"], batch["segments"], strict=True):
            part = list(range(len(text), min(length, len(text) + 3)))
            response.append(list(text) + part)
            segments.append(list(seg) + [len(part)])
        return {
            "response": response,
            "segments": segments,
            "finished": [len(r) >= n for r, n in zip(response, batch["length"], strict=True)],
        }


@pytest.mark.parametrize("backend", ["inprocess", "ray"])
async def test_a_one_step_loop_continues_unfinished_samples_on_any_replica(ray_cluster, backend):
    writer = Writer("writer", {"num_replicas": 3, "batch_size": 4, **CPU})

    def flow(prompts):
        return flowrl.loop(writer.generate, prompts, until="finished", max_turns=20, name="segment")

    lengths = [1 + (i * 5) % 13 for i in range(17)]
    async with flowrl.open_pipeline(flow, {"backend": backend}) as pipe:
        out = await pipe.run([{"response": [], "segments": [], "length": n} for n in lengths])
    for s, n in zip(out, lengths, strict=True):
        assert s["response"] == list(range(n))
        assert s["segments"] == [3] * (n // 3) + ([n % 3] if n % 3 else [])
        assert s["segment_turns"] == len(s["segments"]) and s["segment_stop"] == "done"
    if backend == "ray":
        assert flowrl_actor_names() == []


class Tag(flowrl.Model):
    def __init__(self, name: str, config: dict[str, Any], mark: int) -> None:
        super().__init__(name, config)
        self.mark = mark

    @flowrl.step
    def add(self, batch: flowrl.Batch, iteration: int) -> dict[str, Any]:
        return {"text": [list(t) + [self.mark] for t in batch["text"]], "done": [True] * len(batch)}


class Peek(flowrl.Model):
    def __init__(self, name: str, config: dict[str, Any], field: str) -> None:
        super().__init__(name, config)
        self.field = field

    @flowrl.step
    def look(self, batch: flowrl.Batch, iteration: int) -> dict[str, Any]:
        return {self.field: [list(t) for t in batch["text"]]}


async def test_updates_are_seen_after_their_loop_only_and_a_later_loop_builds_on_them():
    first, second = Tag("first", {"batch_size": 2}, 1), Tag("second", {"batch_size": 3}, 2)
    before, beside, after = (
        Peek("before", {}, "seen_before"),
        Peek("beside", {}, "seen_beside"),
        Peek("after", {}, "seen_after"),
    )

    def flow(x):
        a = flowrl.loop(first.add, x, until="done", max_turns=1, name="one")
        b = flowrl.loop(second.add, a, until="done", max_turns=1, name="two")
        return after.look(b), beside.look(before.look(x))

    async with flowrl.open_pipeline(flow, {"backend": "inprocess"}) as pipe:
        out = await pipe.run([{"text": [0]} for _ in range(7)])
    for s in out:
        assert s["seen_after"] == [0, 1, 2] and s["text"] == [0, 1, 2]  # the later loop's update wins
        assert s["seen_before"] == [0] and s["seen_beside"] == [0]  # a branch beside the loops: the input's


class Overwrite(flowrl.Model):
    """Returns ``field`` (as given), and ``done`` unless told not to."""

    def __init__(self, name: str, config: dict[str, Any], field: str, done: Any = True) -> None:
        super().__init__(name, config)
        self.field, self.done = field, done

    @flowrl.step
    def act(self, batch: flowrl.Batch, iteration: int) -> dict[str, Any]:
        out: dict[str, Any] = {self.field: [1] * len(batch)}
        if self.done is not None:
            out["done"] = [self.done] * len(batch)
        return out


@pytest.mark.parametrize(
    "field, done, message",
    [
        ("text", None, r"must return the field flowrl.loop\(until='done'\) names"),
        ("text", "yes", r"'done' \(flowrl.loop\(until=...\)\) must hold one boolean per sample"),
        ("loop_turns", True, r"'loop_turns' is reserved for the loop's record"),
    ],
    ids=["no-until", "until-not-booleans", "reserved"],
)
async def test_a_loop_step_that_breaks_the_rules_fails_naming_its_stage(field, done, message):
    step = Overwrite("step", {}, field, done)

    def flow(x):
        return flowrl.loop(step.act, x, until="done", max_turns=3)

    with pytest.raises(flowrl.OutputError, match=message) as caught:
        async with flowrl.open_pipeline(flow, {"backend": "inprocess"}) as pipe:
            await pipe.run([{"text": [0]}, {"text": [1]}])
    assert caught.value.stage == "step.act"


async def test_a_turn_field_is_not_an_update_and_two_writers_of_it_are_refused():
    player = Player("player", {})
    cheat = Overwrite("cheat", {}, "move")

    def flow(x):
        return flowrl.loop(lambda s: cheat.act(player.act(s)), x, until="done", max_turns=3)

    with pytest.raises(flowrl.OutputError, match=r"returned field 'move', which its input already has"):
        async with flowrl.open_pipeline(flow, {"backend": "inprocess"}) as pipe:
            await pipe.run([{"text": [0], "goal": 1}])


class StuckGame(Game):
    """A game whose call holding sample ``stuck`` in turn 2 never returns, the first ``times``
    times (a marker file per hang counts them); the replica is stopped from outside."""

    def __init__(
        self, name: str, config: dict[str, Any], marks: str, stuck: int, times: int, how: str = "hang"
    ) -> None:
        super().__init__(name, config)
        self.marks, self.stuck, self.times, self.how = marks, stuck, times, how

    @flowrl.step
    def play(self, batch: flowrl.Batch, iteration: int) -> dict[str, Any]:
        ids, moves = batch.ids.tolist(), list(batch["move"])
        if self.stuck in ids and moves[ids.index(self.stuck)] == 2:
            hangs = len(os.listdir(self.marks))
            if hangs < self.times:
                Path(self.marks, f"hang-{hangs}").write_text(str(self.replica_id))
                if self.how == "exit":
                    os._exit(1)
                threading.Event().wait()
        return super().play(batch, iteration)


def _first_marked(marks: Path) -> int:
    """The replica whose call hung first."""
    return int(Path(marks, "hang-0").read_text())


def stuck_flow(marks: str, times: int, replicas: int = 3, on_spent: str = "fail"):
    player = Player("player", {"num_replicas": 2, "batch_size": 3, **CPU})
    game = StuckGame(
        "game",
        {
            "num_replicas": replicas,
            "batch_size": 2,
            "call_timeout_s": 5.0,
            "on_timeout": "retry",
            "on_spent": on_spent,
            **CPU,
        },
        marks,
        stuck=5,
        times=times,
    )
    return lambda x: flowrl.loop(lambda s: game.play(player.act(s)), x, until="done", max_turns=10)


@pytest.mark.parametrize("replicas", [pytest.param(3, marks=pytest.mark.slow), 1])
async def test_a_stuck_environment_call_is_retried_on_a_new_replica_without_stalling_the_others(
    ray_cluster, tmp_path, replicas
):
    n = 14
    async with flowrl.open_pipeline(stuck_flow(str(tmp_path), times=1, replicas=replicas), {}) as pipe:
        out = await pipe.run(games(n))
        stats = pipe.stats()
        events = pipe.scale_events
    assert len(os.listdir(tmp_path)) == 1
    assert [s["text"] for s in out] == [transcript(goal(i)) for i in range(n)]  # nothing lost, nothing twice
    assert stats["game.play"].samples == sum(goal(i) for i in range(n))
    # sent again: the stuck call's samples (and any queued behind it), and the outputs the stuck
    # replica had made that the next turn had not read (stopped with it, computed again)
    stuck = _first_marked(tmp_path)
    made = next(r.samples for r in stats["game.play"].replicas if r.replica == stuck)
    assert 1 <= stats["game.play"].retried <= 4 + made
    # the stuck replica was stopped, and a new one started in its place (it may still be starting
    # when the run ends: the others, or itself once started, did the stuck call's samples)
    grown = [(e.action, e.after) for e in events if e.model == "game"]
    assert stats.serving["game"] in (replicas - 1, replicas) and grown in ([], [("grow", replicas)])
    if replicas == 1:  # no other replica could have run the stuck call's samples: its replacement did
        assert stats.serving["game"] == 1 and grown == [("grow", 1)]
    assert flowrl_actor_names() == []


@pytest.mark.slow  # in .ci/run's slow step: kept out of the default run for its time
async def test_a_sample_that_keeps_getting_stuck_fails_the_run_once_its_retries_are_spent(ray_cluster, tmp_path):
    with pytest.raises(flowrl.ReplicaDiedError, match=r"call_timeout_s=5s.*max_retries=1") as caught:
        async with flowrl.open_pipeline(stuck_flow(str(tmp_path), times=10), {"max_retries": 1}) as pipe:
            await pipe.run(games(8))
    assert 5 in caught.value.sample_ids and caught.value.stage == "game.play"
    assert len(os.listdir(tmp_path)) == 2  # sent once, retried once
    assert flowrl_actor_names() == []


class Tally(flowrl.Model):
    @flowrl.step
    def score(self, batch: flowrl.Batch, iteration: int) -> dict[str, Any]:
        return {"score": [len(t) for t in batch["text"]]}


@pytest.mark.slow  # in .ci/run's slow step: kept out of the default run for its time
async def test_a_sample_that_keeps_getting_stuck_is_dropped_alone_and_the_run_goes_on(ray_cluster, tmp_path):
    """``on_spent="drop"``: the stuck sample leaves with its reason recorded; its shard-mates,
    cut apart from it after the first hang, keep their retries; a stage after the loop waits
    for no dropped sample; the pipeline stays usable."""
    tally = Tally("tally", {"num_replicas": 1, "batch_size": 8, **CPU})
    play = stuck_flow(str(tmp_path), times=10, on_spent="drop")
    n = 8
    async with flowrl.open_pipeline(lambda x: tally.score(play(x)), {"max_retries": 1}) as pipe:
        out = await pipe.run(games(n))
        stats = pipe.stats()
        again = await pipe.run(games(n))  # ids 8-15: none is stuck
    kept = [i for i in range(n) if i != 5]
    assert [s.id for s in out] == kept
    assert [s["text"] for s in out] == [transcript(goal(i)) for i in kept]
    assert [s["score"] for s in out] == [2 * goal(i) for i in kept]
    assert len(os.listdir(tmp_path)) == 2  # sent once, retried once, then dropped
    (dropped,) = stats.dropped
    assert (dropped.sample, dropped.stage, dropped.turn) == (5, "game.play", 2)
    assert "call_timeout_s=5s" in dropped.reason and "retried 1 times" in dropped.reason
    assert stats["game.play"].dropped == 1 and stats["player.act"].dropped == 0
    assert stats["tally.score"].samples == n - 1
    assert stats["game.play"].samples == sum(goal(i) for i in kept) + 1  # sample 5's first turn
    assert [s["text"] for s in again] == [transcript(goal(i)) for i in range(n)]
    assert flowrl_actor_names() == []


async def test_a_replica_that_dies_mid_turn_loses_no_turn_and_runs_none_twice(ray_cluster, tmp_path):
    player = Player("player", {"num_replicas": 2, "batch_size": 3, **CPU})
    game = StuckGame("game", {"num_replicas": 3, "batch_size": 2, **CPU}, str(tmp_path), stuck=5, times=1, how="exit")
    n = 14
    async with flowrl.open_pipeline(
        lambda x: flowrl.loop(lambda s: game.play(player.act(s)), x, until="done", max_turns=10), {}
    ) as pipe:
        out = await pipe.run(games(n))
        stats = pipe.stats()
    assert len(os.listdir(tmp_path)) == 1
    assert [s["text"] for s in out] == [transcript(goal(i)) for i in range(n)]
    assert [s["loop_turns"] for s in out] == [goal(i) for i in range(n)]
    assert stats["game.play"].samples == sum(goal(i) for i in range(n)) and stats["game.play"].retried >= 1
    assert stats.serving["game"] == 2
    assert flowrl_actor_names() == []


class Counter(flowrl.Model):
    @flowrl.step
    def act(self, batch: flowrl.Batch, iteration: int) -> dict[str, Any]:
        return {"move": [h + 1 for h in batch["hits"]]}

    @flowrl.step
    def score(self, batch: flowrl.Batch, iteration: int) -> dict[str, Any]:
        return {"hits": list(batch["move"]), "done": [m >= 3 for m in batch["move"]]}


async def test_a_field_of_the_last_turn_is_not_there_and_the_error_says_how_to_carry_it():
    count = Counter("count", {})

    def flow(x):
        return flowrl.loop(lambda s: count.score(count.act(s)), x, until="done", max_turns=5)

    with pytest.raises(flowrl.StageError, match=r"field 'hits' is not in this batch.*lasts one turn.*starting value"):
        async with flowrl.open_pipeline(flow, {"backend": "inprocess"}) as pipe:
            await pipe.run([{"x": 0}])
    async with flowrl.open_pipeline(flow, {"backend": "inprocess"}) as pipe:  # with a starting value: a state field
        out = await pipe.run([{"x": 0, "hits": 0}])
    assert (out[0]["hits"], out[0]["loop_turns"]) == (3, 3)


class Step(flowrl.Model):
    """A step by its ``kind``: ``a`` adds a turn-local field; ``b`` updates the state's ``n``;
    ``c`` reads ``n`` beside ``b`` (and records it) after a short pause; ``d`` ends the turn."""

    def __init__(self, name: str, config: dict[str, Any], kind: str) -> None:
        super().__init__(name, config)
        self.kind = kind

    @flowrl.step
    def run(self, batch: flowrl.Batch, iteration: int) -> dict[str, Any]:
        if self.kind == "a":
            return {"a_len": [len(t) for t in batch["text"]]}
        if self.kind == "b":
            return {"n": [x + 1 for x in batch["n"]]}
        if self.kind == "c":
            time.sleep(0.01)  # b usually finishes first: its update must still not be seen here
            return {"c_n": [[len(t), int(n)] for t, n in zip(batch["text"], batch["n"], strict=True)]}
        out = [[*t, 0] for t in batch["text"]]
        return {"text": out, "c_seen": [list(c) for c in batch["c_n"]], "done": [len(t) >= 3 for t in out]}


@pytest.mark.parametrize("threads", [False, True])
async def test_a_step_beside_an_update_reads_the_state_its_turn_began_with(threads):
    a, b, c, d = (Step(k, {"batch_size": 1 if k in "ab" else 4}, k) for k in "abcd")

    def body(s):
        x = a.run(s)
        return d.run(b.run(x), c.run(s, x))

    async with flowrl.open_pipeline(
        lambda x: flowrl.loop(body, x, until="done", max_turns=5),
        {"backend": "inprocess", "inprocess_threads": threads},
    ) as pipe:
        out = await pipe.run([{"text": [], "n": 0} for _ in range(6)])
    for s in out:
        assert s["n"] == 3 and s["loop_turns"] == 3  # b's three updates
        turn, n = s["c_seen"]  # c of the last turn: n as that turn began, not b's update beside it
        assert n == turn == 2


async def test_a_stage_reading_an_earlier_loop_sees_its_value_not_a_later_loops():
    first, second = Tag("first", {"batch_size": 2}, 1), Tag("second", {"batch_size": 3}, 2)
    side = Peek("side", {}, "seen_side")

    def flow(x):
        a = flowrl.loop(first.add, x, until="done", max_turns=1, name="one")
        b = flowrl.loop(second.add, a, until="done", max_turns=1, name="two")
        return b, side.look(a)

    async with flowrl.open_pipeline(flow, {"backend": "inprocess"}) as pipe:
        out = await pipe.run([{"text": [0]} for _ in range(5)])
    assert [(s["seen_side"], s["text"]) for s in out] == [([0, 1], [0, 1, 2])] * 5


class Synced(flowrl.Model):
    """Writes one token a call, its weights' version (as a synced model's replica records it)."""

    def __init__(self, name: str, config: dict[str, Any], until: str, length: int) -> None:
        super().__init__(name, config)
        self.until, self.length = until, length
        self.track_version = True

    @flowrl.step
    def gen(self, batch: flowrl.Batch, iteration: int) -> dict[str, Any]:
        out = [[*r, self.weight_version] for r in batch["response"]]
        return {"response": out, self.until: [len(r) >= self.length for r in out]}

    @flowrl.step
    def more(self, batch: flowrl.Batch, iteration: int) -> dict[str, Any]:
        """A second step of the same model: two more tokens."""
        out = [[*r, self.weight_version] for r in batch["response"]]
        return {"response": out, "more_done": [len(r) >= self.length + 2 for r in out]}


async def test_segment_versions_add_up_over_two_loops():
    one = Synced("policy", {"batch_size": 2}, "finished", 4)

    def flow(x):
        a = flowrl.loop(one.gen, x, until="finished", max_turns=9, name="one")
        return flowrl.loop(one.more, a, until="more_done", max_turns=9, name="two")

    async with flowrl.open_pipeline(flow, {"backend": "inprocess"}) as pipe:
        out = await pipe.run([{"response": []} for _ in range(3)])
    for s in out:
        assert (s["one_turns"], s["two_turns"]) == (4, 2)
        assert s["policy_versions"] == [0] * 6  # every segment of both loops, each once


async def test_an_update_with_the_wrong_row_count_is_named_as_such():
    class Wrong(flowrl.Model):
        @flowrl.step
        def run(self, batch: flowrl.Batch, iteration: int) -> dict[str, Any]:
            return {"text": [[1]] * (len(batch) + 1), "done": [True] * len(batch)}

    wrong = Wrong("wrong", {"batch_size": 3})
    with pytest.raises(flowrl.OutputError, match=r"field 'text' must have 3 rows .* got 4 rows"):
        async with flowrl.open_pipeline(
            lambda x: flowrl.loop(wrong.run, x, until="done", max_turns=2), {"backend": "inprocess"}
        ) as pipe:
            await pipe.run([{"text": []} for _ in range(3)])
