"""Builds the optional native copy kernel (csrc/kvcopy.c); everything else is in pyproject.toml.

The kernel is optional: without a C compiler the install still succeeds and the CPU copy engine falls back
to its pure-Python path (slower with checksums). On x86-64 a second build uses AVX2, picked at run time when
the CPU has it.
"""

import platform

from setuptools import Extension, setup

_FLAGS = ["-O3", "-fvisibility=hidden", "-std=c11"]

extensions = [
    Extension(
        "kvoffload.offload.worker.copy._kvcopy",
        sources=["csrc/kvcopy.c"],
        depends=["csrc/third_party/xxhash/xxhash.h"],
        extra_compile_args=_FLAGS,
        optional=True,
    )
]
if platform.machine().lower() in ("x86_64", "amd64"):
    extensions.append(
        Extension(
            "kvoffload.offload.worker.copy._kvcopy_avx2",
            sources=["csrc/kvcopy_avx2.c"],
            depends=["csrc/kvcopy.c", "csrc/third_party/xxhash/xxhash.h"],
            extra_compile_args=[*_FLAGS, "-mavx2"],
            optional=True,
        )
    )

setup(ext_modules=extensions)
