"""Builds the optional native copy kernel (csrc/kvcopy.c); everything else is in pyproject.toml.

The kernel is optional: without a C compiler the install still succeeds and the CPU copy engine falls back
to its pure-Python path (slower with checksums). On x86-64 two more builds use AVX2 and AVX-512F (the copy loop
hashes in vector registers and streams long copies); the widest one the CPU has is picked at run time.
"""

import platform

from setuptools import Extension, setup

_FLAGS = ["-O3", "-fvisibility=hidden", "-std=c11", "-pthread"]
_LINK = ["-pthread"]  # the kernel's helper threads (kvcopy_pool)

extensions = [
    Extension(
        "kvoffload.offload.worker.copy._kvcopy",
        sources=["csrc/kvcopy.c"],
        depends=["csrc/kvcopy_engine.c", "csrc/third_party/xxhash/xxhash.h"],
        extra_compile_args=_FLAGS,
        extra_link_args=_LINK,
        optional=True,
    )
]
if platform.machine().lower() in ("x86_64", "amd64"):
    for isa, flag in (("avx2", "-mavx2"), ("avx512", "-mavx512f")):
        extensions.append(
            Extension(
                f"kvoffload.offload.worker.copy._kvcopy_{isa}",
                sources=[f"csrc/kvcopy_{isa}.c"],
                depends=["csrc/kvcopy.c", "csrc/kvcopy_engine.c", "csrc/third_party/xxhash/xxhash.h"],
                extra_compile_args=[*_FLAGS, flag],
                extra_link_args=_LINK,
                optional=True,
            )
        )

setup(ext_modules=extensions)
