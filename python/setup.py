"""Bundles libkvxfer, and for a wheel the programs (setuptools reads
pyproject.toml).

Which libraries go into kvxfer/_libs/:
  * $KVXFER_BUNDLE_DIR set (make wheel): every file in it (libkvxfer.so.2;
    auditwheel then grafts what it needs into kvxfer.libs/);
  * else ../build/libkvxfer.so.2 if make built it (pip install ./python);
  * else none: the installed package uses the system's libkvxfer.
Which programs go into kvxfer/_bin/ (the console scripts kvxferd,
kvxferctl and kvxfer-bench run them, kvxfer/_cli.py):
  * $KVXFER_BIN_DIR set (make wheel): every file in it, mode 0755; the
    wheel then depends on the UCX kvxferd was built against (PyPI's
    libucx-cu13, $KVXFER_UCX_REQUIREMENT);
  * else none (a source install: the scripts say so and exit 127).
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


def programs():
    d = os.environ.get("KVXFER_BIN_DIR")
    if not d:
        return []
    return [os.path.join(d, f) for f in sorted(os.listdir(d))]


def requirements():
    """The daemon's UCX, where the wheel carries the daemon."""
    if not programs():
        return []
    return [os.environ.get("KVXFER_UCX_REQUIREMENT",
                           "libucx-cu13>=1.22.0,<2")]


class BuildPy(build_py):
    def run(self):
        super().run()
        self._copy(bundled(), "_libs", None)
        self._copy(programs(), "_bin", 0o755)

    def _copy(self, files, folder, mode):
        if not files:
            return
        dst = os.path.join(self.build_lib, "kvxfer", folder)
        os.makedirs(dst, exist_ok=True)
        for src in files:
            # copy the file a link points at, under the link's name
            out = os.path.join(dst, os.path.basename(src))
            shutil.copyfile(os.path.realpath(src), out)
            if mode is not None:
                os.chmod(out, mode)


class PlatformWheel(bdist_wheel):
    """py3-none-<platform> when a library is bundled: any Python 3 may
    install it, on this platform only (auditwheel repair then names the
    manylinux one). The modules stay at the wheel's root (purelib): ctypes
    loads the library, nothing is compiled."""

    def get_tag(self):
        python, abi, plat = super().get_tag()
        if bundled():
            plat = sysconfig.get_platform().replace("-", "_").replace(".", "_")
            python, abi = "py3", "none"
        return python, abi, plat


setup(cmdclass={"build_py": BuildPy, "bdist_wheel": PlatformWheel},
      install_requires=requirements())
