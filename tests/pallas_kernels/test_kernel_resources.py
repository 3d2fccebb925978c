"""ptxas' registers and spills of compiled Mosaic GPU kernels (meshmoe.analysis.kernel_resources): read from a
real deviceless compile for an H100, and from logs whose figures are known."""

import functools

import jax
import jax.numpy as jnp
import pytest
from jax.sharding import PartitionSpec as P

from meshmoe.analysis import deviceless, kernel_resources
from meshmoe.pallas_kernels import mosaic_tiles
from meshmoe.pallas_kernels.grouped_weight_gradient import api, mosaic_gpu
from tests.pallas_kernels import harness


@pytest.mark.parametrize("tiles", [mosaic_tiles.DEFAULT_TILES, mosaic_tiles.HOPPER_TILES],
                         ids=["one-warpgroup", "warp-specialised"])
def test_a_deviceless_compile_reports_each_kernel_by_name(tmp_path, monkeypatch, tiles):
  monkeypatch.setenv(kernel_resources.DUMP_DIRECTORY, str(tmp_path))  # restored after the test
  mesh, rows = harness.h100_mesh(1), 8 * 64
  args = [harness.abstract(mesh, shape, dtype, P())
          for shape, dtype in [((rows, 512), jnp.bfloat16), ((rows, 512), jnp.bfloat16), ((4,), jnp.int32),
                               ((4, 512, 512), jnp.bfloat16)]]
  jax.jit(lambda x, dy, rows, like: api.weight_gradient(x, dy, rows, like, tile_rows=64, backend="mosaic_gpu",
                                                        num_sms=harness.h100_sms(), tiles=tiles)
          ).lower(*args).compile(compiler_options=deviceless.ANALYSIS_OPTIONS)
  [kernel] = kernel_resources.read(tmp_path)
  assert kernel["name"].startswith(mosaic_gpu.KERNEL_NAME)
  assert 0 < kernel["registers"] <= 255 and kernel["spill_store_bytes"] == 0 == kernel["spill_load_bytes"]
  # A producer and two consumers set their budgets; one warpgroup keeps what it launched with.
  assert kernel["warpgroup_registers"] == ([mosaic_gpu.PRODUCER_REGISTERS, 232] if tiles.consumers > 1 else [])


def test_read_takes_the_figures_from_ptxas_and_the_budgets_from_the_ptx(tmp_path):
  (tmp_path / "moe_dispatch_gemm_2.ptxas").write_text(
      "ptxas info    : Compiling entry function 'body_mosaic_gpu_kernel' for 'sm_90a'\n"
      "ptxas warning : Registers are spilled to local memory in function 'body_mosaic_gpu_kernel', 684 bytes spill "
      "stores, 688 bytes spill loads\n    432 bytes stack frame, 684 bytes spill stores, 688 bytes spill loads\n"
      "ptxas info    : Used 128 registers, used 16 barriers, 1 bytes smem\n")
  (tmp_path / "moe_dispatch_gemm_2.ptx").write_text("".join(
      f"setmaxnreg.{change}.sync.aligned.u32 {n};\n" for change, n in (("dec", 40), ("inc", 224), ("dec", 24))))
  (tmp_path / "flash_attention_0.ptxas").write_text(
      "    0 bytes stack frame, 0 bytes spill stores, 0 bytes spill loads\nptxas info    : Used 90 registers\n")
  assert kernel_resources.read(tmp_path) == [
      {"name": "flash_attention_0", "registers": 90, "spill_store_bytes": 0, "spill_load_bytes": 0,
       "warpgroup_registers": []},
      {"name": "moe_dispatch_gemm_2", "registers": 128, "spill_store_bytes": 684, "spill_load_bytes": 688,
       "warpgroup_registers": [40, 224, 24]}]
  assert "moe_dispatch_gemm_2" in "\n".join(kernel_resources.format_lines(kernel_resources.read(tmp_path)))
  (tmp_path / "broken.ptxas").write_text("not a ptxas log")
  with pytest.raises(ValueError, match="broken.ptxas: no 'Used N registers'"):
    kernel_resources.read(tmp_path)


def test_fused_kernels_are_named_after_their_programs():
  from meshmoe.pallas_kernels import gpu_kernel
  from meshmoe.pallas_kernels.moe_dispatch_gemm import protocol, swiglu
  assert gpu_kernel.program_name(functools.partial(protocol.run, p=2)) == "moe_dispatch_gemm"
  assert gpu_kernel.program_name(swiglu.gradient_kernel) == "moe_dispatch_gemm_swiglu_gradient_kernel"
  assert gpu_kernel.named(lambda *refs: None, "moe_gemm_return").__name__ == "moe_gemm_return"
