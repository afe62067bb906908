"""What the parts say to each other and the streams that carry it: the packets and their codec
(`protocol.py`), reading an append-only record file past damaged bytes (`packet_stream.py`), the
relay frames (`frames.py`), the acknowledged node agent -> aggregator stream (`uplink.py`), the
node's shared-memory lease page (`lease_board.py`), and the aggregator's answers to the ranks
(`directives.py`) and to the driver (`stop_decision.py`)."""
