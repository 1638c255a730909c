"""Hypothesis profiles for the invariance properties.

- ``ci``: derandomized, few examples, no deadline (interpreter and JIT times vary). The default.
- ``dev``: more examples, random, database kept out of the tree.
- ``h200``: many examples at real shapes on the GPU.
Select with HYPOTHESIS_PROFILE.
"""

import os
import tempfile

from hypothesis import HealthCheck, settings
from hypothesis.database import DirectoryBasedExampleDatabase

_SLOW_OK = [HealthCheck.too_slow, HealthCheck.data_too_large]
settings.register_profile(
    "ci",
    max_examples=6,
    derandomize=True,
    deadline=None,
    database=None,
    suppress_health_check=_SLOW_OK,
    print_blob=True,
)
settings.register_profile(
    "dev",
    max_examples=40,
    deadline=None,
    suppress_health_check=_SLOW_OK,
    database=DirectoryBasedExampleDatabase(os.path.join(tempfile.gettempdir(), "corun-hypothesis")),
)
settings.register_profile(
    "h200",
    max_examples=200,
    deadline=None,
    suppress_health_check=_SLOW_OK,
    database=None,
)
settings.load_profile(os.environ.get("HYPOTHESIS_PROFILE", "ci"))
