"""What every part of mindpulse uses: `MindpulseError`, the base of every exception it defines
(`errors.py`), and how every number, size, duration and date is written (`formatting.py`)."""
