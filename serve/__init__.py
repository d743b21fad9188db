"""`duplex serve`: the process manager. Builds the model repository, starts tritonserver (and a private CUDA MPS
daemon where it helps), restarts Triton when it dies, and runs the gateway (gateway/, the FastAPI app) beside it.

Depends on `gateway` (it starts the app), never the other way round; imports neither torch nor `engine`.
"""
