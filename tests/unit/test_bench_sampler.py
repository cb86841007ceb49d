"""The bench's memory sampler keeps its PSS reads (smaps_rollup: a page-table walk of each rank) under
its duty share of the time, so that measuring memory takes little from the ranks it measures."""

import os

import benchmarks.procs as procs


class _Clock:
    def __init__(self):
        self.t = 100.0

    def __call__(self):
        return self.t


def test_pss_reads_stay_under_their_duty(monkeypatch):
    clock = _Clock()
    reads = []

    def fake_tree(rank, with_pss):
        if with_pss:
            reads.append(clock.t)
            clock.t += 0.06  # a 60 ms smaps_rollup walk
        return 1 << 30, (1 << 29) if with_pss else 0

    monkeypatch.setattr(procs, "_tree_memory", fake_tree)
    monkeypatch.setattr(procs.time, "monotonic", clock)
    sampler = procs.MemorySampler(os.getpid(), launcher=False, interval_s=0.5, pss_every=1, pss_duty=0.01)
    for _ in range(100):  # 50 s of samples, 0.5 s apart
        sampler.sample()
        clock.t += 0.5
    # each read of 60 ms is followed by >= 6 s without one: 1% of the time
    gaps = [b - a for a, b in zip(reads, reads[1:])]
    assert len(reads) >= 2 and min(gaps) >= 6.0
    assert sampler.peaks.pss_samples == len(reads) <= 9
    assert sampler.peaks.samples == 100 and sampler.peaks.sum_rss_gib == 1.0 and sampler.peaks.sum_pss_gib == 0.5
