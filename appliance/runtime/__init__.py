"""The engine process's model code: engine loop, scheduler, KV blocks, sampling, backends, speculation, grammar,
tokenizer. Imports numpy and OpenVINO; never imports `appliance.server`, `appliance.http` or the client APIs
(tests/test_architecture.py)."""
