"""tools.cpu_timings: its options and one measurement on a tiny shape (what is measured, never how fast)."""

from __future__ import annotations

import pytest

from tools import cpu_timings


def test_unknown_option_exits_2() -> None:
    with pytest.raises(SystemExit) as exc:
        cpu_timings.main(["--bogus"])
    assert exc.value.code == 2


def test_measures_the_reference_and_records_the_environment() -> None:
    arrays = cpu_timings.tiled_problem(cpu_timings.get_shape("tiny"), 4, distinct=2)
    assert arrays[1].shape[0] == cpu_timings.get_shape("tiny").experts  # 2 distinct experts tiled to all 6
    seconds = cpu_timings.time_reference(arrays, "fp64")
    assert seconds > 0
    blob = cpu_timings.record([{"what": "fp64 tiny T=4", "seconds": seconds, "note": ""}])
    assert set(blob["environment"]) == {"date_utc", "python", "numpy", "cpu_count", "platform"}
    assert blob["rows"][0]["seconds"] == seconds
