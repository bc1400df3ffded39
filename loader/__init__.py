"""flint-aot's serve-time loader (docs/api.md): loads a bundle's cubins and launches them from torch.

Needs only torch and cuda-bindings; never imports the DSL or the build-time package. Importing it registers
the `torch.ops.flint.*` custom ops. (The build tool imports only the stdlib modules `loader.abi` and
`loader.manifest`; in a process that has imported `flint_aot`, the torch side is imported on first use.)
"""

import sys

__version__ = "0.1.0"

__all__ = [
    "BundleError",
    "current_bundle",
    "flint_qkv_fused",
    "fused_add_rms_norm",
    "gemv",
    "launch_options",
    "load_bundle",
    "no_rope_table",
    "qk_norm_rope_cache",
    "rms_norm",
]
_RUNTIME = {"current_bundle", "launch_options", "load_bundle"}


def __getattr__(name):
    if name == "BundleError":
        from loader.bundle import BundleError

        return BundleError
    if name in __all__:
        from loader import runtime, torch_ops  # noqa: F401  (registers torch.ops.flint.*)

        return getattr(runtime if name in _RUNTIME else torch_ops.ops, name)
    raise AttributeError(f"module 'loader' has no attribute {name!r}")


def __dir__():
    return sorted([*globals(), *__all__])


if "flint_aot" not in sys.modules:
    from loader import torch_ops  # noqa: F401,E402
