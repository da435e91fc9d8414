"""``fake`` backend: accepts every batch (after the bounds check) and moves nothing.

For protocol tests and warmup where the bytes do not matter.
"""

from __future__ import annotations

from typing import Any

import numpy as np

from pdserve.disagg.transfer.base import CompletedHandle, TransferBackend, TransferHandle


class FakeBackend(TransferBackend):
    name = "fake"

    def __init__(self, role: str, device: str = "cpu", **options: Any):
        super().__init__(role, device, **options)
        self.batches = 0
        self.bytes = 0

    def _write(
        self, peer_id: str, src: np.ndarray, dst: np.ndarray, lengths: np.ndarray
    ) -> TransferHandle:
        self.batches += 1
        self.bytes += int(lengths.sum())
        return CompletedHandle()
