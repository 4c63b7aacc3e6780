"""RunConfig's sections (checkpoint, staleness, reproducibility): each checks itself where it is
defined, takes a mapping as well as its Struct, and a key that moved into one is named where it
went, whether the config comes as keywords, a mapping or a run file."""

from __future__ import annotations

import re

import pytest

import flowrl


@pytest.mark.parametrize(
    "section, value, expected",
    [
        ("checkpoint", {"dir": "runs/c", "every": 2}, flowrl.CheckpointConfig(dir="runs/c", every=2)),
        ("staleness", {"max": 1, "on_stale": "drop"}, flowrl.StalenessConfig(max=1, on_stale="drop")),
        ("reproducibility", {"deterministic": True}, flowrl.ReproducibilityConfig(deterministic=True)),
    ],
)
def test_a_section_given_as_a_mapping_becomes_its_struct(section, value, expected):
    built = flowrl.RunConfig(sample_per_episode=4, **{section: value})
    loaded = flowrl.RunConfig.from_mapping({"sample_per_episode": 4, section: value})
    assert getattr(built, section) == expected and getattr(loaded, section) == expected
    assert type(getattr(built, section)) is type(expected)


@pytest.mark.parametrize(
    "section, value, message",
    [
        ("checkpoint", {"every": 2}, r"RunConfig\.checkpoint\.every=2 needs RunConfig\.checkpoint\.dir"),
        ("checkpoint", {"keep": -1}, r"RunConfig\.checkpoint\.keep must be >= 0, got -1"),
        ("checkpoint", {"resume": ""}, r'RunConfig\.checkpoint\.resume must be "auto", "never" or the path'),
        ("staleness", {"max": -1}, r"RunConfig\.staleness\.max must be >= 0, got -1"),
        ("staleness", {"segment": "middle"}, r"RunConfig\.staleness\.segment must be one of \['oldest', 'newest'\]"),
        ("reproducibility", {"record_schedule": "a\0b"}, r"RunConfig\.reproducibility\.record_schedule is a path"),
    ],
)
def test_a_bad_section_is_refused_by_its_own_checks_naming_the_key(section, value, message):
    with pytest.raises(flowrl.ConfigError, match=message):
        flowrl.RunConfig(sample_per_episode=4, **{section: value})
    with pytest.raises(flowrl.ConfigError, match=message):
        flowrl.RunConfig.from_mapping({"sample_per_episode": 4, section: value})


@pytest.mark.parametrize(
    "old, new",
    list(flowrl.RunConfig.moved_keys.items()),
)
def test_a_key_that_moved_into_a_section_says_where_it_went(old, new, tmp_path):
    hint = re.escape(f"({old} is now RunConfig.{new})")
    with pytest.raises(flowrl.ConfigError, match=hint):
        flowrl.RunConfig(sample_per_episode=4, **{old: 1})
    with pytest.raises(flowrl.ConfigError, match=hint):
        flowrl.RunConfig.from_mapping({"sample_per_episode": 4, old: 1})
    path = tmp_path / "run.yaml"
    path.write_text(f"sample_per_episode: 4\n{old}: 1\n")
    with pytest.raises(flowrl.ConfigError, match=hint):
        flowrl.RunConfig.load(path)


def test_every_moved_key_names_a_field_of_its_section():
    for new in flowrl.RunConfig.moved_keys.values():
        section, key = new.split(".")
        assert key in type(getattr(flowrl.RunConfig(sample_per_episode=1), section)).__struct_fields__
