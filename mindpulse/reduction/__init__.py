"""Reducing the ranks' packets: the node partial (`partial.py`: one accumulator per registry
reduction, exact merge, wire checks), the reduction of partials into a `ReducedStep`
(`reducer.py`, with the straggler scorer and the run totals), and the robust baselines the
scorers and rules share (`baselines.py`)."""
