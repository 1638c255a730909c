"""Root pytest setup, loaded before any test module imports triton.

Without a CUDA device, Triton kernels run through the interpreter (TRITON_INTERPRET=1, numpy
backed), which must be set before triton is first imported. On a GPU machine kernels run natively
unless the caller set the variable.
"""

import os

import pytest

HAS_CUDA_DEVICE = os.path.exists("/dev/nvidiactl") or os.path.exists("/dev/nvidia0")
if not HAS_CUDA_DEVICE:
    os.environ.setdefault("TRITON_INTERPRET", "1")
os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")


# On a GPU machine the kernel tests (written with CPU tensors, as CI runs them) run natively: a
# torch-function mode puts every tensor the test creates on the GPU. Tensors drawn from a CPU
# torch.Generator are drawn on the CPU first, so a test sees the same data on both machines.
_NATIVE_DIRS = ("tests/kernels/", "invariance_tests/test_")
_ENGINE_TESTS = ("invariance_tests/test_engine_determinism.py",
                 "invariance_tests/test_engine_triton.py")


def _cuda_factory_mode():
    import torch
    from torch.overrides import TorchFunctionMode

    factories = {
        torch.randn, torch.rand, torch.randint, torch.randperm, torch.normal, torch.empty,
        torch.zeros, torch.ones, torch.full, torch.arange, torch.tensor, torch.linspace,
        torch.eye, torch.as_tensor, torch.empty_strided,
    }

    class CudaFactoryMode(TorchFunctionMode):
        def __torch_function__(self, func, types, args=(), kwargs=None):
            kwargs = dict(kwargs or {})
            if func in factories and kwargs.get("device") is None:
                generator = kwargs.get("generator")
                if generator is not None and generator.device.type == "cpu":
                    return func(*args, **kwargs).to("cuda")
                kwargs["device"] = "cuda"
            return func(*args, **kwargs)

    return CudaFactoryMode()


def _runs_native(item) -> bool:
    path = item.nodeid.split("::")[0]
    if (
        os.environ.get("TRITON_INTERPRET", "0") == "1"
        or os.environ.get("CORUN_TEST_DEVICE", "cuda") == "cpu"
        or not path.startswith(_NATIVE_DIRS)
        or path.startswith(_ENGINE_TESTS)
    ):
        return False
    import torch

    return torch.cuda.is_available()


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_setup(item):
    """Kernel and invariance tests run on the GPU when there is one (CORUN_TEST_DEVICE=cpu keeps
    them on the CPU); fixtures are built under the same mode. A test marked ``interpreter_only``
    is skipped there, with its reason."""
    if _runs_native(item):
        marker = item.get_closest_marker("interpreter_only")
        if marker is not None:
            pytest.skip(f"interpreter only: {marker.kwargs.get('reason', marker.args)}")
        with _cuda_factory_mode():
            yield
    else:
        yield


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_call(item):
    if _runs_native(item):
        with _cuda_factory_mode():
            yield
    else:
        yield
