"""Shared test settings.

Hypothesis: the property tests keep their own small ``max_examples``; this profile only stops
hypothesis from writing its example database into the checkout (``.hypothesis/``) and prints the
reproduction blob of a failing example, so a failure seen once can be replayed.
"""

from hypothesis import settings

settings.register_profile("zrw", database=None, print_blob=True, deadline=None)
settings.load_profile("zrw")
