"""Fixtures for the training-layer tests (tests/nn); each module also asks for tests/conftest.py's
`clean_cache` (the weight cache is one process-wide table). The tensors here are tiny: one
intra-op thread is faster than two on the shared 2-core machine (no OpenMP spin-waits), and it
keeps each test's arithmetic on one fixed thread count.
"""

import pytest
import torch


@pytest.fixture(autouse=True, scope="module")
def _one_thread():
    prev = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(prev)
