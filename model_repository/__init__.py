"""Triton models (config.pbtxt + thin model.py per stage) and their shared adapter package `common`."""
