"""The second stage of hookcap's flow: the rows the captured tensors are
written into. A Monitor's settings (``config``), the metrics it has named
(``catalog``), the recorder and its rows (``recorder``), the device rings
(``ring``) and the compiled hook entry points and row identity
(``fastpath``). The op wrappers and the row layout they share are
``hookcap._ops`` and ``hookcap._layout``."""
