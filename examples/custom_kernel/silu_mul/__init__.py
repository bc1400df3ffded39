"""The example plugin kernel's package: `abi` (the sizes the kernel and its caller share; standard library
only, imported at serve time) and `kernel` (the CuTe DSL kernel; imported only by the build)."""
