"""The last stage of hookcap's flow, on the host: the drain that moves
finished steps off the device (``drain``), the recorded steps and their
store (``record``, compactly encoded by ``pack``), what consumes them
(``consumers``: history, detectors, anomalies, sinks), the merge of sink
records across ranks (``ranks``) and the dump at exit (``exit``)."""
