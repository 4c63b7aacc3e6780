"""`flowrl run`'s run folder (made by default, named by the file, never shared, printed at the
start and the end, readable by `flowrl trace`), a run file's imports relative to its folder
whatever the current folder, and `flowrl --version`."""

from __future__ import annotations

import importlib.metadata
import itertools
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

import flowrl
from flowrl._tools.cli import main
from flowrl._tools.run_file import load_run_file, new_run_folder, run_name

ROOT = Path(__file__).resolve().parents[2]
STAMP = r"\d{8}-\d{6}"
_module_names = itertools.count()


def write_project(folder: Path, run_file: str = "toy.yaml", extra: str = "") -> str:
    """A run file and the module it names, side by side in ``folder``; the module's name is new
    to this process (a name imported by an earlier test would be found in sys.modules instead)."""
    module = f"cli_run_dir_flow_{next(_module_names)}"
    folder.mkdir(parents=True, exist_ok=True)
    (folder / f"{module}.py").write_text(
        "import numpy as np\n"
        "def rollout(prompts, *, gen):\n    return gen.forward_step(prompts)\n"
        "def items():\n    return [{'x': np.full(1, float(i))} for i in range(8)]\n"
    )
    (folder / run_file).write_text(
        f"{extra}flow: {module}:rollout\ndataset: {module}:items\ntrain: [trainer]\nsync: [[trainer, gen]]\n"
        "models:\n"
        "  gen: {class: flowrl.testing:Scale, batch_size: 2, args: {srcs: [x], dst: y}}\n"
        "  trainer: {class: flowrl.testing:CountingTrainer}\n"
        "run: {sample_per_episode: 4, num_episode: 2, progress: off, pipeline: {backend: inprocess}}\n"
    )
    return module


def test_a_run_writes_a_new_folder_under_runs_and_says_where(tmp_path, monkeypatch, capsys):
    write_project(tmp_path / "proj")
    monkeypatch.chdir(tmp_path)
    assert main(["run", "proj/toy.yaml"]) == 0
    out = capsys.readouterr().out.splitlines()
    (folder,) = (tmp_path / "runs").iterdir()
    assert re.fullmatch(rf"toy-{STAMP}", folder.name), folder.name
    shown = f"runs/{folder.name}"
    assert out[0] == f"run folder: {shown}"  # first, before the run
    assert out[-1] == f"metrics: {shown}/metrics.jsonl, trace: {shown}/trace.json; view with flowrl trace {shown}"
    assert len((folder / "metrics.jsonl").read_text().splitlines()) == 2  # a line per episode
    assert main(["trace", shown, "--no-png"]) == 0  # the command the run printed, as printed
    summary = capsys.readouterr().out
    assert "gen" in summary and "busy" in summary, summary


def test_the_files_name_key_names_the_folder(tmp_path, monkeypatch, capsys):
    write_project(tmp_path, extra="name: ppo_small.v2\n")
    monkeypatch.chdir(tmp_path)
    assert main(["run", "toy.yaml"]) == 0
    (folder,) = (tmp_path / "runs").iterdir()
    assert re.fullmatch(rf"ppo_small\.v2-{STAMP}", folder.name), folder.name


@pytest.mark.parametrize(
    "flags, expected",
    [
        (["--run-dir", "out/here"], "out/here"),
        (["--set", "run.run_dir=given"], "given"),
        (["--no-run-dir"], None),
        (["--set", "run.run_dir=null"], None),  # the file's own "no folder"
    ],
)
def test_a_given_run_dir_or_none_makes_no_folder_under_runs(tmp_path, monkeypatch, capsys, flags, expected):
    write_project(tmp_path)
    monkeypatch.chdir(tmp_path)
    assert main(["run", "toy.yaml", *flags]) == 0
    out = capsys.readouterr().out
    assert not (tmp_path / "runs").exists()
    if expected is None:
        assert "run folder" not in out and "flowrl trace" not in out
        assert {p.name for p in tmp_path.iterdir() if p.is_dir()} <= {"__pycache__"}  # no folder made
    else:
        assert out.splitlines()[0] == f"run folder: {expected}"
        assert (tmp_path / expected / "metrics.jsonl").is_file() and f"flowrl trace {expected}" in out


def test_run_dir_flags_exclude_each_other(tmp_path, capsys):
    with pytest.raises(SystemExit) as stop:
        main(["run", "toy.yaml", "--run-dir", "x", "--no-run-dir"])
    assert stop.value.code == 2 and "not allowed with argument" in capsys.readouterr().err


def test_a_run_key_at_the_top_is_placed_for_the_user(tmp_path, monkeypatch, capsys):
    write_project(tmp_path)
    monkeypatch.chdir(tmp_path)
    assert main(["run", "toy.yaml", "--set", "run_dir=out"]) == 2
    assert "toy.yaml: run_dir is a run key (RunConfig): give it under run: (run.run_dir)" in capsys.readouterr().err


def test_a_mistake_found_when_building_leaves_no_empty_folder(tmp_path, monkeypatch, capsys):
    write_project(tmp_path)
    monkeypatch.chdir(tmp_path)
    assert main(["run", "toy.yaml", "--set", "models.gen.class=flowrl.testing:Nope"]) == 2
    assert "models.gen.class: module 'flowrl.testing' has no 'Nope'" in capsys.readouterr().err
    assert not (tmp_path / "runs").exists()


def test_two_runs_in_the_same_second_get_two_folders(tmp_path):
    now = 1_800_000_000.0
    first, second, third = (new_run_folder("ppo", tmp_path / "runs", now) for _ in range(3))
    assert len({first, second, third}) == 3 and all(p.is_dir() for p in (first, second, third))
    assert second.name == f"{first.name}-2" and third.name == f"{first.name}-3"


def test_two_processes_started_together_never_share_a_folder(tmp_path):
    """mkdir is the lock: processes racing for one second's name each get their own."""
    code = (
        "import sys; from pathlib import Path; from flowrl._tools.run_file import new_run_folder; "
        "print(new_run_folder('race', Path(sys.argv[1]), 1_800_000_000.0))"
    )
    command = [sys.executable, "-c", code, str(tmp_path)]
    runs = [subprocess.Popen(command, stdout=subprocess.PIPE, text=True) for _ in range(3)]
    made = [run.communicate(timeout=120)[0].strip() for run in runs]
    assert all(run.returncode == 0 for run in runs)
    assert len(set(made)) == 3 and len(list(tmp_path.iterdir())) == 3


@pytest.mark.parametrize(
    "file, name", [("my run (copy).yaml", "my_run_copy_"), (".hidden.yaml", "hidden"), ("---.yaml", "run")]
)
def test_a_file_stem_is_made_fit_for_a_folder_name(tmp_path, file, name):
    path = tmp_path / file
    path.write_text("models: {}\ndataset: m:items\n")
    assert run_name(load_run_file(path), path) == name


def test_a_name_key_that_is_no_folder_name_is_refused(tmp_path):
    path = tmp_path / "run.yaml"
    path.write_text("name: ../up\nmodels: {}\ndataset: m:items\n")
    with pytest.raises(flowrl.ConfigError, match=r"run.yaml: Expected `str` matching regex .* - at `\$.name`"):
        load_run_file(path)


def test_imports_resolve_beside_the_run_file_from_any_folder(tmp_path, monkeypatch, capsys):
    module = write_project(tmp_path / "proj")
    elsewhere = tmp_path / "elsewhere"
    elsewhere.mkdir()
    before = list(sys.path)
    for cwd, path in ((tmp_path / "proj", "toy.yaml"), (elsewhere, "../proj/toy.yaml"), (tmp_path, "proj/toy.yaml")):
        monkeypatch.chdir(cwd)
        sys.modules.pop(module, None)
        assert main(["run", path, "--no-run-dir"]) == 0, capsys.readouterr().err
        assert "trainer: 2 steps, 8 samples" in capsys.readouterr().out
        assert sys.modules[module].__file__ == str(tmp_path / "proj" / f"{module}.py")
    assert sys.path == before  # the run file's folder was on it only while the engine was built


def test_the_run_files_folder_comes_before_the_current_one(tmp_path, monkeypatch, capsys):
    """A module of the same name in the current folder does not shadow the one beside the file."""
    module = write_project(tmp_path / "proj")
    (tmp_path / f"{module}.py").write_text("raise RuntimeError('the wrong module')\n")
    monkeypatch.chdir(tmp_path)
    assert main(["run", "proj/toy.yaml", "--no-run-dir"]) == 0, capsys.readouterr().err


def test_a_module_found_nowhere_names_the_folders_searched(tmp_path, monkeypatch, capsys):
    write_project(tmp_path / "proj")
    monkeypatch.chdir(tmp_path)
    assert main(["run", "proj/toy.yaml", "--set", "flow=nowhere_module:rollout", "--no-run-dir"]) == 2
    err = capsys.readouterr().err
    assert "flow: cannot import module 'nowhere_module'" in err
    assert f"looked in {tmp_path / 'proj'} and {tmp_path} first" in err


def test_the_ppo_example_runs_from_its_own_folder(monkeypatch, capsys):
    """`cd examples && flowrl run ppo_tiny.yaml` (no run folder: the checkout stays as it was)."""
    monkeypatch.chdir(ROOT / "examples")
    sys.modules.pop("ppo_tiny", None)  # found again, beside the file
    fast = ["--set", "run.pipeline.backend=inprocess", "--set", "models.ppo_policy.num_replicas=1"]
    quiet = ["--set", "run.num_episode=1", "--set", "run.progress=off", "--no-run-dir"]
    assert main(["run", "ppo_tiny.yaml", *quiet, *fast]) == 0
    assert "done: 1 episodes in all" in capsys.readouterr().out
    assert sys.modules["ppo_tiny"].__file__ == str(ROOT / "examples" / "ppo_tiny.py")


def test_flowrl_version_is_the_installed_distributions(capsys):
    with pytest.raises(SystemExit) as stop:
        main(["--version"])
    assert stop.value.code == 0
    assert capsys.readouterr().out == f"flowrl {importlib.metadata.version('flowrl')}\n"
    done = subprocess.run([sys.executable, "-m", "flowrl", "--version"], capture_output=True, text=True, timeout=120)
    assert done.returncode == 0 and done.stdout == f"flowrl {importlib.metadata.version('flowrl')}\n"


def test_a_runs_folder_that_cannot_be_made_is_one_line(tmp_path, monkeypatch, capsys):
    write_project(tmp_path)
    (tmp_path / "runs").write_text("a file where the runs folder goes\n")
    monkeypatch.chdir(tmp_path)
    assert main(["run", "toy.yaml"]) == 2
    (line,) = capsys.readouterr().err.splitlines()
    assert line.startswith("flowrl run: ConfigError: cannot make a run folder under 'runs' ("), line
    assert line.endswith("give one with --run-dir DIR (or run.run_dir), or run without one: --no-run-dir"), line


def test_on_ray_a_model_class_beside_the_run_file_reaches_its_replicas(ray_cluster, tmp_path, monkeypatch, capsys):
    """The replicas' sys.path has neither the run file's folder nor this test's current folder: the
    class defined beside the run file must travel by value."""
    from flowrl.testing import flowrl_actor_names

    module = f"cli_run_dir_ray_{next(_module_names)}"
    (tmp_path / "proj").mkdir()
    (tmp_path / "proj" / f"{module}.py").write_text(
        "import numpy as np\nimport flowrl\n"
        "class Double(flowrl.Model):\n"
        "    def forward_step(self, batch, iteration):\n        return {'y': np.asarray(batch['x']) * 2}\n"
        "def rollout(prompts, *, gen):\n    return gen.forward_step(prompts)\n"
        "def items():\n    return [{'x': np.full(1, float(i))} for i in range(8)]\n"
    )
    (tmp_path / "proj" / "toy.yaml").write_text(
        f"flow: {module}:rollout\ndataset: {module}:items\ntrain: [trainer]\n"
        f"models:\n  gen: {{class: {module}:Double, num_replicas: 2, batch_size: 2}}\n"
        "  trainer: {class: flowrl.testing:CountingTrainer}\n"
        "run: {sample_per_episode: 4, num_episode: 1, progress: off}\n"
    )
    (tmp_path / "elsewhere").mkdir()
    monkeypatch.chdir(tmp_path / "elsewhere")
    assert main(["run", "../proj/toy.yaml", "--no-run-dir"]) == 0, capsys.readouterr().err
    assert "trainer: 1 steps, 4 samples" in capsys.readouterr().out
    assert flowrl_actor_names() == []


def write_setup_import_project(folder: Path, backend: str) -> str:
    """A model whose setup() imports a module beside the run file, as a reward model imports its
    scorer: found only if the run file's folder is importable while the replicas start."""
    module = f"cli_run_dir_setup_{next(_module_names)}"
    folder.mkdir(parents=True, exist_ok=True)
    (folder / f"{module}_helper.py").write_text("FACTOR = 3\n")
    (folder / f"{module}.py").write_text(
        "import importlib\nimport numpy as np\nimport flowrl\n"
        "class Triple(flowrl.Model):\n"
        "    def setup(self):\n"
        f"        self.factor = importlib.import_module('{module}_helper').FACTOR\n"
        "    def forward_step(self, batch, iteration):\n"
        "        return {'y': np.asarray(batch['x']) * self.factor}\n"
        "def rollout(prompts, *, gen):\n    return gen.forward_step(prompts)\n"
        "def items():\n    return [{'x': np.full(1, float(i))} for i in range(8)]\n"
    )
    (folder / "toy.yaml").write_text(
        f"flow: {module}:rollout\ndataset: {module}:items\ntrain: [trainer]\n"
        f"models:\n  gen: {{class: {module}:Triple, batch_size: 2}}\n"
        "  trainer: {class: flowrl.testing:CountingTrainer}\n"
        f"run: {{sample_per_episode: 4, num_episode: 1, progress: off, pipeline: {{backend: {backend}}}}}\n"
    )
    return module


def test_a_module_that_setup_imports_beside_the_run_file_is_found(tmp_path, monkeypatch, capsys):
    module = write_setup_import_project(tmp_path / "proj", "inprocess")
    (tmp_path / "elsewhere").mkdir()
    monkeypatch.chdir(tmp_path / "elsewhere")
    monkeypatch.delenv("PYTHONPATH", raising=False)
    path_before = list(sys.path)
    assert main(["run", "../proj/toy.yaml", "--no-run-dir"]) == 0, capsys.readouterr().err
    assert f"{module}_helper" in sys.modules  # setup() ran and imported it
    assert "trainer: 1 steps, 4 samples" in capsys.readouterr().out
    assert sys.path == path_before and "PYTHONPATH" not in os.environ  # both as they were


@pytest.mark.slow
def test_on_an_embedded_ray_cluster_setup_imports_beside_the_run_file(tmp_path):
    """A fresh process whose `flowrl run` starts its own Ray cluster: the replicas get the run
    file's folder through PYTHONPATH. (In this test process Ray runs already, without it.)"""
    write_setup_import_project(tmp_path / "proj", "ray")
    (tmp_path / "elsewhere").mkdir()
    done = subprocess.run(
        [sys.executable, "-m", "flowrl", "run", "../proj/toy.yaml", "--no-run-dir"],
        cwd=tmp_path / "elsewhere",
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert done.returncode == 0, done.stderr
    assert "trainer: 1 steps, 4 samples" in done.stdout


def test_a_run_that_fails_before_writing_leaves_no_empty_folder(tmp_path, monkeypatch, capsys):
    module = write_setup_import_project(tmp_path, "inprocess")
    (tmp_path / f"{module}_helper.py").unlink()  # setup() fails once the engine is built: nothing ran
    monkeypatch.chdir(tmp_path)
    assert main(["run", "toy.yaml"]) == 2
    assert f"No module named '{module}_helper'" in capsys.readouterr().err
    assert not (tmp_path / "runs").exists()


@pytest.mark.parametrize(
    ("sets", "expected"),
    [
        ((), None),
        (("run.checkpoint.every=1",), "checkpoints"),
        (("run.checkpoint.every=1", "run.checkpoint.dir=ck"), "../../ck"),
    ],
    ids=["off", "in-the-run-folder", "the-files-own"],
)
def test_checkpoints_go_in_the_run_folder_when_on_and_given_no_folder(tmp_path, monkeypatch, capsys, sets, expected):
    write_project(tmp_path)
    monkeypatch.chdir(tmp_path)
    assert main(["run", "toy.yaml", *(f"--set={s}" for s in sets)]) == 0, capsys.readouterr().err
    (folder,) = (tmp_path / "runs").iterdir()
    ours = folder / "checkpoints"
    if expected is None:  # checkpoints stay off where the file has them off
        assert not ours.exists() and not (tmp_path / "ck").exists()
    else:
        assert any((folder / expected).resolve().iterdir())


def test_a_run_that_fails_midway_prints_the_command_that_resumes_in_its_folder(tmp_path, monkeypatch, capsys):
    module = write_project(tmp_path)
    (tmp_path / "fail.yaml").write_text(
        f"flow: {module}:rollout\ndataset: {module}:items\ntrain: [trainer]\n"
        "models:\n  gen: {class: flowrl.testing:Fail, batch_size: 2, args: {bad_id: 5}}\n"  # in episode 2
        "  trainer: {class: flowrl.testing:CountingTrainer}\n"
        "run: {sample_per_episode: 4, num_episode: 3, checkpoint: {every: 1}, progress: off, "
        "pipeline: {backend: inprocess, max_retries: 0}}\n"
    )
    monkeypatch.chdir(tmp_path)
    assert main(["run", "fail.yaml", "--set", "run.num_episode=3", "--set", "run.checkpoint.resume=never"]) == 2
    out, err = capsys.readouterr()
    (folder,) = (tmp_path / "runs").iterdir()
    assert "bad sample 5" in err
    assert out.splitlines()[-1] == (
        f"resume into this folder with: flowrl run fail.yaml --run-dir runs/{folder.name} "
        "--set run.num_episode=3 --set run.checkpoint.resume=auto"  # the file's (here --set's) "never" would refuse it
    )
    assert (folder / "checkpoints").is_dir() and (folder / "metrics.jsonl").read_text().count("\n") == 1
