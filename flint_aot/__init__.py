"""flint-aot: ahead-of-time builder of CuTe DSL kernels (Flint's fused decode qkv op and your own) into
bundles of cubins.

`flint_aot.Kernel` is the base class of every kernel kind, built-in or a plugin (docs/plugins.md); it is
resolved on first use, so importing flint_aot does not import the DSL."""

__version__ = "0.1.0"
__all__ = ["Kernel", "__version__"]


def __getattr__(name):
    if name == "Kernel":
        from flint_aot.kernels.compile import Kernel

        return Kernel
    raise AttributeError(f"module 'flint_aot' has no attribute {name!r}")
