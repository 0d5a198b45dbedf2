"""Builds the native cancel token (native/cancel_token.c) as a plain shared library.

It is loaded with ctypes, not imported as a Python extension; setuptools'
Extension machinery is used only because it compiles portably (Linux, macOS).
"""

import sys

from setuptools import Extension, setup
from setuptools.command.build_ext import build_ext


class BuildCtypesLibrary(build_ext):
    # No PyInit_ symbol exists; don't ask the linker to export one (Windows only).
    def get_export_symbols(self, ext):
        return []


extra_compile_args = ["-O2", "-std=gnu11", "-fvisibility=hidden"] if sys.platform != "win32" else []

setup(
    ext_modules=[
        Extension(
            "cancelbench.native._cancelbench_native",
            sources=["native/cancel_token.c"],
            extra_compile_args=extra_compile_args,
        )
    ],
    cmdclass={"build_ext": BuildCtypesLibrary},
)
