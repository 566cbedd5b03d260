"""The OpenAI-compatible HTTP server behind ``python -m lp.serve``.

Modules, one job each:

* ``config``   ServerConfig / ServeConfig dataclasses (the Hydra ``server`` group)
* ``protocol`` request/response pydantic models, validation into DecodingConfig, OpenAI errors
* ``detok``    incremental detokenization (streamed deltas concatenate to the full content)
* ``engine``   the single decode thread, the bounded FIFO, and the worker-side LP loop
* ``metrics``  Prometheus metrics (prometheus_client)
* ``app``      the FastAPI app and its routes
"""
