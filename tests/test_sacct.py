"""What `core.slurm` reads from sacct: rows by job id, by the header, an array's records."""

from __future__ import annotations

import pytest

from slurm_ddp_kit.core.slurmtext import parse_sacct

SACCT = """\
JobID|State|Elapsed|NodeList
41|COMPLETED|00:01:02|node[1-2]
42|CANCELLED by 0|00:00:05|node1
43_3|RUNNING|00:00:10|node2
44|PENDING|00:00:00|None assigned
"""


def test_parse_sacct_keys_rows_by_job_id() -> None:
    rows = parse_sacct(SACCT)
    assert list(rows) == ["41", "42", "43_3", "44"]
    assert rows["41"] == {
        "JobID": "41",
        "State": "COMPLETED",
        "Elapsed": "00:01:02",
        "NodeList": "node[1-2]",
    }
    assert rows["42"]["State"] == "CANCELLED by 0"
    assert rows["43_3"]["State"] == "RUNNING"  # an array element keeps its full id


def test_parse_sacct_goes_by_the_header() -> None:
    text = "NodeList|Elapsed|JobID|State\nnode1|00:00:07|7|FAILED\n|00:00:00|8|PENDING\n"
    rows = parse_sacct(text)
    assert rows["7"] == {
        "JobID": "7",
        "State": "FAILED",
        "Elapsed": "00:00:07",
        "NodeList": "node1",
    }
    assert rows["8"]["NodeList"] == "" and rows["8"]["State"] == "PENDING"


@pytest.mark.parametrize("text", ["", "\n", "JobID|State|Elapsed|NodeList\n"])
def test_parse_sacct_of_nothing_is_empty(text: str) -> None:
    assert parse_sacct(text) == {}


def test_an_array_element_that_never_started_takes_its_arrays_record() -> None:
    """Accounting has no row for a pending element: the array's pending record (`J_[3-9%2]`,
    `J_[1,4-5]`) stands for it; an element outside it, or of another array, finds none."""
    from slurm_ddp_kit.core.slurmtext import JobState, array_records, unstarted

    cancelled = JobState("CANCELLED", "00:00:00", "-")
    accounted = {"70_0": JobState("COMPLETED", "00:01:00", "n1"), "70_[3-9%2]": cancelled,
                 "71_[1,4-5]": cancelled}  # fmt: skip
    arrays = array_records(accounted)
    found = {job: unstarted(job, arrays) for job in ("70_3", "70_9", "70_2", "71_5", "71_3")}
    assert found == {"70_3": cancelled, "70_9": cancelled, "70_2": None, "71_5": cancelled,
                     "71_3": None}  # fmt: skip
    assert unstarted("70", arrays) is None  # a plain job id is no element
