# The optional C extensions; everything else is in pyproject.toml.
# forebay._native: if it cannot be compiled, forebay falls back to numpy code paths.
# forebay._jpeg: region decode with libjpeg-turbo (its headers: Debian's libjpeg-dev,
# Fedora's libjpeg-turbo-devel); without it forebay.torch.DecodeCropFlip decodes whole
# images with Pillow.
from setuptools import Extension, setup

setup(ext_modules=[Extension("forebay._native", ["src/forebay/_native.c"], optional=True,
                             extra_compile_args=["-O3"]),
                   Extension("forebay._jpeg", ["src/forebay/_jpeg.c"], optional=True,
                             libraries=["jpeg"],
                             extra_compile_args=["-O3", "-ffp-contract=off"])])
