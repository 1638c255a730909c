"""Root pytest setup, loaded before any test module imports triton.

Without a CUDA device, Triton kernels run through the interpreter (TRITON_INTERPRET=1, numpy
backed), which must be set before triton is first imported. On a GPU machine kernels run natively
unless the caller set the variable.
"""

import os

HAS_CUDA_DEVICE = os.path.exists("/dev/nvidiactl") or os.path.exists("/dev/nvidia0")
if not HAS_CUDA_DEVICE:
    os.environ.setdefault("TRITON_INTERPRET", "1")
os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
