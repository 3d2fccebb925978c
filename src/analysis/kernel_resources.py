"""Registers and spills of the Mosaic GPU kernels a compile builds, as ptxas reports them: a compiled figure,
read without a GPU (deviceless compiles run ptxas too).

jaxlib's Mosaic GPU compiler writes each kernel's PTX and ptxas log into MOSAIC_GPU_DUMP_TO when that is set
(it reads the variable as each kernel compiles, with many other dumps, hundreds of MB for a training step,
and it notes on stderr that it cannot disassemble without nvdisasm). A kernel is named after its body
function: meshmoe's fused kernels after their program (pallas_kernels/gpu_kernel.py), tokamax's after its.
A kernel that spills keeps part of its working set in local memory, which costs bandwidth in every loop
that touches it; `warpgroup_registers` are the setmaxnreg budgets a warp-specialised kernel gives its
warpgroups (in the order the kernel sets them).
"""

from __future__ import annotations

import os
import re
from pathlib import Path
from typing import Any

DUMP_DIRECTORY = "MOSAIC_GPU_DUMP_TO"
_REGISTERS = re.compile(r"Used (\d+) registers")
_SPILLS = re.compile(r"(\d+) bytes spill stores, (\d+) bytes spill loads")
_SETMAXNREG = re.compile(r"setmaxnreg\.(?:inc|dec)\.sync\.aligned\.u32 (\d+)")


def dump_to(directory: str | os.PathLike) -> None:
  """Makes the Mosaic GPU kernels compiled from now on write their PTX and ptxas logs into `directory`."""
  os.environ[DUMP_DIRECTORY] = str(directory)


def read(directory: str | os.PathLike) -> list[dict[str, Any]]:
  """Each kernel's ptxas figures found in `directory`, by name: registers per thread at launch, spill store
  and load bytes per thread, and the warpgroups' register budgets."""
  kernels = []
  for log in sorted(Path(directory).glob("*.ptxas")):
    text = log.read_text(errors="replace")
    registers, spills = _REGISTERS.search(text), _SPILLS.search(text)
    if registers is None or spills is None:
      raise ValueError(f"{log}: no 'Used N registers' and spill line from ptxas (is it a ptxas log?)")
    ptx = log.with_suffix(".ptx")
    budgets = [int(n) for n in _SETMAXNREG.findall(ptx.read_text(errors="replace"))] if ptx.exists() else []
    kernels.append({"name": log.stem, "registers": int(registers.group(1)),
                    "spill_store_bytes": int(spills.group(1)), "spill_load_bytes": int(spills.group(2)),
                    "warpgroup_registers": budgets})
  return kernels


def format_lines(kernels: list[dict[str, Any]]) -> list[str]:
  lines = ["Mosaic GPU kernels (compiled: ptxas, per thread)   registers   warpgroup budgets   spilled bytes"]
  for k in kernels:
    budgets = " ".join(map(str, k["warpgroup_registers"])) or "-"
    lines.append(f"  {k['name']:46s} {k['registers']:5d}       {budgets:17s}   {k['spill_store_bytes']}")
  return lines
