"""gpuflex: elastic training jobs on on-prem GPU pools reached over SSH."""

__version__ = "0.1.0"
