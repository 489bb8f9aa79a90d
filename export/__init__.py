"""Export tools: turn a local Hugging Face causal-LM folder into a folder the runtime serves without torch.

Heavy libraries (torch, transformers, optimum) are imported only inside the stages that need them, so argument and
source errors are reported in well under a second.
"""
