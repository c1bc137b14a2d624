"""sharedmp's exceptions live in ``sharedmp.errors`` and every one of them is ``sharedmp.<name>``."""
import ast
import inspect
import pickle
from pathlib import Path

import sharedmp as mp
from sharedmp import errors

SRC = Path(mp.__file__).resolve().parent
# Exceptions of the subpackages that have their own public module, exported there.
OWN_MODULE = {"hogwild/nodes.py": {"NodeLost"}, "hogwild/data.py": {"DataError"}}


def error_classes():
    return {name: cls for name, cls in vars(errors).items()
            if inspect.isclass(cls) and issubclass(cls, BaseException)
            and cls.__module__ == errors.__name__}


def test_every_class_of_errors_is_exported():
    classes = error_classes()
    assert {"OutOfSharedMemory", "SegmentError", "ProtocolError", "ManagerError", "CudaError",
            "ProcessException", "ProcessRaisedException", "ProcessExitedException"} <= set(classes)
    for name, cls in classes.items():
        assert getattr(mp, name) is cls, name
        assert name in mp.__all__, name


def test_cuda_error_is_the_class_the_cuda_driver_raises():
    # (importing the driver needs no GPU and no cuda-bindings: it says why it cannot run)
    from sharedmp.cuda import driver
    assert driver.CudaError is mp.CudaError is errors.CudaError
    assert issubclass(mp.CudaError, RuntimeError)
    e = pickle.loads(pickle.dumps(mp.CudaError("cuMemCreate failed: CUDA_ERROR_OUT_OF_MEMORY")))
    assert type(e) is mp.CudaError and str(e) == "cuMemCreate failed: CUDA_ERROR_OUT_OF_MEMORY"


def test_no_public_exception_is_defined_outside_errors():
    found = []
    for f in sorted(SRC.rglob("*.py")):
        rel = f.relative_to(SRC).as_posix()
        if rel == "errors.py":
            continue
        for node in ast.walk(ast.parse(f.read_text())):
            if not isinstance(node, ast.ClassDef) or node.name.startswith("_"):
                continue
            bases = [ast.unparse(b).rpartition(".")[2] for b in node.bases]
            if any(b.endswith(("Error", "Exception", "Exit", "Interrupt")) for b in bases) \
                    and node.name not in OWN_MODULE.get(rel, ()):
                found.append(f"{rel}: {node.name}")
    assert not found, f"exceptions outside sharedmp/errors.py: {found}"
