"""Export tools: turn a local Hugging Face causal-LM folder into a folder the runtime serves without torch.

torch, transformers and optimum are imported only once an export starts (by the backend modules), so argument and
source errors are reported in well under a second.
"""
