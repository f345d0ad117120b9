# The optional C extension (forebay._native); everything else is in pyproject.toml.
# If it cannot be compiled, forebay falls back to numpy code paths.
from setuptools import Extension, setup

setup(ext_modules=[Extension("forebay._native", ["src/forebay/_native.c"], optional=True,
                             extra_compile_args=["-O3"])])
