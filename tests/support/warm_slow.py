"""A module for the zygote of tests/trainer/test_warm.py to preload (``--preload _warm_slow``) whose
import lasts until the file named by ``WARM_TEST_RELEASE`` exists (at most 60 s): a zygote
caught still importing."""

import os
import time

_release = os.environ["WARM_TEST_RELEASE"]
_deadline = time.time() + 60
while not os.path.exists(_release) and time.time() < _deadline:
    time.sleep(0.02)
