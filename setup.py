"""Packaging: the design card's top-level folders are installed as subpackages of `hybrid_indexpool`.

Every package below those folders is found, not listed, so a new kernel folder cannot be left out of the wheel.
Metadata, dependencies and package data are in `setup.cfg`.
"""

from setuptools import find_packages, setup

# Installed name -> folder in the checkout.
PACKAGE_FOLDERS = {
    "hybrid_indexpool": "hybrid_indexpool",
    "hybrid_indexpool.configuration": "configuration",
    "hybrid_indexpool.modeling": "modeling",
    "hybrid_indexpool.kernels": "kernels",
    "hybrid_indexpool.scripts": "scripts",
    "hybrid_indexpool.serving": "serving",
}

setup(
    package_dir=PACKAGE_FOLDERS,
    packages=[f"{name}.{found}" if found else name
              for name, folder in PACKAGE_FOLDERS.items() for found in ["", *find_packages(folder)]],
)
