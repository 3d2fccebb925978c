"""Every twin kernel a test runs, and every Mosaic GPU kernel it runs in the GPU interpreter, is checked by a
race detector: its verdict is recorded after each kernel (pallas_kernels/twin_machine.py, harness.py), and a
test fails if any was flagged and the test did not take it."""

import pytest

from tests.pallas_kernels import harness


@pytest.fixture(autouse=True)
def every_kernel_is_race_free():
  harness.take_race_verdicts()
  yield
  flagged = harness.take_race_verdicts()
  assert not flagged, f"the race detectors flagged these kernels: {flagged}"
