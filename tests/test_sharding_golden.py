"""Golden sharding snapshot: each parameter's PartitionSpec per preset (parameters and optimizer state), and
per preset with each `mesh.weight_storage` other than "preset" ("<preset>/weight_storage=<storage>").

A change to the rules table or to a layer's logical axes shows up here as a diff. If the change is
intended, regenerate with MESHMOE_UPDATE_GOLDEN=1 and review the JSON diff in the commit.
"""

import json
import os
import pathlib

from flax import nnx

from meshmoe.config import MeshConfig
from meshmoe.models.decoder import Transformer
from meshmoe.sharding import rules
from meshmoe.sharding.shardings import partition_specs
from meshmoe.training import model_state
from tests.model_steps import plan_for
from tests.test_model_sharded import small_config

GOLDEN = pathlib.Path(__file__).parent / "golden" / "param_specs.json"


def _spec_json(spec) -> list:
  return [list(e) if isinstance(e, tuple) else e for e in spec]


def _snapshot() -> dict:
  config = small_config(expert_bias=True)
  state = nnx.state(nnx.eval_shape(lambda: Transformer(config.model, rngs=nnx.Rngs(0))))
  snapshot = {}
  for name, preset in rules.PRESETS.items():
    for storage in rules.STORAGE_AXES:
      key = name if storage == "preset" else f"{name}/weight_storage={storage}"
      placed = rules.with_storage(preset, storage)
      snapshot[key] = {}
      for kind, table in (("params", placed.params), ("optimizer", placed.optimizer_rules())):
        specs = partition_specs(state, table)
        snapshot[key][kind] = {"/".join(map(str, path)): _spec_json(spec)
                               for path, spec in nnx.to_flat_state(specs)}
  return snapshot


def test_partition_specs_match_golden():
  snapshot = _snapshot()
  if os.environ.get("MESHMOE_UPDATE_GOLDEN") == "1":
    GOLDEN.write_text(json.dumps(snapshot, indent=1, sort_keys=True) + "\n")
  golden = json.loads(GOLDEN.read_text())
  assert snapshot.keys() == golden.keys()
  for preset in golden:
    for kind in golden[preset]:
      diff = {p: (golden[preset][kind].get(p), snapshot[preset][kind].get(p))
              for p in golden[preset][kind].keys() | snapshot[preset][kind].keys()
              if golden[preset][kind].get(p) != snapshot[preset][kind].get(p)}
      assert not diff, f"preset {preset} {kind}: (golden, now) = {diff}"


def test_initialised_parameters_carry_the_rule_shardings():
  config = small_config()
  config.mesh = MeshConfig(data=2, expert=2, tensor=2, preset="tp_sp")
  model = model_state.init_model(config, plan_for(config))
  expected = _snapshot()["tp_sp"]["params"]
  for path, value in nnx.to_flat_state(nnx.state(model, nnx.Param)):
    key = "/".join(map(str, path))
    assert _spec_json(value[...].sharding.spec) + [None] * (value.ndim - len(value[...].sharding.spec)) == \
        expected[key] + [None] * (value.ndim - len(expected[key])), key
  gate_LEDF = model.moe_layers.layer.ffn.gate_EDF[...]
  assert gate_LEDF.sharding.spec[1] == "expert"
  assert not gate_LEDF.sharding.is_fully_replicated
