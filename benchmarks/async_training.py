"""Synchronous against one-step-off-policy training: time per episode of the RL engine.

Each load-test scenario (``flowrl/_tools/loadtest.py``) is an episode's rollout: the same sleeping
stages, its policy stage fed weights by a trainer whose one step per episode sleeps
``train_s`` (standing in for GPU training). Synchronous training (``staleness.max=0``) runs
rollout, then training and sync, so an episode takes their sum; with ``staleness.max`` k > 0
the next rollout runs while an episode trains, so it should take about the longer of the two.

Per scenario, one engine per mode (sync, k=1, k=2) stays open (starting ~30 actors takes
20-30 s on 2 cores) and each ``learn()`` of ``--episodes`` episodes is one measurement, the
modes interleaved so noise hits them alike. The sync engine's first ``learn()``, without
training, measures the rollout time; ``train_s`` is that times each ``--train-ratio``. Time
per episode is steady state: from the end of a ``learn()``'s first training step to the end
of its last, over ``episodes - 1`` (each interval holds one step, one weight sync and the wait
for a rollout). Reported: medians over ``--repeats`` of that, of the per-episode median time
training waited for the rollout (``wait_s``) and of the mean weight sync (``sync_s``); and the
staleness of the trained samples (versions behind -> samples, summed over episodes and
repeats). Episode 0 is left out of all but the staleness.

    python benchmarks/async_training.py                  # chatlearn-209 and heavy-tail-256
    python benchmarks/async_training.py --repeats 1 --scenario chatlearn-209 --out async.json
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import statistics
import sys
import time
from collections import Counter
from typing import Any

import numpy as np
import ray

import flowrl
from flowrl._sim.simulate import INPUT, Workload, tails
from flowrl._tools.loadtest_report import markdown_table
from flowrl._tools.scenarios import Sleeper, scenarios

MODES = {"sync": 0, "k=1": 1, "k=2": 2}
CPU = 0.05  # logical CPUs per replica: sleeping actors must not wait for Ray's CPU slots


class Stage(Sleeper):
    """A workload stage that sleeps its nominal time. ``Sleeper`` sleeps less by the lateness
    ``sleep_slack`` measures in each replica at setup; replicas set up while ~90 actors start
    on 2 cores measure anything from 0 to 10% (its cap), a bias that differs from engine to
    engine and that interleaving cannot even out. Nominal sleeps keep the OS's lateness for all."""

    def setup(self) -> None:
        pass

    def forward_step(self, batch: flowrl.Batch, iteration: int) -> dict[str, Any]:
        k = np.asarray(batch["k"], dtype=np.int64)
        time.sleep(self.cost.call_s + len(k) * self.cost.per_sample_s + float(self.tail[k].max()))
        return {f"{self.name}_done": [True] * len(k)}


class Policy(Stage):
    """The policy stage, which takes weights from the trainer (it keeps only their step)."""

    step = 0

    def get_weights(self) -> dict[str, Any]:
        return {"step": np.array([self.step])}

    def set_weights(self, weights: Any) -> None:
        self.step = int(weights["step"][0])


class Trainer(flowrl.Model):
    """One step per episode that sleeps as a GPU would train: the seconds ride in the samples'
    ``step_s`` field, so one engine serves every setting."""

    def setup(self) -> None:
        self.steps = 0

    def train_step(self, batch: flowrl.Batch, iteration: int) -> dict[str, Any]:
        time.sleep(float(batch["step_s"][0]))
        self.steps += 1
        return {"samples": len(batch)}

    def get_weights(self) -> dict[str, Any]:
        return {"step": np.array([self.steps]), "bias": np.zeros(4, dtype=np.float32)}


def make_engine(w: Workload, k: int, episodes: int) -> flowrl.Engine:
    """The scenario's stages as the rollout (as ``workload_flow``, the policy a ``Policy``)."""
    tail = tails(w)
    models = {
        st.name: (Policy if st.name == "policy" else Stage)(
            st.name,
            {
                "num_replicas": st.replicas,
                "batch_size": st.batch_size,
                "splitter": st.splitter,
                "prefetch": st.prefetch,
                "cpus_per_replica": CPU,
            },
            st.cost,
            tail[st.name],
        )
        for st in w.stages
    }
    trainer = Trainer("trainer", {"num_replicas": 1, "cpus_per_replica": CPU})

    def flow(x: Any) -> Any:
        nodes = {INPUT: x}
        for st in w.stages:
            nodes[st.name] = models[st.name].forward_step(*[nodes[i] for i in st.inputs])
        return tuple(nodes[st.name] for st in w.stages if not any(st.name in o.inputs for o in w.stages))

    config = {"sample_per_episode": w.samples, "num_episode": episodes, "staleness": {"max": k}, "progress": "off"}
    return flowrl.Engine(rollout=flow, train=[trainer], sync=[(trainer, models["policy"])], config=config)


def learn(engine: flowrl.Engine, w: Workload, train_s: float) -> dict[str, Any]:
    """One ``learn()`` of an open engine: steady time per episode, waits, staleness."""
    engine.set_dataset([{"k": i, "step_s": train_s} for i in range(w.samples)])  # each episode: all, in order
    done = len(engine.stats().episodes)
    episodes = engine.learn().episodes[done:]
    ends = sorted(
        s.end
        for s in engine.spans()
        if s.group == "engine" and s.name == "train" and s.args["episode"] >= episodes[0].episode
    )
    staleness: Counter[int] = Counter()
    for e in episodes:
        staleness.update(e.staleness.get("policy", {}))
    return {
        "episode_s": (ends[-1] - ends[0]) / (len(ends) - 1),
        **{key: statistics.median(getattr(e, key) for e in episodes[1:]) for key in ("rollout_s", "train_s", "wait_s")},
        "sync_s": statistics.mean(e.sync_s for e in episodes[1:]),  # a few long ones count: the mean
        "staleness": dict(sorted(staleness.items())),
    }


def scenario_rows(name: str, w: Workload, ratios: list[float], episodes: int, repeats: int) -> list[dict[str, Any]]:
    """The three modes' engines open side by side; each ``learn()`` is one measurement."""
    with contextlib.ExitStack() as stack:
        engines = {mode: stack.enter_context(make_engine(w, k, episodes)) for mode, k in MODES.items()}
        rollout_s = learn(engines["sync"], w, 0.0)["rollout_s"]  # calibration: the rollout alone
        print(f"{name}: rollout {rollout_s:.3f} s", flush=True)
        rows = []
        for ratio in ratios:
            train_s = round(ratio * rollout_s, 3)
            runs: dict[str, list[dict[str, Any]]] = {m: [] for m in MODES}
            for _ in range(repeats):  # interleaved: noise hits every mode alike
                for mode, engine in engines.items():
                    runs[mode].append(learn(engine, w, train_s))
                    print(name, train_s, mode, json.dumps(runs[mode][-1]), flush=True)
            row: dict[str, Any] = {
                "scenario": name,
                "train_s": train_s,
                "calibrated_rollout_s": rollout_s,
                "runs": runs,
            }
            for mode in MODES:
                for key in ("episode_s", "rollout_s", "wait_s", "sync_s"):
                    row[f"{mode} {key}"] = statistics.median(r[key] for r in runs[mode])
                total: Counter[int] = Counter()
                for r in runs[mode]:
                    total.update(r["staleness"])
                row[f"{mode} staleness"] = dict(sorted(total.items()))
            rows.append(row)
    return rows


def table(rows: list[dict[str, Any]]) -> str:
    def each(r: dict[str, Any], key: str) -> str:
        return " / ".join(f"{r[f'{m} {key}']:.2f}" for m in MODES)

    return markdown_table(
        [
            "scenario",
            "rollout s",
            "train s",
            "s/episode: sync / k=1 / k=2",
            "sync/k=1",
            "sync/k=2",
            "wait s: sync / k=1 / k=2",
            "weight sync s (mean): sync / k=1 / k=2",
            "staleness k=1",
            "staleness k=2",
        ],
        [
            [
                r["scenario"],
                f"{r['sync rollout_s']:.2f}",
                f"{r['train_s']:.2f}",
                each(r, "episode_s"),
                f"{r['sync episode_s'] / r['k=1 episode_s']:.2f}",
                f"{r['sync episode_s'] / r['k=2 episode_s']:.2f}",
                each(r, "wait_s"),
                each(r, "sync_s"),
                str(r["k=1 staleness"]),
                str(r["k=2 staleness"]),
            ]
            for r in rows
        ],
    )


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description="synchronous against one-step-off-policy training, time per episode")
    parser.add_argument("--scenario", action="append", help="default: chatlearn-209 and heavy-tail-256")
    parser.add_argument("--train-ratio", type=float, action="append", help="train_s / rollout_s (default: 1 and 0.5)")
    parser.add_argument("--episodes", type=int, default=6, help="per learn(): one measurement")
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--out", help="also write the rows as JSON here")
    args = parser.parse_args(argv)
    names = args.scenario or ["chatlearn-209", "heavy-tail-256"]
    known = scenarios()
    unknown = sorted(set(names) - set(known))
    if unknown:
        parser.error(f"unknown scenario(s) {unknown}; expected some of {sorted(known)}")
    if args.episodes < 2:
        parser.error("--episodes must be at least 2 (the first is left out of the timing)")
    started = time.perf_counter()
    ray.init(num_cpus=16, include_dashboard=False, log_to_driver=False)
    try:
        ratios = args.train_ratio or [1.0, 0.5]
        rows = [row for name in names for row in scenario_rows(name, known[name], ratios, args.episodes, args.repeats)]
    finally:
        ray.shutdown()
    command = " ".join(["python benchmarks/async_training.py", *(argv if argv is not None else sys.argv[1:])])
    print(f"\n`{command}` ({os.cpu_count()} cores, {time.perf_counter() - started:.0f} s)\n\n" + table(rows))
    if args.out:
        with open(args.out, "w") as f:
            json.dump({"command": command, "cores": os.cpu_count(), "rows": rows}, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
