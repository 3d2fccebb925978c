"""The quickstart notebook runs top to bottom (a failing cell fails the test)."""

import pathlib

import nbformat
import pytest
from nbclient import NotebookClient

NOTEBOOK = pathlib.Path(__file__).resolve().parents[1] / "experiments" / "notebooks" / "quickstart.ipynb"


@pytest.mark.slow
def test_quickstart_notebook_executes(monkeypatch):
  from tests import runs
  for name, value in runs.env(processes=1).items():  # the kernel's: a training run's (its compilation cache)
    monkeypatch.setenv(name, value)
  notebook = nbformat.read(NOTEBOOK, as_version=4)
  NotebookClient(notebook, timeout=600, kernel_name="python3",
                 resources={"metadata": {"path": str(NOTEBOOK.parent)}}).execute()  # as Jupyter runs it
  outputs = "".join(o.get("text", "") for cell in notebook.cells if cell.cell_type == "code"
                    for o in cell.get("outputs", []))
  assert "8 devices" in outputs
  assert "unigram entropy" in outputs and "--- greedy ---" in outputs
  images = [o for cell in notebook.cells for o in cell.get("outputs", []) if "image/png" in o.get("data", {})]
  assert images, "the loss plot is not displayed"
