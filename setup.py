"""Builds the native cancel token (native/cancel_token.c) as a plain shared library.

It is loaded with ctypes, not imported as a Python extension; setuptools'
Extension machinery is used only because it compiles the library with the
interpreter's toolchain. Linux and macOS only: the dataset sink needs fcntl
(cancelbench/sink.py), so Windows is not supported.
"""

from setuptools import Extension, setup

setup(
    ext_modules=[
        Extension(
            "cancelbench.native._cancelbench_native",
            sources=["native/cancel_token.c"],
            depends=["native/cancel_token.h"],
            extra_compile_args=["-O2", "-std=gnu11", "-fvisibility=hidden"],
        )
    ],
)
