"""Launching a fused kernel's protocol program on a Hopper GPU: as one warpgroup per thread block
(gpu_machine.py) or warp-specialised (gpu_warp_specialized.py), as the machine's tiles say."""

from __future__ import annotations

import dataclasses

from jax.experimental.pallas import mosaic_gpu as plgpu

from meshmoe.pallas_kernels import gpu_machine, gpu_warp_specialized, mosaic_tiles
from meshmoe.pallas_kernels.gpu_machine import GpuMachine


def launch(program, machine: GpuMachine, *, out_type, scratch_types, interpret=None, transpose_b: bool = False,
           sender: bool = False):
  """Runs `program(machine, *refs)` as `machine.num_blocks` thread blocks; with machine.tiles.consumers > 1,
  warp-specialised (gpu_warp_specialized.py; `transpose_b`: the GEMMs' B operands are stored [N, K]; `sender`:
  a sender warpgroup runs the program's send phase, which then overlaps the GEMMs).
  Kernels that communicate (those with semaphores) start with Mosaic GPU's device barrier: every device of
  the ring has entered the kernel before any block runs. A ring of one skips it, since the barrier needs
  NVSHMEM, which a single GPU should not."""
  params = dataclasses.replace(mosaic_tiles.compiler_params(), skip_device_barrier=not scratch_types)
  grid = dict(grid=(machine.num_blocks,), grid_names=(gpu_machine.AXIS,))
  if machine.tiles.consumers > 1:
    body, threads = gpu_warp_specialized.kernel_body(program, machine, out_type, transpose_b, sender)
    grid |= threads
  else:
    body = lambda *refs: program(machine, *refs)
  return plgpu.kernel(named(body, program_name(program)), out_type=out_type, scratch_types=scratch_types,
                      compiler_params=params, interpret=interpret, **grid)


def program_name(program) -> str:
  """The kernel's name: its program's module under pallas_kernels, and the function unless it is a
  protocol's `run`, e.g. moe_dispatch_gemm or moe_dispatch_gemm_swiglu_gradient_kernel (Mosaic GPU names
  the compiled kernel, and its ptxas report, after it)."""
  function = getattr(program, "func", program)
  parts = [part for part in function.__module__.removeprefix("meshmoe.pallas_kernels.").split(".")
           if part != "protocol"]
  return "_".join(parts + ([function.__name__] if function.__name__ != "run" else []))


def named(body, name: str):
  """`body` as a function called `name` (Mosaic GPU takes a kernel's name from its body function's)."""
  def kernel(*refs):
    body(*refs)

  kernel.__name__ = kernel.__qualname__ = name
  return kernel
