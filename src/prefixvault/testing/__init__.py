"""Test helpers: tiny, deterministic, state-sensitive hybrid models for vLLM CPU runs."""
