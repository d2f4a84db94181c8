"""The Tinker SDK's protobuf bodies: forward_backward requests in, ForwardBackwardOutput and
SampleResponse out. The schema is the SDK's own (`tinker.proto.tinker_public_pb2`), so the
`tinker` package must be installed (`pip install 'rlproxy[tinker]'`); nothing here knows HTTP.
"""

from __future__ import annotations

import numpy as np


class UserError(ValueError):
    """Bad input from the client: reported with category "user", never retried."""


def schema():
    try:
        from tinker.proto import tinker_public_pb2
    except ImportError:  # routes.py turns this into a clear 501
        return None
    return tinker_public_pb2


def _tensor(msg, pb) -> np.ndarray:
    dtype = {pb.DTYPE_FLOAT32: np.float32, pb.DTYPE_INT64: np.int64,
             pb.DTYPE_INT32: np.int32}.get(msg.dtype)
    if dtype is None:
        raise UserError(f"unsupported tensor dtype {msg.dtype} (send float32 or int64)")
    shape = list(msg.shape)
    if msg.HasField("sparse_csr"):  # rows = crow segments; dense it, loss inputs are small
        csr = msg.sparse_csr
        values = np.frombuffer(csr.values, dtype=dtype)
        crow = np.frombuffer(csr.crow_indices, dtype=np.int64)
        col = np.frombuffer(csr.col_indices, dtype=np.int64)
        out = np.zeros(shape, dtype=dtype)
        for r in range(len(crow) - 1):
            out[r, col[crow[r]:crow[r + 1]]] = values[crow[r]:crow[r + 1]]
        return out
    arr = np.frombuffer(msg.dense, dtype=dtype)
    if shape and int(np.prod(shape)) != arr.size:
        raise UserError(f"tensor of shape {shape} carries {arr.size} values")
    return arr.reshape(shape) if shape else arr


def decode_forward_backward(body: bytes) -> dict:
    """{"model_id", "seq_id", "loss_fn", "loss_fn_config", "forward_only", "data": [{"tokens":
    [int], "inputs": {name: ndarray}}]}."""
    pb = schema()
    msg = pb.ForwardBackwardRequest()
    try:
        msg.ParseFromString(body)
    except Exception as e:
        raise UserError(f"could not parse the ForwardBackwardRequest protobuf: {e}") from None
    config = {k: v.number for k, v in msg.loss_fn_config_v2.items() if v.WhichOneof("value")
              == "number"} if msg.loss_fn_config_v2 else dict(msg.loss_fn_config)
    data = []
    for datum in msg.data:
        tokens = []
        for chunk in datum.model_input:
            if chunk.WhichOneof("chunk") != "encoded_text":
                raise UserError("only encoded_text chunks are supported (no images or audio)")
            tokens.extend(np.frombuffer(chunk.encoded_text.tokens, dtype=np.int32).tolist())
        inputs = {k: _tensor(v, pb) for k, v in datum.loss_fn_inputs.items()}
        data.append({"tokens": tokens, "inputs": inputs})
    return {"model_id": msg.model_id, "seq_id": msg.seq_id, "loss_fn": msg.loss_fn,
            "loss_fn_config": config, "forward_only": msg.forward_only, "data": data}


def encode_forward_backward(logprobs: list[np.ndarray], metrics: dict[str, float]) -> bytes:
    """One ArrayRecord holding each datum's per-token log-probs, plus metrics (keys "name:reduce",
    which the SDK splits to merge chunks)."""
    pb = schema()
    out = pb.ForwardBackwardOutput(loss_fn_output_type="ArrayRecord")
    record = out.loss_fn_outputs.add(num_datums=len(logprobs))
    flat = [np.asarray(lp, dtype=np.float32).reshape(-1) for lp in logprobs]
    offsets = np.cumsum([0] + [a.nbytes for a in flat]).astype(np.int64)
    field = record.fields["logprobs"]
    field.data = b"".join(a.tobytes() for a in flat)
    field.offsets = offsets.tobytes()
    field.dtype = pb.DTYPE_FLOAT32
    for k, v in metrics.items():
        out.metrics[k] = float(v)
    return out.SerializeToString()


def encode_sample(sequences: list[dict], prompt_logprobs: list[float] | None) -> bytes:
    """sequences: [{"tokens", "logprobs", "stop_reason": "stop"|"length"}]; a None prompt
    log-prob (the first token has none) goes as NaN, which the SDK hands back as None."""
    pb = schema()
    out = pb.SampleResponse()
    for s in sequences:
        seq = out.sequences.add()
        seq.stop_reason = pb.STOP_REASON_STOP if s["stop_reason"] == "stop" else \
            pb.STOP_REASON_LENGTH
        seq.tokens = np.asarray(s["tokens"], dtype=np.int32).tobytes()
        seq.logprobs = np.asarray(s["logprobs"], dtype=np.float32).tobytes()
    if prompt_logprobs is not None:
        out.prompt_logprobs = np.asarray(
            [np.nan if v is None else v for v in prompt_logprobs], dtype=np.float32).tobytes()
    return out.SerializeToString()
