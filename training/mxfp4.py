"""MXFP4, the Open Compute Project's Microscaling FP4, as gpt-oss's released folders store its experts' matrices.

A tensor of MXFP4 is two tensors: `*_blocks`, uint8 (..., groups, 16), each byte two 4-bit e2m1 values (one sign
bit, two exponent bits of bias 1, one mantissa bit: 0, 0.5, 1, 1.5, 2, 3, 4, 6 and their negatives), the first of
the pair in the low four bits; and `*_scales`, uint8 (..., groups), one e8m0 exponent a group of 32 values (a
power of two, 2^(byte - 127); the byte 255 is NaN). A value is its e2m1 times its group's power of two, so a
group's 32 values come back exactly in any float wide enough for them (bfloat16, float32, float64).
"""
import torch

E2M1 = (0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0, -0.0, -0.5, -1.0, -1.5, -2.0, -3.0, -4.0, -6.0)
NAN_SCALE = 255  # e8m0's one special value


class BadMXFP4(ValueError):
    """A *_blocks / *_scales pair that is not MXFP4: its message names the tensor and what is wrong."""


def dequantized(blocks, scales, name, dtype=torch.bfloat16):
    """The values (..., groups * 32) in `dtype` of the MXFP4 tensor `name` (blocks, scales as above)."""
    problem = mxfp4_problem(blocks, scales)
    if problem:
        raise BadMXFP4(f"{name}: {problem}")
    table = torch.tensor(E2M1, dtype=dtype, device=blocks.device)
    pairs = torch.stack([table[(blocks & 0x0F).long()], table[(blocks >> 4).long()]], dim=-1)  # (low, high)
    values = pairs.flatten(-2)  # (..., groups, 32)
    return torch.ldexp(values, scales.to(torch.int32).unsqueeze(-1) - 127).to(dtype).flatten(-2)


def mxfp4_problem(blocks, scales):
    """What makes (blocks, scales) not MXFP4, or None."""
    return layout_problem(blocks, scales) or scale_problem(scales)


def layout_problem(blocks, scales):
    """What makes the dtypes or shapes of (blocks, scales) not MXFP4's (their values unread: tensors on the meta
    device will do), or None."""
    if blocks.dtype != torch.uint8 or scales.dtype != torch.uint8:
        return f"blocks and scales are uint8 in MXFP4, not {blocks.dtype} and {scales.dtype}"
    if blocks.shape[-1:] != (16,) or blocks.shape[:-1] != scales.shape:
        return (f"blocks {tuple(blocks.shape)} hold 16 bytes (32 values) for each scale, scales "
                f"{tuple(scales.shape)}: they do not match")
    return None


def scale_problem(scales):
    """What makes these e8m0 scales not scales (a NaN among them), or None."""
    if (scales == NAN_SCALE).any():
        return f"{int((scales == NAN_SCALE).sum())} scales are e8m0's NaN (255): a damaged or mismatched file"
    return None
