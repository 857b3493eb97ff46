"""Handing encoder outputs to an LLM server (vLLM): content ids (`content_id`), the encoder-output cache
(`cache`), the shared encoder-cache folder in vLLM's connector layout (`ec_storage`), vLLM content parts
(`vllm`), the request path that ties them around the engine (`pipeline`), and the client side of the
request flow (`sidecar`)."""
