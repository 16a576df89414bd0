"""Which packages the wheel holds: every ppdsl.* folder, found (setuptools reads
the rest from pyproject.toml), and grammar/ and codegen/ under the names that
pyproject.toml's package-dir gives them, ppdsl._grammar and ppdsl._templates, and
examples/ as ppdsl._schedules (the schedules `ppdsl plan` tries)."""

from setuptools import find_packages, setup

setup(packages=[*find_packages(include=["ppdsl", "ppdsl.*"]), "ppdsl._grammar", "ppdsl._templates",
                "ppdsl._schedules"])
