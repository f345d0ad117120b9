"""The no-I/O ceiling for DLIO runs: a DLIO data loader that yields the same in-memory
batch every step (what DLIO's own synthetic loader does; DLIO 2.0.0's imports NVIDIA
DALI at module load, which this CPU machine does not have)."""

import numpy as np
from dlio_benchmark.common.enumerations import DataLoaderType, DatasetType
from dlio_benchmark.data_loader.base_data_loader import BaseDataLoader


class NoIOLoader(BaseDataLoader):
    def __init__(self, format_type, dataset_type, epoch):
        super().__init__(format_type, dataset_type, epoch, DataLoaderType.CUSTOM)
        n = int(self._args.record_length)
        self._batch = np.zeros((self.batch_size, n), dtype=np.uint8)

    def read(self):
        return

    def next(self):
        super().next()
        total = self._args.training_steps if self.dataset_type is DatasetType.TRAIN \
            else self._args.eval_steps
        for _ in range(int(total)):
            yield self._batch

    def finalize(self):
        return
