"""Build torchext._C against the torch that is installed.

CUDA sources (kernels/*.cu and the NCCL path) build where they can run: torch was built with
CUDA, nvcc is found and a GPU is present. Elsewhere a CPU-only extension is built that still
registers the backend and rejects CUDA tensors with a clear error.

  FASTCOMM_BUILD_CUDA=1      build the CUDA parts without a GPU (e.g. a build machine)
  FASTCOMM_BUILD_CUDA=0      CPU-only build (FASTCOMM_CPU_ONLY=1 is the same)
  FASTCOMM_CUDA_PTX_ONLY=1   device code as compute_90a PTX only, no ptxas: a compile check
  FASTCOMM_BUILD_TESTING=1   also build torchext._testing (scripts/test.sh)
  FASTCOMM_NO_EXTENSION=1    package and entry points only, no extension: scripts/env.sh
                             installs this editable and builds the extension in place
"""

from __future__ import annotations

import glob
import importlib.util
import os
import shutil
import sys

import torch
from setuptools import setup
from torch.utils import cpp_extension

ROOT = os.path.dirname(os.path.abspath(__file__))


def _log(msg: str) -> None:
    print(f"[fastcomm setup] {msg}", file=sys.stderr)


def _gpu_present() -> bool:
    if torch.cuda.is_available():
        return True
    # torch may see no GPU where one exists (CUDA_VISIBLE_DEVICES, driver mismatch).
    smi = shutil.which("nvidia-smi")
    if smi is None:
        return False
    import subprocess

    try:
        out = subprocess.run([smi, "-L"], capture_output=True, text=True, timeout=30).stdout
    except (OSError, subprocess.SubprocessError):
        return False
    return "GPU" in out


def _want_cuda() -> bool:
    """CUDA parts only where they can run or are asked for: sm_90a matmul kernels take
    minutes each to assemble, a cost a machine without a GPU need not pay."""
    asked = os.environ.get("FASTCOMM_BUILD_CUDA", "")
    if asked == "0" or os.environ.get("FASTCOMM_CPU_ONLY", "0") == "1":
        _log("CPU-only build (FASTCOMM_BUILD_CUDA=0)")
        return False
    has_nvcc = (
        cpp_extension.CUDA_HOME is not None
        and shutil.which(os.path.join(cpp_extension.CUDA_HOME, "bin", "nvcc")) is not None
    )
    if asked == "1":
        if torch.version.cuda is None or not has_nvcc:
            raise RuntimeError(
                "FASTCOMM_BUILD_CUDA=1 needs torch built with CUDA and nvcc (CUDA_HOME); "
                f"torch.version.cuda={torch.version.cuda}, CUDA_HOME={cpp_extension.CUDA_HOME}"
            )
        return True
    if torch.version.cuda is None:
        _log("torch has no CUDA: CPU-only build")
        return False
    if not has_nvcc:
        _log("nvcc not found: CPU-only build")
        return False
    if not _gpu_present():
        _log("no GPU found: CPU-only build (FASTCOMM_BUILD_CUDA=1 builds the CUDA parts)")
        return False
    return True


def _nccl_paths() -> tuple[str, str]:
    """Headers and library of the NCCL that torch itself loads.

    torch wheels load libnccl.so.2 from the nvidia-nccl package, so we compile
    against that package's nccl.h; the soname then resolves to the copy torch
    already mapped. NCCL_HOME / CUDA_HOME are the fallback for source builds.
    """
    candidates = []
    spec = importlib.util.find_spec("nvidia")
    if spec is not None and spec.submodule_search_locations:
        for base in spec.submodule_search_locations:
            candidates.append(os.path.join(base, "nccl"))
    for env in ("NCCL_HOME", "NCCL_ROOT"):
        if os.environ.get(env):
            candidates.append(os.environ[env])
    candidates += [cpp_extension.CUDA_HOME or "", "/usr/local/cuda", "/usr"]
    for base in candidates:
        inc = os.path.join(base, "include")
        if os.path.exists(os.path.join(inc, "nccl.h")):
            for libdir in ("lib", "lib64", "lib/x86_64-linux-gnu"):
                lib = os.path.join(base, libdir)
                if glob.glob(os.path.join(lib, "libnccl.so*")):
                    return inc, lib
    raise RuntimeError(
        "nccl.h not found: install nvidia-nccl (as torch does) or set NCCL_HOME, "
        "or build with FASTCOMM_BUILD_CUDA=0"
    )


TESTING_DIR = os.path.join("csrc", "testing")


def _want_testing() -> bool:
    """torchext._testing: bindings only the tests and benchmarks use (scripts/test.sh)."""
    return os.environ.get("FASTCOMM_BUILD_TESTING", "0") == "1"


def _sources(cuda: bool) -> list[str]:
    cpp = sorted(glob.glob(os.path.join("csrc", "**", "*.cpp"), recursive=True))
    cpp = [s for s in cpp if not s.startswith(TESTING_DIR + os.sep)]
    if not cuda:
        # Files under a cuda/, nccl/ or nvlink/ folder use the CUDA runtime or NCCL.
        cuda_only = (f"{os.sep}cuda{os.sep}", f"{os.sep}nccl{os.sep}", f"{os.sep}nvlink{os.sep}")
        cpp = [s for s in cpp if not any(d in s for d in cuda_only)]
        return cpp
    cu = glob.glob(os.path.join("kernels", "**", "*.cu"), recursive=True)
    return cpp + sorted(cu)


def _verbs_include() -> list[str]:
    """Where rdma-core's <infiniband/verbs.h> is (Debian: libibverbs-dev), if anywhere.

    csrc/inter/ib/verbs_device.cpp compiles its libibverbs layer when the header is
    found (__has_include); the library itself is opened at run time, so there is no
    link dependency either way. Without the header the ib transport still builds and
    runs on its emulation (FASTCOMM_IB_EMULATE=1). RDMA_CORE_HOME names a non-system
    install.
    """
    home = os.environ.get("RDMA_CORE_HOME")
    extra = [os.path.join(home, "include")] if home else []
    for d in extra + ["/usr/include", "/usr/local/include"]:
        if os.path.exists(os.path.join(d, "infiniband", "verbs.h")):
            _log(f"rdma-core headers in {d}: the ib transport can use libibverbs")
            return [d] if d in extra else []
    _log("no <infiniband/verbs.h>: the ib transport runs only on its emulation")
    return []


def _shared_libstdcxx() -> list[str]:
    """Link the C++ runtime torch uses (libstdc++.so.6), never a static copy.

    Where the toolchain lacks the libstdc++.so development link (minimal
    images), `g++ -shared` quietly links libstdc++.a into the extension: a
    second copy of the iostream/locale machinery beside torch's, and
    stringstreams then crash on threads we start. Naming the shared object
    first resolves every C++ runtime symbol against it.
    """
    if not sys.platform.startswith("linux"):
        return []
    import subprocess

    cxx = os.environ.get("CXX", "c++")
    try:
        path = subprocess.run(
            [cxx, "-print-file-name=libstdc++.so.6"], capture_output=True, text=True, check=True
        ).stdout.strip()
    except (OSError, subprocess.CalledProcessError):
        return []
    if not os.path.isabs(path) or not os.path.exists(path):
        return []
    return [f"-L{os.path.dirname(path)}", "-l:libstdc++.so.6"]


def _extensions() -> list:
    cuda = _want_cuda()
    # The language standard follows torch (C++17 for 2.11, C++20 for newer headers);
    # our sources are written to C++17.
    # -Wno-interference-size: c10/cuda/CUDAEvent.h trips it under GCC 12.
    # -g0: Python's own CFLAGS carry -g, whose debug info of torch's headers makes each
    # object ~35x larger and its compile ~2.5x slower; crash backtraces use the dynamic
    # symbols, which stay.
    cxx = ["-O3", "-g0", "-Wall", "-Wextra", "-Wno-unused-parameter", "-Wno-interference-size"]
    nvcc = ["-O3", "--expt-relaxed-constexpr", "-lineinfo"]
    define_macros = [("TORCH_EXTENSION_NAME", "_C")]
    include_dirs = [os.path.join(ROOT, "csrc"), ROOT]  # "common/...", "kernels/..."
    library_dirs: list[str] = []
    libraries: list[str] = []
    extra_link = []
    include_dirs += _verbs_include()
    if cuda:
        define_macros.append(("FASTCOMM_WITH_CUDA", "1"))
        inc, lib = _nccl_paths()
        _log(f"NCCL headers {inc}, library {lib}")
        include_dirs.append(inc)
        library_dirs.append(lib)
        # The nvidia-nccl wheel ships only libnccl.so.2 (no dev symlink).
        extra_link += [
            f"-l:{os.path.basename(sorted(glob.glob(os.path.join(lib, 'libnccl.so*')))[-1])}"
        ]
        extra_link += [f"-Wl,-rpath,{lib}"]
        if os.environ.get("FASTCOMM_CUDA_PTX_ONLY", "0") == "1":
            # torch adds no -gencode of its own when one is given.
            nvcc += ["-gencode=arch=compute_90a,code=compute_90a"]
        elif not os.environ.get("TORCH_CUDA_ARCH_LIST") and not torch.cuda.is_available():
            # No GPU to detect: build for Ampere and Hopper.
            os.environ["TORCH_CUDA_ARCH_LIST"] = "8.0;9.0a"
        ext_cls = cpp_extension.CUDAExtension
        extra = {"cxx": cxx, "nvcc": nvcc}
    else:
        ext_cls = cpp_extension.CppExtension
        extra = {"cxx": cxx}
    link = _shared_libstdcxx() + extra_link + ["-lrt", "-ldl"]
    # Each extension gets its own lists: torch's extension classes append their include and
    # library paths in place, and a shared list would give _C a different command line (so a
    # full recompile) depending on whether _testing is built too.
    exts = [
        ext_cls(
            name="torchext._C",
            sources=_sources(cuda),
            include_dirs=list(include_dirs),
            define_macros=list(define_macros),
            library_dirs=list(library_dirs),
            libraries=list(libraries),
            extra_compile_args={k: list(v) for k, v in extra.items()},
            extra_link_args=list(link),
        )
    ]
    if _want_testing():
        macros = [m for m in define_macros if m[0] != "TORCH_EXTENSION_NAME"]
        exts.append(
            ext_cls(
                name="torchext._testing",
                sources=sorted(glob.glob(os.path.join(TESTING_DIR, "*.cpp"))),
                include_dirs=list(include_dirs),
                define_macros=macros + [("TORCH_EXTENSION_NAME", "_testing")],
                library_dirs=list(library_dirs),
                libraries=list(libraries),
                extra_compile_args={k: list(v) for k, v in extra.items()},
                # Linked against _C (found beside it at run time) by BuildExt.
                extra_link_args=link + ["-Wl,-rpath,$ORIGIN"],
            )
        )
    return exts


class BuildExt(cpp_extension.BuildExtension):
    """Builds _C first, then links _testing against it (one copy of fastcomm's state)."""

    def build_extensions(self) -> None:
        self.extensions.sort(key=lambda e: e.name != "torchext._C")
        super().build_extensions()

    def build_extension(self, ext) -> None:
        self._announce(ext)
        if ext.name == "torchext._testing":
            core = self.get_ext_fullpath("torchext._C")
            ext.extra_link_args = [
                f"-L{os.path.dirname(os.path.abspath(core))}",
                f"-l:{os.path.basename(core)}",
            ] + list(ext.extra_link_args)
        super().build_extension(ext)

    # Rough compile seconds per file on one core at -O3 -g0 (g++ 12, nvcc 13; a 2-core
    # machine builds the 42 files of the CPU-only _C in about 1.5 min), for the estimate only.
    SECONDS_PER_CPP = 5
    SECONDS_PER_CU = {"sm": 150, "ptx": 60}

    def _announce(self, ext) -> None:
        """What is about to be compiled, and on a first build roughly how long it takes."""
        cu = [s for s in ext.sources if s.endswith(".cu")]
        n_cpp = len(ext.sources) - len(cu)
        cuda = any(m[0] == "FASTCOMM_WITH_CUDA" for m in ext.define_macros)
        what = f"{n_cpp} C++ files" + (f", {len(cu)} CUDA files" if cu else "")
        what += " (with CUDA)" if cuda else " (CPU only)"
        objects = [
            os.path.join(self.build_temp, os.path.splitext(src)[0] + ".o") for src in ext.sources
        ]
        if any(os.path.exists(o) for o in objects):
            note = "ninja recompiles only what changed"
        else:
            jobs = int(os.environ.get("MAX_JOBS") or os.cpu_count() or 1)
            ptx = os.environ.get("FASTCOMM_CUDA_PTX_ONLY", "0") == "1"
            work = (
                n_cpp * self.SECONDS_PER_CPP + len(cu) * self.SECONDS_PER_CU["ptx" if ptx else "sm"]
            )
            minutes = work / max(1, min(jobs, len(ext.sources))) / 60
            low, high = max(1, round(minutes * 0.8)), max(2, round(minutes * 1.3))
            note = f"first build, about {low}-{high} min with {jobs} jobs"
        _log(f"building {ext.name}: {what}; {note}")


def _entry_points() -> dict[str, list[str]]:
    """How `init_process_group(backend="fastcomm")` finds us without an import.

    torch >= 2.14 resolves unknown backends through the group
    `torch.distributed.backends` on demand. Older torch only has the device
    autoload group `torch.backends`, whose hooks run at every `import torch`;
    we register there only when torch lacks the on-demand group, so newer
    torch does not load fastcomm on every import.
    """
    from torch.distributed import distributed_c10d

    if hasattr(distributed_c10d.Backend, "_ensure_backend_registered"):
        return {"torch.distributed.backends": ["fastcomm = torchext._registration:register"]}
    return {"torch.backends": ["fastcomm = torchext._registration:autoload"]}


setup(
    entry_points=_entry_points(),
    ext_modules=[] if os.environ.get("FASTCOMM_NO_EXTENSION", "0") == "1" else _extensions(),
    cmdclass={"build_ext": BuildExt.with_options(use_ninja=True)},
)
