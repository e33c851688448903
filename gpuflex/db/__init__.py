from gpuflex.db.engine import make_engine, open_database, upgrade
from gpuflex.db.models import Base, Event, Gpu, Host, Job, Worker

__all__ = ["Base", "Event", "Gpu", "Host", "Job", "Worker", "make_engine", "open_database", "upgrade"]
