#!/usr/bin/env python3
"""Where the host time of one ``cupaged.decode`` call goes (held plan, ``out``
given, no graph): the median of N calls with the same arrays, of N calls
rotating through several layers' caches with a new q and out each (a serving
step), and of the bare driver launch; then a cProfile of the first kind of
call sorted by own time. First, without a GPU too, the host cost of
``plan_decode`` on ragged batches of 128 and 256 requests (``--plan-only``
stops there). ``--step`` instead times, without a GPU, the host bookkeeping of
one decode step with a :class:`cupaged.BlockPool` at batch 32, 128 and 256;
``--hot-path-cpu`` times the Python part of a held-plan call with the driver
call replaced by a no-op, on any machine.
Exit status: 0 ran, 3 no CUDA GPU (after the plan timings).
"""

from __future__ import annotations

import argparse
import contextlib
import cProfile
import itertools
import pstats
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import _common  # noqa: E402


#: Ragged batches whose plan_decode host cost is timed (batch, lengths, seed).
PLAN_BATCHES = ((128, "lognormal:1024:1.2", 1), (256, "lognormal:512:1.0", 3), (256, "zipf:1.5:256:32768", 8),
                (256, "uniform:1:32768", 4))


def plan_costs(calls: int = 300) -> None:
    """Median host µs of ``plan_decode`` (the default plan: the step model
    picks the split) on ragged batches, fp16, 32 q / 8 kv heads, D 128,
    page 16, 132 SMs, of the step model alone
    (``schedule.choose_max_pages_per_chunk`` with the plan's arguments), of
    the plan with its cap given (``max_pages_per_chunk``: everything but the
    model) and of the fp8 KV default plan (the model at two residencies)."""
    import numpy as np

    import cupaged
    from cupaged import plan as plan_mod
    from cupaged import schedule

    def median_us(fn):
        for _ in range(20):
            fn()
        times = []
        for _ in range(calls):
            t0 = time.perf_counter()
            fn()
            times.append((time.perf_counter() - t0) * 1e6)
        return statistics.median(times), np.percentile(times, 10), np.percentile(times, 90)

    for batch, spec, seed in PLAN_BATCHES:
        layout = _common.lengths_layout(_common.ragged_lengths(spec, batch, seed), 16, seed=seed)
        table = _common.layout_table(layout)
        med, p10, p90 = median_us(lambda: cupaged.plan_decode(table, 32, 8, 128, np.float16, num_sms=132))
        plan = cupaged.plan_decode(table, 32, 8, 128, np.float16, num_sms=132)
        slots = plan_mod.ctas_per_sm(plan.dtype, plan.kv_dtype, 128, plan.heads_per_cta) * 132
        model = (table.request_pages, plan.heads_groups, slots, 16 * 2 * 128 * 2, -(-plan_mod.MIN_CHUNK_TOKENS // 16))
        model_us = median_us(lambda: schedule.choose_max_pages_per_chunk(*model))[0]
        pinned_us = median_us(lambda: cupaged.plan_decode(table, 32, 8, 128, np.float16, num_sms=132,
                                                          max_pages_per_chunk=plan.pages_per_chunk))[0]
        fp8_us = median_us(lambda: cupaged.plan_decode(table, 32, 8, 128, np.float16, num_sms=132,
                                                       kv_dtype="float8_e4m3fn"))[0]
        print(f"host us per plan_decode, batch {batch} {spec}: median {med:.1f}, "
              f"p10 {p10:.1f}, p90 {p90:.1f} ({calls} calls); the step model alone {model_us:.1f}; "
              f"the plan with its cap given (no step model) {pinned_us:.1f}; fp8 KV (the model at 3 and "
              f"2 CTAs per SM) {fp8_us:.1f}")


#: Batches of the --step timing (batch, prompt lengths, seed), page size 16.
STEP_BATCHES = ((32, "lognormal:1024:1.2", 1), (128, "lognormal:1024:1.2", 1), (256, "lognormal:512:1.0", 3))
STEP_PAGE_SIZE = 16


def _spread(label: str, times: list) -> None:
    import numpy as np

    print(f"  {label:<48} {statistics.median(times):8.1f} {np.percentile(times, 10):8.1f} "
          f"{np.percentile(times, 90):8.1f}")


def _step_pool(prompts, steps: int):
    """A BlockPool holding one sequence per prompt, with room for ``steps``
    decode steps of each and then some; returns ``(pool, ids)``."""
    import cupaged

    P = STEP_PAGE_SIZE
    need = int((-(-(prompts + 2 * steps + 2 * P) // P)).sum()) + 4 * len(prompts)
    pool = cupaged.BlockPool(num_pages=2 * need, page_size=P)
    ids = []
    for n in prompts.tolist():
        ids.append(pool.add_sequence())
        pool.append(ids[-1], n)
    pool.page_table(ids)
    return pool, ids


def _time_steps(pool, ids, steps: int, plan: str | None) -> dict:
    """µs lists of ``steps`` decode steps: advance, page_table, append_kv's
    slot check of the new table (its first layer; no GPU needed) and the
    plan between steps, as a server runs it: ``plan`` "every" step, or
    "held" (a new plan only when the last one no longer ``matches`` the
    table; ``times["replans"]`` counts them), or None."""
    import numpy as np

    import cupaged
    from cupaged.append import _check_distinct_slots

    times: dict = {"advance": [], "table": [], "book": [], "slots": [], "plan": [], "total": [], "replans": 0}
    held = None
    for _ in range(steps):
        t0 = time.perf_counter()
        pool.advance(ids, 1)
        t1 = time.perf_counter()
        table, _ = pool.page_table(ids)
        t2 = time.perf_counter()
        if plan == "every" or (plan == "held" and (held is None or not held.matches(table))):
            held = cupaged.plan_decode(table, 32, 8, 128, np.float16, num_sms=132)
            times["replans"] += 1
        t3 = time.perf_counter()
        _check_distinct_slots(table, None)
        t4 = time.perf_counter()
        for key, t in (("advance", t1 - t0), ("table", t2 - t1), ("book", t2 - t0), ("plan", t3 - t2),
                       ("total", t3 - t0), ("slots", t4 - t3)):
            times[key].append(t * 1e6)
    return times


def step_costs(steps: int = 2000) -> None:
    """Host µs of one decode step with a BlockPool, per batch of
    STEP_BATCHES: ``pool.advance(ids, 1)`` (every sequence grows by one
    token), ``pool.page_table(ids)`` for the same id list (the incremental
    path), ``plan_decode`` on that table (fp16, 32 q / 8 kv heads, D 128, 132
    SMs) and their sum, with plan_decode between steps as a server runs it;
    the same with the plan held while ``plan.matches`` the table (plan_decode
    when it does not, as DecodeRunner.plan does); median, p10 and p90 over
    ``steps`` steps. Then the bookkeeping back to
    back (no plan_decode between: warm caches), append_kv's slot check of a
    new table, the per-sequence way (``B x pool.append`` + ``page_table``)
    and a ``page_table`` after one sequence left and one joined."""
    print(f"host us per decode step, page size {STEP_PAGE_SIZE}, {steps} steps: median, p10, p90")
    for batch, spec, seed in STEP_BATCHES:
        prompts = _common.ragged_lengths(spec, batch, seed)
        pool, ids = _step_pool(prompts, steps)
        served = _time_steps(pool, ids, steps, plan="every")
        kept = _time_steps(pool, ids, steps, plan="held")
        warm = _time_steps(pool, ids, steps // 2, plan=None)
        loop = []
        for _ in range(steps // 10):
            t0 = time.perf_counter()
            for s in ids:
                pool.append(s, 1)
            pool.page_table(ids)
            loop.append((time.perf_counter() - t0) * 1e6)
        churn = []
        for _ in range(steps // 10):  # the oldest leaves, a new one joins with its prompt
            pool.free(ids.pop(0))
            ids.append(pool.add_sequence())
            pool.append(ids[-1], int(prompts[len(churn) % batch]))
            t0 = time.perf_counter()
            pool.page_table(ids)
            churn.append((time.perf_counter() - t0) * 1e6)
        print(f"batch {batch} {spec}: {int(prompts.sum())} prompt tokens")
        _spread("pool.advance(ids, 1)", served["advance"])
        _spread("pool.page_table(ids), same ids", served["table"])
        _spread("advance + page_table (bookkeeping)", served["book"])
        _spread("plan_decode", served["plan"])
        _spread("step total (bookkeeping + plan_decode)", served["total"])
        _spread(f"step total, plan held while it matches ({kept['replans']} plans)", kept["total"])
        _spread("bookkeeping back to back (no plan_decode between)", warm["book"])
        _spread("append_kv slot check of the step's table", served["slots"])
        _spread(f"{batch} x pool.append + page_table", loop)
        _spread("page_table after 1 leave + 1 join", churn)


def hot_path_cpu(batch: int, ctx: int, calls: int) -> None:
    """Median µs of the Python part of decode's hot path (held plan, ``out``
    given, fp16, 32 q / 8 kv heads, D 128), on any machine, GPU or not: CuPy
    arrays over made-up device addresses (never dereferenced), a launch
    state whose fields are set by hand to what ``PartialLaunch.load`` and
    ``set_arrays`` would set, and the PDL launcher (``_launch.ExLauncher``)
    on a no-op driver entry. The H200 host adds the driver call (the
    "piece" lines of a GPU run) and runs Python ~2x slower than a 2-core
    dev box; this is for working on the hot path's checks without a GPU."""
    import ctypes
    import threading

    import cupy
    import numpy as np
    from cupy.cuda import memory

    import cupaged
    from cupaged import _launch
    from cupaged._plan_launch import PLAN_STATES, HotCall, PlanLaunch, PlanStates

    def fake(shape, dtype, address):
        size = int(np.prod(shape)) * np.dtype(dtype).itemsize
        return cupy.ndarray(shape, dtype, memptr=memory.MemoryPointer(
            memory.UnownedMemory(address, size, None, device_id=0), 0))

    class NoDriver:  # what ExLauncher binds from libcuda, doing nothing
        cuGetErrorName = staticmethod(lambda err, name: 0)

        def __getitem__(self, name):
            return lambda config, function, params, extra: 0

    real_cdll, ctypes.CDLL = ctypes.CDLL, lambda name: NoDriver()
    try:
        launcher = _launch.ExLauncher()
    finally:
        ctypes.CDLL = real_cdll
    table = cupaged.PageTable.from_seq_lens([ctx] * batch, page_size=16)
    plan = cupaged.plan_decode(table, 32, 8, 128, np.float16, num_sms=132)
    pages = int(table.indptr[-1])
    q, out = fake((batch, 32, 128), np.float16, 1 << 20), fake((batch, 32, 128), np.float16, 1 << 24)
    k, v = fake((pages, 16, 8, 128), np.float16, 1 << 32), fake((pages, 16, 8, 128), np.float16, 1 << 36)
    state = PlanLaunch.__new__(PlanLaunch)  # the fields the hot path reads, without a device
    state.lock, state.stream_ptr, state.scores, state.hots = threading.Lock(), 0, None, {}
    state.params = _launch.PartialParams()
    state._words = memoryview(state.params).cast("B").cast("Q")
    state._arg = (ctypes.c_void_p * 1)(ctypes.addressof(state.params))
    state.params_ptr = ctypes.addressof(state._arg)
    state.function, state.block, state.heads_groups = 1, 128, plan.heads_groups
    state.units, state._units_smem, state._launch = plan.num_units, 0, launcher
    state._launch_key, state._pointers_key = launcher.launch_key, None
    args = (None, None, None, None, "NHD", None, None, None)  # decode's defaults, as the hot path records them
    hot_args = (None, None, "NHD", None, None)  # (sm_scale, soft cap, layout, window, qo_indptr) as HotCall.launch takes them
    hot = state.hot = HotCall(q, k, v, table, "auto", args, out, None)

    class Stream:
        ptr = 0

    hot.get_device, hot.get_stream = (lambda: 0), (lambda device: Stream)
    states = PlanStates()
    states.last = state
    PLAN_STATES[id(plan)] = states
    try:
        # the record must take these arguments before decode sees them: were a check to fail,
        # decode's full path would launch a real kernel on the made-up addresses (on a GPU)
        if hot.launch(state, q, k, v, table, "auto", *hot_args, out, False, None) is not out:
            raise RuntimeError("host_profile --hot-path-cpu: the hot path's record refused its own call")

        def median_us(fn):
            times = []
            for _ in range(calls):
                t0 = time.perf_counter()
                fn()
                times.append((time.perf_counter() - t0) * 1e6)
            return statistics.median(times)

        for label, fn in (("decode", lambda: cupaged.decode(q, k, v, table, plan, out=out)),
                          ("HotCall.launch", lambda: hot.launch(state, q, k, v, table, "auto", *hot_args, out, False, None)),
                          ("launch_pointers", lambda: state.launch_pointers(1 << 20, 1 << 32, 1 << 36, 1 << 24, None, 0))):
            rounds = [median_us(fn) for _ in range(3)]
            print(f"host us per {label}, Python only (no-op driver, no GPU): median {statistics.median(rounds):.2f} "
                  f"(round medians {min(rounds):.2f}-{max(rounds):.2f}, {calls} calls each)")
    finally:
        PLAN_STATES.pop(id(plan), None)


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0], epilog=_common.EXIT_CODES_EPILOG)
    p.add_argument("--batch", type=int, default=8, help="requests in the batch (default 8)")
    p.add_argument("--ctx", type=int, default=4096, help="tokens per request (default 4096)")
    p.add_argument("--calls", type=int, default=2000, help="calls per timing and in the profile (default 2000)")
    p.add_argument("--layers", type=int, default=4, help="caches rotated through in the serving-step timing")
    p.add_argument("--plan-only", action="store_true", help="time plan_decode on ragged batches only (no GPU)")
    p.add_argument("--step", action="store_true",
                   help="time a decode step's pool bookkeeping and plan_decode at batch 32/128/256 only (no GPU)")
    p.add_argument("--hot-path-cpu", action="store_true",
                   help="time the Python part of decode's hot path only, with a no-op driver (no GPU)")
    args = p.parse_args(argv)
    if args.hot_path_cpu:
        hot_path_cpu(args.batch, args.ctx, args.calls)
        return 0
    if args.step:
        step_costs()
        return 0
    plan_costs()
    if args.plan_only:
        return 0
    _common.require_gpu()
    import cupy
    import numpy as np

    import cupaged

    layout = _common.plan_layout(args.batch, args.ctx, 16, seed=1, mid_page=False, page_order="random")
    dev = _common.make_device_batch(layout, 32, 8, 128, np.float16, seed=1)
    plan = cupaged.plan_decode(dev.table, 32, 8, 128, np.float16)
    out = cupy.empty_like(dev.q)

    def call():
        cupaged.decode(dev.q, dev.k_cache, dev.v_cache, dev.table, plan, out=out)

    def sample(fn, calls):
        for _ in range(50):
            fn()
        cupy.cuda.Device().synchronize()
        times = []
        for _ in range(calls):
            t0 = time.perf_counter()
            fn()
            times.append((time.perf_counter() - t0) * 1e6)
            if len(times) % 100 == 0:  # keep the launch queue short
                cupy.cuda.Device().synchronize()
        cupy.cuda.Device().synchronize()
        return times

    def report(times, label, extra=""):
        print(f"host us per {label}: median {statistics.median(times):.2f}, "
              f"p10 {np.percentile(times, 10):.2f}, p90 {np.percentile(times, 90):.2f} ({len(times)} calls{extra})")

    def timed(fn, label):
        report(sample(fn, args.calls), label)

    timed(call, "decode call")
    # A serving step: per layer its own caches and a new q and out (same shapes).
    layers = [(cupy.empty_like(dev.q), cupy.empty_like(dev.k_cache), cupy.empty_like(dev.v_cache),
               cupy.empty_like(dev.q)) for _ in range(args.layers)]
    turn = iter(range(1 << 62))

    def layer_call():
        q, k, v, o = layers[next(turn) % args.layers]
        cupaged.decode(q, k, v, dev.table, plan, out=o)

    timed(layer_call, f"decode call rotating {args.layers} layers")
    # The floor: the driver launch alone (cuLaunchKernel with packed arguments).
    from cupaged._plan_launch import plan_states

    state = plan_states(plan).last
    stream = cupy.cuda.get_current_stream().ptr
    ptrs = (dev.q.data.ptr, dev.k_cache.data.ptr, dev.v_cache.data.ptr, out.data.ptr, None, stream)
    timed(lambda: state.launch_pointers(*ptrs), "bare launch (launch_pointers)")
    every_path(cupy, np, cupaged, args, sample, report)
    breakdown(cupy, dev, plan, out, timed)
    prof = cProfile.Profile()
    prof.enable()
    for _ in range(args.calls):
        call()
    prof.disable()
    cupy.cuda.Device().synchronize()
    pstats.Stats(prof).sort_stats("tottime").print_stats(18)
    return 0


def breakdown(cupy, dev, plan, out, timed) -> None:
    """The pieces of one hot-path call, each timed alone: the driver launch
    with packed parameters, the pointer writes, the plan-state lookup, the
    array property reads the checks make, the current device and stream
    queries, and an LSE-sized allocation."""
    import numpy as np

    import importlib

    dec = importlib.import_module("cupaged._plan_launch")
    state = dec.plan_states(plan).last
    stream = cupy.cuda.get_current_stream().ptr
    from cupy_backends.cuda.api import driver

    launch = driver.launchKernel  # CuPy's cuLaunchKernel (the launch state may use cuLaunchKernelEx: PDL)
    fn, grid, block, smem, arg = (state.function, state.units * state.heads_groups, state.block, state.smem,
                                  state.params_ptr)
    timed(lambda: launch(fn, grid, 1, 1, block, 1, 1, smem, stream, arg, 0), "piece: driver launchKernel alone")
    from cupaged._launch import ExLauncher

    for pdl in (False, True):
        ex = ExLauncher(pdl)
        timed(lambda ex=ex: ex(fn, grid, 1, 1, block, 1, 1, smem, stream, arg, 0),
              f"piece: ctypes cuLaunchKernelEx{', PDL attribute' if pdl else ''}")
    import ctypes

    size = ctypes.c_size_t(ctypes.sizeof(state.params))
    extra = (ctypes.c_void_p * 5)(1, ctypes.addressof(state.params), 2, ctypes.addressof(size), 0)
    timed(lambda: launch(fn, grid, 1, 1, block, 1, 1, smem, stream, 0, ctypes.addressof(extra)),
          "piece: driver launchKernel, parameters as one 'extra' buffer")
    empty = cupy.RawKernel('extern "C" __global__ void empty_kernel() {}', "empty_kernel")
    empty((1,), (32,), ())
    efn = empty.kernel.ptr
    timed(lambda: launch(efn, 1, 1, 1, 32, 1, 1, 0, stream, 0, 0), "piece: driver launchKernel of an empty kernel")
    own = cupy.cuda.Stream(non_blocking=True)
    timed(lambda: launch(efn, 1, 1, 1, 32, 1, 1, 0, own.ptr, 0, 0),
          "piece: driver launchKernel of an empty kernel, non-blocking stream")
    p = state.params
    ptrs = (dev.q.data.ptr, dev.k_cache.data.ptr, dev.v_cache.data.ptr, out.data.ptr)

    def pointer_writes():
        p.q, p.k_cache, p.v_cache, p.final_out, p.final_lse = *ptrs, None

    timed(pointer_writes, "piece: 5 pointer writes (ctypes fields)")
    timed(lambda: dec.plan_states(plan), "piece: plan-state lookup")
    q = dev.q
    timed(lambda: (q.shape, q.strides, q.dtype, q.data.ptr, q.data.device_id), "piece: 5 property reads of q")
    timed(lambda: (cupy.cuda.runtime.getDevice(), cupy.cuda.get_current_stream().ptr),
          "piece: current device + stream")
    timed(lambda: cupy.empty((q.shape[0], q.shape[1]), dtype=np.float32), "piece: cupy.empty of an LSE")


def every_path(cupy, np, cupaged, args, sample, report, rounds: int = 10) -> None:
    """Host µs per held-plan decode call on every supported path (issue 17):
    fp16, bf16, fp8 with per-tensor and per-head scales, soft cap, HND,
    return_lse (allocating the LSE, and into a given ``lse``), sinks and a
    sliding window (issue 18), fp8 per-head scales with a new array per layer
    (a model's layers; the plan keeps a hot record per layer), 4 query tokens per request
    (a NumPy ``qo_indptr``) and a window per request (a NumPy ``window_left``: the
    hot path compares their content), and ``DecodeRunner.run`` (checked every call;
    no graph), on the legacy default stream and on a non-blocking one. The
    paths of both streams take turns, ``rounds`` rounds of ``calls / rounds``
    calls each, so that a slow stretch of the host (seen: one path 40 %
    slower in its own block, one stream's paths 30 % slower in theirs) falls
    on every path alike; the line gives the median over all calls and the
    spread of the per-round medians."""
    layout = _common.plan_layout(args.batch, args.ctx, 16, seed=2, mid_page=False, page_order="random")
    f16 = _common.make_device_batch(layout, 32, 8, 128, np.float16, seed=2)
    bf16 = _common.make_device_batch(layout, 32, 8, 128, _common.resolve_dtype("bfloat16"), seed=2)
    k8, v8 = (cupaged.fp8.to_e4m3(x) for x in (f16.k_cache, f16.v_cache))
    head = cupy.full(8, 0.5, dtype=cupy.float32)
    hnd = [cupy.ascontiguousarray(x.transpose(0, 2, 1, 3)) for x in (f16.k_cache, f16.v_cache)]
    lse_buf = cupy.empty(f16.q.shape[:2], dtype=cupy.float32)
    cases = {
        "fp16": (f16.q, f16.k_cache, f16.v_cache, None, {}),
        "bf16": (bf16.q, bf16.k_cache, bf16.v_cache, None, {}),
        "fp8 per-tensor scales": (f16.q, k8, v8, "float8_e4m3fn", dict(k_scale=0.5, v_scale=0.25)),
        "fp8 per-head scales": (f16.q, k8, v8, "float8_e4m3fn", dict(k_scale=head, v_scale=head)),
        "soft cap": (f16.q, f16.k_cache, f16.v_cache, None, dict(logits_soft_cap=30.0)),
        "HND": (f16.q, *hnd, None, dict(kv_layout="HND")),
        "return_lse (allocates the LSE)": (f16.q, f16.k_cache, f16.v_cache, None, dict(return_lse=True)),
        "return_lse into lse=": (f16.q, f16.k_cache, f16.v_cache, None, dict(return_lse=True, lse=lse_buf)),
        "sinks": (f16.q, f16.k_cache, f16.v_cache, None, dict(sinks=cupy.full(32, 3.0, dtype=cupy.float32))),
        "window_left": (f16.q, f16.k_cache, f16.v_cache, None, dict(window_left=args.ctx // 2)),
        "window_left per request (an int array)": (
            f16.q, f16.k_cache, f16.v_cache, None,
            dict(window_left=np.arange(args.batch, dtype=np.int32) % 3 * (args.ctx // 4) + args.ctx // 4)),
        # what a model does: each layer its own scale arrays, one plan for the step
        "fp8 per-head scales, a new array per layer (4 layers)": (
            f16.q, k8, v8, "float8_e4m3fn", {"layer_scales": [cupy.full(8, 0.5 + i / 8, dtype=cupy.float32)
                                                              for i in range(4)]}),
        "qo_indptr, 4 query tokens per request": (
            cupy.repeat(f16.q, 4, axis=0), f16.k_cache, f16.v_cache, None,
            dict(qo_indptr=np.arange(args.batch + 1, dtype=np.int32) * 4)),
    }
    # both streams' paths take turns too (a slow stretch of the host once fell on one stream's block)
    streams = (("legacy default stream", None), ("non-blocking stream", cupy.cuda.Stream(non_blocking=True)))
    calls = {}
    for where, stream in streams:
        with contextlib.nullcontext() if stream is None else stream:
            calls[where] = _paths(cupy, np, cupaged, args, f16, cases)
    times = {(where, label): [] for where in calls for label in calls[where]}
    per_round = {key: [] for key in times}
    for _ in range(rounds):
        for where, stream in streams:
            with contextlib.nullcontext() if stream is None else stream:
                for label, fn in calls[where].items():
                    t = sample(fn, args.calls // rounds)
                    times[where, label] += t
                    per_round[where, label].append(statistics.median(t))
    for where, _ in streams:
        print(f"-- on the {where}")
        for label in calls[where]:
            r = per_round[where, label]
            report(times[where, label], label, f"; round medians {min(r):.2f}-{max(r):.2f}")


def _paths(cupy, np, cupaged, args, f16, cases) -> dict:
    """``{label: call}`` of every path, made on the current stream."""
    calls = {}
    for name, (q, k, v, kv_dtype, kw) in cases.items():
        plan = cupaged.plan_decode(f16.table, 32, 8, 128, q.dtype, kv_dtype=kv_dtype,
                                   window_left=kw.get("window_left"), qo_indptr=kw.get("qo_indptr"))
        out = cupy.empty_like(q)
        if "layer_scales" in kw:  # the next layer's arrays on every call
            nxt = itertools.cycle(kw["layer_scales"]).__next__
            calls[f"decode call, {name}"] = (lambda q=q, k=k, v=v, plan=plan, out=out, nxt=nxt: cupaged.decode(
                q, k, v, f16.table, plan, out=out, **dict.fromkeys(("k_scale", "v_scale"), nxt())))
            continue
        calls[f"decode call, {name}"] = (lambda q=q, k=k, v=v, plan=plan, out=out, kw=kw:
                                         cupaged.decode(q, k, v, f16.table, plan, out=out, **kw))
    runner = cupaged.DecodeRunner(32, 8, 128, np.float16, page_size=16, max_batch=args.batch,
                                  max_pages=int(f16.table.indptr[-1]))
    runner.plan(f16.table)
    out = cupy.empty_like(f16.q)
    calls["DecodeRunner.run, fp16 (checked, no graph)"] = lambda: runner.run(f16.q, f16.k_cache, f16.v_cache, out)
    return calls


if __name__ == "__main__":
    sys.exit(main())
