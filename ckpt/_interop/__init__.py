"""Other checkpoint formats, in and out: PyTorch DCP directories (``.metadata`` plus
``__R_N.distcp`` files, as TorchTitan and Megatron-Core write them) and Hugging Face folders
of sharded safetensors."""
