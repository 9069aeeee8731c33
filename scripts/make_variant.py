#!/usr/bin/env python3
"""Writes a copy of cuda_src/ with one named experimental change, for A/B runs
of kernel variants on the GPU (``AB_TREES="cuda_src OUT" scripts/gpu_run.sh
RESULTS variants ncu_sectors``).

The variants are issue-20 experiments on the tensor-core core's K/V copy
(``mma_token_loop`` in attend_mma.cuh), kept here so that an experiment can
be rerun without hand-editing a tree:

* ``predicated``: a copy of a valid row has no source-size operand (the
  zero-fill form only for rows past the range), as FlashInfer's K/V copy;
* ``padded``: the ring's layout before 2026-12-01 (rows padded by 16 bytes,
  the dynamic shared memory 16-byte aligned): 1.5x the K/V sectors through
  the L2 and ~7 % slower on large fp16 cells than today's permuted, aligned rows;
* ``no_l2_hint``, ``no_evict_first``: without the L2::128B prefetch hint or
  the evict_first policy on 16-bit rows;
* ``no_prefetch``: without the partial kernel's L2 prefetch of the first
  tile's K/V rows and the q rows before ``griddepcontrol.wait``
  (``prefetch_first_tile``; adopted 2026-12-02 from the experiments
  ``pdl_prefetch`` and ``prefetch_q``, whose A/B is in
  docs/benchmarks/h200-prefetch-ab-2026-12-02.md).

Lost experiments whose edits no longer apply were removed after their runs
were recorded (``docs/benchmarks/kernel-variants-h200-2026-12-01.log``): the
lane map ``fi_lanes``, the unpadded ``nopad`` and ``permuted`` layouts, and
one ``cp.async.bulk`` per row (``bulk_rows``); their edits are in this
script at commit 4bed7ee.

Variants combine with ``+`` (``predicated+padded``). Each edit is an exact
text replacement; a variant whose text no longer matches the sources stops
with an error naming it (update the edit with the source).

Exit status: 0 written, 2 bad arguments or an edit that no longer applies.
"""

from __future__ import annotations

import argparse
import shutil
import sys
from pathlib import Path

SRC = Path(__file__).resolve().parent.parent / "cuda_src"

_PREDICATED_OLD = "  const int n = valid ? 16 : 0;\n"
_PREDICATED_NEW = """  const int n = valid ? 16 : 0;
  if (valid) {  // variant predicated: no source-size operand
    if constexpr (L2_128B && POLICY)
      asm volatile("cp.async.cg.shared.global.L2::cache_hint.L2::128B [%0], [%1], 16, %2;\\n" ::"r"(dst), "l"(gmem),
                   "l"(policy));
    else if constexpr (POLICY)
      asm volatile("cp.async.cg.shared.global.L2::cache_hint [%0], [%1], 16, %2;\\n" ::"r"(dst), "l"(gmem),
                   "l"(policy));
    else if constexpr (L2_128B)
      asm volatile("cp.async.cg.shared.global.L2::128B [%0], [%1], 16;\\n" ::"r"(dst), "l"(gmem));
    else
      asm volatile("cp.async.cg.shared.global [%0], [%1], 16;\\n" ::"r"(dst), "l"(gmem));
    return;
  }
"""

# padded: the K/V ring's layout before 2026-12-01 (rows padded by 16 bytes, the
# dynamic shared memory at its default 16-byte alignment, 16 mod 32 here)
_PADDED = [
    ("attend_mma.cuh", "  static constexpr bool SWIZZLE = DATA_BYTES % 128 == 0;\n",
     "  static constexpr bool SWIZZLE = false;  // variant padded\n"),
    ("attend_mma.cuh", "  union __align__(128) {", "  union __align__(16) {  // variant padded"),
    ("paged_decode_partial.cu", "    extern __shared__ __align__(128) uint4 dynamic_smem[];",
     "    extern __shared__ uint4 dynamic_smem[];  // variant padded"),
]


_PREFETCH_CALL = ("  prefetch_first_tile<T, KV, HEAD_DIM, HEADS>(p, indices, slot_begin, slot_end, page_size, kv_head, "
                  "req, head0);\n")


#: name -> its edits: (file, old text, new text), every occurrence of old replaced
VARIANTS: dict[str, list[tuple[str, str, str]]] = {
    "predicated": [("common.cuh", _PREDICATED_OLD, _PREDICATED_NEW)],
    "padded": _PADDED,
    "no_l2_hint": [("attend_mma.cuh", "constexpr bool L2_HINT = sizeof(KV) == 2 && HEAD_DIM * 2 % 128 == 0;",
                    "constexpr bool L2_HINT = false;  // variant no_l2_hint")],
    "no_evict_first": [("attend_mma.cuh", "constexpr bool EVICT_FIRST = sizeof(KV) == 2;",
                        "constexpr bool EVICT_FIRST = false;  // variant no_evict_first")],
    "no_prefetch": [("paged_decode_partial.cu", _PREFETCH_CALL, "  // variant no_prefetch\n")],
}


def apply(names: list[str], out: Path, src: Path = SRC) -> None:
    """Copies ``src`` to ``out`` and applies the named variants' edits in order;
    raises ValueError naming the first edit that does not apply."""
    if out.exists():
        raise ValueError(f"{out} exists; choose a new folder")
    texts = {p.name: p.read_text() for p in src.iterdir() if p.is_file()}
    for name in names:
        for fname, old, new in VARIANTS[name]:
            text = texts[fname]
            if old not in text:
                raise ValueError(f"variant {name}: its edit of {fname} no longer matches the source "
                                 f"(looked for {old.strip().splitlines()[0]!r})")
            texts[fname] = text.replace(old, new)
    shutil.copytree(src, out)
    for fname, text in texts.items():
        (out / fname).write_text(text)


def main(argv=None) -> int:
    p = argparse.ArgumentParser(
        prog="make_variant.py",
        formatter_class=argparse.RawDescriptionHelpFormatter,
        description="Write a copy of cuda_src/ with named experimental kernel changes applied, for A/B "
                    "runs of kernel variants (scripts/gpu_run.sh steps variants and ncu_sectors).",
        epilog="variants: " + ", ".join(VARIANTS) + "\n\nexamples:\n"
               "  python3 scripts/make_variant.py predicated .variants/predicated\n"
               "  python3 scripts/make_variant.py predicated+padded .variants/both\n"
               "  AB_TREES='cuda_src .variants/predicated' scripts/gpu_run.sh OUT variants ncu_sectors\n\n"
               "exit status: 0 written, 2 bad arguments or an edit that no longer applies",
    )
    p.add_argument("variant", help="a variant name, or several joined with '+'")
    p.add_argument("out", type=Path, help="the new folder to write (must not exist)")
    args = p.parse_args(argv)
    names = args.variant.split("+")
    unknown = [n for n in names if n not in VARIANTS]
    if unknown:
        p.error(f"unknown variant {unknown[0]!r}; choose from {', '.join(VARIANTS)}")
    try:
        apply(names, args.out)
    except ValueError as exc:
        print(f"make_variant.py: {exc}", file=sys.stderr)
        return 2
    print(f"wrote {args.out} ({args.variant})")
    return 0


if __name__ == "__main__":
    sys.exit(main())
