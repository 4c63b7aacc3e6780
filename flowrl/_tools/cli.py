"""The ``flowrl`` command."""

from __future__ import annotations

import argparse
import contextlib
import importlib.metadata
import importlib.util
import os
import sys
from pathlib import Path
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from .run_file import RunFile

INTERRUPTED = 130  # 128 + SIGINT, as a shell reports a command Ctrl-C stopped
CHECKPOINTS = "checkpoints"  # in the run folder, where a run file turns checkpoints on but names no folder


def version() -> str:
    """The installed distribution's version (a checkout that was never installed has none)."""
    try:
        return importlib.metadata.version("flowrl")
    except importlib.metadata.PackageNotFoundError:
        return "unknown (not installed: pip install .)"


def main(argv: list[str] | None = None) -> int:
    try:
        return _main(argv)
    except KeyboardInterrupt:  # Ctrl-C: the engine has said where it stopped; no traceback
        return INTERRUPTED
    except BrokenPipeError:  # `flowrl trace RUN | head`: the reader left; Python's advice, so exit says nothing
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
        return 1


def _main(argv: list[str] | None) -> int:
    parser = argparse.ArgumentParser(
        prog="flowrl", description="flowrl: actor-pool dataflow runtime for RL post-training"
    )
    parser.add_argument("--version", action="version", version=f"flowrl {version()}")
    commands = parser.add_subparsers(dest="command", required=True)
    commands.add_parser(
        "loadtest", help="run the load-test scenarios (flowrl vs static push vs simulation)", add_help=False
    )
    trace = commands.add_parser(
        "trace",
        help="summarise a run's timeline and draw its utilisation chart",
        description="Read RUN_DIR/trace.json (written by an engine with RunConfig.run_dir, or a file from "
        "write_trace), print busy time per model, trainer and phase, and draw a PNG with a row per replica.",
    )
    trace.add_argument("run_dir", metavar="RUN_DIR", help="a run directory, or a trace .json file")
    trace.add_argument("--png", help="where to write the chart (default: timeline.png beside the trace)")
    trace.add_argument("--no-png", action="store_true", help="print the summary only")
    run = commands.add_parser(
        "run",
        help="run an engine described by a YAML or TOML file",
        description="Build the engine CONFIG describes (models by import path, dataset, run keys) and run it. "
        "See docs/cli.md for the file's keys.",
    )
    run.add_argument("config", metavar="CONFIG", help="a .yaml, .yml or .toml file")
    run.add_argument(
        "--set",
        dest="overrides",
        action="append",
        default=[],
        metavar="KEY=VALUE",
        help="override a key, e.g. run.num_episode=4 or models.policy.num_replicas=1 (repeatable)",
    )
    where = run.add_mutually_exclusive_group()
    where.add_argument(
        "--run-dir",
        metavar="DIR",
        help="write metrics.jsonl, trace.json and, where the file turns them on without a folder, the "
        "checkpoints here; the same DIR resumes there (default: run.run_dir of the file, else a new "
        "runs/<name>-<YYYYmmdd-HHMMSS> in the current folder)",
    )
    where.add_argument("--no-run-dir", action="store_true", help="write no run folder")
    scale = commands.add_parser(
        "scale",
        help="resize inference pools of a running engine",
        description="Ask the engine writing RUN_DIR (RunConfig.run_dir) to grow or shrink inference models' "
        "rollout pools; it applies the request within a second and writes RUN_DIR/scale.done.json.",
    )
    scale.add_argument("run_dir", metavar="RUN_DIR", help="the run directory of a running engine")
    scale.add_argument("sizes", metavar="MODEL=N", nargs="+", help="replicas each model should have, e.g. policy=4")
    args, rest = parser.parse_known_args(argv)
    if args.command != "loadtest" and rest:
        parser.error(f"unrecognized arguments: {' '.join(rest)}")
    from .._core.errors import FlowError

    try:
        if args.command == "loadtest":
            from .loadtest import loadtest_main

            return loadtest_main(rest)
        return {"run": run_main, "trace": trace_main, "scale": scale_main}[args.command](args)
    except FlowError as err:  # the user's mistake, named: one line; anything else keeps its traceback
        print(f"flowrl {args.command}: {type(err).__name__}: {one_line(err)}", file=sys.stderr)
        return 2


def one_line(err: BaseException) -> str:
    """``err``'s message on one line (YAML and msgspec messages may span several)."""
    return " ".join(part.strip() for part in str(err).splitlines() if part.strip())


def run_main(args: argparse.Namespace) -> int:
    import logging

    from .._engine import engine_view
    from .run_file import build_engine, load_run_file, run_imports

    if not logging.getLogger().handlers:  # episode lines when stderr is not a terminal
        logging.basicConfig(level=logging.INFO, format="%(message)s")
    spec, made = _with_run_dir(load_run_file(args.config, args.overrides), args)
    # The run file's folder stays importable for the whole run, not only while the engine is
    # built: a model's setup() (here, or in an embedded Ray cluster's replicas) imports from it.
    with run_imports(Path(args.config).parent):
        try:
            engine = build_engine(spec, Path(args.config).parent)
        except BaseException as err:
            _remove_if_empty(made)  # a mistake in the file (or Ctrl-C) before anything ran
            if isinstance(err, KeyboardInterrupt):  # the engine, not running yet, has nothing to say
                print("flowrl run: stopped while the engine was being built; nothing ran", file=sys.stderr)
            raise
        run_dir = Path(engine.config.run_dir) if engine.config.run_dir else None
        if run_dir is not None:
            print(f"run folder: {run_dir}", flush=True)
            # run again as it was, this command would make a new folder: point at the one printed
            engine_view.RESUME_HOW = "resume into this folder with the command printed below"
        try:
            stats = engine.learn()
        except BaseException:  # Ctrl-C or a failure: what was written is there to read
            if run_dir is not None and not _remove_if_empty(made):
                print(_run_dir_line(run_dir), flush=True)
                again = _resume_line(args, spec, run_dir)
                if again is not None:
                    print(again, flush=True)
            raise
    trained = ", ".join(f"{t.model}: {t.steps} steps, {t.samples} samples" for t in stats.trainers.values())
    print(f"done: {len(stats.episodes)} episodes in all (resumed ones included); {trained}")
    if run_dir is not None:
        print(_run_dir_line(run_dir))
    return 0


def _remove_if_empty(made: Path | None) -> bool:
    """Remove ``made`` (a run folder this command made), and runs/ above it, where nothing was
    written in them; whether ``made`` went."""
    if made is None:
        return False
    try:
        made.rmdir()
    except OSError:  # something was written: it stays to be read
        return False
    with contextlib.suppress(OSError):
        made.parent.rmdir()
    return True


def _with_run_dir(spec: RunFile, args: argparse.Namespace) -> tuple[RunFile, Path | None]:
    """``spec`` with its run folder chosen (the flags', the file's, else a new one under runs/),
    and the folder made here for it, if one was; a run that writes checkpoints but names no
    folder for them writes them in ``<run folder>/checkpoints``."""
    import msgspec

    from .run_file import new_run_folder, run_name

    made = None
    if args.no_run_dir or args.run_dir is not None:
        run = {**spec.run, "run_dir": args.run_dir}
    elif "run_dir" in spec.run:  # the file's (or --set's) choice, null included
        run = dict(spec.run)
    else:
        made = new_run_folder(run_name(spec, args.config))
        run = {**spec.run, "run_dir": str(made)}
    checkpoint = run.get("checkpoint")
    if (
        run.get("run_dir")
        and isinstance(checkpoint, dict)
        and checkpoint.get("every")
        and checkpoint.get("dir") is None
    ):
        # checkpoints are on (the file's choice) with nowhere to go: beside the run's other files,
        # so that resuming into the run folder finds them
        run["checkpoint"] = {**checkpoint, "dir": str(Path(run["run_dir"]) / CHECKPOINTS)}
    return msgspec.structs.replace(spec, run=run), made


def _resume_line(args: argparse.Namespace, spec: RunFile, run_dir: Path) -> str | None:
    """The command that resumes in ``run_dir`` (this one, into this folder), where the run
    writes checkpoints; without any there is nothing to resume, and the engine said so."""
    import shlex

    checkpoint = spec.run.get("checkpoint")
    if not isinstance(checkpoint, dict) or not checkpoint.get("dir") or not checkpoint.get("every"):
        return None

    redirect = ("run.run_dir=", "run.checkpoint.resume=")  # --run-dir names the folder; resume is auto below
    command = ["flowrl", "run", args.config, "--run-dir", str(run_dir)]
    for item in args.overrides:
        if not item.replace(" ", "").startswith(redirect):
            command += ["--set", item]
    if checkpoint.get("resume", "auto") != "auto":
        command += ["--set", "run.checkpoint.resume=auto"]
    return f"resume into this folder with: {shlex.join(command)}"


def _run_dir_line(folder: Path) -> str:
    """What the run left in ``folder``, and how to look at it."""
    files = [(label, folder / name) for label, name in (("metrics", "metrics.jsonl"), ("trace", "trace.json"))]
    found = [f"{label}: {path}" for label, path in files if path.is_file()]
    if not found:
        return f"run folder: {folder} (nothing written yet)"
    view = f"; view with flowrl trace {folder}" if (folder / "trace.json").is_file() else ""
    return ", ".join(found) + view


def scale_main(args: argparse.Namespace) -> int:
    from .._engine.elastic import parse_sizes, request_scale

    sizes = parse_sizes(args.sizes)
    path = request_scale(args.run_dir, sizes)  # refuses when no run is live there
    print(f"requested {sizes} in {path}; the engine writes scale.done.json (or scale.failed.json) when applied")
    return 0


def trace_main(args: argparse.Namespace) -> int:
    from .._core.observe.trace import read_trace_file
    from .timeline_view import format_summary, render_png, summary

    source = Path(args.run_dir)
    path = source / "trace.json" if source.is_dir() else source
    spans = read_trace_file(path)
    if not spans:
        print(f"flowrl trace: {path} holds no spans")
        return 0
    length = max(s.end for s in spans) - min(s.start for s in spans)
    print(format_summary(summary(spans), length))
    if args.no_png:
        return 0
    if importlib.util.find_spec("matplotlib") is None:
        print(
            "flowrl trace: the chart needs matplotlib (pip install 'flowrl[plot]'); --no-png skips it", file=sys.stderr
        )
        return 1
    png = render_png(spans, args.png or path.with_name("timeline.png"), title=f"{path}: busy time per replica")
    print(f"chart: {png}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
