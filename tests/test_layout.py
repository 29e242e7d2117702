"""The layout's rules (issue 40), read from the source as `benchmarks/decisions.py` prints them:
no import circle among `pipejax._src`'s modules, no file of it over 600 lines, no read of
`Pipeline`'s private members below `pipeline.py`, and no `slots is None` in the tick loop."""

from __future__ import annotations

import pytest

from benchmarks import decisions


@pytest.fixture(scope="module")
def files():
    return decisions.sources(None)


def test_no_import_circle(files):
    assert decisions.cycles(decisions.imports(files)) == []


def test_no_file_over_600_lines(files):
    assert decisions.long_files(files) == [], "split the file: each concern in a module of its own"


def test_no_private_reads_of_the_pipeline(files):
    assert decisions.private_reads(files) == [], "read the plan (`pipe.plan`), not Pipeline's members"


def test_the_tick_loop_asks_no_table_kind(files):
    assert decisions.slots_is_none(files) == 0
