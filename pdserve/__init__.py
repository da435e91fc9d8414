"""pdserve: an LLM inference server with prefill/decode disaggregation."""

__version__ = "0.1.0"


def __getattr__(name):
    # Lazy: importing pdserve must not pull torch or transformers.
    if name == "Engine":
        from pdserve.engine.engine import Engine

        return Engine
    if name == "ServerArgs":
        from pdserve.config import ServerArgs

        return ServerArgs
    raise AttributeError(name)
