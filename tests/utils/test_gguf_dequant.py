"""nanovllm's vectorized Q8_0/Q4_0/Q4_1 dequantization gives exactly what the gguf package gives,
on blocks that gguf itself quantized; other types go through gguf unchanged."""

import numpy as np
import pytest
import torch

from nanovllm.utils.gguf_dequant import FAST_DEQUANT, dequantize

gguf = pytest.importorskip("gguf", reason="pip install -e '.[test]'")


@pytest.mark.parametrize("ggml_type", sorted(FAST_DEQUANT) + [int(gguf.GGMLQuantizationType.Q5_0)])
def test_matches_gguf(ggml_type):
    shape = (6, 96)
    values = np.random.default_rng(ggml_type).standard_normal(shape).astype(np.float32)
    quantized = gguf.quants.quantize(values, gguf.GGMLQuantizationType(ggml_type))  # [6, bytes per row]
    quantized.flags.writeable = False  # as read from the memory-mapped file
    expected = torch.from_numpy(gguf.quants.dequantize(quantized, ggml_type).copy()).reshape(shape)
    got = dequantize(quantized, ggml_type, shape)
    assert got.dtype == torch.float32 and torch.equal(got, expected)
