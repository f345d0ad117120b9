"""A tiny program that writes and reads files, traced by the real DFTracer to make
posix-app.pfw.gz (see README.md here)."""
import os

import numpy as np
from dftracer.python import dft_fn, dftracer

log = dftracer.initialize_log(logfile=None, data_dir=None, process_id=-1)
comp = dft_fn("COMPUTE")


@comp.log
def compute(i):
    s = 0
    for k in range(20000):
        s += k
    return s


d = os.path.join(os.getcwd(), "data")
for i in range(4):
    with open(f"{d}/f{i}.bin", "wb") as f:
        f.write(os.urandom(4096 * (i + 1)))
for i in range(4):
    with open(f"{d}/f{i}.bin", "rb") as f:
        f.seek(100)
        f.read(1000)
        f.read()
    compute(i)
np.save(f"{d}/a.npy", np.arange(1000))
np.load(f"{d}/a.npy")
log.finalize()
