"""Code shared by the Triton Python-backend models: request codec, fence table, decoupled adapter.

Reached by the backend stub through PYTHONPATH (the repo root), so the stage models do not copy it.
Only `bridges` (the real engine/ stage engines) imports torch; only `adapter` and `pipeline` import
`triton_python_backend_utils`.
"""
