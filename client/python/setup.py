"""Builds the attnd package; generates its protocol descriptors from proto/ on the way.

`pip install client/python` (Debian: `python3 -m pip install --no-deps --no-build-isolation
client/python`) runs this in the source tree: the build step writes
attnd/_proto/_descriptor_set.py from ../../proto with the protoc of the installing machine (or
grpc_tools.protoc). ATTND_PROTO_DIR names another proto/ directory. ATTND_NATIVE_LIB names a
libattn_client_c.so (build/client/) to copy into the package, for its native transport; with it,
attnd._fast (the native decode step in C, CPython >= 3.11's stable ABI) is compiled too where
the interpreter's headers are (optional: without them the package does that work in Python).
"""

import importlib.util
import os
import shutil
from pathlib import Path

import sys

from setuptools import Extension, setup
from setuptools.command.build_py import build_py

HERE = Path(__file__).resolve().parent


def _load_build_module():
    spec = importlib.util.spec_from_file_location("attnd_proto_build",
                                                  HERE / "attnd" / "_proto" / "build.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


class BuildWithDescriptors(build_py):
    def run(self):
        super().run()
        native = os.environ.get("ATTND_NATIVE_LIB")
        if native:
            if not Path(native).is_file():
                raise SystemExit(f"attnd: ATTND_NATIVE_LIB={native} is not a file")
            shutil.copy(native, Path(self.build_lib) / "attnd" / "libattn_client_c.so")
        build = _load_build_module()
        out = Path(self.build_lib) / "attnd" / "_proto" / build.MODULE_NAME
        proto_dir = build.default_proto_dir()
        if proto_dir is None:
            prebuilt = HERE / "attnd" / "_proto" / build.MODULE_NAME
            if not prebuilt.is_file():
                raise SystemExit("attnd: no proto/ directory (set ATTND_PROTO_DIR) and no "
                                 "pre-generated attnd/_proto/_descriptor_set.py")
            out.write_bytes(prebuilt.read_bytes())
            return
        build.write_module(proto_dir, out)


extensions = []
if os.environ.get("ATTND_NATIVE_LIB") and sys.version_info >= (3, 11):
    # attn/client/c_api.h: the library's types (nothing of it is linked).
    extensions.append(Extension("attnd._fast", ["attnd/_fast.c"], py_limited_api=True,
                                include_dirs=[str(HERE.parent / "include")], optional=True))

setup(cmdclass={"build_py": BuildWithDescriptors}, ext_modules=extensions)
