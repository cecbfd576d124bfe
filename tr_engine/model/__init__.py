"""The network and what it runs on: the hand-written Llama, its config and safetensors weights, the op
namespace (C++/CUDA kernels or their PyTorch references), the KV cache, CPU tiers, tensor parallelism,
CUDA graphs, and the tokenizer with its chat template."""
