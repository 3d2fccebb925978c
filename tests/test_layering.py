"""The layering of ARCHITECTURE.md is a tested rule, read from the imports of every module in the repository.

  experiments -> meshmoe (src/) -> meshmoe.models -> meshmoe.sharding -> meshmoe.pallas_kernels

An import may go down (skipping layers is fine) or stay in its layer, never up; meshmoe.config is plain
data that every layer may import: it and the section modules it re-exports (meshmoe.config_*) import
nothing of meshmoe but each other. Models reach the mesh only through
the parallel ops: they import neither the plan, nor the mesh, nor the rules table. No two modules import
each other, directly or round a longer cycle. Every import is counted, also those inside functions.
"""

import ast
import pathlib
import tomllib

import pytest

REPO = pathlib.Path(__file__).resolve().parents[1]
FOLDERS = {"src": "meshmoe", "models": "meshmoe.models", "sharding": "meshmoe.sharding",
           "pallas_kernels": "meshmoe.pallas_kernels", "experiments": "experiments"}
# Bottom first: a module may import its own layer and the ones before it.
LAYERS = ["meshmoe.pallas_kernels", "meshmoe.sharding", "meshmoe.models", "meshmoe", "experiments"]
# meshmoe.config and the modules it gathers its sections from (src/config.py).
PLAIN_DATA = {"meshmoe.config", "meshmoe.config_checks", "meshmoe.config_model", "meshmoe.config_parallel",
              "meshmoe.config_run"}
NOT_FOR_MODELS = ("meshmoe.sharding.plan", "meshmoe.sharding.mesh", "meshmoe.sharding.rules",
                  "meshmoe.sharding.parallel")


def module_files() -> dict[str, pathlib.Path]:
  """Every Python module of the repository's packages and entry points, by import name."""
  modules = {}
  for folder, package in FOLDERS.items():
    for path in sorted((REPO / folder).rglob("*.py")):
      parts = list(path.relative_to(REPO / folder).with_suffix("").parts)
      if parts[-1] == "__init__":
        parts = parts[:-1]
      modules[".".join([package, *parts])] = path
  return modules


def imports_of(path: pathlib.Path, name: str, known: set[str]) -> set[str]:
  """The repository modules `name` (at `path`) imports, wherever the import statement is."""
  found = set()
  package = name if path.name == "__init__.py" else name.rpartition(".")[0]
  for node in ast.walk(ast.parse(path.read_text(), str(path))):
    if isinstance(node, ast.Import):
      targets = [alias.name for alias in node.names]
    elif isinstance(node, ast.ImportFrom):
      base = node.module or ""
      if node.level:  # relative: from the package, up level - 1
        base = ".".join(package.split(".")[:len(package.split(".")) - node.level + 1] + ([base] if base else []))
      targets = [f"{base}.{alias.name}" for alias in node.names] + [base]
    else:
      continue
    for target in targets:
      while target and target not in known:  # `from a.b import c`: c is a module or a name in a.b
        target = target.rpartition(".")[0]
      if target and target != name:
        found.add(target)
  return found


def layer_of(module: str) -> int:
  """The index in LAYERS of the longest layer name that `module` is, or is inside."""
  matches = [layer for layer in LAYERS if module == layer or module.startswith(layer + ".")]
  return LAYERS.index(max(matches, key=len))


def violations(graph: dict[str, set[str]]) -> list[str]:
  """Imports that break the layering (module docstring), as readable lines."""
  found = []
  for module, imported in sorted(graph.items()):
    for target in sorted(imported):
      if module in PLAIN_DATA and target not in PLAIN_DATA:
        found.append(f"{module} imports {target}: the config is plain data and imports nothing of meshmoe")
      elif target in PLAIN_DATA:
        continue
      elif layer_of(target) > layer_of(module):
        found.append(f"{module} imports {target}: {LAYERS[layer_of(module)]} is below {LAYERS[layer_of(target)]}")
      elif layer_of(module) == LAYERS.index("meshmoe.models") and target.startswith(NOT_FOR_MODELS):
        found.append(f"{module} imports {target}: models reach the mesh only through the parallel ops")
  return found


def cycles(graph: dict[str, set[str]]) -> list[list[str]]:
  """The import cycles: strongly connected groups of more than one module (Tarjan's algorithm)."""
  index, low, stack, on_stack, groups = {}, {}, [], set(), []

  def visit(node):
    index[node] = low[node] = len(index)
    stack.append(node)
    on_stack.add(node)
    for target in sorted(graph.get(node, ())):
      if target not in index:
        visit(target)
        low[node] = min(low[node], low[target])
      elif target in on_stack:
        low[node] = min(low[node], index[target])
    if low[node] == index[node]:
      group = []
      while True:
        member = stack.pop()
        on_stack.discard(member)
        group.append(member)
        if member == node:
          break
      if len(group) > 1:
        groups.append(sorted(group))

  for node in sorted(graph):
    if node not in index:
      visit(node)
  return groups


@pytest.fixture(scope="module")
def graph() -> dict[str, set[str]]:
  files = module_files()
  return {name: imports_of(path, name, set(files)) for name, path in files.items()}


def test_no_import_goes_up_a_layer(graph):
  assert not violations(graph), "\n".join(violations(graph))


def test_no_import_cycle(graph):
  assert not cycles(graph), cycles(graph)


def test_the_graph_is_read_from_every_layer(graph):
  """The rule is checked on real imports: each layer's modules import the one below."""
  assert "meshmoe.sharding.plan" in graph["meshmoe.training.train_step"]
  assert "meshmoe.sharding.expert_parallel" in graph["meshmoe.models.moe"]
  assert "meshmoe.pallas_kernels.allgather_matmul.api" in graph["meshmoe.sharding.tensor_parallel"]
  assert "meshmoe.training.trainer" in graph["experiments.train"]  # an import inside a function
  assert graph["meshmoe.config"] == PLAIN_DATA - {"meshmoe.config"}  # it gathers its sections' modules


def test_the_checks_catch_an_upward_import_a_model_reading_the_plan_and_a_cycle():
  graph = {"meshmoe.sharding.plan": {"meshmoe.models.moe"}, "meshmoe.models.moe": {"meshmoe.sharding.plan"},
           "meshmoe.config": {"meshmoe.sharding.rules"}, "meshmoe.sharding.rules": {"meshmoe.config"},
           "meshmoe.pallas_kernels.ring": {"meshmoe.config"}}
  assert violations(graph) == [
      "meshmoe.config imports meshmoe.sharding.rules: the config is plain data and imports nothing of meshmoe",
      "meshmoe.models.moe imports meshmoe.sharding.plan: models reach the mesh only through the parallel ops",
      "meshmoe.sharding.plan imports meshmoe.models.moe: meshmoe.sharding is below meshmoe.models"]
  assert cycles(graph) == [["meshmoe.config", "meshmoe.sharding.rules"],
                           ["meshmoe.models.moe", "meshmoe.sharding.plan"]]


def test_relative_and_from_imports_resolve_to_modules(tmp_path):
  source = tmp_path / "x.py"
  source.write_text("from . import b\nfrom .c import name\nimport meshmoe.d\n\ndef f():\n  from meshmoe.e import g\n")
  known = {"meshmoe.a.b", "meshmoe.a.c", "meshmoe.d", "meshmoe.e.g", "meshmoe.e"}
  # `from meshmoe.e import g` runs meshmoe.e (the package) and imports its module g.
  assert imports_of(source, "meshmoe.a.x", known) == {"meshmoe.a.b", "meshmoe.a.c", "meshmoe.d", "meshmoe.e",
                                                      "meshmoe.e.g"}


def test_every_package_folder_is_declared_in_pyproject():
  """pyproject.toml lists the packages one by one (the folders are not named after their import paths):
  a new folder of modules that it leaves out would be missing from an installed meshmoe."""
  declared = set(tomllib.loads((REPO / "pyproject.toml").read_text())["tool"]["setuptools"]["packages"])
  packages = {name for name, path in module_files().items()
              if path.name == "__init__.py" and name.startswith("meshmoe")}
  assert packages <= declared, sorted(packages - declared)
