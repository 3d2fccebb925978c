"""Every twin kernel a test runs is checked by the race detector: its verdict is recorded after each kernel
(pallas_kernels/twin_machine.py), and a test fails if any was flagged and the test did not take it."""

import pytest

from tests.pallas_kernels import harness


@pytest.fixture(autouse=True)
def every_twin_kernel_is_race_free():
  harness.take_race_verdicts()
  yield
  flagged = harness.take_race_verdicts()
  assert not flagged, f"the race detector flagged these twin kernels: {flagged}"
