"""The package, and the Hydra configs inside its wheel: the top-level conf/ (with recipes/, linked
as conf/recipe) is installed as lightning_pipe/conf, one copy in the repository. The rest of the
metadata is in pyproject.toml."""

import os

from setuptools import find_namespace_packages, setup

# conf/ and its config groups as packages of YAML files (followlinks: conf/recipe is ../recipes)
CONF = ["lightning_pipe.conf" + root[len("conf") :].replace(os.sep, ".") for root, _, _ in os.walk("conf", followlinks=True)]

setup(
    # namespace packages too: lightning_pipe.runtime and .adaptive have no __init__.py
    packages=find_namespace_packages(include=["lightning_pipe", "lightning_pipe.*"], exclude=["*.__pycache__"]) + CONF,
    package_dir={"lightning_pipe.conf": "conf"},
    package_data={
        **{name: ["*.yaml"] for name in CONF},
        # adaptive=learned's and adaptive=paper's trained networks (lightning_pipe.adaptive.offline and .paper_offline regenerate them)
        "lightning_pipe.adaptive": ["weights/*.pt", "weights/*.json"],
    },
)
