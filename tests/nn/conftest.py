"""Fixtures for the training-layer tests (tests/nn).

The weight cache is one process-wide table, so every test starts and ends with it empty (released
weights are restored first, so no test leaves a poisoned parameter behind). The tensors here are
tiny: one intra-op thread is faster than two on the shared 2-core machine (no OpenMP spin-waits),
and it keeps each test's arithmetic on one fixed thread count.
"""

import pytest
import torch

from zrw import cache


@pytest.fixture(autouse=True, scope="module")
def _one_thread():
    prev = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(prev)


@pytest.fixture(autouse=True)
def _empty_cache():
    cache.cache_clear()
    yield
    cache.cache_clear()
