"""CUDA: saves and loads on a device, and the device checks run on the CPU."""
