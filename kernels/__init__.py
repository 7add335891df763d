"""CUDA C sources of duelq's kernels, shipped as package data."""

from importlib import resources


def source(name: str) -> str:
    """Text of ``kernels/<name>`` (for example ``"learner_step.cu"``)."""
    return resources.files(__name__).joinpath(name).read_text(encoding="utf-8")
