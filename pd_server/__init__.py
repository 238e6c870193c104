"""The router: OpenAI-compatible HTTP in front, ranks over ZeroMQ behind.

Data flow of one request, in file order:
    api_models.py   pydantic request bodies (400 on any bad field)
    prompts.py      chat template (+ tools, response_format hints) -> prompt ids
    sampling.py     OpenAI fields -> one wire Sampling per choice; context / vocab checks
    routing.py      which rank (least-loaded, round-robin; pluggable)
    dispatcher.py   the rank socket: Generate / Abort out, TokenBatch in, liveness
    ranks.py        the registry of ranks (loading / ready / dead, load, in-flight)
    chat.py, completions.py   handlers: stream SSE chunks (sse.py) or one response (responses.py)
    sse_response.py the streaming response (pure ASGI; one send per stream per receive round)
    tool_parser.py  Hermes / bare JSON tool calls out of the text
    serving.py      what handlers share: ServerContext, collection, disconnect aborts, logprobs
    app.py          FastAPI routes and OpenAI-shaped errors (errors.py); metrics.py for /metrics
The messages between router and ranks: cluster/protocol/ (PROTOCOL_VERSION). Starting the router
with its ranks as one process group: launcher/ (launch.py, supervisor.py, ray_ranks.py).
"""
