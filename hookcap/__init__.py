"""hookcap: low-overhead per-layer activation and gradient telemetry for PyTorch.

Statistics are computed by compiled kernels (CPU, and CUDA when built) in one
pass over each tensor, on the tensor's own device, into a preallocated ring.
"""

from ._build import build_info, check_and_load

_BUILD_META = check_and_load()

from . import reference  # noqa: E402
from ._layout import MOMENT_NAMES, STAT_NAMES  # noqa: E402
from .functional import tensor_stats  # noqa: E402
from .groups import Channels, Groups  # noqa: E402
from .histogram import Histogram  # noqa: E402
from . import sinks  # noqa: E402
from .anomaly import Anomaly, AnomalyError, Dead, NonFinite, Spike, Threshold, Underflow  # noqa: E402
from .drained import DrainedStep  # noqa: E402
from .movers import Explanation, Mover, explain  # noqa: E402
from .history import History, load  # noqa: E402
from .skip import SkipStep  # noqa: E402
from .monitor import CAPTURE_KINDS, Monitor  # noqa: E402
from .summary import ModelSummary, summary  # noqa: E402
from .taps import tap  # noqa: E402

__version__ = "0.1.0"

__all__ = [
    "Anomaly",
    "AnomalyError",
    "CAPTURE_KINDS",
    "Dead",
    "Explanation",
    "Mover",
    "DrainedStep",
    "Channels",
    "Groups",
    "NonFinite",
    "Spike",
    "Threshold",
    "Underflow",
    "SkipStep",
    "sinks",
    "Histogram",
    "History",
    "ModelSummary",
    "Monitor",
    "STAT_NAMES",
    "MOMENT_NAMES",
    "build_info",
    "explain",
    "load",
    "reference",
    "summary",
    "tap",
    "tensor_stats",
    "__version__",
]
