"""The one native piece: the `xxh3_64-rows` tensor checksum in C, so that it releases the GIL, and
the staging copies with non-temporal stores.

Everything else is in pyproject.toml. The extension is optional: without a C compiler the install
goes on and fsdpkit computes the same checksums in Python (slower, and holding the GIL) and stages
with torch's copy_.
"""

from setuptools import Extension, setup

setup(ext_modules=[Extension(
    "fsdpkit.checkpoint._rowhash",
    sources=["src/fsdpkit/checkpoint/_rowhash.c"],
    include_dirs=["third_party/xxhash"],
    extra_compile_args=["-O3"],
    optional=True,
)])
