"""`neuralraycast share`: the page renders the trained field in a browser (headless Chromium, WebGPU on
SwiftShader) as the desktop renderer does, with the key light's mesh shadows where the run has them, and
makes no network request."""

from __future__ import annotations

import json
import time

import numpy as np
import pytest
from headless_browser import Browser, find_chromium

from NeuralRaycastLib.app.cli import main

pytestmark = pytest.mark.gpu


def psnr(a: np.ndarray, b: np.ndarray) -> float:
    mse = float(np.mean((a.astype(np.float64) - b.astype(np.float64)) ** 2))
    return float("inf") if mse == 0 else 10.0 * np.log10(1.0 / mse)


def test_shared_page_renders_the_desktop_picture_without_network_requests(tmp_path, capsys, gpu):
    from NeuralRaycastLib.app.share import view_floats
    from NeuralRaycastLib.render.camera import orbit_cameras
    from NeuralRaycastLib.train.run_folder import open_run

    chromium = find_chromium()
    if chromium is None:
        pytest.skip("no chromium on this machine (tools/setup.sh installs Debian's package)")
    # The phantom run test_cli trains (the same kernels, from the shader cache).
    assert main(["sample", str(tmp_path / "s"), "--case", "phantom", "--spacing", "4"]) == 0
    manifest = capsys.readouterr().out.strip()
    run = tmp_path / "run"
    assert main(["fit", manifest, "--preset", "quick", "--iterations", "12", "--views", "4", "--size", "32",
                 "--out", str(run)]) == 0
    page = tmp_path / "page.html"
    assert main(["share", str(run), "--out", str(page)]) == 0
    assert str(page) in capsys.readouterr().out
    html = page.read_text()
    assert "default-src 'none'" in html and str(tmp_path) not in html  # no request allowed; no path of the study
    assert main(["share", str(run), "--out", str(page)]) == 2  # never over an existing page unless told
    assert str(page) in capsys.readouterr().err

    trained = open_run(gpu, run)
    assert trained.prepared.study.name not in html  # nor the study's name
    camera = orbit_cameras(trained.prepared.bounds, 3, 64, 64)[1]
    desktop = trained.render(camera).rgba
    assert desktop[..., 3].max() > 0.2  # something is in view

    # A run trained with --shadows is rendered with the key light's shadows from meshes of its learned surfaces,
    # on the desktop and in its page (the setting in run.json is what such a run has; training with it here
    # would only make the references slower).
    meta = json.loads((run / "run.json").read_text())
    meta["settings"]["shadows"] = True
    (run / "run.json").write_text(json.dumps(meta))
    shadowed_page = tmp_path / "shadowed.html"
    assert main(["share", str(run), "--out", str(shadowed_page)]) == 0
    assert "with its meshes' shadows" in capsys.readouterr().out
    shadowed = open_run(gpu, run).render(camera).rgba

    browser = Browser(chromium, timeout=600)
    try:
        pixels = {}
        for name, path, shadows in (("plain", page, True), ("shadowed", shadowed_page, True),
                                    ("shadows off", shadowed_page, False)):
            browser.open(path.as_uri() + "#test")  # renderForTest alone renders
            ready = browser.evaluate("window.pageReady.catch(e => e.message)")
            assert ready == "ready", browser.evaluate("window.gpuErrors")
            view = json.dumps(view_floats(camera, shadows).tolist())
            pixels[name] = np.asarray(browser.evaluate(f"window.renderForTest({view})"), np.float32).reshape(64, 64, 4)
        requests = list(browser.requests)
    finally:
        browser.close()
    for name, expected in (("plain", desktop), ("shadowed", shadowed), ("shadows off", desktop)):
        web = pixels[name]
        assert psnr(np.clip(web[..., :3], 0, 1), np.clip(expected[..., :3], 0, 1)) >= 40.0, name
        assert psnr(web[..., 3], expected[..., 3]) >= 40.0, name
    # The shadows are the desktop's: far closer to its shadowed picture than to the unshadowed one.
    assert psnr(pixels["shadowed"], shadowed) > psnr(pixels["shadowed"], desktop) + 10.0
    # The pages themselves, nothing else.
    assert {url.split("#")[0] for url in requests} == {page.as_uri(), shadowed_page.as_uri()}


def test_the_report_shows_the_live_view_where_webgpu_is_and_says_so_elsewhere(tmp_path):
    """The demo's report frames live.html where the browser has a WebGPU adapter; without one it says so
    above the turntable GIF, which stays."""
    from headless_browser import CHROMIUM_FLAGS

    from NeuralRaycastLib.app.report import write_report

    chromium = find_chromium()
    if chromium is None:
        pytest.skip("no chromium on this machine (tools/setup.sh installs Debian's package)")
    (tmp_path / "live.html").write_text("<!doctype html><title>live</title>")
    metrics = {"dice": {}, "heldout_psnr": 30.0, "heldout_ssim": 0.9, "image_size": 32, "preset": "quick",
               "train_seconds": 1.0, "device": "d", "backend": "vulkan", "model_bytes": 1}
    report = write_report(tmp_path, {
        "study": "s", "metrics": metrics, "log_rows": [], "timings": {}, "meshes": [], "versions": {},
        "pictures": {"held_out": [], "turntable": "turntable.gif", "live": "live.html", "depth": "d.png",
                     "normal": "n.png"}})
    shown = "[!document.getElementById('live-view').hidden, !document.getElementById('live-missing').hidden, " \
            "!!document.querySelector('img[src=\"turntable.gif\"]')]"
    without_webgpu = tuple(f for f in CHROMIUM_FLAGS if "webgpu" not in f.lower() and "Vulkan" not in f)
    for flags, expected in ((without_webgpu, [False, True, True]), (CHROMIUM_FLAGS, [True, False, True])):
        browser = Browser(chromium, flags=flags)
        try:
            browser.open(report.as_uri())
            deadline = time.time() + 60
            while browser.evaluate(shown) != expected and time.time() < deadline:
                time.sleep(0.2)  # the adapter is asked for after the page loads
            assert browser.evaluate(shown) == expected, flags
        finally:
            browser.close()
    assert "does not offer WebGPU" in report.read_text()


def test_the_page_stores_each_hash_grid_entry_as_one_byte_within_half_a_step_and_the_networks_in_float16():
    """The page's field (what share.py's page_parameters says the browser renders with): every hash-grid entry
    within half a 255th of its level's and feature's range, the networks as float16, and the table's bytes
    a third of float16's or less, which is what keeps the sample's page small."""
    import gzip

    from NeuralRaycastLib.app.share import page_parameters, quantised_parameters, table_columns
    from NeuralRaycastLib.field.field import FieldLayout, field_config_for

    layout = FieldLayout.build(field_config_for(4.0, small=True), np.array([[0, 0, 0], [60, 70, 50.0]]), 3, 1)
    rng = np.random.default_rng(0)
    values = layout.initial_parameters(0)
    near_zero = rng.random(layout.geometry_offset) < 0.7  # most entries stay near their start, as trained ones do
    values[: layout.geometry_offset] = np.where(near_zero, values[: layout.geometry_offset],
                                                rng.normal(0, 0.2, layout.geometry_offset))
    paged = page_parameters(values, layout)
    for column in table_columns(layout):
        step = np.ptp(values[column]) / 255
        assert np.max(np.abs(paged[column] - values[column])) <= 0.5 * step * (1 + 1e-5)
    networks = slice(layout.geometry_offset, None)
    assert np.array_equal(paged[networks], values[networks].astype(np.float16).astype(np.float32))
    stored = quantised_parameters(values, layout)
    halves = len(gzip.compress(values[: layout.geometry_offset].astype(np.float16).tobytes(), 9))
    assert len(stored["table"]) * 3 / 4 <= halves / 2  # base64 back to bytes


def test_the_page_keeps_the_occupancy_distances_only_at_corners_of_occupied_cells():
    """The kernel interpolates `nearest` only inside occupied cells: exactly their corners are kept (the rest
    are zeros, which pack to nothing), so leaving them out changes no sample."""
    from NeuralRaycastLib.app.share import read_corners
    from NeuralRaycastLib.render.occupancy import Occupancy

    cells = np.zeros((3, 4, 5), bool)
    cells[1, 2, 3] = True
    cells[0, 0, 0] = True
    read = read_corners(Occupancy(cells, np.zeros(3), 1.0, np.ones((4, 5, 6), np.float32), 2.0))
    expected = np.zeros((4, 5, 6), bool)
    expected[1:3, 2:4, 3:5] = True
    expected[0:2, 0:2, 0:2] = True
    assert np.array_equal(read, expected)


def test_the_pages_bvh_holds_the_same_triangles_within_its_boxes():
    """The page's BVH (share.py's page_bvh: leaves of up to 16 triangles, corners two bytes an axis, boxes
    computed from the decoded corners): every triangle and its mesh kept, each corner within half a 65535th of
    the meshes' box, every triangle inside its leaf's box and every box inside its parent's, so a ray that
    meets a triangle is never culled on the way to it."""
    from NeuralRaycastLib.app.share import PAGE_LEAF_TRIANGLES, page_bvh
    from NeuralRaycastLib.mesh.bvh import build_bvh
    from NeuralRaycastLib.mesh.mesh import Mesh

    rng = np.random.default_rng(3)
    meshes = []
    for m in range(3):
        centres = rng.uniform(-60, 60, (300, 1, 3))
        vertices = (centres + rng.normal(0, 2, (300, 3, 3))).reshape(-1, 3)
        meshes.append(Mesh(vertices, np.arange(900).reshape(-1, 3), np.zeros((0, 3)), f"m{m}", (1.0, 1.0, 1.0)))
    desktop = build_bvh(meshes)
    page = page_bvh(desktop)
    assert len(page.links) < len(desktop.links) / 2  # bigger leaves: fewer nodes, fewer links to carry

    # Each of the page's triangles is one of the desktop's, of the same mesh, its corners within half a step.
    step = np.ptp(desktop.corners.reshape(-1, 3), axis=0) / 65535
    apart = np.max(np.abs(page.corners.reshape(-1, 1, 9) - desktop.corners.reshape(1, -1, 9)), axis=2)
    match = np.argmin(apart, axis=1)
    assert sorted(match) == list(range(len(desktop.corners)))
    assert np.array_equal(page.triangle_meshes, desktop.triangle_meshes[match])
    assert np.all(np.abs(page.corners - desktop.corners[match]) <= 0.5 * step * (1 + 1e-3) + 1e-5)
    for node, (first, second) in enumerate(page.links):
        if second < 0:
            assert -second <= PAGE_LEAF_TRIANGLES
            inside = page.corners[first:first - second].reshape(-1, 3)
            assert np.all(inside >= page.box_min[node]) and np.all(inside <= page.box_max[node])
        else:
            for child in (first, second):
                assert np.all(page.box_min[child] >= page.box_min[node])
                assert np.all(page.box_max[child] <= page.box_max[node])
