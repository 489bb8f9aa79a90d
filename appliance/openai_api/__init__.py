"""OVMS's and OpenAI's APIs (completions, chat, tokenize, models, Responses, embeddings, rerank, health, config): their
field tables, rules, shapes and routes, an adapter over the shared front (appliance/api/)."""
