"""labkit._hardware: what the CPU offers bfloat16, and the GPU datasheet peaks lesson 08 divides by."""

from __future__ import annotations

import pytest

import labkit
from labkit import _hardware

CPUINFO = """processor\t: 0
vendor_id\t: GenuineIntel
flags\t\t: fpu sse2 avx2 avx512f avx512_bf16 avx512_vnni
"""


def test_cpu_flags_read_from_cpuinfo():
    assert _hardware.cpu_flags(CPUINFO) == {"fpu", "sse2", "avx2", "avx512f", "avx512_bf16", "avx512_vnni"}
    assert _hardware.cpu_flags("Features\t: fp asimd bf16 i8mm\n") == {"fp", "asimd", "bf16", "i8mm"}  # ARM
    assert _hardware.cpu_flags("processor : 0\n") is None


@pytest.mark.parametrize("flags, found", [
    ({"sse2", "avx512_bf16"}, ["AVX-512 BF16 (bf16 dot products)"]),
    ({"sse2", "amx_bf16", "amx_tile", "avx512_bf16"}, ["AMX-BF16 (matrix tiles in bf16)", "AVX-512 BF16 (bf16 dot products)"]),
    ({"fp", "asimd", "bf16"}, ["ARM BF16 (bf16 dot products and matrix multiply)"]),
    ({"sse2", "avx2"}, []),
    (set(), []),
])
def test_cpu_bf16_names_what_the_cpu_has(flags, found):
    assert _hardware.cpu_bf16(flags) == found


def test_this_machines_flags_are_read_or_unknown():
    flags = _hardware.cpu_flags()
    assert flags is None or isinstance(flags, set)


@pytest.mark.parametrize("name, precision, tflops", [
    ("NVIDIA H100 80GB HBM3", "bf16", 989.4),
    ("NVIDIA H100 PCIe", "tf32", 378.0),
    ("NVIDIA A100-SXM4-80GB", "tf32", 156.0),
    ("NVIDIA A100 80GB PCIe", "bf16", 312.0),
    ("NVIDIA H200", "fp32", 67.0),
    ("NVIDIA L4", "bf16", 121.0),
    ("NVIDIA H100 NVL", "tf32", None),    # another part, other peaks: not guessed
    ("Tesla T4", "tf32", None),
    ("NVIDIA L40S", "tf32", None),        # "L4" inside another name is not an L4
])
def test_datasheet_peaks_of_known_gpus_and_none_for_the_rest(name, precision, tflops):
    assert labkit.datasheet_tflops(name, precision) == tflops


def test_datasheet_refuses_an_unknown_precision():
    with pytest.raises(ValueError, match="precision must be"):
        labkit.datasheet_tflops("NVIDIA A100-SXM4-80GB", "fp8")
