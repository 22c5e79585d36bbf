"""Draw the robot from its collision hulls instead of its visual meshes (`env.robot_visual: hull`).

On the software renderer (lavapipe) a frame's cost is set by the triangles it shades, not by its
pixels: every vertex is transformed even when it lies outside the view. ManiSkill's Panda has
~135 k visual triangles; its links' convex collision hulls have ~150-260 each. At 64 px over the
workspace a PushCube frame takes ~17 ms with the visual meshes and ~4 ms with the hulls, and the
robot looks the same shape and colour in the image, only faceted (docs/performance.md).

The swap is made once, after the env is built: each link keeps its visual render body, disabled,
and gains one made of its hulls (flat-shaded, in the colour of its largest visual part). A link
with no convex collision hull keeps its visual mesh if that is small (the Panda's fingers collide
as boxes: 624 triangles each), else it is drawn as that mesh's oriented bounding box: the wrist
camera of `panda_wristcam` has no collision shape and a 425 k-triangle model (its convex hull
alone has 12 k), which made a 64 px frame ~50 ms. The physics and the other objects are
untouched. ManiSkill rebuilds its scene only on a reconfigure, which these envs never ask for
(reconfiguration_freq 0), so the swap holds for the env's life.
"""

from __future__ import annotations

import numpy as np

# A link without convex collision hulls keeps a visual mesh of up to this many triangles.
MAX_KEPT_TRIANGLES = 5_000


def flat_shaded(vertices: np.ndarray, triangles: np.ndarray) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """(vertices [3n,3], triangles [n,3], normals [3n,3]) of a triangle mesh with each triangle's
    own corners, so that each face gets its own normal: a hull shaded with shared-vertex normals
    looks like a smooth blob, with face normals like the faceted solid it is."""
    v = np.asarray(vertices, np.float32)[np.asarray(triangles, np.int64)].reshape(-1, 3)
    tris = np.arange(len(v), dtype=np.uint32).reshape(-1, 3)
    normals = np.cross(v[1::3] - v[0::3], v[2::3] - v[0::3])
    normals /= np.linalg.norm(normals, axis=1, keepdims=True) + 1e-12
    return v, tris, np.repeat(normals, 3, axis=0).astype(np.float32)


def draw_robot_with_hulls(base_env) -> int:
    """Swap the render body of every robot link that has convex collision hulls for one made of
    them, and of every link with no hulls and a large visual mesh for that mesh's bounding box, in
    every sub-scene. Returns the number of links swapped (0 for a robot with none)."""
    import sapien

    swapped = 0
    for link in base_env.agent.robot.get_links():
        for component in link._objs:                # one per sub-scene
            entity = component.entity
            visual = entity.find_component_by_type(sapien.render.RenderBodyComponent)
            if visual is None or not visual.is_enabled:
                continue
            hulls = [(hull.get_vertices() * hull.get_scale(), hull.get_triangles(), hull.get_local_pose())
                     for hull in component.collision_shapes
                     if isinstance(hull, sapien.physx.PhysxCollisionShapeConvexMesh)]
            parts = [p for shape in visual.render_shapes for p in shape.parts]
            if not hulls and sum(len(p.get_triangles()) for p in parts) > MAX_KEPT_TRIANGLES:
                hulls = [visual_box(visual)]
            if not hulls:
                continue
            material = max(parts, key=lambda p: len(p.get_triangles())).material
            body = sapien.render.RenderBodyComponent()
            for vertices, triangles, pose in hulls:
                v, tris, normals = flat_shaded(vertices, triangles)
                shape = sapien.render.RenderShapeTriangleMesh(v, tris, normals, np.zeros((len(v), 2), np.float32),
                                                              material)
                shape.local_pose = pose
                body.attach(shape)
            visual.disable()
            entity.add_component(body)
            swapped += 1
    return swapped


def visual_box(visual) -> tuple:
    """(vertices, triangles, identity pose) of the oriented bounding box of a render body's meshes,
    in its entity's frame."""
    import sapien
    import trimesh

    points = []
    for shape in visual.render_shapes:
        pose = shape.local_pose.to_transformation_matrix()
        scale = np.asarray(getattr(shape, "scale", (1.0, 1.0, 1.0)), np.float64)
        for part in shape.parts:
            v = np.asarray(part.get_vertices(), np.float64) * scale
            points.append(v @ pose[:3, :3].T + pose[:3, 3])
    box = trimesh.PointCloud(np.concatenate(points)).bounding_box_oriented
    return np.asarray(box.vertices, np.float32), np.asarray(box.faces, np.uint32), sapien.Pose()
