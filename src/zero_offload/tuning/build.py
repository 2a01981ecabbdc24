"""Compile the C Adam with cffi on first use, into a cache keyed by the source, the header and the flags.

`build()` returns the compiled module (its `lib` holds the C functions, its `ffi` the types). A second call,
in this process or any later one, loads the cached library instead of compiling again; a changed source or
flag is a new key, so a stale library is never loaded. Lab 4 compiles the learner's C file the same way.
`make build` compiles ahead of time. No C compiler is an error that says how to get one.
"""

from __future__ import annotations

import hashlib
import importlib.util
import os
import platform
import shutil
import sys
import sysconfig
import tempfile
from pathlib import Path

CSRC = Path(__file__).resolve().parent / "csrc"
SOURCE = CSRC / "cpu_adam.c"
HEADER = CSRC / "cpu_adam.h"
# No -march=native: the vector loop chooses its instructions per function, so one build runs on any CPU.
# -ffp-contract=off keeps the scalar reference free of fused multiply-adds the compiler might add.
FLAGS = ("-O3", "-std=c11", "-ffp-contract=off", "-pthread", "-Wall")
# ZO_CPU_ADAM_SANITIZE=1 adds AddressSanitizer and UBSan: an out-of-bounds access or undefined behaviour in the
# kernel stops the process with a report. Python must load libasan first:
#   LD_PRELOAD=$(cc -print-file-name=libasan.so) ASAN_OPTIONS=detect_leaks=0 ZO_CPU_ADAM_SANITIZE=1 python ...
SANITIZE_FLAGS = (
    "-fsanitize=address,undefined",
    "-fno-sanitize-recover=undefined",
    "-fno-omit-frame-pointer",
)
_loaded: dict[object, object] = {}  # content key, and (path, flags, name, file stamps), -> module


class CPUAdamUnavailable(RuntimeError):
    """The C CPU Adam cannot be had here, for one of the reasons below; whoever can do without it catches this."""


class CompilerNotFound(CPUAdamUnavailable):
    """The C CPU Adam cannot be built here (no C compiler, or no cffi): the message says what to install."""


class BuildFailed(CPUAdamUnavailable):
    """The compiler or the loader failed (missing Python headers, a cache directory it cannot write, a broken
    toolchain): the message says which, and the fix. The engine then runs torch's Adam; lab 4 shows the error."""


def _build_failed(err: Exception, directory: Path) -> BuildFailed:
    text = str(err)
    if isinstance(err, OSError):
        fix = f"make the cache directory writable, or point ZO_CACHE_DIR at one that is (now {directory})"
    else:
        fix = "check the C compiler ($CC) works, e.g. `make build` shows its full output"
    last = text.strip().splitlines()[-1][:300] if text.strip() else type(err).__name__
    return BuildFailed(
        f"the SIMD CPU Adam could not be built or loaded ({type(err).__name__}: {last}); {fix}; or keep "
        '"zero_offload": {"cpu_adam": {"impl": "torch"}}'
    )


def cache_dir() -> Path:
    return Path(os.environ.get("ZO_CACHE_DIR") or Path.home() / ".cache" / "zero_offload")


def _compiler() -> str:
    candidates = [
        os.environ.get("CC"),
        (sysconfig.get_config_var("CC") or "").split(" ")[0],
        "cc",
        "gcc",
        "clang",
    ]
    for name in filter(None, candidates):
        if shutil.which(name):
            return name
    raise CompilerNotFound(
        "no C compiler found for the SIMD CPU Adam (tried $CC, cc, gcc, clang). Install one: "
        "`apt-get install gcc` (Debian/Ubuntu), `xcode-select --install` (macOS); or keep "
        '"zero_offload": {"cpu_adam": {"impl": "torch"}}'
    )


def _declarations(header: str) -> str:
    return "\n".join(line for line in header.splitlines() if not line.lstrip().startswith("#"))


def _file_stamp(path) -> tuple[int, int]:
    status = os.stat(path)
    return status.st_mtime_ns, status.st_size


def build(source: str | Path = SOURCE, *, flags: tuple[str, ...] = FLAGS, name: str = "zo_cpu_adam"):
    """The compiled module for `source` (cached); raises CompilerNotFound, or BuildFailed with the cause."""
    try:
        import cffi  # only needed when compiling or loading
    except ImportError as err:  # a bare ImportError would escape the engine's fallback to torch's Adam
        raise CompilerNotFound(
            f"cffi is not installed ({err}), so the SIMD CPU Adam cannot be built or loaded: "
            "`pip install cffi` (`make install` pins it), or keep "
            '"zero_offload": {"cpu_adam": {"impl": "torch"}}'
        ) from err

    if os.environ.get("ZO_CPU_ADAM_SANITIZE") == "1":
        flags = (*flags, *SANITIZE_FLAGS)

    # Every Adam update asks for the module: while neither file has changed, skip reading and hashing them
    # (two stat calls; resolving the path as well would cost more than a small update).
    stamp = (str(source), flags, name, _file_stamp(source), _file_stamp(HEADER))
    if stamp in _loaded:
        return _loaded[stamp]
    source = Path(source).resolve()  # the object file goes under the temporary directory by this path
    code, header = source.read_bytes(), HEADER.read_bytes()
    key = hashlib.sha256(
        b"\0".join(
            [code, header, " ".join(flags).encode(), sys.version.encode(), platform.machine().encode()]
        )
    ).hexdigest()[:16]
    module_name = f"{name}_{key}"
    if module_name in _loaded:
        _loaded[stamp] = _loaded[module_name]
        return _loaded[module_name]
    directory = cache_dir()
    try:
        module = _compile_and_load(cffi, source, header, flags, directory, module_name)
    except CPUAdamUnavailable:
        raise
    except Exception as err:  # whatever the toolchain or the loader raise: cffi, distutils, OS errors
        raise _build_failed(err, directory) from err
    _loaded[module_name] = _loaded[stamp] = module
    return module


def check_python_headers(include_dir: str | None) -> None:
    """cffi compiles against Python.h; a Python installed without its headers fails in the compiler, whose own
    message goes to stderr where nobody connects it to the fallback. Say it before compiling."""
    if include_dir and (Path(include_dir) / "Python.h").is_file():
        return
    raise BuildFailed(
        f"the SIMD CPU Adam cannot be built: this Python has no C headers (no Python.h in {include_dir}); "
        "install them: `apt-get install python3-dev` (Debian/Ubuntu), `dnf install python3-devel` (Fedora), "
        'or use a Python that ships them; or keep "zero_offload": {"cpu_adam": {"impl": "torch"}}'
    )


def _compile_and_load(cffi, source: Path, header: bytes, flags, directory: Path, module_name: str):
    suffix = sysconfig.get_config_var("EXT_SUFFIX") or ".so"
    library = directory / f"{module_name}{suffix}"
    if not library.exists():
        compiler = _compiler()
        check_python_headers(sysconfig.get_paths().get("include"))
        ffi = cffi.FFI()
        ffi.cdef(_declarations(header.decode()))
        ffi.set_source(
            module_name,
            '#include "cpu_adam.h"',
            sources=[str(source)],
            include_dirs=[str(CSRC)],
            extra_compile_args=list(flags),
            extra_link_args=["-pthread", *(flag for flag in flags if flag.startswith("-fsanitize"))],
        )
        directory.mkdir(parents=True, exist_ok=True)
        old_cc = os.environ.get("CC")
        os.environ["CC"] = compiler
        try:
            with tempfile.TemporaryDirectory(dir=directory) as tmp:
                built = ffi.compile(tmpdir=tmp, verbose=False)
                os.replace(built, library)  # atomic: a parallel build of the same key lands the same file
        finally:
            if old_cc is None:
                os.environ.pop("CC", None)
            else:
                os.environ["CC"] = old_cc
    spec = importlib.util.spec_from_file_location(module_name, library)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def main() -> int:
    """`make build`: compile ahead of time and say where the library is."""
    module = build()
    variants = module.lib.zo_cpu_variants()
    names = [
        n for bit, n in ((0, "scalar"), (1, "avx2+fma+f16c"), (2, "avx512f+bw")) if variants & (1 << bit)
    ]
    print(f"built {module.__file__}; variants this CPU runs: {', '.join(names)}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
