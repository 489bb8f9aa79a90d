"""Embedding and rerank models in the engine process, one module per part:
- embeddings.py: the engine socket's ENCODE op (`run_encode`), an encoder export's load and its task;
- service.py: `EncoderService`, the encoder's threads and their priority beside chat;
- inputs.py: a job's inputs tokenized and checked (every 400);
- batches.py: the queue and how a forward's batch is chosen (length buckets, round robin);
- priority.py: the background thread's scheduling priority (why, and what it measured)."""
