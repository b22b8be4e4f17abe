"""Times the wgmma attention kernel at every valid split-K count for the benchmark cases.

`ops._kernels.choose_splits` picks the split count from a wave model (waves x (tiles per
CTA + 1) + a charge per split); this sweep measures what each count costs on the GPU, so
the model can be checked against the card rather than against itself. One process, GPU
busy time per call (`timing.call_times`) on the inputs of `jax-dspark bench attention`.

    JAX_DSPARK_FFI_LIB=... python tools/attention_split_sweep.py --out $OUT/split_sweep.json
        [--commit C]  (default: report.commit_id, i.e. $JAX_DSPARK_COMMIT or git HEAD)
"""

from __future__ import annotations

import argparse
import json

from jax_dspark import _ffi
from jax_dspark.bench import attention, report, timing
from jax_dspark.ops import _kernels


def valid_splits(k_total: int) -> list[int]:
    """Split counts that leave no split empty (the ones choose_splits considers): all up to
    8, then 12, 16 and 32 where valid (the long lists have two dozen; these bracket them)."""
    tiles = -(-k_total // _kernels.KEYS_PER_TILE)
    out = []
    for splits in range(1, min(_kernels.MAX_SPLITS, tiles) + 1):
        if -(-tiles // -(-tiles // splits)) == splits and (splits <= 8 or splits in (12, 16, 32)):
            out.append(splits)
    return out


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", required=True)
    parser.add_argument("--sets", type=int, default=8)
    parser.add_argument("--commit", default=None, help="the commit the library was built from")
    args = parser.parse_args()
    chosen = _kernels.choose_splits
    rows = []
    for kv_dtype in attention.KV_DTYPES:
        for case in attention.CASES:
            sets = attention.make_inputs(case, args.sets, kv_dtype=kv_dtype)
            model = chosen(case.B, case.S, case.H, case.K, _ffi.num_sms())
            for splits in valid_splits(case.K):
                _kernels.choose_splits = lambda *a, _s=splits: _s
                try:
                    with _kernels.attention_kernel("wgmma"):
                        wall, busy = timing.call_times(attention._op("kernel"), sets)
                finally:
                    _kernels.choose_splits = chosen
                row = dict(case=case.name, kv=kv_dtype, splits=splits, model_choice=model, wall_us=wall, busy_us=busy)
                rows.append(row)
                print(json.dumps(row), flush=True)
    with open(args.out, "w") as fh:
        json.dump(dict(gpu=timing.gpu_name(), commit=report.commit_id(args.commit), date=report.today(),
                       num_sms=_ffi.num_sms(), rows=rows), fh, indent=1)
    best = {}
    for r in rows:
        key = (r["case"], r["kv"])
        t = r["busy_us"] if r["busy_us"] is not None else r["wall_us"]
        if key not in best or t < best[key][1]:
            best[key] = (r["splits"], t)
    for r in rows:
        if r["splits"] == r["model_choice"]:
            b = best[(r["case"], r["kv"])]
            t = r["busy_us"] if r["busy_us"] is not None else r["wall_us"]
            print(f"{r['case']:28s} {r['kv']:5s} model {r['splits']:2d}: {t:8.1f} us   best {b[0]:2d}: {b[1]:8.1f} us")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
