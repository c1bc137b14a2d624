"""The optional compiled core (plain C, built by setuptools where a compiler works).

Everything else is in pyproject.toml. Each extension has a pure-Python twin that stays the
reference: SHAREDMP_NO_EXTENSIONS=1 selects the twins at run time (sharedmp/native.py), and
an install where the build fails installs the twins alone (optional=True; `doctor` says
which path runs). SHAREDMP_SANITIZE=1 builds with AddressSanitizer and UBSan (CI runs the
ring and codec tests that way: scripts/sanitize).
"""
import os

from setuptools import Extension, setup

FLAGS = ["-std=c11", "-O2", "-Wall", "-Wextra", "-Werror", "-Wno-missing-field-initializers",
         "-fvisibility=hidden"]
LINK: list[str] = []
if os.environ.get("SHAREDMP_SANITIZE") == "1":
    FLAGS += ["-fsanitize=address,undefined", "-fno-sanitize-recover=undefined",
              "-fno-omit-frame-pointer", "-O1", "-g"]
    LINK += ["-fsanitize=address,undefined"]


def ext(name: str) -> Extension:
    return Extension(f"sharedmp._{name}", [f"src/sharedmp/_c/{name}.c"],
                     extra_compile_args=FLAGS, extra_link_args=LINK, optional=True)


setup(ext_modules=[ext("cframe"), ext("cring")])
