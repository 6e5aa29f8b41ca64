"""The OpenAI-compatible REST gateway in front of the router."""
