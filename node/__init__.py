"""What runs on each node, one agent per machine: the packet relay the node's ranks talk to,
the card samplers (npu-smi/DCMI, NVML, psutil), the MindSpore scheduler (ray backend) and msrun."""
