"""Bundles libkvxfer into the package (setuptools reads pyproject.toml).

Which libraries go into kvxfer/_libs/:
  * $KVXFER_BUNDLE_DIR set (make wheel): every file in it (libkvxfer.so.2
    and the shared libraries it needs that a fresh machine may lack);
  * else ../build/libkvxfer.so.2 if make built it (pip install ./python);
  * else none: the installed package uses the system's libkvxfer.
A package with a library in it is a platform wheel (py3-none-linux_*).
"""

import os
import shutil
import sysconfig

from setuptools import setup
from setuptools.command.build_py import build_py

try:
    from setuptools.command.bdist_wheel import bdist_wheel
except ImportError:  # setuptools < 70.1
    from wheel.bdist_wheel import bdist_wheel

HERE = os.path.dirname(os.path.abspath(__file__))


def bundled():
    d = os.environ.get("KVXFER_BUNDLE_DIR")
    if d:
        return [os.path.join(d, f) for f in sorted(os.listdir(d))]
    lib = os.path.join(HERE, "..", os.environ.get("KVX_BUILD", "build"),
                       "libkvxfer.so.2")
    return [lib] if os.path.exists(lib) else []


class BuildPy(build_py):
    def run(self):
        super().run()
        libs = bundled()
        if not libs:
            return
        dst = os.path.join(self.build_lib, "kvxfer", "_libs")
        os.makedirs(dst, exist_ok=True)
        for src in libs:
            # copy the file a link points at, under the link's name
            shutil.copyfile(os.path.realpath(src),
                            os.path.join(dst, os.path.basename(src)))


class PlatformWheel(bdist_wheel):
    """py3-none-<platform> when a library is bundled: any Python 3 may
    install it, on this platform only. The modules stay at the wheel's
    root (purelib): ctypes loads the library, nothing is compiled."""

    def get_tag(self):
        python, abi, plat = super().get_tag()
        if bundled():
            plat = sysconfig.get_platform().replace("-", "_").replace(".", "_")
            python, abi = "py3", "none"
        return python, abi, plat


setup(cmdclass={"build_py": BuildPy, "bdist_wheel": PlatformWheel})
