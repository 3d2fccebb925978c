import jax
import meshmoe
import meshmoe.models
import meshmoe.sharding
import meshmoe.pallas_kernels


def test_eight_devices_and_package_layout():
  assert jax.device_count() == 8
  assert meshmoe.models.__name__ == "meshmoe.models"
