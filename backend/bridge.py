"""A crossing model's runtime (``blockflow.plan.crossing``): the requests of a call, as their tensors
arrive in host memory, are sent to the next server's ensemble over Triton's gRPC, together in calls
of at most its batch (``BridgeSpec.max_batch_size``; one by one where answers vary in size per
request), and each request gets its rows of the answer. A call waits at most the next server's
``timeout_s``, and one that fails (that server down, slow, or refusing it) fails its requests with a
clear error, nothing else: the next call tries again, so the path heals when that server is back.

Inside a stub only (it needs ``triton_python_backend_utils``).
"""

from __future__ import annotations

import json
from typing import Any

import numpy as np
import numpy.typing as npt
import triton_python_backend_utils as pb_utils
from torch.utils.dlpack import from_dlpack

from blockflow.backend.replies import error
from blockflow.core.spec import BRIDGE_PARAMETER, BridgeSpec

# Triton's datatype of each hop dtype a crossing sends (bf16 never crosses: blockflow.plan.crossing).
_DATATYPES = {"fp32": "FP32", "fp16": "FP16"}
# A call's readable requests: each one's position in the call and its input arrays.
Read = list[tuple[int, list[npt.NDArray[Any]]]]


class TritonPythonModel:
    def initialize(self, args: dict[str, str]) -> None:
        import tritonclient.grpc as grpcclient

        config = json.loads(args["model_config"])
        self.spec = BridgeSpec.model_validate_json(config["parameters"][BRIDGE_PARAMETER]["string_value"])
        self.name = config["name"]
        self._grpc = grpcclient
        # gRPC's own reconnect backoff grows to two minutes while the next server is down; capped
        # at one second, a crossing answers again within about a second of that server's return.
        self.client = grpcclient.InferenceServerClient(self.spec.grpc, channel_args=[
            ("grpc.max_send_message_length", 2**31 - 1), ("grpc.max_receive_message_length", 2**31 - 1),
            ("grpc.initial_reconnect_backoff_ms", 200), ("grpc.min_reconnect_backoff_ms", 200),
            ("grpc.max_reconnect_backoff_ms", 1000)])
        self.logger = pb_utils.Logger

    def execute(self, requests: list[Any]) -> list[Any]:
        # Blocking calls: tritonclient's async callbacks never ran inside the r24.10 stub (a request
        # waited past its deadline with the next server idle, 2026-11-29), so the crossing's instances
        # (two) are what lets calls cross at once.
        responses: list[Any] = [None] * len(requests)
        read: Read = []
        for i, request in enumerate(requests):
            try:
                # Through DLPack: the stub's as_numpy misreads some tensors (docs/triton-notes.md).
                read.append((i, [from_dlpack(pb_utils.get_input_tensor_by_name(request, n).to_dlpack()).numpy()
                                 for n, _ in self.spec.inputs]))
            except Exception as exc:  # a request that cannot be read fails alone
                responses[i] = self._failed(exc)
        for chunk in self._chunks(read):
            self._cross(chunk, responses)
        return responses

    def _chunks(self, read: Read) -> list[Read]:
        """The requests in calls of at most ``max_batch_size`` samples (each alone without one)."""
        chunks: list[Read] = []
        rows = 0
        for item in read:
            n = int(item[1][0].shape[0])
            if not chunks or not self.spec.max_batch_size or rows + n > self.spec.max_batch_size:
                chunks.append([])
                rows = 0
            chunks[-1].append(item)
            rows += n
        return chunks

    def _cross(self, chunk: Read, responses: list[Any]) -> None:
        """One call for the requests of ``chunk``; each gets its rows of the answer (or the call's error)."""
        try:
            inputs = []
            for k, (name, dtype) in enumerate(self.spec.inputs):
                parts = [arrays[k] for _, arrays in chunk]
                x = np.ascontiguousarray(parts[0] if len(parts) == 1 else np.concatenate(parts))
                inp = self._grpc.InferInput(name, list(x.shape), _DATATYPES[dtype])
                inp.set_data_from_numpy(x)
                inputs.append(inp)
            wanted = [self._grpc.InferRequestedOutput(n) for n in self.spec.outputs]
            result = self.client.infer(self.spec.model, inputs, outputs=wanted, client_timeout=self.spec.timeout_s)
            answers = {n: result.as_numpy(n) for n in self.spec.outputs}
            rows = sum(int(arrays[0].shape[0]) for _, arrays in chunk)
            wrong = {n: None if a is None else a.shape for n, a in answers.items() if a is None or a.shape[:1] != (rows,)}
            if wrong:  # each request's rows could not be told apart
                raise ValueError(f"the answer to {rows} samples has outputs of other sizes: {wrong}")
            start = 0
            for i, arrays in chunk:
                stop = start + int(arrays[0].shape[0])
                responses[i] = pb_utils.InferenceResponse(output_tensors=[
                    pb_utils.Tensor(n, np.ascontiguousarray(a[start:stop])) for n, a in answers.items()])
                start = stop
        except Exception as exc:  # the next server down, slow or refusing: this call's requests fail (logged once)
            for n, (i, _) in enumerate(chunk):
                responses[i] = self._failed(exc, log=n == 0)

    def _failed(self, exc: Any, log: bool = True) -> Any:
        text = exc.message() if callable(getattr(exc, "message", None)) else str(exc)
        message = (f"crossing {self.name!r}: the next server ({self.spec.grpc}, ensemble {self.spec.model!r}) did not "
                   f"answer: {text}")
        if log:
            self.logger.log_error(f"blockflow: {message}")
        return pb_utils.InferenceResponse(error=error(message, "UNAVAILABLE"))

    def finalize(self) -> None:
        self.client.close()
