"""The kernels gpu study."""
