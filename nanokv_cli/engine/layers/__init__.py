"""Building blocks of the decoder models, tensor-parallel-ready in the style of nano-vllm."""
