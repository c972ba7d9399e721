"""pipedream_fast: pipeline-parallel training for PyTorch, after PipeDream.

The flow, one direction only (see ARCHITECTURE.md):

    nn.Module -> LayerChain -> Profile -> Plan -> Schedule IR -> executor | simulator -> trace

The C++ core lives in `pipedream_fast._C`; everything here is the thin Python layer.
"""

import torch as _torch  # noqa: F401  (loads libtorch, which the C++ core links against)

from pipedream_fast.formats import FormatError, Plan, Profile
from pipedream_fast.launch import LaunchError, Stopped, launch
from pipedream_fast.local_pipeline import LocalPipeline
from pipedream_fast.options import OptionError, PipelineOptions
from pipedream_fast.pipeline import NonFiniteLoss, Pipeline
from pipedream_fast.tuning import Tuning, TuningError

__version__ = "0.1.0"

__all__ = ["FormatError", "LaunchError", "LocalPipeline", "NonFiniteLoss", "OptionError",
           "Pipeline", "PipelineOptions", "Plan", "Profile", "Stopped", "Tuning", "TuningError",
           "__version__", "launch"]
