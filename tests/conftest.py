"""Shared pytest set-up: GPU tests skip with a reason where CUDA is absent."""
import pytest
import torch


def pytest_collection_modifyitems(config, items):
    if torch.cuda.is_available():
        return
    skip = pytest.mark.skip(reason="needs a CUDA GPU (run `pytest -m gpu` on the GPU test machine)")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip)
