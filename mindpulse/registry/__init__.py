"""The metric registry (`metrics.py`): every step metric declared once (its packet field,
reductions, console column, TensorBoard tags, Prometheus series, rule aliases, run totals)."""
