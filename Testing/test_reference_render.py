"""The reference raycaster: surfaces at the right depth, determinism, shadows exactly where occluded."""

from __future__ import annotations

import numpy as np
import pytest
from conftest import analytic_prepared, sphere_trace

from NeuralRaycastLib.render.camera import Camera, orbit_cameras
from NeuralRaycastLib.render.reference_render import ReferenceRenderer
from NeuralRaycastLib.render.style import Lighting, RenderStyle, StructureStyle
from NeuralRaycastLib.study.sample.phantom import Phantom, sphere_sdf

PHANTOM = Phantom()


@pytest.fixture(scope="module")
def phantom_exact():
    sdfs = {n: (lambda points, n=n: PHANTOM.sdf(n, points)) for n in Phantom.structure_names}
    return analytic_prepared(sdfs, 2.0, *PHANTOM.bounds(8.0))


def _surface_cosine(sdf, points, directions):
    h = 1e-3
    gradient = np.stack([(sdf(points + h * e) - sdf(points - h * e)) / (2 * h) for e in np.eye(3)], axis=-1)
    return np.abs((gradient * directions).sum(-1)) / np.linalg.norm(gradient, axis=-1)


@pytest.mark.parametrize("name", Phantom.structure_names)
def test_rays_hit_each_analytic_surface_at_the_right_depth(gpu, phantom_exact, name):
    """An opaque structure's depth is within half a step of the exact first hit (rays within 60° of the normal)."""
    style = RenderStyle({n: StructureStyle(0.999 if n == name else 0.0) for n in Phantom.structure_names})
    renderer = ReferenceRenderer(gpu, phantom_exact, style)
    half_step = 0.5 * style.step_voxels * 2.0
    epsilon = style.epsilon_voxels * 2.0

    def sdf(points):
        return PHANTOM.sdf(name, points)

    inside = np.argwhere(phantom_exact.boundary[phantom_exact.structure_index(name)] < 0)
    box = np.stack([inside.min(0), inside.max(0)]) * 2.0 + phantom_exact.affine[:3, 3]
    for camera in orbit_cameras(box, 2, 48, 40):  # the structure fills the frame
        image = renderer.render(camera)
        directions = camera.ray_directions()
        origin = np.array(camera.position)
        exact = sphere_trace(sdf, origin, directions)
        hit = np.isfinite(exact)
        assert hit.sum() > 10
        covered = image.rgba[..., 3] > 0.5
        assert covered[hit].mean() > 0.98
        # the smooth step widens silhouettes: a covered ray that misses passes within 3 ε of the surface
        halo = covered & ~hit
        reach = np.linalg.norm(origin - box.mean(axis=0)) + np.linalg.norm(box[1] - box[0])  # past the box
        samples = origin + np.arange(0.0, reach, 0.25)[:, None, None] * directions[halo][None]
        assert np.all(sdf(samples).min(axis=0) < 3 * epsilon)
        points = origin + np.where(hit, exact, 0.0)[..., None] * directions
        facing = hit & covered & (_surface_cosine(sdf, points, directions) > 0.5)
        error = np.abs(image.depth[facing] - exact[facing])
        assert error.max() <= half_step, f"{name}: depth error up to {error.max():.3f} mm"


def test_rendering_is_deterministic(gpu, phantom_exact):
    renderer = ReferenceRenderer(gpu, phantom_exact)
    camera = orbit_cameras(phantom_exact.bounds, 3, 40, 32)[1]
    for shadows in (False, True):
        first, second = renderer.render(camera, shadows), renderer.render(camera, shadows)
        assert np.array_equal(first.rgba, second.rgba) and np.array_equal(first.depth, second.depth)
        assert np.array_equal(first.normal, second.normal)
        assert np.isfinite(first.rgba).all() and first.rgba.min() >= 0.0 and first.rgba[..., 3].max() <= 1.0


def test_shadows_darken_exactly_the_regions_occluded_from_the_key_light(gpu):
    """A small sphere above a large one, the key light straight above: only the occluded part darkens."""
    top_centre, top_radius, bottom_radius = np.array([0.0, 0.0, 32.0]), 8.0, 18.0
    prepared = analytic_prepared(
        {"top": lambda p: sphere_sdf(p, top_centre, top_radius), "bottom": lambda p: sphere_sdf(p, (0, 0, 0), 18.0)},
        1.0, (-26, -26, -24), (26, 26, 46),
    )
    style = RenderStyle(
        # nearly opaque, so a ray stops at the front surface (the lit inside of a translucent shell is
        # rightly shadowed by the shell itself)
        {"top": StructureStyle(0.9999, specular=0.0), "bottom": StructureStyle(0.9999, specular=0.0)},
        Lighting(key_direction=(0.0, 0.0, 1.0)),
    )
    renderer = ReferenceRenderer(gpu, prepared, style)
    camera = Camera((0.0, -110.0, 75.0), (0.0, 0.0, 4.0), (0.0, 0.0, 1.0), 30.0, 96, 96)
    lit, shadowed = renderer.render(camera, shadows=False), renderer.render(camera, shadows=True)

    directions, origin = camera.ray_directions(), np.array(camera.position)
    t_bottom = sphere_trace(lambda p: sphere_sdf(p, (0, 0, 0), bottom_radius), origin, directions)
    t_top = sphere_trace(lambda p: sphere_sdf(p, top_centre, top_radius), origin, directions)
    on_bottom = np.isfinite(t_bottom) & ~(t_top < t_bottom + 1.0) & ~np.isfinite(t_top)
    points = origin + np.where(on_bottom, t_bottom, 0.0)[..., None] * directions
    facing_light = points[..., 2] / bottom_radius > 0.4  # n · l for a sphere at the origin
    to_centre = top_centre - points
    along = to_centre[..., 2]
    miss = np.linalg.norm(to_centre[..., :2], axis=-1)  # closest approach of the vertical light ray
    occluded = on_bottom & facing_light & (along > 0) & (miss < top_radius - 2.5)
    clear = on_bottom & facing_light & (miss > top_radius + 6.0)  # beyond the smooth step's tail
    assert occluded.sum() > 20 and clear.sum() > 20

    brightness_lit, brightness_shadowed = lit.rgba[..., :3].sum(-1), shadowed.rgba[..., :3].sum(-1)
    np.testing.assert_allclose(brightness_shadowed[clear], brightness_lit[clear], rtol=1e-3)
    assert np.all(brightness_shadowed[occluded] < 0.8 * brightness_lit[occluded])
    # nothing gets brighter anywhere
    assert np.all(brightness_shadowed <= brightness_lit + 1e-4)


def test_study_render_shows_every_structure(gpu, phantom_study_dir):
    from NeuralRaycastLib.study.preprocess import prepare
    from NeuralRaycastLib.study.study import load_study

    prepared = prepare(load_study(phantom_study_dir), use_cache=False)
    renderer = ReferenceRenderer(gpu, prepared)
    image = renderer.render(orbit_cameras(prepared.bounds, 1, 64, 64)[0])
    assert image.rgba[..., 3].max() > 0.9  # the tumour is nearly opaque
    assert (image.rgba[..., 3] > 0.1).mean() > 0.2  # the brain fills much of the frame
    # the tumour is red-dominated where it shows through the brain
    red = image.rgba[..., 0] > 1.5 * image.rgba[..., 2] + 0.05
    assert red.sum() > 10


def test_mesh_shadows_match_volumetric_shadows(gpu, phantom_study_dir):
    """The hybrid route (shadow rays against marching-cubes meshes through a BVH) gives the gold
    standard's picture: same shadowed pixels, high PSNR."""
    from NeuralRaycastLib.render.metrics import psnr
    from NeuralRaycastLib.render.reference_render import hybrid_shadows
    from NeuralRaycastLib.study.preprocess import prepare
    from NeuralRaycastLib.study.study import load_study

    prepared = prepare(load_study(phantom_study_dir), use_cache=False)
    renderer = ReferenceRenderer(gpu, prepared)
    camera = orbit_cameras(prepared.bounds, 5, 64, 64)[2]
    mesh = hybrid_shadows(gpu, prepared, renderer.style)
    lit = renderer.render(camera, shadows=False)
    volumetric = renderer.render(camera, shadows=True)
    hybrid = renderer.render(camera, mesh_shadows=mesh)
    darkened = lit.rgb().sum(-1) - volumetric.rgb().sum(-1) > 0.05
    assert darkened.sum() > 20  # the scene has shadows to compare
    assert psnr(hybrid.rgb(), volumetric.rgb()) > 35.0
    assert psnr(hybrid.rgb(), volumetric.rgb()) > psnr(lit.rgb(), volumetric.rgb()) + 5.0


def test_reference_views_are_rendered_once_then_read_from_the_cache(gpu, phantom_exact, tmp_path, monkeypatch):
    """A second run on the same study starts without rendering its views again; anything that changes
    the pixels is another entry, and a damaged entry is rendered again, never trusted."""
    from dataclasses import replace

    from NeuralRaycastLib.render.reference_views import render_reference_views

    prepared = replace(phantom_exact, key="phantom-exact")
    first = render_reference_views(gpu, prepared, 3, 24, 20, cache_root=tmp_path)
    assert len(list(tmp_path.iterdir())) == 1

    def no_render(*args, **kwargs):
        raise AssertionError("the views were rendered again")

    with monkeypatch.context() as patched:
        patched.setattr(ReferenceRenderer, "render", no_render)
        second = render_reference_views(gpu, prepared, 3, 24, 20, cache_root=tmp_path)
    for a, b in zip(first.images, second.images, strict=True):
        np.testing.assert_array_equal(a.rgba, b.rgba)
        np.testing.assert_array_equal(a.depth, b.depth)
        np.testing.assert_array_equal(a.normal, b.normal)
    assert (second.training, second.held_out) == (first.training, first.held_out)

    shadowed = render_reference_views(gpu, prepared, 3, 24, 20, shadows=True, cache_root=tmp_path)
    assert len(list(tmp_path.iterdir())) == 2
    assert not np.array_equal(shadowed.images[1].rgba, first.images[1].rgba)
    other_study = render_reference_views(gpu, replace(prepared, key="another"), 3, 24, 20, cache_root=tmp_path)
    assert len(list(tmp_path.iterdir())) == 3
    np.testing.assert_array_equal(other_study.images[0].rgba, first.images[0].rgba)  # same pixels, own entry

    for entry in tmp_path.iterdir():
        rgba = entry / "rgba.npy"
        rgba.write_bytes(rgba.read_bytes()[: rgba.stat().st_size // 2])  # truncated
    again = render_reference_views(gpu, prepared, 3, 24, 20, cache_root=tmp_path)
    np.testing.assert_array_equal(again.images[0].rgba, first.images[0].rgba)

    unkeyed = tmp_path / "unkeyed"
    render_reference_views(gpu, phantom_exact, 3, 24, 20, cache_root=unkeyed)
    assert not unkeyed.exists()

    from NeuralRaycastLib.render.reference_views import VIEW_CACHE_ENTRIES

    bounded = tmp_path / "bounded"
    for index in range(VIEW_CACHE_ENTRIES + 2):  # the oldest entries go, the newest stay
        render_reference_views(gpu, replace(prepared, key=f"study {index}"), 1, 16, 16, cache_root=bounded)
    assert len(list(bounded.iterdir())) == VIEW_CACHE_ENTRIES
