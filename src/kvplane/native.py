"""Build and load the C kernels that ship inside the package.

Compiles a kernel once per machine into a hash-keyed cache and types its functions; a missing
compiler is a ``reason`` in the returned :class:`KernelBuild`, never an exception. See
docs/transports.md.
"""

from __future__ import annotations

import ctypes
import hashlib
import os
import platform
import shutil
import subprocess
import tempfile
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

CACHE_ENV = "KVPLANE_CACHE_DIR"
BASE_FLAGS = ("-O3", "-std=c11", "-fPIC", "-shared", "-pthread", "-ffp-contract=fast")
X86_FLAGS = ("-mavx2", "-mfma")
BUILD_TIMEOUT_S = 120.0


@dataclass(frozen=True, slots=True)
class KernelBuild:
    """The loaded library of one kernel source, or why there is none."""

    library: ctypes.CDLL | None
    reason: str | None = None


def compiler() -> str | None:
    """The C compiler to build with: ``$CC`` when set, else the first of cc/gcc/clang found."""
    chosen = os.environ.get("CC")
    if chosen:
        return shutil.which(chosen)
    for name in ("cc", "gcc", "clang"):
        found = shutil.which(name)
        if found is not None:
            return found
    return None


def cpu_flags() -> frozenset[str]:
    """The CPU feature flags of this Linux machine (empty where ``/proc/cpuinfo`` is absent)."""
    try:
        text = Path("/proc/cpuinfo").read_text(encoding="utf-8", errors="replace")
    except OSError:
        return frozenset()
    for line in text.splitlines():
        if line.startswith("flags"):
            return frozenset(line.partition(":")[2].split())
    return frozenset()


def build_flags() -> tuple[str, ...]:
    """Compiler flags: the base set, plus AVX2/FMA code on x86-64 CPUs that have both."""
    x86 = platform.machine().lower() in ("x86_64", "amd64")
    wide = x86 and {"avx2", "fma"} <= cpu_flags()
    return BASE_FLAGS + (X86_FLAGS if wide else ())


def cache_dir() -> Path:
    """Where built kernels are kept (see the module docstring)."""
    chosen = os.environ.get(CACHE_ENV)
    if chosen:
        return Path(chosen)
    base = os.environ.get("XDG_CACHE_HOME")
    return (Path(base) if base else Path.home() / ".cache") / "kvplane"


Signature = tuple[Sequence[Any], Any]
"""A C function's ``(argtypes, restype)`` for ``ctypes`` (``restype`` None for ``void``)."""


def load_kernel(path: Path, signatures: Mapping[str, Signature] | None = None) -> KernelBuild:
    """Build (once per machine and source version) and load the C source at ``path``, typing
    each function named in ``signatures`` (a name the library lacks is a failed build)."""
    cc = compiler()
    if cc is None:
        return KernelBuild(None, "no C compiler found (install gcc or set $CC)")
    text = path.read_bytes()
    flags = build_flags()
    key = hashlib.sha256(b"\0".join([text, cc.encode(), " ".join(flags).encode()])).hexdigest()
    out = cache_dir() / f"{path.stem}-{key[:16]}.so"
    if not out.exists():
        reason = _compile(cc, flags, path, out)
        if reason is not None:
            return KernelBuild(None, reason)
    try:
        library = ctypes.CDLL(str(out))
    except OSError as exc:
        return KernelBuild(None, f"cannot load {out}: {exc}")
    for name, (argtypes, restype) in (signatures or {}).items():
        try:
            fn = getattr(library, name)
        except AttributeError:
            return KernelBuild(None, f"{out.name} has no function {name!r}")
        fn.argtypes, fn.restype = list(argtypes), restype
    return KernelBuild(library)


def _compile(cc: str, flags: tuple[str, ...], source: Path, out: Path) -> str | None:
    """Compile ``source`` to ``out`` through a temporary file; the failure reason or ``None``."""
    try:
        out.parent.mkdir(parents=True, exist_ok=True)
        fd, tmp = tempfile.mkstemp(prefix=out.stem, suffix=".tmp", dir=out.parent)
        os.close(fd)
    except OSError as exc:
        return f"cannot write the kernel cache {out.parent}: {exc}"
    try:
        done = subprocess.run(
            [cc, *flags, "-o", tmp, str(source), "-lm"],
            capture_output=True, text=True, timeout=BUILD_TIMEOUT_S, check=False,
        )  # fmt: skip
        if done.returncode != 0:
            first = (done.stderr.strip().splitlines() or ["no output"])[0]
            return f"building {source.name} with {cc} failed: {first}"
        os.replace(tmp, out)
        return None
    except (OSError, subprocess.TimeoutExpired) as exc:
        return f"building {source.name} with {cc} failed: {exc}"
    finally:
        if os.path.exists(tmp):
            os.unlink(tmp)
