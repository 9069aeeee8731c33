"""The ctypes mirror of the partial kernel's parameter struct has NVRTC's
layout (cupaged/_launch.py PartialParams vs cuda_src PartialParams), and the
plan image holds what the kernel's header comment says. CPU only: NVRTC
compiles without a GPU."""

import ctypes

import numpy as np
import pytest

import cupaged
from cupaged import _launch, _loader


def _probe_source() -> str:
    """A kernel that stores sizeof(PartialParams) and each field's offset, in
    ctypes field order; NVRTC folds them to constants in its PTX."""
    names = [n for n, _ in _launch.PartialParams._fields_]
    body = "\n".join(f"  out[{i + 1}] = reinterpret_cast<const char*>(&p->{n}) - base;" for i, n in enumerate(names))
    return f"""
extern "C" __global__ void cupaged_layout_probe(const cupaged::PartialParams* p, long long* out) {{
  const char* base = reinterpret_cast<const char*>(p);
  out[0] = sizeof(cupaged::PartialParams);
{body}
}}"""


def _nvrtc_layout() -> list[int]:
    """[sizeof, offsets...] of cuda_src's PartialParams as NVRTC lays it out."""
    import re

    from cupy.cuda import nvrtc

    prog = nvrtc.createProgram(_loader.module_source("partial") + _probe_source(), "layout.cu", [], [])
    try:
        nvrtc.compileProgram(prog, [*_loader.OPTIONS, "-arch=compute_90"])
        ptx = nvrtc.getPTX(prog).decode()
    finally:
        nvrtc.destroyProgram(prog)
    probe = ptx[ptx.index(".entry cupaged_layout_probe"):]
    consts = dict(re.findall(r"mov\.[ub]64\s+(%rd\d+),\s*(\d+);", probe))
    stores = re.findall(r"st\.global\.[ub]64\s+\[%rd\d+(?:\+(\d+))?\],\s*(%rd\d+|\d+);", probe)
    values = {int(off or 0) // 8: int(consts.get(v, v)) for off, v in stores}
    return [values[i] for i in range(len(values))]


def test_ctypes_struct_matches_nvrtc_layout():
    pytest.importorskip("cupy")
    P = _launch.PartialParams
    mirror = [ctypes.sizeof(P)] + [getattr(P, n).offset for n, _ in P._fields_]
    assert _nvrtc_layout() == mirror


def test_layout_probe_reads_the_real_layout():
    # the probe sees a change of the CUDA struct: the check can fail
    pytest.importorskip("cupy")
    src = _loader.module_source("partial")
    swapped = src.replace("  const float* k_head_scale;\n  const float* v_head_scale;\n",
                          "  int padding_probe;\n  const float* k_head_scale;\n  const float* v_head_scale;\n")
    assert swapped != src
    real = _loader.module_source
    try:
        _loader.module_source = lambda family: swapped
        layout = _nvrtc_layout()
    finally:
        _loader.module_source = real
    P = _launch.PartialParams
    assert layout[0] == ctypes.sizeof(P) + 8
    assert layout[1 + [n for n, _ in P._fields_].index("k_head_scale")] == P.k_head_scale.offset + 8


def test_every_struct_field_is_mirrored():
    # the CUDA struct's field names, in order, are the ctypes fields
    import re

    src = (_loader.SRC_DIR / "paged_decode_partial.cu").read_text()
    body = src[src.index("struct PartialParams {"):]
    body = body[:body.index("};")]
    names = []
    for decl in re.findall(r"^\s+[^/\n][^;]*;", body, flags=re.M):
        decl = decl.split("//")[0].strip().rstrip(";")
        names += [part.strip().lstrip("*").split()[-1].lstrip("*") for part in decl.split(",")]
    assert names == [n for n, _ in _launch.PartialParams._fields_]


def test_plan_image_layout():
    table = cupaged.PageTable.from_seq_lens([700, 33, 0], page_size=16)
    plan = cupaged.plan_decode(table, 32, 8, 128, np.float16, pages_per_chunk=4)
    units = _launch.plan_units(plan)
    size = _launch.image_capacity(plan.batch_size + 2, plan.num_chunks + 3, int(table.indptr[-1]))
    offsets = _launch.image_offsets(plan.batch_size + 2, plan.num_chunks + 3)
    dst = np.full(size + 5, -7, dtype=np.int32)
    n = _launch.write_image(dst, offsets, units, plan, table)
    assert n == size and (dst[n:] == -7).all()
    num_units, o_off, indptr_off, last_off, first_off, idx_off, batch, _ = dst[:_launch.HEADER].tolist()
    assert (num_units, batch) == (plan.num_chunks, 3)
    B = plan.batch_size
    assert dst[o_off:o_off + B + 1].tolist() == plan.o_indptr.tolist()
    assert dst[indptr_off:indptr_off + B + 1].tolist() == table.indptr.tolist()
    assert dst[last_off:last_off + B].tolist() == table.last_page_len.tolist()
    assert dst[first_off:first_off + B].tolist() == table.first_page_offset.tolist()
    assert dst[idx_off:idx_off + len(table.indices)].tolist() == table.indices.tolist()
    got = dst[_launch.HEADER:_launch.HEADER + 4 * num_units].reshape(-1, 4)
    # every chunk once, each covering its request's pages [j*c, (j+1)*c) in launch order
    assert sorted(got[:, 1].tolist()) == list(range(plan.num_chunks))
    for r, c, lo, hi in got.tolist():
        j = c - plan.o_indptr[r]
        assert plan.chunk_request[c] == r and lo == j * 4 and hi == lo + 4


@pytest.mark.parametrize("dtype", [np.float16, np.float32, np.uint8])
def test_elem_strides_of_leading_or_listed_axes(dtype):
    """The kernels' int64 element strides (decode, merge and append_kv share
    one helper): of the first n axes, or of the axes listed (append_kv's NHD
    and HND cache orders), of strided views, equal to strides // itemsize."""
    base = np.zeros((5, 16, 8, 128), dtype=dtype)
    for a in (base, base[:, :, 2:6], base[::2, 1:], base.transpose(0, 2, 1, 3)):
        want = [s // a.itemsize for s in a.strides]
        assert _launch.elem_strides(a, 2) == tuple(want[:2])
        for axes in ((0, 1), (0, 1, 2), (0, 2, 1)):
            got = _launch.elem_strides(a, axes)
            assert got == tuple(want[ax] for ax in axes) and all(type(x) is np.int64 for x in got)


def test_waiting_merge_takes_one_wave_split_plans():
    # the waiting merge (cuda_src/paged_decode_partial.cu merge_waiting: a request's first chunk merges its
    # partials as their values arrive, waiting on the GPU) runs only where a split plan's CTAs fit one wave and
    # its requests' first chunks are fewer CTAs than SMs (so one always leaves a slot for a chunk it waits for)
    table = cupaged.PageTable.from_seq_lens([3000, 17, 0, 500, 1, 4099], page_size=16)

    def plan(c):
        return cupaged.plan_decode(table, 32, 8, 128, np.float16, pages_per_chunk=c, num_sms=132)

    p64 = plan(64)  # chunks [3, 1, 1, 1, 1, 5]: 12 units of 8 CTAs, 2 requests split
    assert (p64.num_chunks, p64.ctas_per_sm) == (12, 2)
    assert _launch.plan_waits(p64, 12, 8, 132)
    assert not _launch.plan_waits(p64, 12, 8, 40)  # 96 CTAs past one wave of 40 SMs x 2
    assert not _launch.plan_waits(p64, 12, 8, 16)  # 16 first-chunk CTAs: not fewer than the SMs
    assert _launch.plan_waits(p64, 12, 8, 48)      # 96 <= 48 x 2, 16 < 48
    assert not _launch.plan_waits(plan(8), 64, 8, 132)   # 512 CTAs: two waves
    unsplit = plan(1000)
    assert not unsplit.needs_merge and not _launch.plan_waits(unsplit, unsplit.num_chunks, 8, 132)
    rows = cupaged.plan_decode(cupaged.PageTable.from_seq_lens([3000, 17, 500, 4099], page_size=16), 32, 8, 128,
                               np.float16, pages_per_chunk=64, num_sms=132, qo_indptr=np.array([0, 2, 3, 5, 7]))
    assert rows.group_last is not None and not _launch.plan_waits(rows, rows.num_chunks, 8, 132)


@pytest.mark.parametrize("waits", [False, True])
def test_plan_image_header_says_which_merge(waits):
    # without row groups the header's group_rows entry is the merge: 0 the ticket's, HEADER_WAITS the waiting one
    table = cupaged.PageTable.from_seq_lens([700, 33, 0], page_size=16)
    plan = cupaged.plan_decode(table, 32, 8, 128, np.float16, pages_per_chunk=4)
    units = _launch.plan_units(plan)
    offsets = _launch.image_offsets(plan.batch_size, plan.num_chunks)
    dst = np.zeros(_launch.image_capacity(plan.batch_size, plan.num_chunks, int(table.indptr[-1])), dtype=np.int32)
    _launch.write_image(dst, offsets, units, plan, table, waits)
    assert dst[_launch.HEADER - 1] == (_launch.HEADER_WAITS if waits else 0) and _launch.HEADER_WAITS < 0


def test_partial_empty_is_the_kernels_mark():
    # the waiting merge's workspace is allocated holding the bits it waits on (cuda_src/merge.cuh)
    import re

    src = (_loader.SRC_DIR / "merge.cuh").read_text()
    (value,) = re.findall(r"constexpr unsigned PARTIAL_EMPTY = (0x[0-9a-fA-F]+)u;", src)
    assert int(value, 16) == _launch.PARTIAL_EMPTY
    # a NaN no float32 arithmetic yields (its NaN results are canonical, 0x7fffffff)
    mark = np.array([_launch.PARTIAL_EMPTY], np.uint32).view(np.float32)
    assert np.isnan(mark).all() and _launch.PARTIAL_EMPTY != 0x7FFFFFFF
    # and the kernel reads the header entry write_image sets
    body = (_loader.SRC_DIR / "paged_decode_partial.cu").read_text()
    assert f"p.plan[{_launch.HEADER - 1}] < 0" in body
