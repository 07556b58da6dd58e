"""KServe v2 tensor data <-> Python values, at the router's KServe API boundary.

A request carries each input's data either typed (`contents.<type>_contents`) or raw
(`raw_input_contents[i]` for `inputs[i]`, Triton's client default): fixed-size
little-endian elements, BOOL one byte each, BYTES a 4-byte little-endian length before
each element. Responses always use raw contents, as Triton does.
"""

from __future__ import annotations

import math
import struct
from collections.abc import Sequence

from tandem.proto.inference import grpc_service_pb2 as kserve_pb
from tandem.router.errors import InvalidRequest

# struct codes of the fixed-size datatypes (little-endian, no padding).
_RAW_FORMATS = {
    "BOOL": "?",
    "INT8": "b",
    "INT16": "h",
    "INT32": "i",
    "INT64": "q",
    "UINT8": "B",
    "UINT16": "H",
    "UINT32": "I",
    "UINT64": "Q",
    "FP16": "e",
    "FP32": "f",
    "FP64": "d",
}

# Which `InferTensorContents` list holds each datatype's typed data (FP16 has none).
_TYPED_FIELDS = {
    "BOOL": "bool_contents",
    "INT8": "int_contents",
    "INT16": "int_contents",
    "INT32": "int_contents",
    "INT64": "int64_contents",
    "UINT8": "uint_contents",
    "UINT16": "uint_contents",
    "UINT32": "uint_contents",
    "UINT64": "uint64_contents",
    "FP32": "fp32_contents",
    "FP64": "fp64_contents",
    "BYTES": "bytes_contents",
}

_LENGTH_PREFIX = struct.Struct("<I")

InputTensor = kserve_pb.ModelInferRequest.InferInputTensor


def num_elements(name: str, shape: Sequence[int]) -> int:
    if any(dim < 0 for dim in shape):
        raise InvalidRequest(f"input {name!r} has a negative dimension in shape {list(shape)}")
    return math.prod(shape)


def decode_input(tensor: InputTensor, raw: bytes | None) -> list:
    """The tensor's elements, flattened; `raw` is its raw contents when the request uses them.

    Raises `InvalidRequest` (naming the input) when the data does not match the declared
    datatype and shape.
    """
    name, datatype = tensor.name, tensor.datatype
    count = num_elements(name, tensor.shape)
    if raw is not None:
        if _has_typed_data(tensor):
            raise InvalidRequest(
                f"input {name!r} sets `contents` although the request uses raw_input_contents",
                param=name,
            )
        return _decode_raw(name, datatype, count, raw)
    field = _TYPED_FIELDS.get(datatype)
    if field is None:
        raise InvalidRequest(f"input {name!r}: datatype {datatype!r} has no typed contents")
    values = list(getattr(tensor.contents, field))
    if len(values) != count:
        raise InvalidRequest(
            f"input {name!r} has shape {list(tensor.shape)} ({count} elements) but "
            f"contents.{field} holds {len(values)}",
            param=name,
        )
    return values


def encode_bytes(values: Sequence[bytes]) -> bytes:
    """Raw contents of a BYTES tensor."""
    return b"".join(_LENGTH_PREFIX.pack(len(v)) + v for v in values)


def _has_typed_data(tensor: InputTensor) -> bool:
    return any(len(getattr(tensor.contents, f)) for f in set(_TYPED_FIELDS.values()))


def _decode_raw(name: str, datatype: str, count: int, raw: bytes) -> list:
    if datatype == "BYTES":
        return _decode_raw_bytes(name, count, raw)
    code = _RAW_FORMATS.get(datatype)
    if code is None:
        raise InvalidRequest(f"input {name!r} has unsupported datatype {datatype!r}", param=name)
    layout = struct.Struct(f"<{count}{code}")
    if len(raw) != layout.size:
        raise InvalidRequest(
            f"input {name!r}: {count} {datatype} elements take {layout.size} bytes, "
            f"raw contents have {len(raw)}",
            param=name,
        )
    return list(layout.unpack(raw))


def _decode_raw_bytes(name: str, count: int, raw: bytes) -> list[bytes]:
    values: list[bytes] = []
    offset = 0
    while offset < len(raw):
        if offset + _LENGTH_PREFIX.size > len(raw):
            raise InvalidRequest(f"input {name!r}: truncated BYTES length prefix", param=name)
        (length,) = _LENGTH_PREFIX.unpack_from(raw, offset)
        offset += _LENGTH_PREFIX.size
        if offset + length > len(raw):
            raise InvalidRequest(
                f"input {name!r}: BYTES element of {length} bytes overruns the raw contents",
                param=name,
            )
        values.append(raw[offset : offset + length])
        offset += length
    if len(values) != count:
        raise InvalidRequest(
            f"input {name!r}: shape holds {count} elements, raw contents {len(values)}",
            param=name,
        )
    return values
