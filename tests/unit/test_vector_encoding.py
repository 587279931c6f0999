"""Vectors in the answer: orjson float lists and base64 both carry the float32 values exactly."""

from __future__ import annotations

import base64

import numpy as np
import orjson

from lenbatch.embed.protocol import dumps, encode_vector


def test_float_and_base64_round_trip_exactly() -> None:
    """Decoding either encoding gives back the very float32 values, bit for bit."""
    rng = np.random.default_rng(7)
    batch = rng.standard_normal((3, 384)).astype(np.float32)
    batch[0, :3] = [1e-38, -0.0, 3.4e38]  # tiny, signed zero, huge
    for vec in batch:  # rows of one batch array, as the engine hands them over
        payload = orjson.loads(dumps({"embedding": encode_vector(vec, "float")}))
        floats = np.array(payload["embedding"], dtype=np.float32)
        np.testing.assert_array_equal(floats, vec)
        raw = base64.b64decode(orjson.loads(dumps({"e": encode_vector(vec, "base64")}))["e"])
        np.testing.assert_array_equal(np.frombuffer(raw, dtype="<f4"), vec)


def test_non_float32_input_is_converted() -> None:
    """A float64 vector is sent as float32 in both encodings (the API's stated type)."""
    vec = np.array([0.1, 0.2], dtype=np.float64)
    raw = base64.b64decode(encode_vector(vec, "base64"))
    assert len(raw) == 8
    floats = orjson.loads(dumps(encode_vector(vec, "float")))
    assert floats == [0.1, 0.2]  # float32's shortest round-trip digits
    np.testing.assert_array_equal(np.array(floats, dtype=np.float32), vec.astype(np.float32))
