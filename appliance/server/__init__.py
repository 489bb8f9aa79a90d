"""The engine process: supervisor, engine service, jobs, slots, metrics. It owns the model (through
`appliance.runtime`) and starts the gunicorn workers of `appliance.http`, which reach it over a Unix socket. See
docs/serving.md for why."""
