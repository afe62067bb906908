"""The card samplers of a node, one module per telemetry source.

* :mod:`.base` - the :class:`~.base.Sampler` interface, the card record
  (:class:`~.base.CardRecord`, :func:`~.base.card_record`) and helpers every source uses;
* :mod:`.npu_smi` - :class:`~.npu_smi.NpuSmiSampler`, the ``npu-smi`` tool (Ascend), whose
  output is parsed by :mod:`mindpulse.node.npu_smi`;
* :mod:`.dcmi` - :class:`~.dcmi.DcmiSampler`, Huawei's ``libdcmi.so`` through ctypes (Ascend);
* :mod:`.nvml` - :class:`~.nvml.NvmlSampler`, NVIDIA's NVML through ``pynvml`` (GPUs);
* :mod:`.host` - :class:`~.host.PsutilSampler`, the host CPU and memory and per-rank processes.

Choosing a source for a device, and sampling a node on an interval, is
:mod:`mindpulse.node.telemetry`.
"""
