"""The HTTP layer: the FastAPI app, request and response bodies, response encoders, and the uvicorn server."""
