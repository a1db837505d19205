"""minisgl's own CPU kernel (`qdot.cpp`): GGUF-quantized projections at decode sizes on
AVX512-VNNI, for `quantized.VnniLinear`.

torch's int4 kernel computes in float32 FMAs and unpacks its weight again for every 4 rows:
SmolLM2's Q8_0 LM head took 8.4 ms at 8 rows against 2.0 here, a 3072 x 576 Q4_1 layer 0.29
against 0.11 ms, and one row 2-2.5x less (2 cores, AVX512-VNNI). The kernel quantizes each block
of 32 activations to int8 as llama.cpp does, so a block's dot product is an integer one
(qdot.cpp says how); a layer's error stays that of its 4-bit weights (tests bound it).

The source is compiled once per source, compiler and flags with the system's C++ compiler (the
one AOTInductor needs; `CXX` chooses another) into the cache (`kernels/`, 0.1 MB, ~2 s), and
loaded with ctypes. It runs its OpenMP loop on torch's own runtime (the same libgomp.so.1,
already loaded), at torch's thread count. Where the CPU lacks AVX512-VNNI, no compiler works, or
MINISGL_CPU_NATIVE=0, `native_kernel()` is None and the layers keep torch's int4 kernels; a
failed build says so in one line. A compiled step calls the kernel back through
`torch.ops.minisgl.qdot_mm`."""

from __future__ import annotations

import ctypes
import functools
import hashlib
import os
import platform
import shutil
import subprocess
import sys
from pathlib import Path

import torch

from minisgl import env
from minisgl.ext.cpu.gguf import cache_root
from minisgl.ext.cpu.policy import cpu_flags

SOURCE = Path(__file__).with_name("qdot.cpp")
FLAGS = ["-O3", "-std=c++17", "-shared", "-fPIC", "-fopenmp",
         "-mavx512f", "-mavx512bw", "-mavx512vl", "-mavx512vnni", "-mf16c"]  # fmt: skip
NEEDS = ("avx512f", "avx512bw", "avx512_vnni")  # /proc/cpuinfo's names
TILE_ROWS, BLOCK = 16, 32  # a tile's output rows; a block's inputs
FOUR_BIT_BYTES = 256  # a tile's codes of one block at 4 bits (512 at 8)
PTR, INT = ctypes.c_void_p, ctypes.c_int


def compiler() -> str | None:
    return os.environ.get("CXX") or shutil.which("g++") or shutil.which("c++")


def library_path(cxx: str) -> str:
    key = hashlib.sha256(SOURCE.read_bytes() + repr((cxx, FLAGS)).encode()).hexdigest()[:16]
    return os.path.join(cache_root(), "kernels", f"qdot-{key}.so")


def build(cxx: str, path: str) -> None:
    """Compiles the source into `path` (written whole or not at all)."""
    os.makedirs(os.path.dirname(path), exist_ok=True)
    tmp = f"{path}.tmp-{os.getpid()}"
    try:
        subprocess.run(
            [cxx, *FLAGS, str(SOURCE), "-o", tmp], check=True, capture_output=True, text=True
        )
        os.replace(tmp, path)
    finally:
        if os.path.exists(tmp):
            os.remove(tmp)


def load(path: str) -> ctypes.CDLL | None:
    lib = ctypes.CDLL(path)
    if not lib.qdot_supported():
        return None
    lib.qdot_mm.argtypes = [PTR, INT, INT, PTR, PTR, INT, INT, PTR, INT, INT]
    lib.qdot_mm.restype = None
    return lib


def wanted() -> bool:
    """The kernel can run here and is not switched off."""
    if "MINISGL_CPU_NATIVE" in os.environ and not env.flag("MINISGL_CPU_NATIVE"):
        return False
    x86 = platform.machine().lower() in ("x86_64", "amd64")
    return x86 and all(flag in cpu_flags() for flag in NEEDS)


@functools.cache
def native_kernel() -> ctypes.CDLL | None:
    """The loaded kernel, built at its first need; None where it cannot run (see above)."""
    if not wanted():
        return None
    cxx = compiler()
    if cxx is None:
        print("minisgl: no C++ compiler (CXX); torch's int4 kernels instead", file=sys.stderr)
        return None
    path = library_path(cxx)
    try:
        if not os.path.isfile(path):
            build(cxx, path)
        return load(path)
    except (OSError, subprocess.CalledProcessError) as e:
        detail = getattr(e, "stderr", None) or str(e)
        line = detail.strip().splitlines()[0] if detail.strip() else type(e).__name__
        print(f"minisgl: the native CPU kernel did not build ({line}); torch's int4 kernels "
              "instead", file=sys.stderr)  # fmt: skip
        return None


def qdot_mm(x: torch.Tensor, codes: torch.Tensor, scales: torch.Tensor) -> torch.Tensor:
    """x [rows, in] (bf16 or fp16) W^T for W in the kernel's layout: codes uint8 [out / 16,
    in / 32, 256 or 512], scales fp16 [out / 16, in / 32, 2, 16] -> [rows, out] in x's dtype."""
    lib = native_kernel()
    assert lib is not None, "qdot_mm without the native kernel"
    x = x.contiguous()
    rows, cols = x.shape
    out = x.new_empty((rows, codes.shape[0] * TILE_ROWS))
    if rows:
        bits = 4 if codes.shape[2] == FOUR_BIT_BYTES else 8
        half = int(x.dtype == torch.float16)
        lib.qdot_mm(x.data_ptr(), rows, cols, codes.data_ptr(), scales.data_ptr(), bits, half,
                    out.data_ptr(), out.shape[1], torch.get_num_threads())  # fmt: skip
    return out


def qdot_mm_shape(x: torch.Tensor, codes: torch.Tensor, scales: torch.Tensor) -> torch.Tensor:
    return x.new_empty((x.shape[0], codes.shape[0] * TILE_ROWS))


# a plain CPU kernel, as packed.py's (compiled steps call it back)
_LIBRARY = torch.library.Library("minisgl", "FRAGMENT")
_LIBRARY.define("qdot_mm(Tensor x, Tensor codes, Tensor scales) -> Tensor")
_LIBRARY.impl("qdot_mm", qdot_mm, "CPU")
torch.library.register_fake("minisgl::qdot_mm", qdot_mm_shape, lib=_LIBRARY)
