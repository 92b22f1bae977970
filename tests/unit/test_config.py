from pathlib import Path

import pytest
import yaml

from cellpath.config import load_params, parse_params
from cellpath.errors import ConfigError
from helpers.project import PROJECT_ROOT, TINY_SECTIONS


def _base() -> dict:
    return {"synthetic": {"sections": [dict(s) for s in TINY_SECTIONS]}}


def test_project_params_are_valid_and_cover_the_protocols(monkeypatch):
    monkeypatch.chdir(PROJECT_ROOT)
    params = load_params(PROJECT_ROOT / "params.yaml")
    sections = params.synthetic.sections
    organs = [s.organ for s in sections]
    assert params.source == "synthetic"
    assert len(sections) >= 10
    assert len(set(organs)) >= 5
    per_organ = {o: organs.count(o) for o in set(organs)}
    # IOCD needs organs with >= 2 sections; LOOO needs >= 5 organs; MOCV 5 folds needs >= 5 units.
    assert sum(1 for n in per_organ.values() if n >= 2) >= 4
    assert max(per_organ.values()) <= 3


def test_the_section_list_lives_in_its_own_file(monkeypatch):
    monkeypatch.chdir(PROJECT_ROOT)
    data = yaml.safe_load((PROJECT_ROOT / "params.yaml").read_text())
    assert data["synthetic"]["sections"] == "data/manifests/synthetic_sections.yaml"
    listed = yaml.safe_load((PROJECT_ROOT / data["synthetic"]["sections"]).read_text())
    params = load_params(PROJECT_ROOT / "params.yaml")
    assert [s.model_dump(exclude_unset=True) for s in params.synthetic.sections] == listed


def _with_section_file(tmp_path, monkeypatch, sections) -> Path:
    """A params.yaml in ``tmp_path`` (the working directory) whose sections are in sections.yaml."""
    monkeypatch.chdir(tmp_path)
    (tmp_path / "sections.yaml").write_text(yaml.safe_dump(sections) if not isinstance(sections, str) else sections)
    params = tmp_path / "params.yaml"
    params.write_text(yaml.safe_dump({"synthetic": {"sections": "sections.yaml"}}))
    return params


def test_a_section_file_is_read(tmp_path, monkeypatch):
    params = load_params(_with_section_file(tmp_path, monkeypatch, [dict(s) for s in TINY_SECTIONS]))
    assert [s.section_id for s in params.synthetic.sections] == [s["section_id"] for s in TINY_SECTIONS]


def test_problems_in_the_section_file_name_the_file(tmp_path, monkeypatch):
    sections = [dict(s) for s in TINY_SECTIONS]
    sections[1]["organ"] = "Spleen"
    with pytest.raises(ConfigError) as err:
        load_params(_with_section_file(tmp_path, monkeypatch, sections))
    msg = str(err.value)
    assert "sections.yaml" in msg and "synthetic.sections[1].organ" in msg and "Spleen" in msg
    assert "Field required" not in msg


@pytest.mark.parametrize("content, expected", [
    (None, "section file .*sections.yaml not found"),
    ("section_id: a\n", "must hold a YAML list of sections"),
    ("- {section_id: a, organ: [\n", "not readable YAML"),
])
def test_an_unreadable_section_file_is_one_clear_problem(tmp_path, monkeypatch, content, expected):
    params = _with_section_file(tmp_path, monkeypatch, content if content is not None else "[]")
    if content is None:
        (tmp_path / "sections.yaml").unlink()
    with pytest.raises(ConfigError, match=expected) as err:
        load_params(params)
    assert len(str(err.value).splitlines()) == 1, str(err.value)


def test_unknown_key_names_the_key_and_allowed_keys():
    data = _base()
    data["synthetic"]["cells_per_sectoin"] = 10
    with pytest.raises(ConfigError) as err:
        parse_params(data)
    msg = str(err.value)
    assert "synthetic.cells_per_sectoin" in msg
    assert "cells_per_section" in msg and "he_mpp" in msg


def test_unknown_top_level_key():
    data = _base()
    data["protocl"] = "mocv"
    with pytest.raises(ConfigError, match=r"unknown key `protocl`: did you mean `protocol`\? allowed keys here: source, seed"):
        parse_params(data)


def test_bad_organ_lists_allowed_values():
    data = _base()
    data["synthetic"]["sections"][1]["organ"] = "Spleen"
    with pytest.raises(ConfigError) as err:
        parse_params(data)
    msg = str(err.value)
    assert "synthetic.sections[1].organ" in msg
    assert "'Breast'" in msg and "'Lymphoid'" in msg and "Spleen" in msg


def test_status_must_match_organ():
    data = _base()
    data["synthetic"]["sections"][0]["status"] = "Melanoma"
    with pytest.raises(ConfigError, match=r"synthetic.sections\[0\].*'Breast cancer', 'Normal'"):
        parse_params(data)


@pytest.mark.parametrize(
    ("key", "value", "needle"),
    [
        ("cells_per_section", 0, "greater than or equal to 50"),
        ("he_mpp", -1.0, "greater than 0.1"),
        ("registration_jitter_um", [3.0, 1.0], "low <= high"),
        ("morphology_strength", [0.2, 1.5], "less than or equal to 1"),
    ],
)
def test_out_of_range_values_name_the_key(key, value, needle):
    data = _base()
    data["synthetic"][key] = value
    with pytest.raises(ConfigError) as err:
        parse_params(data)
    assert f"synthetic.{key}" in str(err.value)
    assert needle in str(err.value)


def test_bad_source_lists_choices():
    data = _base()
    data["source"] = "hub"
    with pytest.raises(ConfigError, match=r"key `source`: Input should be 'synthetic' or '10x'"):
        parse_params(data)


def test_duplicate_section_ids():
    data = _base()
    data["synthetic"]["sections"].append(dict(TINY_SECTIONS[0]))
    with pytest.raises(ConfigError, match="repeated: breast_a"):
        parse_params(data)


def test_missing_file_and_bad_yaml(tmp_path):
    with pytest.raises(ConfigError, match="parameter file not found"):
        load_params(tmp_path / "nope.yaml")
    bad = tmp_path / "bad.yaml"
    bad.write_text("source: [unclosed\n")
    with pytest.raises(ConfigError, match="not valid YAML"):
        load_params(bad)
    bad.write_text(yaml.safe_dump(["a", "list"]))
    with pytest.raises(ConfigError, match="expected a mapping"):
        load_params(bad)


def test_panel_must_be_one_that_concordance_builds():
    data = _base()
    data["concordance"] = {"panel_sizes": [4, 8]}
    data["panel"] = "S12"
    with pytest.raises(ConfigError, match=r"panel 'S12' is not one of the panels concordance builds: S4, S8"):
        parse_params(data)
    data["concordance"] = {"panel_sizes": [8, 4]}
    data["panel"] = "S8"
    with pytest.raises(ConfigError, match="distinct and increasing"):
        parse_params(data)


def test_stage_magnifications_must_be_extracted():
    from helpers.project import tiny_params

    data = tiny_params().model_dump(mode="json")
    data["extract"]["magnifications"] = ["20x"]
    data["robustness"]["magnifications"] = ["40x"]
    with pytest.raises(ConfigError, match=r"robustness.magnifications: 40x not in extract.magnifications \(20x\)"):
        parse_params(data)


def test_shortcut_levels_are_chosen_one_way():
    data = _base() | {"robustness": {"shortcut": {"train_levels": ["a", "b"], "held_out": 2}}}
    with pytest.raises(ConfigError, match=r"key `robustness\.shortcut`: set either train_levels .* or held_out"):
        parse_params(data)
    data = _base() | {"robustness": {"shortcut": {"train_levels": ["a", "b", "a"]}}}
    with pytest.raises(ConfigError, match=r"train_levels repeats a level"):
        parse_params(data)
    assert parse_params(_base() | {"robustness": {"shortcut": {"train_levels": ["a", "b"]}}}) is not None
