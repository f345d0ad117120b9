"""DFTracer's AI logging API (epochs, fetch iterations, items, compute, checkpoint) around
file reads, traced by the real DFTracer to make ai-app.pfw.gz (see README.md here)."""
import os
import time

from dftracer.python import dftracer
from dftracer.python.ai import ai

log = dftracer.initialize_log(logfile=None, data_dir=None, process_id=-1)
d = os.path.join(os.getcwd(), "data")


@ai.data.item
def item(i):
    with open(f"{d}/f{i % 4}.bin", "rb") as f:
        return f.read()


@ai.compute
def compute(b):
    time.sleep(0.002)


for _epoch in ai.pipeline.epoch.iter(range(2)):
    for _step, b in ai.dataloader.fetch.iter(
            enumerate([[item(i) for i in range(4)] for _ in range(3)])):
        compute(b)
ai.checkpoint.capture.start()
time.sleep(0.001)
ai.checkpoint.capture.stop()
log.finalize()
