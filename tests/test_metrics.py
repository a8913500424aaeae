"""Metrics: consensus distance, averaged model, collective bytes read from compiled HLO."""

import jax
import jax.numpy as jnp
import numpy as np

from lpdec import metrics

HLO = """
HloModule m

ENTRY %main (p: u8[1000]) -> u8[1000] {
  %p = u8[1000]{0} parameter(0)
  %cp = u8[1000]{0} collective-permute(u8[1000]{0} %p), channel_id=1, source_target_pairs={{0,1}}
  %s = f32[7]{0} collective-permute(%q), channel_id=2, source_target_pairs={{0,1}}
  %ars = (f32[16]{0}, f32[16]{0}) all-reduce-start(f32[16]{0} %a), replica_groups={}
  %ard = f32[16]{0} all-reduce-done(%ars)
  ROOT %ag = bf16[2,8]{1,0} all-gather(bf16[1,8]{1,0} %b), dimensions={0}
}
"""


def test_collective_traffic_parses_operand_bytes():
    traffic = metrics.collective_traffic(HLO)
    assert traffic.count_by_op == {"collective-permute": 2, "all-reduce": 1, "all-gather": 1}
    assert traffic.bytes_by_dtype[("collective-permute", "u8")] == 1000
    assert traffic.bytes_by_dtype[("collective-permute", "f32")] == 28
    # The async start counts its operand once; the done is not a second transfer.
    assert traffic.bytes_by_op["all-reduce"] == 64
    # all-gather contributes its operand (1 x 8 bf16), not the gathered result.
    assert traffic.bytes_by_op["all-gather"] == 16
    assert traffic.total_bytes == 1000 + 28 + 64 + 16


def test_collectives_within_groups_of_one_device_send_nothing():
    """An axis of size 1 (FSDP on a machine of one worker) leaves collectives in the
    program whose every group is one device: nothing crosses, nothing is counted."""
    alone = """
  %a = f32[8]{0} all-gather(f32[8]{0} %x), replica_groups={{0},{1}}, dimensions={0}
  %b = f32[8]{0} all-reduce(f32[8]{0} %x), replica_groups=[2,1]<=[2], to_apply=%sum
  %c = f32[4]{0} all-reduce(f32[4]{0} %x), replica_groups={{0,1}}, to_apply=%sum
  %d = f32[2]{0} all-reduce(f32[2]{0} %x), replica_groups=[1,2]<=[2], to_apply=%sum
"""
    traffic = metrics.collective_traffic(alone)
    assert traffic.count_by_op == {"all-reduce": 2}
    assert traffic.bytes_by_op == {"all-reduce": 16 + 8}


def test_compiled_ppermute_bytes_match_the_payload():
    n = 8
    mesh = jax.make_mesh((n,), ("nodes",))
    spec = jax.P("nodes")

    def node(x):
        return jax.lax.ppermute(x.astype(jnp.uint8), "nodes", [(i, (i + 1) % n) for i in range(n)])

    fn = jax.shard_map(node, mesh=mesh, in_specs=spec, out_specs=spec)
    x = jax.device_put(jnp.zeros((n * 333,)), jax.NamedSharding(mesh, spec))
    traffic = metrics.compiled_traffic(fn, x)
    assert traffic.ops() == {"collective-permute"}
    assert traffic.bytes_by_dtype == {("collective-permute", "u8"): 333}


def test_consensus_distance_and_average_against_numpy(rng):
    tree = {"a": rng.standard_normal((8, 5, 3)), "b": rng.standard_normal((8, 4))}
    tree = jax.tree.map(lambda x: jnp.asarray(x, jnp.float32), tree)
    flat = np.concatenate([np.asarray(x, np.float64).reshape(8, -1) for x in tree.values()], 1)
    expected = np.mean(np.sum((flat - flat.mean(0)) ** 2, axis=1))
    np.testing.assert_allclose(float(metrics.consensus_distance(tree)), expected, rtol=1e-5)
    avg = metrics.average_model(tree)
    np.testing.assert_allclose(
        np.asarray(avg["a"]), np.asarray(tree["a"]).mean(0), rtol=1e-6, atol=1e-6
    )


def test_hierarchical_average_is_every_nodes_mean_on_every_node(rng):
    """2 machines x 4 workers, leaves whose sizes 4 does not divide: every node gets the
    float64 mean of the 8 nodes' values to float32 rounding, all with the same bits."""
    import lpdec

    layout = lpdec.make_layout(8, machines=2)
    params = {
        "a": rng.normal(size=(8, 3, 5)).astype(np.float32),
        "b": rng.normal(size=(8, 7)).astype(np.float32),
    }
    average = jax.jit(
        layout.map(
            lambda p: metrics.hierarchical_average(p, layout.machine_axis, layout.worker_axis),
            (True,),
        )
    )
    out = average(layout.put(params))
    for name, x in params.items():
        got = np.asarray(out[name])
        np.testing.assert_allclose(got[0], x.astype(np.float64).mean(0), rtol=0, atol=1e-6)
        np.testing.assert_array_equal(got, np.broadcast_to(got[0], got.shape))
