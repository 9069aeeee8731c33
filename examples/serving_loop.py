#!/usr/bin/env python3
"""Continuous batching with one CUDA graph: a BlockPool of pages, requests
that arrive, fork (a shared prefix) and finish at random, and per step
append_kv + decode for every layer, captured once and replayed every step.

Each step the host grows every live sequence by one token in the pool
(copy-on-write where a fork shares a partial page), builds the page table,
and has the DecodeRunner plan it (one async copy into the runner's fixed
buffers); then the graph replays. The graph was captured at step 0 for a
batch of a few requests and is never captured again: the runner's buffers
keep their addresses and its captured grid covers ``--max-batch``.
Every ``--check-every`` steps the first and the last layer are compared with
the float64 reference (cupaged.reference.decode on host copies).

With ``--draft N`` each step is a draft/verify step of speculative decoding:
every request appends N + 1 tokens (here all accepted) and the layers decode
all of them, causal among themselves (``qo_indptr``: the runner plans one
row per query token, a request's rows in row groups that read each chunk's
K/V once, and its append_kv writes each token at its slot).

    python3 examples/serving_loop.py --steps 200 --layers 32
    python3 examples/serving_loop.py --steps 100 --draft 3

Prints steps/s and the host µs per step (pool, table, plan). Needs a CUDA GPU.
Exit status: 0 ran and every check passed, 1 a check failed, 2 no GPU.
"""

from __future__ import annotations

import argparse
import sys
import time

import numpy as np

import cupaged
from cupaged import reference

HQ, HKV, D, P = 32, 8, 128, 16


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--steps", type=int, default=200)
    p.add_argument("--layers", type=int, default=32)
    p.add_argument("--max-batch", type=int, default=32)
    p.add_argument("--num-pages", type=int, default=12288, help="pages in the pool (and in each layer's cache)")
    p.add_argument("--check-every", type=int, default=25, help="compare with the reference every N steps (0: never)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--draft", type=int, default=0, metavar="N",
                   help="draft tokens per request and step (0..15): each step decodes N + 1 tokens per request")
    args = p.parse_args(argv)
    if not 0 <= args.draft <= 15:
        p.error(f"--draft must be in 0..15 (at most 16 query tokens per request), got {args.draft}")
    return args


class Server:
    """The model side: per layer a K/V cache, the step's static buffers, and
    the runner; the step (append_kv + decode per layer) as one graph."""

    def __init__(self, args, rng):
        import cupy

        self.cp, self.rng, self.args = cupy, rng, args
        shape = (args.num_pages, P, HKV, D)
        self.caches = []
        for _ in range(args.layers):  # random contents: a prompt's K/V is whatever its pages hold
            self.caches.append(tuple(cupy.random.standard_normal(shape, dtype=cupy.float32).astype(cupy.float16)
                                     for _ in range(2)))
        B = args.max_batch * (args.draft + 1)  # query rows: every request's tokens of a step
        self.q = cupy.zeros((args.layers, B, HQ, D), dtype=cupy.float16)
        self.k_new = cupy.zeros((args.layers, B, HKV, D), dtype=cupy.float16)
        self.v_new = cupy.zeros((args.layers, B, HKV, D), dtype=cupy.float16)
        self.out = cupy.zeros((args.layers, B, HQ, D), dtype=cupy.float16)
        self.runner = cupaged.DecodeRunner(HQ, HKV, D, np.float16, page_size=P, max_batch=B,
                                           max_pages=args.num_pages * (args.draft + 1),  # (a row per query token)
                                           group_tokens=args.draft > 0)
        self.graph = None
        self.captures = 0

    def layer_step(self):
        for layer, (k, v) in enumerate(self.caches):
            self.runner.append_kv(self.k_new[layer], self.v_new[layer], k, v)
            self.runner.run(self.q[layer], k, v, out=self.out[layer])

    def capture(self):
        self.layer_step()  # compiles and checks outside the capture
        stream = self.cp.cuda.get_current_stream()
        stream.synchronize()
        stream.begin_capture()
        try:
            self.layer_step()
        finally:
            self.graph = stream.end_capture()
        self.captures += 1

    def new_inputs(self):
        """The step's q and new K/V (what the layers' projections would write)."""
        for a in (self.q, self.k_new, self.v_new):
            a[...] = self.cp.random.standard_normal(a.shape, dtype=self.cp.float32).astype(self.cp.float16)


def churn(pool, rng, max_batch, caches):
    """Requests finish, arrive (prompts of 1-2000 tokens) and fork at random."""
    ids = list(pool.seq_ids)
    for sid in ids:
        if len(pool.seq_ids) > 1 and rng.random() < 0.05:
            pool.free(sid)
    while len(pool.seq_ids) < max_batch and rng.random() < 0.5:
        if pool.seq_ids and rng.random() < 0.3:  # a shared prefix: fork a live request
            _, copies = pool.fork(int(rng.choice(pool.seq_ids)))
            for k, v in caches:
                cupaged.apply_page_copies([k, v], copies)
        else:
            sid = pool.add_sequence()
            pool.append(sid, int(rng.integers(1, 2000)))


def check(server, table, qo_indptr, layers) -> float:
    """The worst relative error of the given layers against the float64 reference."""
    b = int(qo_indptr[-1])
    worst = 0.0
    for layer in layers:
        k, v = server.caches[layer]
        ref, _ = reference.decode(server.q[layer, :b].get(), k.get(), v.get(), table, qo_indptr=qo_indptr)
        got = server.out[layer, :b].get().astype(np.float64)
        worst = max(worst, float(np.abs(got - ref).max() / max(np.abs(ref).max(), 1e-30)))
    return worst


def main(argv=None) -> int:
    args = parse_args(argv)
    if not cupaged.has_gpu():
        print("no CUDA GPU: the serving loop needs one", file=sys.stderr)
        return 2
    import cupy

    rng = np.random.default_rng(args.seed)
    cupy.random.seed(args.seed)
    with cupy.cuda.Stream(non_blocking=True):  # graphs are captured on a non-default stream
        server = Server(args, rng)
        pool = cupaged.BlockPool(args.num_pages, P)
        for _ in range(3):
            pool.append(pool.add_sequence(), int(rng.integers(1, 2000)))
        host_us, batches, worst, failed = [], [], 0.0, 0
        start = None
        for step in range(args.steps):
            if step == 1:
                cupy.cuda.get_current_stream().synchronize()
                start = time.perf_counter()
            t0 = time.perf_counter()
            if step:
                churn(pool, rng, args.max_batch, server.caches)
            ids = pool.seq_ids
            q_len = args.draft + 1
            pool.advance(ids, q_len)  # this step's tokens of every request
            table, _ = pool.page_table(ids)
            qo_indptr = np.arange(len(ids) + 1, dtype=np.int32) * q_len
            server.runner.plan(table, qo_indptr=qo_indptr if q_len > 1 else None)
            host_us.append((time.perf_counter() - t0) * 1e6)
            batches.append(table.batch_size)
            server.new_inputs()
            if server.graph is None:
                server.capture()
            else:
                server.graph.launch()
            if args.check_every and step % args.check_every == args.check_every - 1:
                err = check(server, table, qo_indptr, sorted({0, args.layers - 1}))
                worst = max(worst, err)
                failed += err > 2e-2
        cupy.cuda.get_current_stream().synchronize()
        elapsed = time.perf_counter() - start if start else float("nan")
    steps = args.steps - 1
    print(f"steps {args.steps}, layers {args.layers}, tokens per request and step {args.draft + 1}, "
          f"batch {min(batches)}-{max(batches)} "
          f"(mean {np.mean(batches):.1f}), graph captures {server.captures}")
    print(f"steps/s {steps / elapsed:.1f}; host us per step (pool + table + plan): median "
          f"{np.median(host_us):.0f}, p90 {np.percentile(host_us, 90):.0f}")
    print(f"reference checks: worst max_rel {worst:.2e}, {failed} failed")
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
