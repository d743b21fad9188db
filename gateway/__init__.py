"""FastAPI gateway: Realtime / native duplex protocol, session actor, Triton client.

Never imports torch or `engine` (ARCHITECTURE.md: gateway -> gRPC -> model_repository -> engine).
"""
