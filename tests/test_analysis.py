"""`python -m analysis summarize` on run folders that the kit itself made: what a user sees."""

from __future__ import annotations

import io
import json
import math
import os
import pickle
import re
import shutil
import time
from pathlib import Path
from typing import Any

import pandas as pd
import pytest
from kit import SMALL, kit, kit_here, records, run_folder

from slurm_ddp_kit.analysis.figures import FIGURES
from slurm_ddp_kit.analysis.table import comparison
from slurm_ddp_kit.core import runfolder
from slurm_ddp_kit.core.settings.loading import load_config

LABELS = {f.column: f.label for f in FIGURES}


def _submit(tmp: Path, *args: str) -> Path:
    where = [f"output.root={tmp}/runs", f"data.root={tmp}/data", "cluster.backend=local"]
    done = kit("launch", "submit", *args, *SMALL, "cluster.gpus_per_node=2", *where, "--wait")
    assert done.returncode == 0, done.stdout + done.stderr
    return run_folder(done.stdout)


@pytest.fixture(scope="module")
def runs(small_runs: dict[str, Path]) -> dict[str, Path]:
    """A DP and a DDP run of the same settings, and a DP run of another global batch (made once
    for every test file: conftest.small_runs)."""
    return small_runs


@pytest.fixture(scope="module")
def largest(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    """A DP and a DDP largest-batch run (on CPU: nothing searched), apart from `runs`' root.
    A test that edits one edits a copy (`_copy`)."""
    tmp = tmp_path_factory.mktemp("largest")
    return {m: _submit(tmp, "--mode", m, "task=largest_batch") for m in ("dp", "ddp")}


def _copy(run_dir: Path, tmp_path: Path) -> Path:
    return Path(shutil.copytree(run_dir, tmp_path / run_dir.name))


def _summarize(*args: str | Path, cwd: Path | None = None) -> tuple[int, str, str]:
    """`python -m analysis summarize`'s main in this interpreter (it only reads folders); the
    real process is `test_summarize_speed.py`'s and `--help`'s below."""
    done = kit_here("analysis", "summarize", *map(str, args), cwd=cwd)
    return done.returncode, done.stdout, done.stderr


CPU_DP = "DP (one process, no DataParallel)"  # DP's heading in a group that ran on no GPU
GPU_ROWS = ("GPU util main card", "GPU util other cards", "peak memory main card")
LEFT_OUT = "Not measured by any run here, so left out (null in csv/json): {}."
GPU_ONLY = ("energy_epoch_j", "energy_kilosample_j", "energy_run_j", "gpu_seconds")
# Shown in a GPT's group (on the tokens) only.
GPT_ONLY = ("largest_width", "largest_model_parameters", "tokens_per_s")


def _tables(markdown: str) -> dict[str, dict[str, list[str]]]:
    """Each group's heading → its table as {row name: [DP, DDP, DDP vs DP]} (CPU runs: DP is
    one process, and the comparison says so)."""
    tables: dict[str, dict[str, list[str]]] = {}
    for block in markdown.split("## ")[1:]:
        heading, *lines = block.splitlines()
        rows = [
            [c.strip() for c in line.strip("|").split("|")]
            for line in lines
            if line.startswith("|")
        ]
        assert rows[0] == ["metric", CPU_DP, "DDP", f"DDP vs {CPU_DP}"]
        tables[heading] = {row[0]: row[1:] for row in rows[2:]}
    return tables


def _steady_epoch_seconds(run_dir: Path, ranks: int) -> float:
    """Epoch 2 ends when its slowest rank ends (with 2 epochs the steady state is epoch 2 alone)."""
    return max(
        r["seconds"] for rank in range(ranks) for r in records(run_dir, rank) if r.get("epoch") == 2
    )


def test_markdown_table_puts_dp_and_ddp_side_by_side(runs: dict[str, Path]) -> None:
    code, out, err = _summarize("--root", runs["dp"].parent)
    assert code == 0, err
    table = next(t for heading, t in _tables(out).items() if "global batch 512" in heading)
    # The GPU figures, which a CPU run cannot measure, are left out, and the table says so.
    # The small CPU runs never reach the target accuracy (98.5 %): no time to it, and it says so.
    measured = [
        f.label
        for f in FIGURES
        if f.card is None
        and f.column not in ("largest_batch", "tta_s", "tta_data_s", *GPU_ONLY, *GPT_ONLY)
    ]
    assert list(table) == measured
    assert "No run here reached the target accuracy (98.5 %): time to it left out." in out
    gpu_rows = (
        "energy per epoch, energy per 1,000 samples, energy per run, GPU time per run, "
        "GPU util main card, GPU util other cards, peak memory main card, peak memory "
    )
    assert LEFT_OUT.format(gpu_rows + "other cards, largest batch") in out.splitlines()
    assert "Note: without GPUs nn.DataParallel runs the bare model in one process" in out
    assert table["runs"] == ["1", "1", ""]
    dp, ddp, speed = table[LABELS["epoch_s"]]
    assert float(dp) == round(_steady_epoch_seconds(runs["dp"], 1), 2)
    assert float(ddp) == round(_steady_epoch_seconds(runs["ddp"], 2), 2)
    assert re.fullmatch(r"\d+\.\d\d× (faster|slower)", speed)
    assert re.fullmatch(r"[+-]\d+%", table[LABELS["throughput"]][2])
    assert re.fullmatch(r"[+-]\d+\.\d pp", table[LABELS["final_test_accuracy"]][2])


def test_runs_of_other_settings_get_their_own_table(runs: dict[str, Path]) -> None:
    _, out, _ = _summarize("--root", runs["dp"].parent)
    tables = _tables(out)
    assert len(tables) == 2
    heading = next(h for h in tables if "global batch 256" in h)
    assert "CPU" in heading and "torch" in heading
    assert f"{CPU_DP}: {runs['dp-256'].name}; DDP: none" in out
    assert tables[heading]["runs"] == ["1", "0", ""]
    assert tables[heading][LABELS["epoch_s"]][1:] == ["n/m", "n/m"]


@pytest.mark.parametrize(
    ("section", "key", "value"),
    [("train", "lr", 0.02), ("train", "seed", 3), ("model", "dropout", False)],
)
def test_runs_of_another_learning_rate_or_seed_are_not_repeats(
    runs: dict[str, Path], tmp_path: Path, section: str, key: str, value: object
) -> None:
    """A sweep's points differ in settings the heading has no words of its own for: each point
    is its own group, named by what it changed, never pooled as a repeat of another."""
    point = Path(shutil.copytree(runs["dp"], tmp_path / "20991231-000000-dp-1n2g-0000"))
    meta = json.loads((point / "run.json").read_text()) | {"run_id": point.name}
    meta["config"][section][key] = value
    (point / "run.json").write_text(json.dumps(meta))
    code, out, err = _summarize(runs["dp"], runs["ddp"], point)
    assert code == 0, err
    tables = _tables(out)
    assert len(tables) == 2, out
    changed = next(h for h in tables if f"{section}.{key}={value}" in h)
    assert tables[changed]["runs"] == ["1", "0", ""]
    (default,) = (h for h in tables if h != changed)
    assert tables[default]["runs"] == ["1", "1", ""] and f"{section}.{key}=" not in default


def test_repeats_of_one_setting_give_the_median_and_their_count(
    runs: dict[str, Path], tmp_path: Path
) -> None:
    """A second DP run, its epochs twice as slow: the pooled figure is the median of the two."""
    repeat = Path(shutil.copytree(runs["dp"], tmp_path / "20991231-000000-dp-1n2g-0000"))
    meta = json.loads((repeat / "run.json").read_text()) | {"run_id": repeat.name}
    (repeat / "run.json").write_text(json.dumps(meta))
    path = repeat / "metrics" / "rank-00000.jsonl"
    slower = [
        r | {"seconds": 2 * r["seconds"]} if r["kind"] == "epoch" else r for r in records(repeat)
    ]
    path.write_text("".join(json.dumps(r) + "\n" for r in slower))
    code, out, err = _summarize(runs["dp"], runs["ddp"], repeat)
    assert code == 0, err
    (table,) = _tables(out).values()
    assert table["runs"] == ["2", "1", ""]
    expected = 1.5 * _steady_epoch_seconds(runs["dp"], 1)
    assert float(table[LABELS["epoch_s"]][0]) == pytest.approx(expected, abs=0.006)


def _searched(run_dir: Path, largest: int | None, trials: list[tuple[int, bool]]) -> None:
    """Make a CPU largest-batch run read as a GPU search that made these trials."""
    path = run_dir / "metrics" / "rank-00000.jsonl"
    found = {
        "largest_global_batch": largest,
        "trials": [{"global_batch": b, "fits": ok} for b, ok in trials],
    }
    edited = [r | found if r["kind"] == "summary" else r for r in records(run_dir)]
    path.write_text("".join(json.dumps(r) + "\n" for r in edited))


def test_the_largest_batch_row_tells_none_fits_from_not_measured(
    runs: dict[str, Path], largest: dict[str, Path], tmp_path: Path
) -> None:
    """Beside the training runs: DP's search found that nothing fits (0), DDP's found 4096; a
    search on CPU measures nothing (n/m)."""
    dp, ddp = (_copy(largest[m], tmp_path) for m in ("dp", "ddp"))
    _, out, _ = _summarize(runs["dp"], runs["ddp"], dp, ddp)
    (table,) = _tables(out).values()
    assert LABELS["largest_batch"] not in table  # measured by none: left out, and said
    assert "left out (null in csv/json): " in out and "largest batch." in out
    _searched(dp, None, [(512, False)])
    _searched(ddp, 4096, [(512, True), (1024, True), (2048, True), (4096, True), (8192, False)])
    code, out, err = _summarize(runs["dp"], runs["ddp"], dp, ddp)
    assert code == 0, err
    (table,) = _tables(out).values()
    assert table[LABELS["largest_batch"]] == ["0", "4096", "–"]


ALONE = (
    "note {}: a largest-batch run is shown beside training runs of the same strategy, model, "
    "precision and GPUs; none here (largest global batch: {})"
)


def test_a_largest_batch_run_without_its_training_runs_is_a_note(
    runs: dict[str, Path], largest: dict[str, Path], tmp_path: Path
) -> None:
    """Alone, it leaves nothing to summarize; beside training runs of another strategy it joins no
    table. Either way stderr says so, with its figure, and never with a traceback."""
    alone = largest["ddp"]
    code, out, err = _summarize(alone)
    assert code == 1 and out == "" and "Traceback" not in err
    assert err.splitlines() == [
        ALONE.format(alone.name, "not measured (no GPU)"),
        "error: none of the 1 run(s) has finished its training (why: above): nothing to summarize",
    ]
    for found, text in ((None, "0, none fits"), (4096, "4096")):
        searched = _copy(alone, tmp_path / str(found))
        _searched(searched, found, [(512, found is not None), (8192, False)])
        code, out, err = _summarize(runs["dp-256"], searched)  # DP only: DDP's run joins no table
        assert code == 0, err
        assert len(_tables(out)) == 1 and searched.name not in out
        assert err.splitlines() == [ALONE.format(searched.name, text)]


def test_csv_and_json_carry_every_figure_as_numbers(runs: dict[str, Path]) -> None:
    _, csv_out, _ = _summarize(runs["dp"], runs["ddp"], "--format", "csv")
    _, json_out, _ = _summarize(runs["dp"], runs["ddp"], "--format", "json")
    for frame in (pd.read_csv(io.StringIO(csv_out)), pd.DataFrame(json.loads(json_out)["records"])):
        # Every figure but the largest model's, which only a GPT group has.
        assert set(frame["metric"]) == set(LABELS) - set(GPT_ONLY) and set(frame["mode"]) == {
            "dp",
            "ddp",
            "ddp_vs_dp",
        }
        assert (frame["global_batch"] == 512).all() and (
            frame["device_name"].str.startswith("CPU")
        ).all()
        epoch = frame[frame["metric"] == "epoch_s"].set_index("mode")
        assert epoch.loc["dp", "unit"] == "s" and epoch.loc["ddp", "value"] > 0
        assert epoch.loc["ddp_vs_dp", "value"] == pytest.approx(
            epoch.loc["dp", "value"] / epoch.loc["ddp", "value"]
        )
        assert epoch.loc["ddp_vs_dp", "column"] == f"DDP vs {CPU_DP}"  # what it compares
        util = frame.loc[frame["metric"] == "util_pct_main", "value"]
        assert len(util) == 3 and util.isna().all()  # n/m, not 0
    assert "NaN" not in json_out
    (group,) = json.loads(json_out)["groups"]
    assert [note.split(":")[0] for note in group["notes"]] == ["Note"]


@pytest.mark.parametrize(("rank", "kept"), [(1, True), (0, False)])
def test_a_line_cut_short_is_skipped_with_a_warning(
    runs: dict[str, Path], tmp_path: Path, rank: int, kept: bool
) -> None:
    run_dir = Path(shutil.copytree(runs["ddp"], tmp_path / runs["ddp"].name))
    path = run_dir / "metrics" / f"rank-{rank:05d}.jsonl"
    text = path.read_text()
    path.write_text(text[: len(text) - 40])  # the job was killed while writing its summary
    code, out, err = _summarize(run_dir)
    assert f"{path}:4: unreadable line skipped" in err
    if kept:  # every epoch is there: the figures stand, rank 1's per-card figures are n/m
        assert code == 0 and "rank 1 has no summary record" in err
        assert _tables(out)  # the table is printed
    else:  # no final accuracy without rank 0's summary: the run is left out, and said so
        assert code == 1 and f"skipped {run_dir.name}: no summary from rank 0" in err
        assert "nothing to summarize" in err.splitlines()[-1]


def test_a_field_of_the_wrong_type_is_skipped_by_every_reader(
    runs: dict[str, Path], tmp_path: Path
) -> None:
    """One hand-edited record ("first_epoch": "two") in one run of a folder: status, summarize,
    logs and cancel each skip that record, say so in one warning line, and go on with the rest."""
    root = tmp_path / "runs"
    good, bad = (_copy(runs[mode], root) for mode in ("dp", "ddp"))
    path = bad / "metrics" / "rank-00000.jsonl"
    lines = path.read_text().splitlines()
    start = json.loads(lines[0]) | {"first_epoch": "two"}
    path.write_text("\n".join([json.dumps(start), *lines[1:]]) + "\n")
    skipped = f"{path}:1: record skipped: its first_epoch is 'two', not int"
    code, out, err = _summarize(root)
    assert code == 0 and _tables(out) and skipped in err, err  # the DP run's table stands
    assert f"skipped {bad.name}: no start record from rank(s) 0" in err
    status = kit_here("launch", "status", "--root", str(root))
    assert status.returncode == 0 and status.stderr.splitlines() == [f"warning: {skipped}"]
    assert good.name in status.stdout and bad.name in status.stdout
    done = kit_here("launch", "logs", str(bad))
    assert done.returncode == 0 and "Traceback" not in done.stderr, done.stderr
    # A third run whose run.json holds a field of the wrong type: cancel goes on past it.
    damaged = root / "20000101-000000-ddp-1n2g-dead"
    damaged.mkdir()
    meta = json.loads((good / "run.json").read_text()) | {"job_id": 5}
    (damaged / "run.json").write_text(json.dumps(meta))
    done = kit_here("launch", "cancel", str(root))
    assert done.returncode == 2 and "Traceback" not in done.stderr, done.stderr
    assert f"{good.name}: job" in done.stdout and f"{bad.name}: " in done.stdout
    assert f"warning: {damaged.name}: {damaged}/run.json is damaged: its job_id is 5" in done.stderr
    assert done.stderr.splitlines()[-1] == (
        "error: 1 of 3 runs were not cancelled: see the warnings above"
    )


@pytest.mark.parametrize(
    ("edit", "said"),
    [
        ({"mode": "xyz"}, "mode='xyz' is not valid"),
        ({"config": {"train": {"epochs": "2"}}}, "epochs='2', where the kit writes int"),
        ({"config": {"cluster": {"setup": "not a list"}}}, "setup='not a list'"),
        ({"config": {"train": {"epochs": -3}}}, "train.epochs=-3 must be between 1 and"),
    ],
)
def test_a_run_json_no_kit_writes_is_skipped_and_the_others_summarized(
    runs: dict[str, Path], tmp_path: Path, edit: dict[str, Any], said: str
) -> None:
    """A hand-edited run.json (a mode this kit lacks, a setting of the wrong type or out of
    range) leaves that run out of the summary with its name and why; the other runs' table stands."""
    root = tmp_path / "runs"
    good, bad = (_copy(runs[mode], root) for mode in ("dp", "ddp"))
    meta = json.loads((bad / "run.json").read_text())
    for key, value in edit.items():
        if key == "mode":
            meta["mode"] = meta["config"]["mode"] = value
        else:  # one setting of one group
            ((group, settings),) = value.items()
            meta["config"][group].update(settings)
    (bad / "run.json").write_text(json.dumps(meta))
    code, out, err = _summarize(root)
    assert code == 0 and _tables(out) and good.name in out, err
    assert f"skipped {bad}: " in err and said in err, err
    assert "Traceback" not in err


@pytest.mark.parametrize("value", ["-5", "Infinity"])
def test_an_epoch_time_no_run_measures_is_skipped_and_named(
    runs: dict[str, Path], tmp_path: Path, value: str
) -> None:
    """A negative or infinite epoch time (a hand edit) would be a figure of the table (-5.00 s
    per epoch, a negative throughput): the run is left out, saying which value."""
    root = tmp_path / "runs"
    good, bad = (_copy(runs[mode], root) for mode in ("dp", "ddp"))
    for rank in runfolder.rank_files(bad):  # on every rank: the table takes the slowest
        metrics = runfolder.metrics_path(bad, rank)
        metrics.write_text(
            re.sub(r'"seconds": [0-9.]+', f'"seconds": {value}', metrics.read_text())
        )
    code, out, err = _summarize(root)
    assert code == 0 and _tables(out) and good.name in out and bad.name not in out, err
    assert f"skipped {bad}: " in err and f"an epoch's seconds is {float(value)}" in err, err


@pytest.mark.parametrize("unreadable", ["permissions", "a folder"])
def test_a_file_that_cannot_be_read_is_a_warning_not_a_traceback(
    runs: dict[str, Path], tmp_path: Path, unreadable: str
) -> None:
    """Rank 0's records and a log that cannot be read: mode 000 for a user who is not the owner
    (root reads them all: skipped as root), or a folder where the file should be."""
    if unreadable == "permissions" and os.geteuid() == 0:
        pytest.skip("root reads a file of any mode")
    run_dir = _copy(runs["ddp"], tmp_path)
    files = [runfolder.metrics_path(run_dir, 0), next(runfolder.logs_dir(run_dir).rglob("*.err"))]
    for path in files:
        if unreadable == "permissions":
            path.chmod(0)
        else:
            path.unlink()
            (path / "x").mkdir(parents=True)
    for command in (
        ("launch", "status", str(run_dir)),
        ("analysis", "summarize", str(run_dir)),
        ("launch", "logs", str(run_dir), "--rank", "0"),
        ("launch", "cancel", str(run_dir)),
    ):
        done = kit_here(*command)
        assert "Traceback" not in done.stderr and done.returncode in (0, 1), (command, done)
    if unreadable == "permissions":
        assert "Permission denied" in kit_here("launch", "status", str(run_dir)).stderr


def _edit_record(path: Path, kind: str, **fields: Any) -> None:
    """Rank's last record of `kind` with `fields` set, as a hand edit or another tool leaves it."""
    lines = path.read_text().splitlines()
    at = max(i for i, line in enumerate(lines) if json.loads(line)["kind"] == kind)
    lines[at] = json.dumps(json.loads(lines[at]) | fields)
    path.write_text("\n".join(lines) + "\n")


DEEP = "[" * 100_000 + "]" * 100_000  # the json module's recursion ends long before this


@pytest.mark.timeout(120)  # a record's world_size once made status count to it
@pytest.mark.parametrize(
    ("edit", "said"),
    [
        ("deep line", "line skipped: nested deeper than any record of this kit"),
        ("deep field", "line skipped: nested deeper than any record of this kit"),
        ("long line", "characters skipped: no record of this kit is so long"),
        ("local_world_size", "record skipped: its local_world_size is 'four', not int"),
        ("world_size", "record skipped: its world_size is 1000000000, not in 1..6400000"),
        ("gpus", "record skipped: its gpus holds 1, not a mapping of one card's figures"),
        ("gpus entry", "record skipped: its gpus holds {'util_pct': 'high'}, not a mapping"),
        ("total_seconds", "record skipped: its total_seconds is inf, not in 0.0.."),
    ],
)
def test_a_hostile_record_is_skipped_with_one_warning_by_every_reader(
    runs: dict[str, Path], tmp_path: Path, edit: str, said: str
) -> None:
    """A record no kit writes (nested 100,000 deep, a megabyte long, a field of the wrong type
    or out of range) is one counted warning in status, summarize, logs and cancel; the command
    goes on with the other records and runs (no traceback, no count to a billion)."""
    root = tmp_path / "runs"
    good, bad = (_copy(runs[mode], root) for mode in ("dp", "ddp"))
    path = runfolder.metrics_path(bad, 0)
    if edit == "deep line":
        path.write_text(path.read_text() + DEEP + "\n")
    elif edit == "deep field":
        _edit_record(path, "summary", extra="x")
        path.write_text(path.read_text().replace('"extra": "x"', f'"extra": {DEEP}'))
    elif edit == "long line":
        path.write_text(
            path.read_text() + json.dumps({"kind": "notice", "text": "x" * 2**21}) + "\n"
        )
    elif edit in ("local_world_size", "world_size"):
        _edit_record(path, "start", **{edit: "four" if edit == "local_world_size" else 10**9})
    elif edit == "gpus":
        _edit_record(path, "summary", gpus=[1, "x"])
    elif edit == "gpus entry":
        _edit_record(path, "summary", gpus=[{"util_pct": "high"}])
    else:
        _edit_record(path, "summary", total_seconds=math.inf)
    for command in (
        ("launch", "status", "--root", str(root)),
        ("analysis", "summarize", "--no-cache", str(root)),
        ("launch", "logs", str(bad)),
        ("launch", "cancel", str(bad)),
    ):
        runfolder.layout._warned.clear()  # a process of its own would warn anew
        done = kit_here(*command)
        assert done.returncode == 0 and "Traceback" not in done.stderr, (command, done.stderr)
        warnings = [line for line in done.stderr.splitlines() if line.startswith("warning: ")]
        assert len(warnings) == 1 and said in warnings[0], (command, done.stderr)
        assert warnings[0].startswith(f"warning: {path}:"), warnings
    assert good.name in kit_here("launch", "status", "--root", str(root)).stdout


def test_a_summary_without_its_total_seconds_shows_no_elapsed_time(
    runs: dict[str, Path], tmp_path: Path
) -> None:
    """null: not measured, which the schema allows; status shows '-' rather than a traceback."""
    run_dir = _copy(runs["ddp"], tmp_path)
    _edit_record(runfolder.metrics_path(run_dir, 0), "summary", total_seconds=None)
    done = kit_here("launch", "status", str(run_dir))
    assert done.returncode == 0 and done.stderr == "", done.stderr
    row = done.stdout.splitlines()[1].split()
    assert row[4:7] == ["COMPLETED", row[5], "-"], row


def test_a_file_named_as_a_rank_that_is_none_is_named(
    runs: dict[str, Path], tmp_path: Path
) -> None:
    run_dir = _copy(runs["ddp"], tmp_path)
    stray = runfolder.metrics_path(run_dir, 0).with_name("rank-99999999999.jsonl")
    shutil.copy(runfolder.metrics_path(run_dir, 0), stray)
    (stray.parent / "notes.txt").write_text("a user's own file: not the kit's to speak of\n")
    said = f"warning: {stray.parent}: rank-99999999999.jsonl skipped: no rank of this run"
    for command in (("launch", "status", str(run_dir)), ("analysis", "summarize", str(run_dir))):
        runfolder.layout._warned.clear()  # a process of its own would warn anew
        done = kit_here(*command)
        assert done.returncode == 0, done.stderr
        assert [line for line in done.stderr.splitlines() if "warning" in line] == [
            f"{said}, whose ranks are 0–1"
        ], done.stderr


@pytest.mark.parametrize("unreadable", ["mode 000", "a link to itself"])
def test_a_metrics_folder_that_cannot_be_read_is_a_warning(
    runs: dict[str, Path], tmp_path: Path, unreadable: str
) -> None:
    """Mode 000 stops a user who is not its owner (root enters any folder: skipped as root);
    a link to itself stops root too (ELOOP), through the same path."""
    if unreadable == "mode 000" and os.geteuid() == 0:
        pytest.skip("root enters a folder of any mode")
    run_dir = _copy(runs["ddp"], tmp_path)
    metrics = run_dir / "metrics"
    if unreadable == "mode 000":
        metrics.chmod(0)
    else:
        shutil.rmtree(metrics)
        metrics.symlink_to("metrics")
    runfolder.update_meta(run_dir, job_id="999999999")  # no such process: nothing to signal
    try:
        for command in (
            ("launch", "status", str(run_dir)),
            ("launch", "logs", str(run_dir)),
            ("launch", "cancel", str(run_dir)),
            ("analysis", "summarize", str(run_dir)),
        ):
            runfolder.layout._warned.clear()  # a process of its own would warn anew
            done = kit_here(*command)
            assert "Traceback" not in done.stderr and done.returncode in (0, 1, 2), done.stderr
            said = f"warning: {metrics}" in done.stderr and "cannot be read (" in done.stderr
            assert said, (command, done.stderr)
    finally:
        metrics.chmod(0o755) if unreadable == "mode 000" else None


def test_control_characters_in_records_and_logs_are_printed_escaped(
    runs: dict[str, Path], tmp_path: Path
) -> None:
    """An escape sequence in a record or a log (clear the screen, set the title, rewrite a line)
    reaches the terminal as text: status, logs and summarize print `\\x1b`, never ESC."""
    root = tmp_path / "runs"
    run_dir = _copy(runs["ddp"], root)
    path = runfolder.metrics_path(run_dir, 0)
    _edit_record(path, "start", node="n\x1b]0;owned\x07", device_name="cpu\x1b[2J\u202e")
    runfolder.RecordWriter(run_dir, 0).write("notice", text="look\x1b[1A\r")
    log = next(runfolder.logs_dir(run_dir).glob("*_0_log.out"))
    log.write_text(log.read_text() + "\x1b[31mred\x9b\n")
    for command in (
        ("launch", "status", str(run_dir)),
        ("launch", "logs", str(run_dir), "--rank", "0"),
        ("analysis", "summarize", "--no-cache", str(root)),
    ):
        done = kit_here(*command)
        assert done.returncode in (0, 1), done.stderr
        for text in (done.stdout, done.stderr):
            assert not set(text) & {"\x1b", "\x07", "\x9b", "\r", "\u202e"}, (command, text)
    assert "n\\x1b]0;owned\\x07" in kit_here("launch", "status", str(run_dir)).stdout
    assert "\\x1b[31mred\\x9b" in kit_here("launch", "logs", str(run_dir), "--rank", "0").stdout


def test_a_run_without_metrics_is_reported_not_fatal(runs: dict[str, Path], tmp_path: Path) -> None:
    queued = tmp_path / "runs" / "20000101-000000-ddp-1n2g-beef"
    queued.mkdir(parents=True)
    shutil.copy(runs["ddp"] / "config.yaml", queued)
    meta = json.loads((runs["ddp"] / "run.json").read_text()) | {"run_id": queued.name}
    (queued / "run.json").write_text(json.dumps(meta))
    code, out, err = _summarize(queued.parent, runs["dp"], runs["ddp"])
    assert code == 0 and len(_tables(out)) == 1
    assert f"skipped {queued.name}: no metrics yet" in err


def test_plot_writes_a_png(runs: dict[str, Path], tmp_path: Path) -> None:
    image = tmp_path / "plots" / "comparison.png"
    code, _, err = _summarize("--root", runs["dp"].parent, "--plot", image)
    assert code == 0, err
    assert image.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n" and image.stat().st_size > 20_000


def test_the_plot_has_a_panel_per_figure_measured(runs: dict[str, Path]) -> None:
    """CPU runs: epoch times and throughput, no empty GPU panels; a GPU figure measured by one run
    (peak memory, as a GPU run reads) brings its panel back."""
    from slurm_ddp_kit.analysis import plot
    from slurm_ddp_kit.analysis.load import load_runs
    from slurm_ddp_kit.analysis.table import group_runs

    frame, _ = load_runs([runs["dp"], runs["ddp"]])
    (group,), _ = group_runs(frame)
    assert [p.__name__ for p in plot.panels(group)] == ["_epoch_times", "_throughput"]
    group.medians["ddp"]["max_allocated_mb_main"] = 512.0
    assert len(plot.panels(group)) == 3


@pytest.mark.parametrize("split", [(1,), (1, 2)], ids=["first-epoch", "every-epoch"])
def test_plot_leaves_out_epochs_without_one_time(
    runs: dict[str, Path], tmp_path: Path, split: tuple[int, ...]
) -> None:
    """An epoch split across attempts of a requeued job records no time ("seconds": null): its
    figure is n/m, drawn as a gap; with no epoch time at all (nor throughput) the plot still
    writes."""
    resumed = _copy(runs["dp"], tmp_path)
    path = resumed / "metrics" / "rank-00000.jsonl"
    split_epoch = {"seconds": None, "samples_per_s": None, "resumed_at_batch": 3}
    edited = [
        r | split_epoch if r["kind"] == "epoch" and r["epoch"] in split else r
        for r in records(resumed)
    ]
    path.write_text("".join(json.dumps(r) + "\n" for r in edited))
    image = tmp_path / "comparison.png"
    code, out, err = _summarize(resumed, "--plot", image)
    assert code == 0 and "Traceback" not in err, err
    (table,) = _tables(out).values()
    assert LABELS["first_epoch_s"] not in table  # measured by no run: left out, and said so
    left_out = next(line for line in out.splitlines() if line.startswith("Not measured"))
    assert "first epoch" in left_out and ("seconds per epoch" in left_out) == (split == (1, 2))
    assert image.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


@pytest.mark.parametrize(
    ("args", "message"),
    [
        (["/no/such/run"], "/no/such/run does not exist"),
        (["{tmp}"], "is not a run folder and holds none"),
        ([], "no runs found under runs/: make one with `python -m launch submit"),
        (["--format", "xml", "{tmp}"], "--format xml is not known: use one of markdown, csv, json"),
        (["--plot", "out.gif"], "end the name in .png or .svg or .pdf"),
        (["--frobnicate"], "unrecognized arguments: --frobnicate"),
    ],
)
def test_usage_errors_exit_2_with_one_line(tmp_path: Path, args: list[str], message: str) -> None:
    code, out, err = _summarize(*(a.format(tmp=tmp_path) for a in args), cwd=tmp_path)
    assert code == 2 and out == ""
    assert err.startswith("error: ") and err.count("\n") == 1 and message in err


def test_help_explains_the_command() -> None:
    top = kit("analysis", "--help")
    assert top.returncode == 0 and "summarize" in top.stdout
    sub = kit("analysis", "summarize", "--help")
    assert sub.returncode == 0
    assert all(word in sub.stdout for word in ("RUN_DIR", "--root", "--format", "--plot", "n/m"))


@pytest.mark.parametrize(
    ("column", "dp", "ddp", "text"),
    [
        ("epoch_s", 4.2, 2.0, "2.10× faster"),
        ("startup_s", 10.0, 13.0, "1.30× slower"),
        ("throughput", 100.0, 210.0, "+110%"),
        ("final_test_accuracy", 97.1, 97.5, "+0.4 pp"),
        ("epoch_s", math.nan, 2.0, "n/m"),
    ],
)
def test_the_improvement_column_reads_like_the_article(
    column: str, dp: float, ddp: float, text: str
) -> None:
    figure = next(f for f in FIGURES if f.column == column)
    assert comparison(figure, dp, ddp)[2] == text


def test_time_to_accuracy_counts_from_submission_and_from_the_first_touch_of_data(
    runs: dict[str, Path],
) -> None:
    """Any target the first epoch reaches: its end, counted from the run folder's making (the
    submission) and from rank 0's start of reading the data; a target no epoch reached: NaN."""
    from slurm_ddp_kit.analysis import load

    run_dir = runs["ddp"]
    meta = runfolder.read_meta(run_dir)
    ranks, _ = load._read_ranks(run_dir)
    start, first = ranks[0]["start"][-1], ranks[0]["epoch"][0]
    reached = load._time_to_accuracy(ranks[0], first["test_accuracy"], meta["created_at"])
    assert reached["tta_epoch"] == 1
    assert reached["tta_s"] == pytest.approx(first["time"] - meta["created_at"])
    # The process started after the submission, and read its data after its imports.
    assert reached["tta_s"] > reached["tta_data_s"] + start["startup_parts"]["python_and_imports"]
    assert reached["tta_data_s"] > first["seconds"]  # the first epoch lies inside it
    assert reached["tta_data_s"] == pytest.approx(first["time"] - start["data_touched"])
    best = max(e["test_accuracy"] for e in ranks[0]["epoch"])
    missed = load._time_to_accuracy(ranks[0], best + 0.001, meta["created_at"])
    assert all(math.isnan(v) for v in missed.values())


def _cache_file() -> Path:
    (cached,) = (Path(os.environ["XDG_CACHE_HOME"]) / "kit" / "summarize").iterdir()
    return cached


def test_a_second_summary_reads_again_only_the_runs_that_changed(
    runs: dict[str, Path], tmp_path: Path
) -> None:
    """The cache's results are used while a run is unchanged (shown by a figure planted in it),
    a run that changed is read afresh, and --no-cache reads every run."""
    root = tmp_path / "runs"
    dp, _ = _copy(runs["dp"], root), _copy(runs["ddp"], root)
    code, first, err = _summarize("--root", root)
    assert code == 0, err
    cached = _cache_file()
    assert cached.stat().st_mode & 0o777 == 0o600  # a pickle: its owner's alone
    kept = pickle.loads(cached.read_bytes())
    fingerprint, (row, notes) = kept["entries"][str(dp)]
    kept["entries"][str(dp)] = (fingerprint, ({**row, "final_test_accuracy": 12.34}, notes))
    cached.write_bytes(pickle.dumps(kept))
    accuracy = LABELS["final_test_accuracy"]
    planted = next(iter(_tables(_summarize("--root", root)[1]).values()))[accuracy][0]
    assert planted == "12.34", planted  # taken from the cache, not read
    assert _summarize("--root", root, "--no-cache")[1] == first
    runfolder.RecordWriter(dp, 0).write("notice", text="a later attempt's word")
    assert _summarize("--root", root)[1] == first  # changed: read afresh


def test_a_damaged_cache_is_passed_over_and_replaced(runs: dict[str, Path], tmp_path: Path) -> None:
    """… and another folder's cache, not used for a month, is deleted."""
    root = tmp_path / "runs"
    for mode in ("dp", "ddp"):
        _copy(runs[mode], root)
    first = _summarize("--root", root)[1]
    cached = _cache_file()
    unused = cached.with_name("0" * 24 + ".pickle")
    unused.write_bytes(cached.read_bytes())
    month_ago = time.time() - 31 * 86400
    os.utime(unused, (month_ago, month_ago))
    cached.write_bytes(b"not a pickle")
    code, out, err = _summarize("--root", root)
    assert (code, out, err) == (0, first, "")
    assert pickle.loads(cached.read_bytes())["entries"]  # written whole again
    assert not unused.exists()
    if os.getuid() == 0:  # someone else's file is never unpickled
        kept = pickle.loads(cached.read_bytes())
        for key, (fingerprint, (row, notes)) in kept["entries"].items():
            kept["entries"][key] = (fingerprint, ({**row, "final_test_accuracy": 12.34}, notes))
        cached.write_bytes(pickle.dumps(kept))
        os.chown(cached, 65534, 65534)
        assert _summarize("--root", root)[1] == first


def test_the_time_to_accuracy_benchmark_lists_each_run(
    runs: dict[str, Path], tmp_path: Path
) -> None:
    """docs/benchmarks/tta_runs.py, which tta.sh ends with: a line per run, with the figures the
    comparison table pools (here the final accuracy, as summarize prints it)."""
    import subprocess
    import sys

    from kit import REPO

    root = tmp_path / "runs"
    for mode in ("dp", "ddp"):
        _copy(runs[mode], root)
    done = subprocess.run(
        [sys.executable, str(REPO / "docs/benchmarks/tta_runs.py"), str(root)],
        env={**os.environ, "PYTHONPATH": str(REPO)},
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert done.returncode == 0, done.stderr
    lines = {line.split(" | ")[0]: line.split(" | ") for line in done.stdout.splitlines()}
    for mode in ("dp", "ddp"):
        cells = lines[f"| {runs[mode].name}"]
        assert cells[1] == f"{mode}, none"
        final = records(runs[mode], 0)[-1]["final_test_accuracy"]
        assert cells[-1] == f"{100 * final:.2f} |"


def test_the_scaling_table_gives_the_published_speed_ups() -> None:
    """docs/benchmarks/scaling_table.py, which scaling.sh ends with, over the published speed
    runs on 1 and 2 × H200: the speed-ups the speed benchmark's README states (1.37× default,
    1.39× fast path, 1.96× compute-bound), a path with no one-GPU run n/m."""
    import subprocess
    import sys

    from kit import REPO

    done = subprocess.run(
        [sys.executable, str(REPO / "docs/benchmarks/scaling_table.py"),
         str(REPO / "docs/benchmarks/speed-h200x2/runs")],
        env={**os.environ, "PYTHONPATH": str(REPO)}, capture_output=True, text=True, timeout=300,
    )  # fmt: skip
    assert done.returncode == 0, done.stderr
    rows = [line.split(" | ") for line in done.stdout.splitlines()[2:]]
    speed_ups = {(r[0].lstrip("| "), r[1], r[3]): r[-1].rstrip(" |") for r in rows}
    fast = "ddp, bf16, data on device, channels_last, cudnn benchmark, compile"
    assert speed_ups[("ddp, fp32, none", "512", "2")] == "1.37×"
    assert speed_ups[(f"{fast} (max-autotune-no-cudagraphs), CUDA graph", "512", "2")] == "1.39×"
    assert speed_ups[(f"{fast}, CUDA graph", "16000", "2")] == "1.96×"
    assert speed_ups[("dp, fp32, none", "512", "2")] == "n/m"


def test_a_cancelled_sweep_is_said_in_a_few_lines_naming_the_cancel(tmp_path: Path) -> None:
    """Twelve runs cancelled before they trained: each of the first ten says it was cancelled and
    how to finish it, the rest are counted in one line."""
    cfg = load_config(overrides=[f"output.root={tmp_path}/sweep", "cluster.backend=local"])
    for _ in range(12):
        run_dir = runfolder.create(cfg, launcher="test", backend="slurm", command=[])
        runfolder.update_meta(run_dir, job_id="9_1", cancel_requested=True)
    code, out, err = _summarize(tmp_path / "sweep")
    assert code == 1 and out == "", err
    lines = err.splitlines()
    assert len(lines) == 12, err
    assert all(
        "cancelled (`launch cancel`); `python -m launch resume " in line for line in lines[:10]
    )
    assert lines[10] == "skipped 2 more run(s) not finished: `launch status` shows each"
    assert lines[11].startswith("error: none of the 12 run(s) has finished its training")
