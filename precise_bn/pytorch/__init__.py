"""The PyTorch backend: which layers, how a call is captured, and the pass over a model."""
