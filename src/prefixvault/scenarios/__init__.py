"""The product's scenario library: tiny, deterministic, state-sensitive hybrid models, the
prompts and engine runner of the seed scenario (``prefixvault repro``, ``verify``), OpenAI
servers and vLLM's benchmark client, and the store servers and faulty links the benchmarks
and tests run against. Helpers only the test suite uses live under ``tests/vllm_support``."""
