"""Array backends (NumPy host buffers, CuPy device buffers) and capability probes.

Nothing here imports CuPy at import time; probes import it lazily when asked.
"""
