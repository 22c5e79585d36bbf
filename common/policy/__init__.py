"""The VLA policy shared by actors (sampling) and learner (training)."""
