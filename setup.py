"""The one compiled part: the restore's verified copy (``flashckpt/_verified_copy.c``).

Optional: where it does not build (no compiler, a CPU other than x86-64), the restore copies
and checks each chunk from Python instead, at a lower speed. Everything else is configured
in pyproject.toml.
"""

from setuptools import Extension, setup

setup(
    ext_modules=[
        Extension(
            "flashckpt._verified_copy",
            ["flashckpt/_verified_copy.c"],
            depends=["flashckpt/_crc32c.h"],
            extra_compile_args=["-O2"],
            optional=True,
        )  # fmt: skip
    ]
)
