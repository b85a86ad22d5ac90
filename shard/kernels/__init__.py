"""Conveyor's own C++ kernels: small, each with its torch reference beside it (see `toolchain.py`)."""
