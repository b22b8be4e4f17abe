"""`jax-dspark selfcheck`: every op against its pure-JAX reference on fresh random inputs.

On a GPU with the kernel library this compares kernels with references; elsewhere it
checks the references' own algebra (sink-free equals softmax attention, merge of split
partials equals the whole, RoPE inverse, FP8 byte rule) so a broken install shows up at once.
"""

from __future__ import annotations

import argparse
import json
import sys


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--json", action="store_true", help="print one JSON object")


def _rel(a, b) -> float:
    import numpy as np

    a, b = np.asarray(a, np.float64), np.asarray(b, np.float64)
    return float(np.linalg.norm(a - b) / max(np.linalg.norm(b), 1e-30))


def _checks(seed: int):
    import jax
    import jax.numpy as jnp
    import numpy as np

    from jax_dspark import ops

    rng = np.random.default_rng(seed)
    b, s, h, d, n, k = 2, 3, 8, 512, 300, 40
    q = jnp.asarray(rng.standard_normal((b, s, h, d)), jnp.bfloat16)
    rows = jnp.asarray(rng.standard_normal((n, d)), jnp.bfloat16)
    idx = rng.integers(-1, n, size=(b, s, k)).astype(np.int32)
    sink = rng.standard_normal(h).astype(np.float32)
    freqs = ops.rope_table(1024, 64, theta=1e4)[rng.integers(0, 1024, (b, s))]
    kw = dict(sink=sink, scale=d**-0.5, inverse_rope=freqs)
    out = ops.sparse_sink_attention(q, rows, idx, **kw)
    ref = ops.sparse_sink_attention_reference(q, rows, idx, **kw)
    yield "sparse_sink_attention vs reference", _rel(out.astype(jnp.float32), ref.astype(jnp.float32)), 2e-2
    parts = [ops.sparse_sink_attention(q, rows, idx[..., :17], scale=d**-0.5, return_lse=True),
             ops.sparse_sink_attention(q, rows, idx[..., 17:], scale=d**-0.5, return_lse=True)]
    merged, _ = ops.merge_partials([p[0] for p in parts], [p[1] for p in parts], sink)
    whole = ops.sparse_sink_attention(q, rows, idx, sink=sink, scale=d**-0.5)
    yield "merge_partials of a split == whole", _rel(merged.astype(jnp.float32), whole.astype(jnp.float32)), 2e-2
    x = jnp.asarray(rng.standard_normal((64, 512)), jnp.float32)
    back = ops.apply_rope(ops.apply_rope(x, freqs[0, :1]), freqs[0, :1], inverse=True)
    yield "apply_rope inverse round trip", _rel(back, x), 1e-6
    big = jnp.full((1, 128), 448.0 * 2.0**8)
    yield "fp8 UE8M0 byte at 448*2^8 is 135", float(int(ops.quantize_fp8(big)[1][0, 0]) != 135), 0.5
    yield "fp8 round trip", _rel(ops.fp8_round_trip(x), x), 0.07
    t, e, i = 32, 16, 64
    xt = jnp.asarray(rng.standard_normal((t, 128)), jnp.float32)
    w1 = jnp.asarray(rng.standard_normal((e, 128, 2 * i)) / 10, jnp.float32)
    w2 = jnp.asarray(rng.standard_normal((e, i, 128)) / 10, jnp.float32)
    wts, ids = ops.topk_route(ops.router_scores(jnp.asarray(rng.standard_normal((t, e)), jnp.float32)), 4)
    moe = ops.moe_experts(xt, ids, wts, w1, w2, limit=10.0)
    dense = sum(
        wts[:, j, None] * jax.vmap(lambda xr, ee: ops.mlp_swiglu(xr, w1[ee], w2[ee], limit=10.0))(xt, ids[:, j])
        for j in range(4)
    )
    yield "moe_experts vs per-token experts", _rel(moe, dense), 1e-4


def run(args: argparse.Namespace) -> int:
    import jax

    from jax_dspark import kernels

    results = [(name, err, tol, err <= tol) for name, err, tol in _checks(args.seed)]
    report = {
        "backend": jax.default_backend(),
        "kernels": kernels(),
        "checks": [{"name": n, "error": e, "tolerance": t, "ok": ok} for n, e, t, ok in results],
    }
    if args.json:
        print(json.dumps(report, indent=2))
    else:
        print(f"backend: {report['backend']}; kernels: {report['kernels'] or 'none built'}")
        for name, err, tol, ok in results:
            print(f"  {'ok  ' if ok else 'FAIL'} {name}: rel. error {err:.2e} (tolerance {tol:.0e})")
    ok = all(r[3] for r in results)
    print("selfcheck passed" if ok else "selfcheck FAILED", file=sys.stderr)
    return 0 if ok else 1
