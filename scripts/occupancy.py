#!/usr/bin/env python3
"""Registers, spills and resident CTAs per SM of every partial-kernel
instance, as the driver reports them, beside what the planner assumes
(``cupaged.plan.ctas_per_sm``) and what a full-wave launch allows (the
programmatic-dependent-launch instances pass ``_launch.residency_smem``'s
entry for the planner's count; the table is listed, k = 0, 1, ...).

    python3 scripts/occupancy.py [--csv FILE]

Needs a CUDA GPU (it compiles and loads every partial module, ~1 min cold).
Exit status: 0 every instance agrees with the planner, 1 some differ, 2 no GPU.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import _common  # noqa: E402

COLUMNS = ("variant", "head_dim", "heads", "core", "threads", "smem", "regs", "local_bytes", "driver_ctas_per_sm",
           "planner_ctas_per_sm", "launch_ctas_per_sm", "residency_smem")


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--csv", default=None, help="write the table to this CSV file")
    p.add_argument("--head-dims", type=int, nargs="*", default=None, help="only these head dims (default: all)")
    args = p.parse_args(argv)
    _common.require_gpu()
    import numpy as np
    from cupy_backends.cuda.api import driver

    from cupaged import _configs, _launch, _loader
    from cupaged.plan import ctas_per_sm

    rows, differ = [], 0
    print(" ".join(COLUMNS))
    for family, variant, head_dim in _configs.all_modules():
        if family != "partial" or (args.head_dims and head_dim not in args.head_dims):
            continue
        q_name, kv_name = _configs.split_variant(variant)
        for core in _configs.CORES:
            if not _configs.serves(core, variant, head_dim):
                continue
            for heads in _configs.HEADS_PER_CTA:
                index, threads = _configs.partial_instance(variant, head_dim, heads, core)
                fn = _loader.get_kernel("partial", variant, head_dim, index).kernel.ptr
                smem = _configs.dynamic_smem(core, variant, head_dim)
                if smem:
                    driver.funcSetAttribute(fn, driver.CU_FUNC_ATTRIBUTE_MAX_DYNAMIC_SHARED_SIZE_BYTES, smem)
                regs = driver.funcGetAttribute(driver.CU_FUNC_ATTRIBUTE_NUM_REGS, fn)
                local = driver.funcGetAttribute(driver.CU_FUNC_ATTRIBUTE_LOCAL_SIZE_BYTES, fn)
                occ = driver.occupancyMaxActiveBlocksPerMultiprocessor(fn, threads, smem)
                kv = np.uint8 if kv_name == _configs.FP8 else kv_name
                planned = ctas_per_sm(np.dtype(q_name), np.dtype(kv), head_dim, heads) if core == _configs.choose_core(
                    variant, head_dim) else occ
                # what a full-wave launch allows: PDL launches pass residency_smem's entry for the plan's count
                pdl = _configs.module_pdl("partial", variant, head_dim) and core == "mma"
                table = _launch.residency_smem(fn, threads, smem) if pdl else (smem,)
                launched = driver.occupancyMaxActiveBlocksPerMultiprocessor(
                    fn, threads, table[min(planned, len(table) - 1)])
                row = (variant, head_dim, heads, core, threads, smem, regs, local, occ, planned, launched,
                       "/".join(map(str, table)))
                differ += occ != planned
                rows.append(dict(zip(COLUMNS, row)))
                print(" ".join(map(str, row)), flush=True)
    if args.csv:
        _common.write_csv(args.csv, COLUMNS, rows)
    print(f"SUMMARY {len(rows)} instances, {differ} where the planner's CTAs per SM differ from the driver's")
    return 1 if differ else 0


if __name__ == "__main__":
    sys.exit(main())
