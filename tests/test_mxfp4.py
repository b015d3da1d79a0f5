"""training/mxfp4.py: MXFP4 (the Open Compute Project's Microscaling FP4, gpt-oss's experts as released) read
back exactly from values packed here as the format defines them, and refused, naming the tensor, where a file's
pair is not MXFP4."""
import pytest
import torch

from training import mxfp4


def e2m1(code):
    """The value of a 4-bit e2m1 code from its fields: sign, two exponent bits (bias 1), one mantissa bit; an
    exponent of 0 is subnormal (0 or 0.5)."""
    sign, exponent, mantissa = code >> 3, (code >> 1) & 3, code & 1
    magnitude = mantissa * 0.5 if exponent == 0 else 2.0 ** (exponent - 1) * (1 + mantissa / 2)
    return -magnitude if sign else magnitude


def packed(codes, exponents):
    """(blocks, scales) of codes (..., groups, 32) and power-of-two exponents (..., groups): two codes a byte, the
    first in the low four bits; each exponent biased by 127."""
    blocks = (codes[..., 0::2] | codes[..., 1::2] << 4).to(torch.uint8)
    return blocks, (exponents + 127).to(torch.uint8)


def test_the_table_is_e2m1s_definition():
    assert list(mxfp4.E2M1) == [e2m1(code) for code in range(16)]


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32, torch.float64])
def test_values_packed_as_the_format_defines_come_back_exactly(dtype):
    g = torch.Generator().manual_seed(0)
    codes = torch.randint(0, 16, (3, 5, 4, 32), generator=g)
    exponents = torch.randint(-30, 30, (3, 5, 4), generator=g)
    exponents[0, 0, 0], codes[0, 0, 0] = -127, torch.arange(32) % 2  # e8m0's smallest power: 0 and 2^-128
    expected = torch.tensor([e2m1(code) for code in range(16)], dtype=torch.float64)[codes]
    expected = (expected * torch.exp2(exponents.double()).unsqueeze(-1)).flatten(-2)
    got = mxfp4.dequantized(*packed(codes, exponents), "blocks.0.experts.down_proj", dtype)
    assert got.dtype == dtype and got.shape == (3, 5, 128)
    assert torch.equal(got.double(), expected)


def test_a_pair_that_is_not_mxfp4_is_refused_naming_the_tensor():
    blocks, scales = packed(torch.zeros(2, 4, 32, dtype=torch.long), torch.zeros(2, 4, dtype=torch.long))
    name = "model.layers.3.mlp.experts.gate_up_proj"
    with pytest.raises(mxfp4.BadMXFP4, match=f"{name}: blocks .2, 4, 16. hold 16 bytes .* scales .2, 3.: they do"):
        mxfp4.dequantized(blocks, scales[:, :3], name)
    scales[1, 2] = 255
    with pytest.raises(mxfp4.BadMXFP4, match=f"{name}: 1 scales are e8m0's NaN"):
        mxfp4.dequantized(blocks, scales, name)
    with pytest.raises(mxfp4.BadMXFP4, match="uint8 in MXFP4, not torch.int8"):
        mxfp4.dequantized(blocks.view(torch.int8), scales, name)
