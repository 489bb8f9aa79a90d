"""What every client API shares (the worker process): the route context, errors, the request-table machinery and
parsers, the one internal request and the jobs it makes, sampling, and `Generation` with the one `start()` /
`respond()` pair. The adapters (openai_api/, anthropic_api/, ollama_api/, web/) sit above it as peers; wsgi/ above
them registers every one."""
