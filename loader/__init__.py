"""flint-aot's serve-time loader (docs/api.md): loads a bundle's cubins and launches them from torch.

Needs only torch and cuda-bindings; never imports the DSL or the build-time package. Importing it registers
the `torch.ops.flint.*` custom ops. (The build tool imports only the stdlib modules `loader.abi` and
`loader.manifest`; in a process that has imported `flint_aot`, the torch side is imported on first use.)
"""

import sys

__version__ = "0.1.0"

__all__ = ["BundleError", "current_bundle", "flint_qkv_fused", "fused_add_rms_norm", "gemv", "launch_kernel",
           "launch_options", "load_bundle", "no_rope_table", "qk_norm_rope_cache", "rms_norm"]  # fmt: skip
_RUNTIME = {"current_bundle", "launch_options", "load_bundle"}


def __getattr__(name):
    """The public names, resolved on first use (then bound: later lookups are plain module attributes)."""
    if name not in __all__:
        raise AttributeError(f"module 'loader' has no attribute {name!r}")
    from loader import bundle, kernels, ops, runtime, torch_ops  # noqa: F401  (torch_ops: torch.ops.flint.*)

    for n in __all__:
        mod = bundle if n == "BundleError" else kernels if n == "launch_kernel" else ops
        globals()[n] = getattr(runtime if n in _RUNTIME else mod, n)
    return globals()[name]


def __dir__():
    return sorted({*__all__, "__version__", "abi", "doctor", "nvfp4", "reference"})  # the documented API


if "flint_aot" not in sys.modules:
    __getattr__("load_bundle")
