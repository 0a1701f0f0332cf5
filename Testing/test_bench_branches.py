"""The side-by-side comparison of the two branches (``bench --suite branches``) and the demo report's column per
branch, from a field run and a Gaussian run trained for a few steps on the 4 mm phantom: every figure once per
branch, each the one the branch's own ``evaluate`` wrote, and the refusal of a demo without the field."""

from __future__ import annotations

import json
import math

import pytest

from NeuralRaycastLib.app.cli import main
from NeuralRaycastLib.bench.branches import BRANCHES, SUITE, branch_rows, run_branch, summary
from NeuralRaycastLib.bench.report import BenchReport, side_by_side
from NeuralRaycastLib.train.presets import RunSettings

STRUCTURES = ("brain", "whole_tumor", "tumor_core", "enhancing_tumor")


@pytest.fixture(scope="module")
def branch_results(tmp_path_factory, gpu):
    """Both branches through the suite's own steps, a dozen training steps each on four views of 32²."""
    folder = tmp_path_factory.mktemp("branches")
    assert main(["sample", str(folder / "s"), "--case", "phantom", "--spacing", "4"]) == 0
    manifest = next((folder / "s").rglob("manifest.json"))
    settings = RunSettings.for_device(gpu, "quick", views=4, size=32, iterations=12).check()
    messages = []
    results = [run_branch(gpu, branch, manifest, folder / branch, settings, (16,),
                          lambda message, fraction: messages.append(message)) for branch in BRANCHES]
    return folder, results, messages


@pytest.mark.gpu
def test_each_figure_has_a_row_per_branch_with_what_evaluate_wrote(branch_results):
    folder, results, messages = branch_results
    assert any(m.startswith("field: fit") for m in messages) and any(m.startswith("gaussians: fit") for m in messages)
    rows = branch_rows(results)
    assert {row.suite for row in rows} == {SUITE}
    by_figure: dict[str, dict[str, float]] = {}
    for row in rows:
        assert row.column not in by_figure.get(row.metric, {}), row
        by_figure.setdefault(row.metric, {})[row.column] = row.value
    expected = {"held-out PSNR", "held-out SSIM", "training time", "fit wall clock", "frame time 16²",
                "live view frame 16²", "peak GPU memory while fitting", "model size"}
    expected |= {f"{name}: {figure}" for name in STRUCTURES for figure in ("Dice", "mean surface distance", "HD95")}
    assert set(by_figure) == expected
    assert all(set(values) == set(BRANCHES) for values in by_figure.values()), by_figure
    # figure by figure, the field's row right before the Gaussians'
    assert [row.column for row in rows] == list(BRANCHES) * len(expected)
    model = {"field": "model.safetensors", "gaussians": "gaussians.safetensors"}
    for branch in BRANCHES:
        written = json.loads((folder / branch / "metrics.json").read_text())
        assert by_figure["held-out PSNR"][branch] == pytest.approx(written["heldout_psnr"]) and 5 < written[
            "heldout_psnr"] < 60
        assert by_figure["held-out SSIM"][branch] == pytest.approx(written["heldout_ssim"])
        assert by_figure["model size"][branch] == pytest.approx((folder / branch / model[branch]).stat().st_size / 1e6)
        assert by_figure["training time"][branch] == pytest.approx(written["train_seconds"])
        assert 0 < by_figure["training time"][branch] < by_figure["fit wall clock"][branch]
        assert by_figure["frame time 16²"][branch] > 0 and by_figure["live view frame 16²"][branch] > 0
        for name in STRUCTURES:  # a surface a few steps have not found has no distance: NaN, not a number made up
            for figure, key in (("Dice", "dice"), ("HD95", "hd95_mm"), ("mean surface distance",
                                                                      "mean_surface_distance_mm")):
                value, evaluated = by_figure[f"{name}: {figure}"][branch], written[key][name]
                assert math.isnan(value) if evaluated is None else value == pytest.approx(evaluated), (name, figure)
    assert json.loads((folder / "gaussians" / "run.json").read_text())["representation"] == "gaussians"
    assert (folder / "field" / "model.safetensors").is_file()


@pytest.mark.gpu
def test_the_markdown_sets_the_branches_side_by_side(branch_results):
    _, results, _ = branch_results
    rows = branch_rows(results)
    report = BenchReport("d", {"adapter": "a", "backend": "vulkan", "slangpy_version": "0", "python_version": "3"},
                         "neuralraycast bench --suite branches", "phantom", rows)
    text = report.markdown()
    table = side_by_side(rows)
    assert table in text
    lines = table.splitlines()
    assert lines[0] == "| figure | field | gaussians |"
    psnr = {row.column: row.value for row in rows if row.metric == "held-out PSNR"}
    assert f"| held-out PSNR (dB) | {psnr['field']:.4g} | {psnr['gaussians']:.4g} |" in lines
    assert len(lines) == 2 + len({row.metric for row in rows})
    # the rows table names each row's branch
    assert "| branches | held-out PSNR (gaussians) |" in text
    assert json.loads(json.dumps(report.as_dict()))["rows"][0]["column"] == "field"
    for result in results:  # the log's line per branch, there even when the suite is stopped later
        line = summary(result)
        assert f"held-out {result.metrics['heldout_psnr']:.2f} dB" in line and "frames 16² " in line, line
        assert f"whole_tumor {result.metrics['dice']['whole_tumor']:.3f}" in line, line


def test_a_figure_one_branch_lacks_or_could_not_read_is_marked_not_invented():
    from NeuralRaycastLib.bench.report import BenchRow

    rows = [BenchRow(SUITE, "peak GPU memory", math.nan, "GiB", column="field"),
            BenchRow(SUITE, "peak GPU memory", 2.5, "GiB", column="gaussians"),
            BenchRow(SUITE, "Gaussians", 1234.0, "", column="gaussians")]
    assert side_by_side(rows).splitlines()[2:] == ["| peak GPU memory (GiB) | n/a | 2.5 |", "| Gaussians | – | 1234 |"]


@pytest.mark.gpu
def test_the_demo_report_has_a_column_per_branch_and_the_gaussians_picture(branch_results, tmp_path):
    from NeuralRaycastLib.app.report import branch_column, write_report

    _, results, _ = branch_results
    columns = {result.branch: branch_column(result.metrics, 1e3 * result.frames[16][0]) for result in results}
    field = results[0].metrics
    held_out = [{"view": 3, "psnr": 20.0, "reference": "compare/003_reference.png", "neural": "compare/003_neural.png",
                 "error": "compare/003_error.png", "gaussians": "compare/003_gaussians.png", "gaussians_psnr": 18.5}]
    page = write_report(tmp_path, {
        "study": "phantom", "metrics": field, "log_rows": [], "timings": {}, "meshes": [], "versions": {},
        "branches": columns, "pictures": {"held_out": held_out, "turntable": "t.gif", "depth": "d.png",
                                          "normal": "n.png"}}).read_text()
    assert "<h2>Branches side by side</h2>" in page
    assert "<tr><th>figure</th><th>field</th><th>gaussians</th></tr>" in page
    for result in results:  # each column shows its branch's own evaluation
        assert f"{result.metrics['heldout_psnr']:.2f}" in page
        assert f"{result.metrics['dice']['whole_tumor']:.3f}" in page
    psnr_row = (f"<tr><td>held-out PSNR (dB)</td><td>{results[0].metrics['heldout_psnr']:.2f}</td>"
                f"<td>{results[1].metrics['heldout_psnr']:.2f}</td></tr>")
    assert psnr_row in page
    assert '<img src="compare/003_gaussians.png">' in page and "Gaussians (PSNR 18.50 dB)" in page
    # a field-only demo's report is as before: no side-by-side table
    alone = write_report(tmp_path, {"study": "phantom", "metrics": field, "log_rows": [], "timings": {},
                                    "meshes": [], "versions": {}, "branches": {"field": columns["field"]},
                                    "pictures": {"held_out": held_out[:0], "turntable": "t.gif", "depth": "d.png",
                                                 "normal": "n.png"}}).read_text()
    assert "Branches side by side" not in alone and "gaussians" not in alone


@pytest.mark.parametrize("branches", [["gaussians"], ["field", "splats"]])
def test_a_demo_without_the_field_or_with_an_unknown_branch_is_refused_before_any_work(branches, tmp_path, capsys):
    out = tmp_path / "demo"
    assert main(["demo", "--out", str(out), "--case", "fixture", "--branches", *branches]) == 2
    error = capsys.readouterr().err.strip()
    assert len(error.splitlines()) == 1, error
    assert error.startswith("neuralraycast demo: error: --branches ") and "'field gaussians'" in error
    assert not out.exists()


@pytest.mark.gpu
def test_a_branch_that_fails_is_a_row_saying_why_and_the_other_keeps_its_figures(branch_results, gpu, monkeypatch):
    from NeuralRaycastLib.bench import branches
    from NeuralRaycastLib.study.preprocess import prepare
    from NeuralRaycastLib.study.study import load_study

    folder, results, _ = branch_results
    trained = []

    def run_branch_or_fail(gpu, branch, study, out, settings, sizes, progress, quick, baseline):
        trained.append((branch, load_study(study).shape, settings.preset, sizes))
        if branch == "gaussians":
            raise RuntimeError("the GPU could not hold\nthe Gaussians")
        return results[0]

    monkeypatch.setattr(branches, "run_branch", run_branch_or_fail)
    prepared = prepare(load_study(next((folder / "s").rglob("manifest.json"))))
    rows = branches.bench_branches(gpu, prepared, True, lambda message, fraction: None)
    # both branches on the bench's own study, the quick preset and its frames, the Gaussians first
    assert trained == [(branch, prepared.study.shape, "quick", (128,)) for branch in ("gaussians", "field")]
    assert rows[0].metric == "settings" and "preset quick, 8 views of 64², 150 steps each" in rows[0].notes
    assert rows[-1].metric == "gaussians: failed" and rows[-1].notes == "the GPU could not hold the Gaussians"
    assert [row.metric for row in rows[1:-1]] == [row.metric for row in branch_rows(results[:1])]
    assert {row.column for row in rows[1:-1]} == {"field"}
