# Only the package layout lives here; the metadata, dependencies and package data are in setup.cfg.
# This file exists because the repository keeps its folders at the root (actors/, common/, learner/,
# launch/) and installs them as `asyncvla.<folder>`: setup.cfg's `find:` cannot add that prefix, and
# a list kept by hand forgets new subpackages (it once left out asyncvla.common.data.lerobot).
from setuptools import find_namespace_packages, setup

FOLDERS = ("actors", "common", "learner", "launch")

# Namespace discovery: a folder of data files without an __init__.py (launch/slurm/) is a package
# too, so setup.cfg's package_data ships its files. __pycache__ is no package.
found = find_namespace_packages(
    include=[pattern for folder in FOLDERS for pattern in (folder, f"{folder}.*")],
    exclude=["*__pycache__"])

setup(
    package_dir={f"asyncvla.{folder}": folder for folder in FOLDERS},
    packages=[f"asyncvla.{package}" for package in found],
)
