"""The report header's notes about the sections (report/page.py)."""

from __future__ import annotations

import pandas as pd

from cellpath.report.page import header_notes


def _panels(**columns) -> pd.DataFrame:
    base = {"section_id": ["a", "b", "c"], "excluded_by_annotation": [False] * 3,
            "poor_reference_coverage": [False] * 3}
    return pd.DataFrame(base | columns)


def test_a_registration_flagged_section_is_named_in_the_header():
    notes = header_notes(_panels(registration_flagged=[False, True, False]))
    assert len(notes) == 1 and "Registration QC flagged b:" in notes[0]


def test_no_note_when_nothing_is_flagged_or_before_registration_qc():
    assert header_notes(_panels(registration_flagged=[False] * 3)) == []
    assert header_notes(_panels()) == []
