"""minisgl's own CPU kernels (`qdot.cpp`, `attention.cpp`, `fused.cpp`, `sample.cpp`; `ops.cpp`
registers them as torch.ops.minisgl ops): GGUF-quantized projections at decode sizes for
`quantized.VnniLinear` (`qdot_mm`), fresh prompts' attention in float32 for `speed.py`
(`causal_attention`: 3.6x torch's flash kernel on a 1,000-token SmolLM2 prompt on the AMD EPYC
Zen 5 VM, 2 threads; its predecessor 3.0x there, 1.5-1.9x on the Intel VM), float32 RoPE,
SiLU-and-mul and RMSNorm in one pass each for `fused.py`, and the Gumbel-max sampler for
`sampling.py`. Built for AVX512-VNNI where the CPU
has it, else for AVX-VNNI or AVX2 (most laptops): there `qdot_mm` alone, with the same bits
(`float32_kernels()` is False); MINISGL_CPU_ISA=avxvnni or avx2 chooses such a build.

torch's int4 kernel dequantizes each weight to float32 and multiplies with FMAs: compute-bound
from a few rows (this VM: 5 G zmm FMAs/s a core; its output equals such a loop bit for bit).
Here each block of 32 activations is quantized to int8 as llama.cpp does, so a block's dot
product is an integer one (vpdpbusd: 64 products an instruction at 4.7 G/s; qdot.cpp says how);
a layer's error stays that of its 4-bit weights (tests bound it). SmolLM2's Q8_0 LM head took
8.4 ms at 8 rows against 2.0 here, a 3072 x 576 Q4_1 layer 0.29 against 0.11 ms, one row 2-2.5x
less (2 cores; weights in cache).

The sources are compiled once per source, compiler, flags and torch with the system's C++
compiler (the one AOTInductor needs; `CXX` chooses another) into the cache (`kernels/`, ~5 s on
2 cores), then loaded: the ops' CPU kernels are registered, so eager layers and compiled steps
call them without Python. Their OpenMP loops run on torch's own runtime (the same libgomp.so.1,
already loaded), at torch's thread count. Where the CPU lacks both ISAs, no compiler works, or
MINISGL_CPU_NATIVE=0, `native_kernel()` is None and every caller keeps torch's path (int4
kernels, SDPA, torch's ops); a failed build says so in one line."""

from __future__ import annotations

import contextlib
import ctypes
import fcntl
import functools
import hashlib
import os
import platform
import shutil
import subprocess
import sys
import tempfile
import threading
from pathlib import Path
from typing import NamedTuple

import torch

from minisgl import env
from minisgl.ext.cpu.gguf import cache_root, remove_quietly

# no contraction of a * b + c into one FMA: fused.cpp's rotation keeps torch's roundings
FLAGS = ["-O3", "-std=c++17", "-ffp-contract=off", "-shared", "-fPIC", "-fopenmp", "-w"]


class Isa(NamedTuple):
    sources: tuple[str, ...]
    flags: tuple[str, ...]
    needs: tuple[str, ...]  # /proc/cpuinfo's names


ISAS = {  # the first the CPU has is built
    "avx512": Isa(("qdot.cpp", "attention.cpp", "fused.cpp", "sample.cpp", "ops.cpp"),
                  ("-mavx512f", "-mavx512bw", "-mavx512vl", "-mavx512vnni", "-mf16c"),
                  ("avx512f", "avx512bw", "avx512_vnni")),
    "avxvnni": Isa(("qdot.cpp", "ops.cpp"), ("-mavx2", "-mfma", "-mf16c", "-mavxvnni"),
                   ("avx2", "fma", "f16c", "avx_vnni")),
    "avx2": Isa(("qdot.cpp", "ops.cpp"), ("-mavx2", "-mfma", "-mf16c"), ("avx2", "fma", "f16c")),
}  # fmt: skip
TILE_ROWS, BLOCK = 16, 32  # a tile's output rows; a block's inputs
BYTES_PER_BIT = 64  # a tile's codes of one block, per bit of a code (256 bytes at 4 bits)
OP = "minisgl::qdot_mm"  # stands for every op ops.cpp registers (all at once)


@functools.cache
def cpuinfo_field(name: str) -> str:
    """The first CPU's `name` line of /proc/cpuinfo, its value ("" off Linux or where absent:
    an ARM CPU has no vendor_id)."""
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                key, _, value = line.partition(":")
                if key.strip() == name:
                    return value.strip()
    except OSError:
        pass
    return ""


@functools.cache
def cpu_flags() -> frozenset[str]:
    """The CPU's /proc/cpuinfo flags (none off Linux)."""
    return frozenset(cpuinfo_field("flags").split())


def cpu_vendor() -> str:
    """The x86 vendor string (GenuineIntel, AuthenticAMD, ...); "" elsewhere."""
    return cpuinfo_field("vendor_id")


def compiler() -> str | None:
    return os.environ.get("CXX") or shutil.which("g++") or shutil.which("c++")


def torch_flags() -> tuple[list[str], list[str]]:
    """(compile, link) flags against the running torch's headers and libraries (ops.cpp
    registers kernels)."""
    root = Path(torch.__file__).parent
    abi = int(torch._C._GLIBCXX_USE_CXX11_ABI)
    compile_flags = [f"-D_GLIBCXX_USE_CXX11_ABI={abi}", f"-I{root / 'include'}"]
    return compile_flags, [f"-L{root / 'lib'}", "-ltorch_cpu", "-lc10"]


def sources(isa: str) -> list[Path]:
    return [Path(__file__).with_name(name) for name in ISAS[isa].sources]


def library_path(cxx: str, isa: str) -> str:
    text = b"".join(path.read_bytes() for path in sources(isa))
    key = repr((cxx, FLAGS, ISAS[isa].flags, torch.__version__)).encode()
    digest = hashlib.sha256(text + key).hexdigest()[:16]
    return os.path.join(cache_root(), "kernels", f"qdot-{isa}-{digest}.so")


def build(cxx: str, path: str, isa: str) -> None:
    """Compiles the sources into `path` (written whole or not at all), each in its own process
    at once, then links them: ops.cpp (torch's headers) takes 4.3 s alone on the AMD VM, the
    others 3.4 together; one command compiling them in turn took 7.8 s, this 4.6."""
    os.makedirs(os.path.dirname(path), exist_ok=True)
    compile_flags, link_flags = torch_flags()
    with tempfile.TemporaryDirectory(dir=os.path.dirname(path), prefix=".build-") as work:
        objects = [os.path.join(work, f"{src.stem}.o") for src in sources(isa)]
        jobs = [
            subprocess.Popen(
                [cxx, *FLAGS, *ISAS[isa].flags, "-c", str(src), *compile_flags, "-o", obj],
                stdout=subprocess.PIPE,
                stderr=subprocess.PIPE,
                text=True,
            )  # fmt: skip
            for src, obj in zip(sources(isa), objects)
        ]
        results = [(job, job.communicate()[1]) for job in jobs]  # every job waited for
        for job, stderr in results:
            if job.returncode:
                raise subprocess.CalledProcessError(job.returncode, job.args, stderr=stderr)
        tmp = os.path.join(work, "lib.so")
        link = [cxx, *FLAGS, *objects, *link_flags, "-o", tmp]
        subprocess.run(link, check=True, capture_output=True, text=True)
        os.replace(tmp, path)


def ensure_built(cxx: str, path: str, isa: str) -> None:
    """Builds `path` unless it is there, one build at a time across processes: a scheduler (or
    a test worker) waits for the build under way, the launcher's `prebuild` included, rather
    than start a second one on the same cores."""
    folder = os.path.dirname(path)
    os.makedirs(folder, exist_ok=True)
    lock = os.open(folder, os.O_RDONLY)  # the folder's lock: no lock file left beside the kernels
    try:
        fcntl.flock(lock, fcntl.LOCK_EX)
        if not os.path.isfile(path):
            build(cxx, path, isa)
    finally:
        os.close(lock)  # releases it


def prebuild() -> threading.Thread | None:
    """Starts building this CPU's kernels in a thread (the compilers in their own processes):
    the launcher's, while a first start converts its GGUF (the build took 5 of that start's 23
    s after the conversion, AMD VM). None when they are built or cannot be; a failure is left
    for the engine's own attempt to say."""
    if native_kernel.cache_info().currsize:  # this process's kernels are loaded: none to build
        return None
    try:
        isa, cxx = wanted(), compiler()
    except ValueError:  # MINISGL_CPU_ISA: the engine's process says it
        return None
    if isa is None or cxx is None or os.path.isfile(path := library_path(cxx, isa)):
        return None
    thread = threading.Thread(target=_build_quietly, args=(cxx, path, isa), name="kernels")
    thread.start()  # not a daemon: an exit waits for its compilers (seconds), not orphans them
    return thread


def _build_quietly(cxx: str, path: str, isa: str) -> None:
    with contextlib.suppress(Exception):  # not a thread's traceback: the engine tries and says
        ensure_built(cxx, path, isa)


def load(path: str) -> ctypes.CDLL | None:
    """The library, ops.cpp's kernels registered (once a process: a second file of the same
    kernels, another cache directory's, is not registered again); None off its ISA's CPUs."""
    lib = ctypes.CDLL(path)
    if not lib.qdot_supported():
        return None
    if not torch._C._dispatch_has_kernel_for_dispatch_key(OP, "CPU"):
        torch.ops.load_library(path)
    return lib


def wanted() -> str | None:
    """The ISA to build for: the first of ISAS this CPU has (MINISGL_CPU_ISA: that one, if the
    CPU has it); None when none or MINISGL_CPU_NATIVE=0."""
    if "MINISGL_CPU_NATIVE" in os.environ and not env.flag("MINISGL_CPU_NATIVE"):
        return None
    if platform.machine().lower() not in ("x86_64", "amd64"):
        return None
    chosen = os.environ.get("MINISGL_CPU_ISA", "").strip().lower()
    if chosen and chosen not in ISAS:
        raise ValueError(f"MINISGL_CPU_ISA={chosen!r}: expected one of {', '.join(ISAS)}")
    names = [chosen] if chosen else list(ISAS)
    return next((n for n in names if all(f in cpu_flags() for f in ISAS[n].needs)), None)


def float32_kernels() -> bool:
    """attention.cpp's and fused.cpp's ops are registered (the AVX512 build)."""
    lib = native_kernel()
    return lib is not None and has_float32(lib)


@functools.cache  # asked at every norm of a float32 step
def has_float32(lib: ctypes.CDLL) -> bool:
    return bool(lib.float32_supported())


@functools.cache
def native_kernel() -> ctypes.CDLL | None:
    """The loaded kernel, built at its first need; None where it cannot run (see above)."""
    isa = wanted()
    if isa is None:
        return None
    cxx = compiler()
    if cxx is None:
        print("minisgl: no C++ compiler (CXX); torch's kernels instead", file=sys.stderr)
        return None
    path = library_path(cxx, isa)
    try:
        if not os.path.isfile(path):
            ensure_built(cxx, path, isa)
        return load(path)
    except (OSError, RuntimeError, subprocess.CalledProcessError) as e:
        remove_quietly(path)  # a file that does not load is built again at the next start
        detail = getattr(e, "stderr", None) or str(e)
        line = detail.strip().splitlines()[0] if detail.strip() else type(e).__name__
        print(f"minisgl: the native CPU kernels did not build or load ({line}); torch's "
              "kernels instead", file=sys.stderr)  # fmt: skip
        return None


def qdot_mm_shape(x: torch.Tensor, codes: torch.Tensor, scales: torch.Tensor) -> torch.Tensor:
    return x.new_empty((x.shape[0], codes.shape[0] * TILE_ROWS))


def decode_attention_shape(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    slots: torch.Tensor,
    lens: torch.Tensor,
    scale: float,
) -> torch.Tensor:
    return q.new_empty(q.shape)


def causal_attention_shape(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    q_starts: torch.Tensor,
    k_starts: torch.Tensor,
    scale: float,
) -> torch.Tensor:
    return q.new_empty(q.shape)


# the ops' schemas; their CPU kernels are ops.cpp's, registered when the library loads: x [rows,
# in] (bf16 or fp16) W^T for W in qdot.cpp's layout (codes uint8 [out / 16, in / 32, 256, 384 or
# 512], scales fp16 [out / 16, in / 32, 1 to 3, 16] or, K-quants', uint8 [out / 16, in / 256,
# bytes]) -> [rows, out] in x's dtype
_LIBRARY = torch.library.Library("minisgl", "FRAGMENT")
_LIBRARY.define("qdot_mm(Tensor x, Tensor codes, Tensor scales) -> Tensor")
torch.library.register_fake(OP, qdot_mm_shape, lib=_LIBRARY)
# q [T, Hq, D], k and v [S, Hk, D] float32, q_starts and k_starts int64 [B + 1]: B prompts' T
# new tokens against their S keys (each a cached prefix, then its new tokens')
_LIBRARY.define(
    "causal_attention(Tensor q, Tensor k, Tensor v, Tensor q_starts, Tensor k_starts, "
    "float scale) -> Tensor"
)
torch.library.register_fake("minisgl::causal_attention", causal_attention_shape, lib=_LIBRARY)
# q [B, Hq, D] float32 (one query a decode row), the pools k and v [S, Hk, D] (float32, bf16 or
# fp16), slots int64 [B, L] and lens int64 [B]: each row against its first lens[b] slots
_LIBRARY.define(
    "decode_attention(Tensor q, Tensor k, Tensor v, Tensor slots, Tensor lens, float scale) "
    "-> Tensor"
)
torch.library.register_fake("minisgl::decode_attention", decode_attention_shape, lib=_LIBRARY)
# fused.cpp's float32 kernels for eager steps (fused.py never calls them while compiling): x
# [T, H, D] rotated by table rows [T, 2, D]; [T, 2 I] -> [T, I]; RMSNorm, and with the residual
# add in place
_LIBRARY.define("rotate(Tensor x, Tensor table) -> Tensor")
_LIBRARY.define("silu_and_mul(Tensor x) -> Tensor")
_LIBRARY.define("rms_norm(Tensor x, Tensor weight, float eps) -> Tensor")
_LIBRARY.define("add_rms_norm_(Tensor(a!) x, Tensor(b!) residual, Tensor weight, float eps) -> ()")
# sample.cpp's: logits [B, V] (float32, bfloat16 or float16), temperature, seed, step [B] -> ids
# [B] int64, the Gumbel-max draw of engine/sample.py's `sample` (argmax where temperature <= 0)
_LIBRARY.define(
    "gumbel_argmax(Tensor logits, Tensor temperature, Tensor seed, Tensor step) -> Tensor"
)
