"""Draw the robot from its collision hulls instead of its visual meshes (`env.robot_visual: hull`).

On the software renderer (lavapipe) a frame's cost is set by the triangles it shades, not by its
pixels: every vertex is transformed even when it lies outside the view. ManiSkill's Panda has
~135 k visual triangles; its links' convex collision hulls have ~150-260 each. At 64 px over the
workspace a PushCube frame takes ~17 ms with the visual meshes and ~4 ms with the hulls, and the
robot looks the same shape and colour in the image, only faceted (docs/performance.md).

The swap is made once, after the env is built: each link keeps its visual render body, disabled,
and gains one made of its hulls (flat-shaded, in the colour of its largest visual part); a link
with no convex hull (the Panda's fingers collide as boxes) keeps its visual mesh. The physics and
the other objects are untouched. ManiSkill rebuilds its scene only on a reconfigure,
which these envs never ask for (reconfiguration_freq 0), so the swap holds for the env's life.
"""

from __future__ import annotations

import numpy as np


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
    them, in every sub-scene. Returns the number of links swapped (0 for a robot with none)."""
    import sapien

    swapped = 0
    for link in base_env.agent.robot.get_links():
        for component in link._objs:                # one per sub-scene
            entity = component.entity
            visual = entity.find_component_by_type(sapien.render.RenderBodyComponent)
            hulls = [s for s in component.collision_shapes
                     if isinstance(s, sapien.physx.PhysxCollisionShapeConvexMesh)]
            if visual is None or not hulls or not visual.is_enabled:
                continue
            parts = [p for shape in visual.render_shapes for p in shape.parts]
            material = max(parts, key=lambda p: len(p.get_triangles())).material
            body = sapien.render.RenderBodyComponent()
            for hull in hulls:
                v, tris, normals = flat_shaded(hull.get_vertices() * hull.get_scale(), hull.get_triangles())
                shape = sapien.render.RenderShapeTriangleMesh(v, tris, normals, np.zeros((len(v), 2), np.float32),
                                                              material)
                shape.local_pose = hull.get_local_pose()
                body.attach(shape)
            visual.disable()
            entity.add_component(body)
            swapped += 1
    return swapped
