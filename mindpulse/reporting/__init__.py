"""What the run's numbers say, for the aggregator, the driver and the views: goodput accounting
(`goodput.py`), the cards' peak TFLOPS (`card_peaks.py`), the console tables (`tables.py`)."""
