"""A crossing model's runtime (``blockflow.plan.crossing``): each request's tensors, as they arrive in
host memory, are sent to the next server's ensemble over Triton's gRPC, and its answer is this
request's. Each request waits at most the next server's ``timeout_s``, and one that fails (that server down, slow, or refusing it) fails alone with a
clear error: the next request tries again, so the path heals when that server is back.

Inside a stub only (it needs ``triton_python_backend_utils``).
"""

from __future__ import annotations

import json
from typing import Any

import numpy as np
import triton_python_backend_utils as pb_utils
from torch.utils.dlpack import from_dlpack

from blockflow.backend.replies import error
from blockflow.core.spec import BRIDGE_PARAMETER, BridgeSpec

# Triton's datatype of each hop dtype a crossing sends (bf16 never crosses: blockflow.plan.crossing).
_DATATYPES = {"fp32": "FP32", "fp16": "FP16"}


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
        # One blocking call per request: tritonclient's async callbacks never ran inside the r24.10
        # stub (a request waited past its deadline with the next server idle, 2026-11-29), so the
        # crossing's instances (two) are what lets requests cross at once.
        return [self._cross(request) for request in requests]

    def _cross(self, request: Any) -> Any:
        try:
            inputs = []
            for name, dtype in self.spec.inputs:
                tensor = pb_utils.get_input_tensor_by_name(request, name)
                # Through DLPack: the stub's as_numpy misreads some tensors (docs/triton-notes.md).
                x = from_dlpack(tensor.to_dlpack()).numpy()
                inp = self._grpc.InferInput(name, list(x.shape), _DATATYPES[dtype])
                inp.set_data_from_numpy(np.ascontiguousarray(x))
                inputs.append(inp)
            wanted = [self._grpc.InferRequestedOutput(n) for n in self.spec.outputs]
            result = self.client.infer(self.spec.model, inputs, outputs=wanted, client_timeout=self.spec.timeout_s)
            return pb_utils.InferenceResponse(output_tensors=[pb_utils.Tensor(n, result.as_numpy(n)) for n in self.spec.outputs])
        except Exception as exc:  # the next server down, slow or refusing: this request fails alone
            return self._failed(exc)

    def _failed(self, exc: Any) -> Any:
        text = exc.message() if callable(getattr(exc, "message", None)) else str(exc)
        message = (f"crossing {self.name!r}: the next server ({self.spec.grpc}, ensemble {self.spec.model!r}) did not "
                   f"answer: {text}")
        self.logger.log_error(f"blockflow: {message}")
        return pb_utils.InferenceResponse(error=error(message, "UNAVAILABLE"))

    def finalize(self) -> None:
        self.client.close()
