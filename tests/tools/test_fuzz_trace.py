"""Fuzzing the trace reader and `flowrl trace` (hypothesis, the "ci" profile of conftest.py; FLOWRL_FUZZ=long
for 20,000 cases a test): a file is read into spans that `flowrl trace` summarises (exit 0), or refused
with one line and exit 2; never another exception or a hang. A trace written by chrome_trace reads
back to its spans."""

from __future__ import annotations

import contextlib
import io
import json
import math

import pytest
from hypothesis import given
from hypothesis import strategies as st

from flowrl._core.errors import ConfigError
from flowrl._core.observe.trace import Span, chrome_trace, read_chrome_trace, read_trace_file
from flowrl._tools.cli import main

NAMES = st.text(st.characters(codec="utf-8", exclude_categories=["Cs"]), max_size=12)
SPANS = st.lists(
    st.builds(
        Span,
        group=st.sampled_from(["engine", "policy", "reward", "ppo_policy"]),
        lane=st.integers(0, 7),
        name=NAMES,
        start=st.floats(1.7e9, 1.7e9 + 3600),
        end=st.floats(1.7e9, 1.7e9 + 3600),
        args=st.fixed_dictionaries({}, optional={"samples": st.integers(0, 1024), "ids": st.lists(st.integers(0, 99))}),
    ),
    max_size=12,
)
JSON = st.recursive(
    st.none() | st.booleans() | st.integers() | st.floats(allow_nan=False) | NAMES,
    lambda inner: st.lists(inner, max_size=4) | st.dictionaries(NAMES, inner, max_size=4),
    max_leaves=30,
)
# an event with the keys of a real one, each an odd value at times
ODD = (
    st.none() | st.booleans() | st.integers(-(2**70), 2**70) | st.floats() | NAMES | st.lists(st.integers(), max_size=2)
)
EVENT = st.fixed_dictionaries(
    {"ph": st.sampled_from(["M", "X", "B", "i"]) | ODD},
    optional={
        "name": st.sampled_from(["process_name", "thread_name", "rollout"]) | ODD,
        "pid": st.integers(0, 3) | ODD,
        "tid": st.integers(0, 3) | ODD,
        "ts": st.floats(0, 1e7) | ODD,
        "dur": st.floats(0, 1e7) | ODD,
        "args": st.fixed_dictionaries({}, optional={"name": NAMES | ODD, "samples": st.integers(0, 9) | ODD}) | ODD,
    },
)
TOKENS = [
    b"{",
    b"}",
    b"[",
    b"]",
    b",",
    b":",
    b'"',
    b"\\",
    b"-",
    b"1e999",
    b"NaN",
    b"Infinity",
    b"null",
    b"\xff",
    b"\x00",
]


def run_trace(path) -> int:
    """`flowrl trace PATH --no-png` in process: its exit code; a FlowError shows as one line on stderr."""
    out, err = io.StringIO(), io.StringIO()
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
        code = main(["trace", str(path), "--no-png"])
    if code == 2:
        lines = err.getvalue().splitlines()
        assert len(lines) == 1 and lines[0].startswith(f"flowrl trace: ConfigError: {path}"), err.getvalue()
    else:
        assert code == 0 and err.getvalue() == "", err.getvalue()
    return code


@pytest.fixture(scope="module")
def folder(tmp_path_factory):
    return tmp_path_factory.mktemp("fuzz_trace")


@given(spans=SPANS)
def test_a_written_trace_reads_back_to_its_spans(folder, spans):
    path = folder / "trace.json"
    path.write_text(json.dumps(chrome_trace(spans)))
    back = sorted(read_trace_file(path), key=lambda s: (s.start, s.group, s.lane, s.name))
    wanted = sorted(spans, key=lambda s: (s.start, s.group, s.lane, s.name))
    assert len(back) == len(wanted)
    for got, span in zip(back, wanted, strict=True):
        assert (got.group, got.lane, got.name, got.args) == (span.group, span.lane, span.name, span.args)
        # microseconds rounded to 3 decimals, relative to the first start: a nanosecond, plus float error
        assert math.isclose(got.start, span.start, abs_tol=1e-6)
        assert math.isclose(got.end, max(span.end, span.start), abs_tol=1e-6)
    assert run_trace(path) == 0


@given(spans=SPANS, edits=st.lists(st.tuples(st.integers(0, 2), st.floats(0, 1), st.sampled_from(TOKENS)), max_size=6))
def test_a_mutated_trace_reads_or_is_refused_in_one_line(folder, spans, edits):
    data = bytearray(json.dumps(chrome_trace(spans)).encode())
    for op, where, piece in edits:
        at = int(where * len(data))
        if op == 0:
            del data[at : at + len(piece)]
        elif op == 1:
            data[at:at] = piece
        else:
            data[at : at + 1] = piece[:1]
    path = folder / "trace.json"
    path.write_bytes(bytes(data))
    run_trace(path)


@given(events=st.lists(EVENT, max_size=8), other=st.none() | JSON)
def test_events_with_odd_fields_read_or_are_refused(folder, events, other):
    trace = {"traceEvents": events} if other is None else {"traceEvents": events, "otherData": other}
    path = folder / "trace.json"
    path.write_text(json.dumps(trace))  # NaN and Infinity as JS writes them: not JSON, refused too
    run_trace(path)
    try:
        read_chrome_trace(trace)
    except ConfigError:
        pass


@given(value=JSON)
def test_random_json_reads_or_is_refused(folder, value):
    path = folder / "trace.json"
    path.write_text(json.dumps(value))
    run_trace(path)
