#!/usr/bin/env python3
"""PFS MB/s each policy draws, the conserving model against the thesis' rule (Lassen preset,
ImageNet-1k, 4 and 1,024 workers): python benchmarks/sim/sim_conservation.py"""
from dataclasses import replace
from forebay.sim import simulate, lassen
for workers, scale in ((4, 0.01), (1024, 0.05)):
    out = {}
    for model in ("conserving", "thesis"):
        rep = simulate(replace(lassen(), model=model), "imagenet-1k", workers=workers, epochs=2,
                       scale=scale, progress=False)
        out[model] = rep["policies"]
    print(f"\n{workers} workers, imagenet-1k at scale {scale}, 2 epochs, lassen (table max 2,870 MB/s)")
    print("| policy | conserving: PFS MB/s over the run | total s | thesis rule: PFS MB/s | total s |")
    print("|---|---:|---:|---:|---:|")
    for name in out["conserving"]:
        c, t = out["conserving"][name], out["thesis"][name]
        if c["failed"] or name == "perfect":
            continue
        print(f"| {name} | {c['pfs_MBps_mean']:,.0f} | {c['total_s']:.2f} | {t['pfs_MBps_mean']:,.0f} | {t['total_s']:.2f} |")
