"""Every hardware and toolchain fact moe-tune asks about, asked once, here.

Other modules never call torch.cuda.get_device_properties or read TRITON_INTERPRET themselves.
"""

from __future__ import annotations

import functools
import os
import platform
import subprocess
from dataclasses import asdict, dataclass

import torch
import triton

# Hopper (sm_90) lets one block opt in to 227 KB of shared memory; Triton reserves a little for
# its barriers, so configurations are sized against this and rejected above it before compiling.
HOPPER_SMEM_BYTES = 227 * 1024
# With 128-byte shared-memory swizzling a TMA box row spans at most 128 bytes (64 bf16 elements).
TMA_MAX_INNER_BYTES = 128
# TMA moves global rows whose strides are multiples of 16 bytes (cuTensorMapEncodeTiled's rule).
TMA_ALIGN_BYTES = 16
# The interpreter has no shared-memory limit; use Hopper's so the CPU prunes what the GPU would.
DEFAULT_SMEM_BYTES = HOPPER_SMEM_BYTES


def interpreter_mode() -> bool:
    """True when Triton kernels run through the CPU interpreter (TRITON_INTERPRET=1)."""
    return os.environ.get("TRITON_INTERPRET", "0") == "1"


def quiet_interpreter() -> None:
    """Silence numpy's overflow warnings from the interpreter: they come from padding rows that the
    kernels compute on uninitialised memory and never store."""
    if interpreter_mode():
        import warnings

        warnings.filterwarnings("ignore", category=RuntimeWarning, module="triton")


def has_gpu() -> bool:
    return torch.cuda.is_available() and not interpreter_mode()


def device() -> torch.device:
    """Where kernels run: the GPU, or the CPU under the interpreter."""
    return torch.device("cuda") if has_gpu() else torch.device("cpu")


@functools.lru_cache(maxsize=1)
def smem_bytes() -> int:
    """Shared memory one program may use on the current device."""
    if not has_gpu():
        return DEFAULT_SMEM_BYTES
    props = triton.runtime.driver.active.utils.get_device_properties(torch.cuda.current_device())
    return int(props["max_shared_mem"])


def gpu_uuid() -> str | None:
    """The current GPU's UUID (None where torch does not report one): what nvidia-smi names it by,
    whatever CUDA_VISIBLE_DEVICES renumbers."""
    uuid = getattr(torch.cuda.get_device_properties(torch.cuda.current_device()), "uuid", None)
    return None if uuid is None else str(uuid)


@functools.lru_cache(maxsize=1)
def sm_count() -> int:
    if not has_gpu():
        return 132  # an H200's count, so CPU-side grid arithmetic matches the target
    return torch.cuda.get_device_properties(0).multi_processor_count


@dataclass(frozen=True)
class Fingerprint:
    """What a measurement depends on besides the code: the GPU and the software that drove it."""

    gpu: str
    capability: str
    driver: str
    cuda: str
    torch: str
    triton: str
    interpreter: bool

    @property
    def key(self) -> str:
        """Short tag that separates studies: results never cross GPUs or Triton versions."""
        gpu = self.gpu.replace("NVIDIA ", "").replace(" ", "-")
        mode = "interp" if self.interpreter else f"sm{self.capability.replace('.', '')}"
        return f"{gpu}-{mode}-triton{self.triton}"

    def as_dict(self) -> dict:
        return asdict(self)


def _driver_version() -> str:
    try:
        out = subprocess.run(
            ["nvidia-smi", "--query-gpu=driver_version", "--format=csv,noheader"],
            capture_output=True, text=True, timeout=10, check=True,
        )
        return out.stdout.strip().splitlines()[0]
    except (OSError, subprocess.SubprocessError, IndexError):
        return "unknown"


@functools.lru_cache(maxsize=1)
def fingerprint() -> Fingerprint:
    if has_gpu():
        props = torch.cuda.get_device_properties(0)
        return Fingerprint(
            gpu=props.name, capability=f"{props.major}.{props.minor}", driver=_driver_version(),
            cuda=str(torch.version.cuda), torch=torch.__version__, triton=triton.__version__,
            interpreter=False,
        )
    return Fingerprint(
        gpu=f"CPU {platform.machine()}", capability="none", driver="none", cuda="none",
        torch=torch.__version__, triton=triton.__version__, interpreter=True,
    )
