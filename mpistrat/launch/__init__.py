"""Launching: which launcher started us, finding and driving ``mpiexec``."""
