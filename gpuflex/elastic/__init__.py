"""gpuflex.elastic: the worker runtime (imports only torch and the standard library).

    from gpuflex.elastic import ElasticRun
"""

from gpuflex.elastic.rendezvous import EVICTED_EXIT, STORE_LOST_EXIT
from gpuflex.elastic.runtime import ElasticRun
from gpuflex.elastic.sampler import Batch, ElasticSampler

__all__ = ["Batch", "ElasticRun", "ElasticSampler", "EVICTED_EXIT", "STORE_LOST_EXIT"]
