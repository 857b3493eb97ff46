"""Handing encoder outputs to an LLM server: vLLM's encoder-cache folder layout and an example client."""
