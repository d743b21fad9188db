"""Runnable examples of `DuplexClient` use."""
