"""`flowrl trace`: the summary of a run's timeline and its chart (a colour per model, resize
lines, startup), and what is missing."""

from __future__ import annotations

import itertools
import json

import matplotlib.colors as mc
import numpy as np
import pytest
from _traces import assert_trace_event_format, run_spans, scale_event

import flowrl
from flowrl._core.observe.trace import Span
from flowrl._tools.timeline_view import PALETTE, PHASE_COLOURS, draw_timeline, format_summary, model_colours, summary
from flowrl.testing import CountingTrainer, Scale

CPU = {"cpus_per_replica": 0.1}


def test_flowrl_trace_prints_a_summary_and_draws_the_chart(ray_cluster, tmp_path, capsys):
    from flowrl._tools.cli import main

    policy = Scale("policy", {"num_replicas": 2, "batch_size": 2, **CPU}, srcs=["x"], dst="y", sleep_s=0.002)
    trainer = CountingTrainer("trainer", {"num_replicas": 1, **CPU})
    engine = flowrl.Engine(
        rollout=lambda x: policy.forward_step(x),
        train=[trainer],
        config={"sample_per_episode": 8, "num_episode": 2, "run_dir": str(tmp_path)},
    )
    engine.set_dataset([{"x": np.full(1, float(i))} for i in range(16)])
    stats = engine.learn()
    assert main(["trace", str(tmp_path)]) == 0
    out = capsys.readouterr().out.splitlines()
    rows = {line.split()[0]: line.split() for line in out[3:] if line.strip() and not line.startswith("chart")}
    assert set(rows) == {"startup", "engine", "policy", "trainer"}
    assert rows["startup"][1:4] == ["1", "1", "0"]  # the engine's span before its first episode: a row
    assert rows["policy"][1:4] == ["2", str(stats.rollout["policy.forward_step"].calls), "16"]  # lanes, spans, samples
    assert rows["trainer"][1:4] == ["1", "2", "16"] and rows["engine"][2] == "4"  # 2 x (rollout, train)
    png = tmp_path / "timeline.png"
    assert out[-1] == f"chart: {png}" and png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert_trace_event_format(json.loads((tmp_path / "trace.json").read_text()))  # Perfetto reads it


def test_flowrl_trace_names_what_is_missing(tmp_path, capsys):
    from flowrl._tools.cli import main

    assert main(["trace", str(tmp_path)]) == 2
    assert f"no trace at {tmp_path / 'trace.json'}" in capsys.readouterr().err
    (tmp_path / "trace.json").write_text('{"not": "a trace"}')
    assert main(["trace", str(tmp_path), "--no-png"]) == 2
    assert "is not a flowrl trace: Object missing required field `traceEvents`" in capsys.readouterr().err


def test_a_chart_of_more_rows_than_a_png_holds_is_refused_in_one_line_and_the_summary_still_prints(tmp_path, capsys):
    from flowrl._core.observe.trace import Span, chrome_trace, write_json
    from flowrl._tools.cli import main
    from flowrl._tools.timeline_view import MAX_CHART_ROWS

    spans = [Span(group="policy", lane=i, name="forward_step", start=0.0, end=1.0) for i in range(MAX_CHART_ROWS + 1)]
    write_json(tmp_path / "trace.json", chrome_trace(spans))
    assert main(["trace", str(tmp_path)]) == 2
    captured = capsys.readouterr()
    assert f"{MAX_CHART_ROWS + 1} rows" in captured.err and len(captured.err.strip().splitlines()) == 1
    assert "policy" in captured.out  # the summary came first
    assert not (tmp_path / "timeline.png").exists()
    assert main(["trace", str(tmp_path), "--no-png"]) == 0


def _bars(fig) -> dict[str, str]:
    """gid -> face colour (hex) of the bar collections of the chart's last (or only) panel."""
    ax = fig.axes[-1]
    return {c.get_gid(): mc.to_hex(c.get_facecolor()[0]) for c in ax.collections if c.get_gid().startswith("bars:")}


def _picture(models: list[str], eval_models: list[str] = ()) -> dict[str, str]:
    """The colour each group's bars get in a chart of ``models`` (in this order) and evaluation pools."""
    import matplotlib.pyplot as plt

    spans = [Span(group="engine", lane=0, name="rollout", start=0.0, end=1.0)]
    for i, group in enumerate([*models, *(f"eval:{m}" for m in eval_models)]):
        spans.append(Span(group=group, lane=0, name=f"{group.split(':')[-1]}.step", start=i * 0.01, end=0.5))
    fig = draw_timeline(spans)
    try:
        return {gid.split(":", 1)[1].rsplit("[", 1)[0]: colour for gid, colour in _bars(fig).items()}
    finally:
        plt.close(fig)


def test_a_model_keeps_its_colour_whatever_the_other_models_and_their_order_and_in_its_eval_pool():
    first = _picture(["policy", "reference", "reward", "policy_trainer"], eval_models=["policy"])
    second = _picture(["value", "critic", "policy", "judge", "policy_trainer"])
    third = _picture(["policy_trainer", "policy"])
    for model in ("policy", "policy_trainer"):
        assert first[model] == second[model] == third[model]
    assert first["eval:policy"] == first["policy"]  # the same model in its evaluation pool
    assert first["engine"] == second["engine"] == PHASE_COLOURS["rollout"]
    # the colour its name hashes to, as when drawn alone (reward moves off reference's red: next test)
    assert all(model_colours([m])[m] == first[m] for m in ("policy", "reference", "policy_trainer"))


def test_colours_within_a_picture_are_distinct_also_for_names_that_hash_alike():
    # "b" and "trainer" hash to the same colour on their own; together, the later name moves on
    assert model_colours(["b"])["b"] == model_colours(["trainer"])["trainer"]
    together = _picture(["trainer", "a", "b"])
    assert len({together[m] for m in ("a", "b", "trainer")}) == 3
    assert together == _picture(["b", "trainer", "a"])  # the same set gives the same picture
    many = model_colours([f"model_{i}" for i in range(len(PALETTE))])
    assert len(set(many.values())) == len(PALETTE)  # every palette colour once
    assert not set(many.values()) & set(PHASE_COLOURS.values())  # a model never wears a phase's colour


def _lab(colour: str) -> np.ndarray:
    """CIELAB (D65) of an sRGB colour: distances there follow perceived differences."""
    rgb = np.array(mc.to_rgb(colour))
    linear = np.where(rgb > 0.04045, ((rgb + 0.055) / 1.055) ** 2.4, rgb / 12.92)
    xyz = np.array([[0.4124, 0.3576, 0.1805], [0.2126, 0.7152, 0.0722], [0.0193, 0.1192, 0.9505]]) @ linear
    xyz /= np.array([0.95047, 1.0, 1.08883])
    f = np.where(xyz > 0.008856, np.cbrt(xyz), 7.787 * xyz + 16 / 116)
    return np.array([116 * f[1] - 16, 500 * (f[0] - f[1]), 200 * (f[1] - f[2])])


def _closest(colours) -> float:
    colours = list(colours)
    return min(np.linalg.norm(_lab(a) - _lab(b)) for i, a in enumerate(colours) for b in colours[i + 1 :])


def test_every_two_colours_are_far_apart_in_perceived_colour_and_a_pictures_models_farther():
    """CIE 1976 distances (2.3 is just noticeable): any two colours, models' and phases', are over
    20 apart; the models of a picture of up to six are 45 apart (a red never beside a salmon)."""
    colours = [*PALETTE, *PHASE_COLOURS.values()]
    assert len(set(colours)) == len(colours) == 21
    assert _closest(colours) > 20
    rlhf = ["policy", "reference", "value", "reward", "policy_trainer", "value_trainer"]
    for names in (rlhf, ["policy", "reference", "value", "reward"], [f"model_{i}" for i in range(6)]):
        assert _closest(model_colours(names).values()) >= 45, names
    # why six: any five palette colours 45 apart leave a sixth 45 from each (so probing finds it)
    lab = [_lab(c) for c in PALETTE]
    far = [[np.linalg.norm(a - b) >= 45 for b in lab] for a in lab]
    for k in range(1, 6):
        for held in itertools.combinations(range(len(PALETTE)), k):
            if all(far[a][b] for a, b in itertools.combinations(held, 2)):
                assert any(all(far[s][t] for t in held) for s in range(len(PALETTE)) if s not in held), held
    # on their own, "reference" and "reward" hash to a red and a salmon (32 apart): together, reward moves
    near = model_colours(["reference"])["reference"], model_colours(["reward"])["reward"]
    assert np.linalg.norm(_lab(near[0]) - _lab(near[1])) < 45
    assert model_colours(["reference", "reward"])["reward"] != near[1]


def test_scale_events_are_labelled_dashed_lines_across_every_row_above_the_bars():
    import matplotlib.pyplot as plt

    spans = run_spans()  # origin 100 s; policy grown 1 -> 2 at 105 s, shrunk 2 -> 1 at 107.5 s
    spans += [scale_event("value", 106.0, 3, 4), scale_event("reward", 105.0, 2, 1)]  # with policy's: one label
    fig = draw_timeline(spans)
    try:
        startup, ax = fig.axes  # the resizes are after startup: all in the episodes' panel
        assert not [line for line in startup.get_lines() if (line.get_gid() or "").startswith("scale:")]
        lines = [line for line in ax.get_lines() if (line.get_gid() or "").startswith("scale:")]
        assert [(line.get_gid(), list(line.get_xdata())) for line in lines] == [
            ("scale:grow policy", [5.0, 5.0]),
            ("scale:shrink reward", [5.0, 5.0]),
            ("scale:grow value", [6.0, 6.0]),
            ("scale:shrink policy", [7.5, 7.5]),
        ]
        assert all(list(line.get_ydata()) == [0, 1] for line in lines)  # the axes' full height: every row
        assert all(line.get_linestyle() == "--" and line.get_visible() for line in lines)
        bars = [c for c in ax.collections if c.get_gid().startswith("bars:")]
        assert min(line.get_zorder() for line in lines) > max(c.get_zorder() for c in bars)
        labels = [t for t in ax.texts if (t.get_gid() or "").startswith("scale-label:")]
        assert [(t.get_position()[0], t.get_text().strip()) for t in labels] == [
            (5.0, "grow policy 1→2; shrink reward 2→1"),  # at one time: one label, not two on top of each other
            (6.0, "grow value 3→4"),
            (7.5, "shrink policy 2→1"),
        ]
        assert min(t.get_zorder() for t in labels) > max(c.get_zorder() for c in bars)
        assert "resize" in [t.get_text() for t in fig.legends[0].get_texts()]
        assert "autoscale[0]" not in [t.get_text() for t in startup.get_yticklabels()]  # a line, not a row
    finally:
        plt.close(fig)


def test_startup_is_a_row_of_the_summary_and_busy_is_measured_after_it():
    spans = run_spans()  # startup from 100 s to 104 s, episodes until 108 s
    rows = {r["group"]: r for r in summary(spans)}
    assert list(rows)[:2] == ["startup", "engine"]
    assert rows["startup"] == {"group": "startup", "lanes": 1, "spans": 1, "samples": 0, "busy_s": 4.0, "busy": 0.5}
    assert rows["engine"]["spans"] == 4 and rows["engine"]["busy_s"] == pytest.approx(4.75)  # phases only
    assert rows["trainer"]["busy"] == 0.2  # 0.8 s of the 4 s after startup (not of all 8 s)
    assert rows["autoscale"]["spans"] == 2
    head = format_summary(list(rows.values()), 8.0).splitlines()[0]
    assert head.startswith(
        "timeline of 8.00 s: startup 4.00 s, then 4.00 s of episodes; busy = busy seconds / (lanes x 4.00 s)"
    )
    no_startup = [s for s in spans if s.name != "startup"]
    assert summary(no_startup)[0]["group"] == "engine"
    assert format_summary(summary(no_startup), 4.0).startswith(
        "timeline of 4.00 s; busy = busy seconds / (lanes x 4.00 s)"
    )


def test_startup_is_a_phase_of_its_own_in_the_chart_with_a_panel_of_its_own_when_it_is_long():
    import matplotlib.pyplot as plt

    spans = run_spans()  # a startup of 4 s in a timeline of 8 s: more than a third
    fig = draw_timeline(spans)
    try:
        startup, episodes = fig.axes
        assert startup.get_xlim() == (0.0, 4.0) and episodes.get_xlim() == (4.0, 8.0)
        drawn = {c.get_gid(): mc.to_hex(c.get_facecolor()[0]) for c in startup.collections}
        assert drawn["bars:engine[0]:startup"] == PHASE_COLOURS["startup"]
        bars = _bars(fig)
        assert bars["bars:engine[0]:rollout"] == bars["bars:engine[1]:rollout"] == PHASE_COLOURS["rollout"]
        legend = [t.get_text() for t in fig.legends[0].get_texts()]
        assert legend == ["policy", "trainer", "startup", "rollout", "train", "sync", "resize"]
        rows = [t.get_text() for t in startup.get_yticklabels()]  # bottom up
        assert rows[::-1] == ["phases", "phases[1]", "phases[2]", "policy[0]", "policy[1]", "trainer[0]"]
    finally:
        plt.close(fig)
    short = [Span(group="engine", lane=0, name="startup", start=100.0, end=101.0), *spans[1:]]  # 1 s of 8
    fig = draw_timeline(short)
    try:
        (ax,) = fig.axes  # one panel: startup drawn in line with the episodes
        assert ax.get_xlim() == (0.0, 8.0)
        assert _bars(fig)["bars:engine[0]:startup"] == PHASE_COLOURS["startup"]
    finally:
        plt.close(fig)


def test_the_stages_of_one_model_share_its_colour_and_differ_by_hatch():
    import matplotlib.pyplot as plt

    spans = [
        Span(group="policy", lane=0, name="policy.generate", start=0.0, end=1.0),
        Span(group="policy", lane=0, name="policy.forward_step", start=1.0, end=1.5),
        Span(group="reward", lane=0, name="reward.forward_step", start=1.5, end=2.0),
    ]
    fig = draw_timeline(spans)
    try:
        bars = {c.get_gid(): c for c in fig.axes[-1].collections}
        generate, forward = bars["bars:policy[0]:policy.generate"], bars["bars:policy[0]:policy.forward_step"]
        assert mc.to_hex(generate.get_facecolor()[0]) == mc.to_hex(forward.get_facecolor()[0])
        assert (forward.get_hatch(), generate.get_hatch()) == ("", "//")  # in name order: forward_step plain
        assert bars["bars:reward[0]:reward.forward_step"].get_hatch() == ""  # a model of one stage: plain
        legend = [t.get_text() for t in fig.legends[0].get_texts()]
        assert legend == ["policy: forward_step", "policy: generate", "reward"]
    finally:
        plt.close(fig)
