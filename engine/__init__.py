"""MiniCPM-o 4.5 duplex runtime: PyTorch modules, checkpoint loader and streaming engines.

Imports neither Triton nor FastAPI.
"""
