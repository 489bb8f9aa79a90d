"""The gunicorn HTTP workers: config, the edge worker, the engine client. A worker stays thin (no numpy, no
OpenVINO, about 32 MB): it imports only the shared wire types at the package root and the client APIs
(tests/test_architecture.py)."""
