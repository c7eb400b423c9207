"""Shared test settings and fixtures.

Hypothesis: the property tests keep their own small ``max_examples``; this profile only stops
hypothesis from writing its example database into the checkout (``.hypothesis/``) and prints the
reproduction blob of a failing example, so a failure seen once can be replayed.

``clean_cache``: the one fixture for a test that needs zrw's weight cache empty. A module asks for
it explicitly, ``pytestmark = pytest.mark.usefixtures("clean_cache")``, or a test names it.

``nothing_changes``: for a test of a refused call. ``with nothing_changes(*roots, dirs=()):``
snapshots the weight-record registry, the native state of every recorded weight, the cache's
stats and entries, torch's global hooks, the bytes of every weight that is not released and of
its masters, and the given modules, optimizers, tensors and directories; it fails the test if
the block changed any of it (tests/helpers/refusal.py). Put ``pytest.raises`` inside the block.
"""

import gc

import pytest
from hypothesis import settings

settings.register_profile("zrw", database=None, print_blob=True, deadline=None)
settings.load_profile("zrw")


@pytest.fixture
def clean_cache():
    """The test starts and ends with an empty weight cache (released weights restored first, so
    no test leaves a poisoned parameter behind; hit/miss/skip counters zeroed).

    The cyclic GC is paused during the test: a collection of an earlier test's garbage in the
    middle of a measurement would shift the allocator's byte counts (a test that needs a
    collection calls gc.collect() itself, before it measures). zrw is imported here, not at the
    top, so that the tests that only read files (tests/docs) run without the built extension."""
    from zrw import cache

    cache.cache_clear()
    gc.disable()
    try:
        yield
    finally:
        gc.enable()
        cache.cache_clear()


@pytest.fixture
def nothing_changes():
    """A context manager that fails the test if its block changed zrw's or the roots' state
    (see the module docstring; the same as helpers.refusal.unchanged)."""
    from helpers.refusal import unchanged

    return unchanged
