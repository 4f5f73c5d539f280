"""Images that reach the first block on a GPU (CUDA shared memory), copied into its own memory."""

from __future__ import annotations

import torch


class DeviceInputs:
    """A stream and an event of their own for copying a call's GPU inputs (see :meth:`own`)."""

    def __init__(self, device: torch.device) -> None:
        self.device = device
        # Its own stream, so waiting for these copies never waits for the block's earlier work.
        self.stream = torch.cuda.Stream(device)  # type: ignore[no-untyped-call]
        self.owned = torch.cuda.Event()  # type: ignore[no-untyped-call]

    def own(self, batch: list[list[torch.Tensor]]) -> bool:
        """Replace each input that arrived on a GPU with a copy in this block's memory and wait for
        the copies; whether there was one.

        The server hands a GPU input over in a buffer of the CUDA pool it shares with this process
        (or, when that pool is full, of its own, mapped here by CUDA IPC) and takes the buffer back
        once ``execute`` returns; a copy still queued then would read another request's data or
        unmapped memory. So such inputs are copied on a stream with no other work, and the host
        waits for those copies alone (a few microseconds), never for the block's own earlier work
        on its main stream.
        """
        main = torch.cuda.current_stream(self.device)
        copied = False
        with torch.cuda.stream(self.stream):
            for xs in batch:
                for j, x in enumerate(xs):
                    if x.is_cuda:
                        own = torch.empty(x.shape, dtype=x.dtype, device=self.device)
                        own.copy_(x, non_blocking=True)
                        own.record_stream(main)  # the allocator keeps it until the main stream's use is done
                        xs[j] = own
                        copied = True
        if copied:
            self.owned.record(self.stream)
            self.owned.synchronize()
        return copied
